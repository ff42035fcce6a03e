"""
Writes VJ2 .npz trajectory files whose dynamics are learnable and depend on the actions.

The hidden world is a GUI screen: content scrolled by an offset (sx, sy) on a torus, a cursor (cx, cy) and a
pressed flag. Between two latent steps one gesture happens (drag, tap or hover), recorded as A atomic
[x, y, touch] events; while the finger stays down its motion drags the content along, and the cursor ends
where the last event was. A fixed random "encoder" World(world_seed) turns a state into P x D tokens: Fourier
features of the scrolled patch positions and a bump around the cursor, through a random tanh MLP, plus a little
noise. The encoder depends on world_seed only, so train and val sets written with different --seed values
share one encoder and differ only in their trajectories.

    python create_synthetic_data.py --output_dir data/train --num_files 3 --trajectories_per_file 10
    python create_synthetic_data.py --output_dir data/real --real_shapes --val_fraction 0.1

(--compress writes np.savez_compressed's layout; the loader then decompresses a whole file for a read outside
its small cache: keep large data sets uncompressed.)
"""

import argparse
import math
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

import config

# state layout: scroll offset (torus), cursor position (screen), finger down after the last event
STATE_NAMES = ("scroll_x", "scroll_y", "cursor_x", "cursor_y", "pressed")
STATE_DIM = len(STATE_NAMES)
# gesture mix per step: drags move the content, taps and hovers only move the cursor
GESTURE_PROBS = {"drag": 0.5, "tap": 0.2, "hover": 0.3}
# largest drag displacement per step, in screen units
MAX_DRAG = 0.35
# width of the cursor highlight, in screen units
CURSOR_SIGMA = 0.15
# (kx, ky) frequencies of the content pattern
CONTENT_FREQS = np.array([[1, 0], [0, 1], [1, 1], [1, -1], [2, 0], [0, 2]], dtype=np.float64)
# --noise may reach at most this many standard deviations below the dtype's largest value: numpy's float32
# normal sampler does not draw beyond about 8.3, and a chunk that still overflows is refused, not written
NOISE_SIGMAS = 10
# float32 elements of one embedding chunk in flight (64 MiB); bounds memory for the real geometry
CHUNK_ELEMENTS = 1 << 24
SPLITS = ("train", "val")
# the command-line flag that names each split's directory, for error messages
OUTPUT_FLAGS = {"train": "--output_dir", "val": "--val_output_dir"}
DTYPES = ("float16", "float32")  # what the loader reads

# -----------------------------------------------------------------------------------------------------------------
# the encoder


def patch_positions(patches):
    """Screen positions [P, 2] of the patch centres, on the most square h x w grid with h * w == P."""
    w = max(d for d in range(1, math.isqrt(patches) + 1) if patches % d == 0)
    h = patches // w
    rows, cols = np.divmod(np.arange(patches), w)
    return np.stack([(cols + 0.5) / w, (rows + 0.5) / h], axis=1)


class World:
    """The fixed synthetic encoder: states [..., STATE_DIM] -> tokens [..., P, D] (float32, no noise)."""

    def __init__(self, patches, embed_dim, world_seed=config.WORLD_SEED, hidden=64):
        rng = np.random.default_rng(world_seed)
        self.pos = patch_positions(patches)
        num_features = self.features(np.zeros(STATE_DIM)).shape[-1]
        # gain > 1 keeps tanh in its curved range, so tokens are a genuinely nonlinear function of the state
        self.w1 = (rng.standard_normal((num_features, hidden)) * 1.5 / math.sqrt(num_features)).astype(np.float32)
        self.b1 = (rng.standard_normal(hidden) * 0.5).astype(np.float32)
        self.w2 = (rng.standard_normal((hidden, embed_dim)) / math.sqrt(hidden) * 2.0).astype(np.float32)

    def features(self, states):
        s = np.asarray(states, dtype=np.float64)[..., None, :]
        content = self.pos + s[..., 0:2]
        phase = 2 * np.pi * content @ CONTENT_FREQS.T
        delta = (self.pos - s[..., 2:4]) / CURSOR_SIGMA
        bump = np.exp(-0.5 * (delta ** 2).sum(-1, keepdims=True))
        pressed = np.broadcast_to(s[..., 4:5], bump.shape)
        # real ViT tokens carry their patch position (position embeddings), so these do too
        where = np.concatenate([np.sin(2 * np.pi * self.pos), np.cos(2 * np.pi * self.pos)], -1)
        where = np.broadcast_to(where, bump.shape[:-1] + where.shape[-1:])
        parts = [np.sin(phase), np.cos(phase), 2 * bump, 2 * bump * delta, 2 * bump * pressed, pressed, where]
        return np.concatenate(parts, axis=-1).astype(np.float32)

    def embed(self, states):
        return np.tanh(self.features(states) @ self.w1 + self.b1) @ self.w2

    def bound(self):
        """The largest |token value| embed can give: tanh is within [-1, 1]."""
        return float(np.abs(self.w2).sum(0).max())

# -----------------------------------------------------------------------------------------------------------------
# the dynamics


def sample_gestures(rng, cursor, actions_per_step):
    """One gesture per row, starting at `cursor` [n, 2]; returns xy [n, A, 2] and touch [n, A] in {0, 1}."""
    n, A = len(cursor), actions_per_step
    kind = rng.choice(len(GESTURE_PROBS), size=n, p=list(GESTURE_PROBS.values()))
    drag, tap = kind == 0, kind == 1
    start = rng.uniform(0.1, 0.9, size=(n, 2))
    end = np.where(drag[:, None], np.clip(start + rng.uniform(-MAX_DRAG, MAX_DRAG, (n, 2)), 0, 1), start)
    # drags press early and release late (sometimes not at all: the finger is still down at the next step)
    down = np.where(drag, rng.integers(0, A // 4 + 1, n), np.where(tap, rng.integers(0, A, n), A))
    up = np.where(drag, A - rng.integers(0, A // 4 + 1, n), np.minimum(down + 1 + A // 10, A))
    i = np.arange(A)[None, :]
    # before `down` the finger glides from the cursor to `start`, while down it moves from `start` to `end`
    approach = (i + 1) / np.maximum(down, 1)[:, None]
    stroke = (i - down[:, None]) / np.maximum(up - down - 1, 1)[:, None]
    frac = np.where(i < down[:, None], approach, np.clip(stroke, 0, 1))[..., None]
    xy = np.where((i < down[:, None])[..., None],
                  cursor[:, None] + (start - cursor)[:, None] * frac,
                  start[:, None] + (end - start)[:, None] * frac)
    touch = (i >= down[:, None]) & (i < up[:, None])
    return xy, touch.astype(np.float64)


def step_state(state, actions):
    """Next states [n, STATE_DIM] from states [n, STATE_DIM] and the step's actions [n, A, C] (as stored)."""
    xy = np.concatenate([state[:, None, 2:4], actions[:, :, 0:2].astype(np.float64)], axis=1)
    touch = np.concatenate([state[:, None, 4], actions[:, :, 2].astype(np.float64)], axis=1) > 0.5
    # the content follows the finger over every move made while it stayed down
    held = (touch[:, 1:] & touch[:, :-1])[..., None]
    scroll = (state[:, 0:2] + (np.diff(xy, axis=1) * held).sum(1)) % 1.0
    return np.concatenate([scroll, xy[:, -1], touch[:, -1:].astype(np.float64)], axis=1)


def simulate(rng, n, steps, actions_per_step, channels=config.ACTION_CHANNELS):
    """Roll n trajectories: states [n, steps, STATE_DIM] (float64), actions [n, steps-1, A, C] (float32)."""
    states = np.zeros((n, steps, STATE_DIM))
    actions = np.zeros((n, steps - 1, actions_per_step, channels), dtype=np.float32)
    states[:, 0, :4] = rng.random((n, 4))
    for t in range(steps - 1):
        xy, touch = sample_gestures(rng, states[:, t, 2:4], actions_per_step)
        actions[:, t, :, 0:2] = xy
        actions[:, t, :, 2] = touch
        # the dynamics read the stored float32 actions, so the file is exactly consistent with its states
        states[:, t + 1] = step_state(states[:, t], actions[:, t])
    return states, actions

# -----------------------------------------------------------------------------------------------------------------
# writing


def file_rng(seed, split, index):
    """The generator of one file; train and val never share a stream, whatever the seed."""
    return np.random.default_rng([seed, SPLITS.index(split), index])


def embedding_chunks(world, states, rng, noise, dtype):
    """Yields the embeddings of `states` a few trajectories at a time, so memory stays bounded."""
    n, steps = states.shape[:2]
    hidden, embed_dim = world.w2.shape
    rows = max(1, CHUNK_ELEMENTS // (steps * len(world.pos) * max(embed_dim, hidden)))
    for i in range(0, n, rows):
        emb = world.embed(states[i:i + rows])
        if noise > 0:
            emb += noise * rng.standard_normal(emb.shape, dtype=np.float32)
        with np.errstate(over="ignore"):  # an overflow is reported below, naming the flags
            out = emb.astype(dtype)
        if not np.isfinite(out).all():
            raise ValueError(f"--noise {noise:g} with --dtype {np.dtype(dtype).name} gave embeddings beyond the "
                             f"dtype's range, which the loader refuses; expected a smaller --noise or float32")
        yield out


def write_npy_member(zf, key, shape, dtype, chunks):
    """Streams one array into the zip as `key`.npy, laid out exactly as np.savez would write it."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    with zf.open(key + ".npy", "w", force_zip64=True) as fp:
        np.lib.format.write_array_header_1_0(fp, header)
        for chunk in chunks:
            fp.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())


def write_file(path, world, rng, n, steps, actions_per_step, channels, dtype, compress, noise, save_states):
    states, actions = simulate(rng, n, steps, actions_per_step, channels)
    emb_shape = (n, steps, len(world.pos), world.w2.shape[1])
    # a killed process leaves a .tmp behind, never a half-written .npz that the loader would pick up
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # its own: several processes may write the same file
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as zf:
            write_npy_member(zf, "embeddings", emb_shape, dtype, embedding_chunks(world, states, rng, noise, dtype))
            write_npy_member(zf, "actions", actions.shape, np.float32, [actions])
            if save_states:
                write_npy_member(zf, "states", states.shape, np.float32, [states])
    except BaseException:
        tmp.unlink(missing_ok=True)  # a refused or interrupted (Ctrl-C) file leaves nothing behind
        raise
    os.replace(tmp, path)
    return emb_shape, actions.shape


def check_counts(num_files, trajectories_per_file, seed, world_seed, dtype):
    """What the loader would refuse, or numpy's seeding: refused before anything is written."""
    for flag, value in (("num_files", num_files), ("trajectories_per_file", trajectories_per_file)):
        if value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    for flag, value in (("seed", seed), ("world_seed", world_seed)):
        if value < 0:
            raise ValueError(f"--{flag} must be >= 0, got {value}")
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name}")


def check_geometry(steps, patches, embed_dim, actions_per_step, channels):
    if steps < 2:
        raise ValueError(f"--num_steps must be >= 2 (actions live between steps), got {steps}")
    names = config.ACTION_CHANNEL_NAMES
    if channels < len(names):
        raise ValueError(f"--action_channels must be >= {len(names)} for [{', '.join(names)}], got {channels}")
    if channels > config.MAX_ACTION_CHANNELS:  # what the loader refuses
        raise ValueError(f"--action_channels must be <= {config.MAX_ACTION_CHANNELS}, got {channels}")
    if min(patches, actions_per_step) < 1:
        raise ValueError(f"--patches and --actions_per_step must be >= 1, got {patches}, {actions_per_step}")
    if embed_dim < config.MIN_EMBED_DIM:
        raise ValueError(f"--embed_dim must be >= {config.MIN_EMBED_DIM} (the predictor layer-norms tokens over D), "
                         f"got {embed_dim}")


def check_noise(noise, dtype, world):
    """Refuses a --noise that could push token values past the largest finite value of the storage dtype."""
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"--noise must be a finite number >= 0, got {noise}")
    name, top = np.dtype(dtype).name, float(np.finfo(dtype).max)
    largest = round_down((top - world.bound()) / NOISE_SIGMAS)
    if noise > largest:
        other = " (or --dtype float32)" if name == "float16" else ""
        raise ValueError(f"--noise {noise:g} with --dtype {name} could give embeddings beyond {name}'s largest "
                         f"value {top:g}, which the loader refuses as inf; expected --noise <= {largest:g}{other}")


def round_down(x, digits=3):
    """x rounded down to `digits` significant digits, so the bound a message prints is itself accepted."""
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{math.floor(x / unit) * unit:.{digits}g}")


def generate(output_dir, num_files=3, trajectories_per_file=10, seed=0,
             steps=config.SMALL_NUM_STEPS, patches=config.SMALL_PATCHES_PER_STEP,
             embed_dim=config.SMALL_EMBED_DIM, actions_per_step=config.SMALL_ACTIONS_PER_STEP,
             channels=config.SMALL_ACTION_CHANNELS, dtype="float16", compress=False,
             noise=config.SYNTHETIC_NOISE, world_seed=config.WORLD_SEED, split="train",
             save_states=False, verbose=False):
    """
    Writes `num_files` files `<split>_NNNNN.npz` into output_dir and returns their paths.
    Keys: embeddings [N, T, P, D] in `dtype`, actions [N, T-1, A, C] float32 in [0, 1], and with save_states
    also states [N, T, STATE_DIM] float32 (the hidden state, for probing; the loader ignores it).
    Extra action channels beyond [x, y, touch] are zero.
    """
    check_counts(num_files, trajectories_per_file, seed, world_seed, dtype)
    check_geometry(steps, patches, embed_dim, actions_per_step, channels)
    world = World(patches, embed_dim, world_seed)
    check_noise(noise, dtype, world)
    output_dir = Path(output_dir)
    check_output_dir(output_dir, split, num_files)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, name in enumerate(file_names(split, num_files)):
        path = output_dir / name
        shapes = write_file(path, world, file_rng(seed, split, index), trajectories_per_file, steps,
                            actions_per_step, channels, np.dtype(dtype), compress, noise, save_states)
        paths.append(path)
        if verbose:
            print(f"wrote {path}: embeddings {shapes[0]} {dtype}, actions {shapes[1]} float32, "
                  f"{path.stat().st_size:,} bytes")
    if verbose:
        total = sum(p.stat().st_size for p in paths)
        print(f"{split}: {len(paths)} file{'s' * (len(paths) != 1)}, {num_files * trajectories_per_file} trajectories, "
              f"{total:,} bytes in {output_dir}")
    return paths


def file_names(split, num_files):
    return [f"{split}_{index:05d}.npz" for index in range(num_files)]


def check_output_dir(output_dir, split, num_files):
    """
    Refuses a directory holding any .npz that this call will not overwrite: the loader reads every *.npz in
    a directory, so a leftover file (a larger earlier run, the other split) would silently join this set.
    """
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ValueError(f"{OUTPUT_FLAGS[split]} {output_dir}: is a file; expected a directory (new or holding "
                         f"only this set's .npz files)")
    planned = set(file_names(split, num_files))
    others = sorted(p.name for p in Path(output_dir).glob("*.npz") if p.name not in planned)
    if others:
        raise ValueError(f"{output_dir} already holds {len(others)} other .npz files ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}) that a loader would read together with the "
                         f"{split} files; expected a directory without other .npz files: remove them or choose "
                         f"another {OUTPUT_FLAGS[split]}")


def val_split(num_files, trajectories_per_file, val_fraction):
    """(files, trajectories per file) of a validation set holding about val_fraction of the training set."""
    total = max(1, round(val_fraction * num_files * trajectories_per_file))
    files = math.ceil(total / trajectories_per_file)
    return files, math.ceil(total / files)

# -----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--output_dir", required=True, help="directory for the training files")
    d = " (default %(default)s)"
    p.add_argument("--num_files", type=int, default=3, help="files in --output_dir" + d)
    p.add_argument("--trajectories_per_file", type=int, default=10, help="N of each file" + d)
    p.add_argument("--seed", type=int, default=0, help="seeds the trajectories (not the encoder)" + d)
    p.add_argument("--world_seed", type=int, default=config.WORLD_SEED,
                   help="seeds the state -> token encoder; keep it equal for train and val" + d)
    p.add_argument("--num_steps", type=int, help=f"T (default {config.SMALL_NUM_STEPS})")
    p.add_argument("--patches", type=int, help=f"P (default {config.SMALL_PATCHES_PER_STEP})")
    p.add_argument("--embed_dim", type=int, help=f"D (default {config.SMALL_EMBED_DIM})")
    p.add_argument("--actions_per_step", type=int, help=f"A (default {config.SMALL_ACTIONS_PER_STEP})")
    p.add_argument("--action_channels", type=int, help=f"C (default {config.SMALL_ACTION_CHANNELS})")
    p.add_argument("--real_shapes", action="store_true",
                   help=f"real geometry T={config.NUM_STEPS} P={config.PATCHES_PER_STEP} D={config.EMBED_DIM} "
                        f"A={config.ACTIONS_PER_STEP} C={config.ACTION_CHANNELS} (explicit flags still win)")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="dtype of the embeddings (actions are float32)" + d)
    p.add_argument("--compress", action="store_true", help="np.savez_compressed layout (deflate)")
    p.add_argument("--noise", type=float, default=config.SYNTHETIC_NOISE, help="std of token noise" + d)
    p.add_argument("--save_states", action="store_true", help="also store the hidden states (key 'states')")
    p.add_argument("--val_fraction", type=float, default=0.0,
                   help="also write a validation set of this size relative to the training set")
    p.add_argument("--val_output_dir", help="where the validation set goes (default <output_dir>_val)")
    args = p.parse_args(argv)
    try:
        check_counts(args.num_files, args.trajectories_per_file, args.seed, args.world_seed, args.dtype)
    except ValueError as exc:
        p.error(str(exc))
    for flag in ("noise", "val_fraction"):
        if not math.isfinite(getattr(args, flag)):  # nan passes every comparison check below
            p.error(f"--{flag} must be a finite number, got {getattr(args, flag)}")
        if getattr(args, flag) < 0:
            p.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    if args.val_fraction > 1:
        p.error(f"--val_fraction must be in [0, 1], got {args.val_fraction}")
    if args.val_output_dir and not args.val_fraction:
        p.error(f"--val_output_dir {args.val_output_dir} without --val_fraction: no validation set is written; "
                f"expected --val_fraction > 0 (the share of the training set to write there)")
    try:
        check_geometry(*resolve_geometry(args).values())
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.output_dir).resolve()
    if args.val_fraction > 0 and Path(val_output_dir(args)).resolve() == out:
        p.error(f"--val_output_dir {args.val_output_dir} and --output_dir {args.output_dir} are the same "
                f"directory ({out}); expected two directories: the loader reads every .npz in a directory, so "
                f"the validation files would be trained on")
    return args


def resolve_geometry(args):
    real = (config.NUM_STEPS, config.PATCHES_PER_STEP, config.EMBED_DIM, config.ACTIONS_PER_STEP,
            config.ACTION_CHANNELS)
    small = (config.SMALL_NUM_STEPS, config.SMALL_PATCHES_PER_STEP, config.SMALL_EMBED_DIM,
             config.SMALL_ACTIONS_PER_STEP, config.SMALL_ACTION_CHANNELS)
    given = (args.num_steps, args.patches, args.embed_dim, args.actions_per_step, args.action_channels)
    defaults = real if args.real_shapes else small
    keys = ("steps", "patches", "embed_dim", "actions_per_step", "channels")
    return {k: d if g is None else g for k, g, d in zip(keys, given, defaults)}


def val_output_dir(args):
    out = Path(args.output_dir).resolve()  # "." has no name of its own
    return args.val_output_dir or out.with_name(out.name + "_val")


def main(argv=None):
    args = parse_args(argv)
    geometry = resolve_geometry(args)
    if geometry["steps"] - 1 < config.ROLLOUT_HORIZON:  # written anyway: a shorter horizon trains on them
        print(f"note: T={geometry['steps']} leaves {geometry['steps'] - 1} step(s) to predict, fewer than the "
              f"trainer's default --rollout_horizon {config.ROLLOUT_HORIZON}: train on these files with "
              f"--rollout_horizon {max(1, geometry['steps'] - 1)}", file=sys.stderr)
    common = dict(seed=args.seed, dtype=args.dtype, compress=args.compress, noise=args.noise,
                  world_seed=args.world_seed, save_states=args.save_states, verbose=True, **geometry)
    sets = [(args.output_dir, args.num_files, args.trajectories_per_file, "train")]
    if args.val_fraction > 0:
        sets.append((val_output_dir(args), *val_split(args.num_files, args.trajectories_per_file,
                                                       args.val_fraction), "val"))
    try:
        # both directories are checked before either is written, so a refusal leaves nothing half-made
        for output_dir, num_files, _, split in sets:
            check_output_dir(output_dir, split, num_files)
        for output_dir, num_files, per_file, split in sets:
            generate(output_dir, num_files, per_file, split=split, **common)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
