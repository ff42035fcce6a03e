"""
Trains a V-JEPA 2-AC style action-conditioned predictor on VJ2 GUI trajectories, through DDPTrainer.

The predictor reads frozen encoder tokens z_t [P, D] and the GUI actions a_t between steps, and predicts z_{t+1}.
Per step t its tokens are [action_t, patch_1 .. patch_P]; a block-causal mask lets every token see its own step
and earlier ones, so the output of step t can predict step t+1. The loss is L1 teacher forcing over steps 1..T-1
plus L1 over an autoregressive rollout of --rollout_horizon steps, on layer-normed tokens (see README.md).

    python create_synthetic_data.py --output_dir ./train_data --num_files 3 --trajectories_per_file 10
    python create_synthetic_data.py --output_dir ./val_data --seed 1 --num_files 1
    torchrun --nproc_per_node=2 vj2ac_train_multi_gpu.py --device cpu --dist-backend gloo \\
        --processed_data_dir ./train_data --validation_data_dir ./val_data --num_epochs 1 --batch_size 2 \\
        --save_every_iters 100
    python vj2ac_train_multi_gpu.py --evaluate checkpoints/vj2ac/vjepa2_final.pt --validation_data_dir ./val_data \\
        [--shuffle_actions]

Checkpoints (rank 0, weights only): checkpoint_dir/vjepa2_{best,step_N,epoch_N,interrupted,final}.pt, each
holding `predictor`, `global_step`, `predictor_config`, `rollout_horizon`, `data_geometry` (T, P, D, A, C of the
training data), and `val_loss` when a validation ran at that step.
"""

import signal

import early_signals

# The stop signals that schedulers send are caught from here, before torch's import: see ddp_training.py
EARLY_STOPS: list = early_signals.catch_stops() if __name__ == "__main__" else []
if __name__ == "__main__":
    _SIGINT_AT_START = early_signals.quiet_ctrl_c()

import argparse
import json
import logging
import math
import numbers
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import config
import ddp_runtime as rt
from ddp_training import (MAX_TIMEOUT_S, BadInput, DataMismatch, DDPTrainer, EvaluationFailed, RunDirInUse,
                          TrainConfig, add_config_flags, epochs_rule, evaluate_model, load_yaml_mapping,
                          train_preemptible)
from vj2_dataloader import VJ2TrajectoryDataset, data_fingerprint, list_files

# -----------------------------------------------------------------------------------------------------------------
# the predictor


class BlockCausalAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, mask):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, width, heads, mlp_ratio):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = BlockCausalAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class ACPredictor(nn.Module):
    """
    predict(z [B, S, P, D], actions [B, S, A*C]) -> layer-normed predictions of z_1 .. z_S, one per input step.
    `z` must be layer-normed over D already (F.layer_norm(tokens, (D,)), as forward does: the predictor
    trained on normed tokens and predicts normed ones), and each step's A x C actions flattened to A*C values,
    action-major ([x, y, touch] of event 0, then of event 1, ...), as in the .npz files.
    forward(embeddings [B, T, P, D], actions [B, T-1, A*C], rollout_horizon) -> per-sample (jloss, sloss).
    """
    static_graph = True  # one block-causal pass serves teacher forcing and rollout: every parameter, every step

    def __init__(self, embed_dim, num_patches, action_dim, max_steps, predictor_dim, depth, num_heads, mlp_ratio=4):
        super().__init__()
        self.config = checked_config(dict(embed_dim=embed_dim, num_patches=num_patches, action_dim=action_dim,
                                          max_steps=max_steps, predictor_dim=predictor_dim, depth=depth,
                                          num_heads=num_heads, mlp_ratio=mlp_ratio))
        self.patch_in = nn.Linear(embed_dim, predictor_dim)
        self.action_in = nn.Linear(action_dim, predictor_dim)
        self.patch_pos = nn.Parameter(torch.zeros(num_patches, predictor_dim))
        self.step_pos = nn.Parameter(torch.zeros(max_steps, predictor_dim))
        self.blocks = nn.ModuleList(Block(predictor_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(predictor_dim)
        self.patch_out = nn.Linear(predictor_dim, embed_dim)
        self.apply(self._init)
        nn.init.normal_(self.patch_pos, std=0.02)
        nn.init.normal_(self.step_pos, std=0.02)
        # masks depend only on the shape, so each is built once; a plain dict keeps them out of the state dict
        self._masks = {}

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def block_causal_mask(self, steps, tokens_per_step, device):
        """[L, L] boolean, True where attention is allowed: token i sees token j iff step(j) <= step(i)."""
        key = (steps, tokens_per_step, device)
        if key not in self._masks:
            step = torch.arange(steps, device=device).repeat_interleave(tokens_per_step)
            self._masks[key] = step[None, :] <= step[:, None]
        return self._masks[key]

    def predict(self, z, actions):
        B, S, P, D = z.shape
        if S > self.config["max_steps"]:
            raise ValueError(f"{S} input steps but the predictor has position embeddings for "
                             f"max_steps={self.config['max_steps']}")
        patches = self.patch_in(z) + self.patch_pos
        action = self.action_in(actions)[:, :, None]
        x = (torch.cat([action, patches], 2) + self.step_pos[:S, None]).flatten(1, 2)
        mask = self.block_causal_mask(S, 1 + P, x.device)
        for block in self.blocks:
            x = block(x, mask)
        # only patch outputs are predictions; the action token's output is dropped
        x = self.norm(x).view(B, S, 1 + P, -1)[:, :, 1:]
        return F.layer_norm(self.patch_out(x), (D,))

    def forward(self, embeddings, actions, rollout_horizon):
        # Teacher forcing and the rollout share this one call so that DDP sees a single forward per micro-step
        # whose outputs all reach the backward (several DDP forwards before one backward are an error).
        z = F.layer_norm(embeddings, (embeddings.shape[-1],))
        teacher = self.predict(z[:, :-1], actions)
        jloss = (teacher - z[:, 1:]).abs().mean((1, 2, 3))
        # The first rollout step sees exactly what teacher forcing saw (z_0, a_0): reuse its prediction. Later
        # steps feed the predictions back; gradients flow through them, so early errors that compound are
        # penalised where they are made.
        rollout = [teacher[:, 0]]
        for k in range(1, rollout_horizon):
            context = torch.cat([z[:, :1], torch.stack(rollout, 1)], 1)
            rollout.append(self.predict(context, actions[:, :k + 1])[:, -1])
        sloss = (torch.stack(rollout, 1) - z[:, 1:rollout_horizon + 1]).abs().mean((1, 2, 3))
        return jloss, sloss


def checked_config(cfg):
    """
    The predictor's config with every value an int >= 1 and predictor_dim divisible by num_heads; a checkpoint
    brings its own, so a bad one is a ValueError here rather than an error deep inside the first forward.
    """
    for key, value in cfg.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"predictor_config {key} must be an integer >= 1, got {value!r}")
    if cfg["predictor_dim"] % cfg["num_heads"]:
        raise ValueError(f"predictor_dim={cfg['predictor_dim']} must be divisible by num_heads={cfg['num_heads']}")
    if cfg["embed_dim"] < config.MIN_EMBED_DIM:
        raise ValueError(f"predictor_config embed_dim must be >= {config.MIN_EMBED_DIM} (tokens are layer-normed "
                         f"over it), got {cfg['embed_dim']}")
    return {key: int(value) for key, value in cfg.items()}


def vj2_loss(model, batch, rollout_horizon):
    """DDPTrainer's contract: (sum over samples of jloss + sloss, samples, {name: sum})."""
    embeddings, actions = batch
    # embeddings may be float16 on disk; the trainer moved them to the device as stored
    jloss, sloss = model(embeddings.float(), actions.float(), rollout_horizon)
    return (jloss + sloss).sum(), jloss.shape[0], {"jloss": jloss.sum(), "sloss": sloss.sum()}

# -----------------------------------------------------------------------------------------------------------------
# data


@contextmanager
def blamed_on(flag):
    """Reports a data error as a BadInput naming the flag that pointed at the data."""
    try:
        yield
    except (ValueError, OSError) as exc:  # DataFileError and the horizon check are ValueErrors
        raise BadInput(f"{flag}: {exc}") from exc


def load_dataset(flag, path, args, logger=None):
    with blamed_on(flag):
        return VJ2TrajectoryDataset(path, skip_bad_files=args.skip_bad_files, logger=logger,
                                    rollout_horizon=args.rollout_horizon)


def check_disjoint(args):
    """
    Refuses training and validation data that share a file: the validation loss would then score trajectories
    the predictor trained on and hide overfitting. A file is shared under another name too: a hard link, or
    a copy (same data members). Runs before any data is read: a stat and the zip directory per file.
    """
    train, val = (file_identities(flag, data_dir)
                  for flag, data_dir in (("--processed_data_dir", args.processed_data_dir),
                                         ("--validation_data_dir", args.validation_data_dir)))
    seen = {}
    for path, identities in train:
        for identity in identities:
            seen.setdefault(identity, path)
    shared = []
    for path, identities in val:
        match = next((identity for identity in identities if identity in seen), None)
        if match:
            shared.append((seen[match], path, match[0]))
    if shared:
        train_file, val_file, reason = shared[0]
        example = val_file if train_file == val_file else f"{train_file} and {val_file}: {reason}"
        raise BadInput(f"--processed_data_dir {args.processed_data_dir} and --validation_data_dir "
                       f"{args.validation_data_dir} share {len(shared)} .npz files (e.g. {example}); expected "
                       f"disjoint training and validation data")


def file_identities(flag, data_dir):
    """
    [(path, [(reason, key)])] for the files of data_dir: two files sharing a (reason, key) are one file,
    checked in the order listed so the plainest reason is the one reported. What cannot be read gives no key;
    the loader reports such a file (honouring --skip_bad_files).
    """
    with blamed_on(flag):
        paths = list_files(data_dir)
    out = []
    for path in paths:  # named as listed (a link by its own name), compared by what it is
        identities = [("the same path", path.resolve())]
        try:
            st = path.stat()
            identities.append(("the same file (a hard link)", (st.st_dev, st.st_ino)))
        except OSError:
            pass
        fingerprint = data_fingerprint(path)
        if fingerprint is not None:
            identities.append(("a copy (same CRC-32 and size of 'embeddings' and 'actions')", fingerprint))
        out.append((path, identities))
    return out


class ShuffledActions(Dataset):
    """Each trajectory's embeddings with another trajectory's actions, by a fixed derangement (seeded)."""

    def __init__(self, dataset, seed):
        if len(dataset) < 2:
            raise BadInput("--shuffle_actions needs at least 2 validation trajectories")
        self.dataset = dataset
        order = np.random.default_rng(seed).permutation(len(dataset))
        # following a random cycle through all trajectories moves every one of them
        self.partner = np.empty_like(order)
        self.partner[order] = np.roll(order, -1)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i][0], self.dataset.actions(int(self.partner[i]))


def predictor_for(geometry, args):
    T, P, D, A, C = geometry
    return ACPredictor(embed_dim=D, num_patches=P, action_dim=A * C, max_steps=T - 1,
                       predictor_dim=args.predictor_dim, depth=args.depth, num_heads=args.num_heads)


def check_fits(predictor, geometry, flag, trained_on=None):
    """The data must fit the predictor's shapes, and where the checkpoint says what it trained on, have the
    same layout: the predictor sees an action step as one vector of A*C values, so 5 x 6 actions would pass
    for 10 x 3 and be read scrambled."""
    T, P, D, A, C = geometry
    if trained_on is not None and tuple(trained_on[1:]) != (P, D, A, C):
        differ = [name for name, here, there in zip("PDAC", (P, D, A, C), trained_on[1:]) if here != there]
        raise BadInput(f"{flag}: data geometry {geometry} differs from the training data's "
                       f"{type(geometry)(*trained_on)} in {' and '.join(differ)}")
    cfg = predictor.config
    if (cfg["embed_dim"], cfg["num_patches"], cfg["action_dim"]) != (D, P, A * C) or T - 1 > cfg["max_steps"]:
        raise BadInput(f"{flag}: data geometry {geometry} does not fit the predictor (embed_dim={cfg['embed_dim']}, "
                       f"num_patches={cfg['num_patches']}, action_dim=A*C={cfg['action_dim']}, "
                       f"max_steps=T-1<={cfg['max_steps']})")

# -----------------------------------------------------------------------------------------------------------------
# command line

# --test: a quick run; explicit flags still win
TEST_DEFAULTS = dict(max_steps=20, val_every_iters=10, preset="tiny", run_name="vj2ac_test")
TEST_DATA = "test_data"  # where --test without data dirs writes its synthetic set, in its run dir
# default --lr per preset: the small ones train fast on the synthetic data; a 300M-parameter predictor needs a
# conservative rate
PRESET_LR = {"tiny": 1e-2, "small": 5e-3, "vjepa2_ac": 4e-4}


def build_parser():
    p = rt.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    d = " (default %(default)s)"
    p.add_argument("--config", help="YAML file of flag names and values (a run dir's config.yaml); flags win")
    p.add_argument("--processed_data_dir", help="training .npz files (required unless --evaluate)")
    p.add_argument("--validation_data_dir", help="validation .npz files (required)")
    p.add_argument("--num_epochs", "--epochs", type=int, default=1, help=d)
    p.add_argument("--batch_size", "--batch-size", type=int, default=4, help="trajectories per rank and step" + d)
    p.add_argument("--num_workers", type=int, default=0, help="DataLoader workers per rank" + d)
    p.add_argument("--loader_timeout", type=float, default=120.0,
                   help="seconds a rank waits for a batch from its workers before the run fails (a stuck worker)" + d)
    p.add_argument("--save_every_iters", type=int, default=500, help="vjepa2_step_N.pt every N steps; 0 = off" + d)
    p.add_argument("--save_every_epochs", type=int, default=0, help="vjepa2_epoch_N.pt every N epochs; 0 = off" + d)
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--dist-backend", "--dist_backend", dest="dist_backend", choices=["nccl", "gloo"],
                   help="default: nccl on cuda, gloo on cpu")
    rt.add_local_rank_flag(p)
    p.add_argument("--run_name", "--run-name", default="vj2ac",
                   help="names the default checkpoint dir, checkpoints/<run_name>; relaunching the same run "
                        "resumes it" + d)
    p.add_argument("--checkpoint_dir", "--checkpoint-dir", help="default: checkpoints/<run_name>")
    p.add_argument("--log_dir", "--log-dir", help="rank_N.log and metrics.jsonl; default: the checkpoint dir")
    p.add_argument("--rollout_horizon", type=int,
                   help=f"autoregressive steps in the rollout loss; needs T-1 >= it "
                        f"(default: {config.ROLLOUT_HORIZON}; with --evaluate, the checkpoint's)")
    p.add_argument("--lr", "--learning_rate", type=float, help=f"peak learning rate; default by preset: {PRESET_LR}")
    p.add_argument("--weight_decay", type=float, default=0.04, help=d)
    p.add_argument("--warmup_steps", type=int, default=5, help=d)
    p.add_argument("--grad_accum_steps", type=int, default=1, help="micro-steps per optimizer step" + d)
    p.add_argument("--max_steps", "--max-steps", type=int, default=0, help="optimizer steps; 0 = --num_epochs worth")
    p.add_argument("--val_every_iters", type=int, default=100, help="0 = at the end of every epoch" + d)
    p.add_argument("--preset", choices=sorted(config.PREDICTOR_PRESETS), default=config.DEFAULT_PREDICTOR_PRESET,
                   help=f"predictor size: {config.PREDICTOR_PRESETS}" + d)
    p.add_argument("--depth", type=int, help="overrides the preset")
    p.add_argument("--num_heads", type=int, help="overrides the preset")
    p.add_argument("--predictor_dim", type=int, help="overrides the preset")
    p.add_argument("--seed", type=int, default=0, help=d)
    p.add_argument("--resume", default="auto",
                   help="auto: the newest resumable state in --checkpoint_dir, if any | none | PATH")
    p.add_argument("--no_amp", action="store_true", help="no mixed precision on CUDA")
    p.add_argument("--evaluate", metavar="CKPT", help="only evaluate this checkpoint on --validation_data_dir")
    p.add_argument("--shuffle_actions", action="store_true",
                   help="with --evaluate: pair each trajectory with another one's actions")
    p.add_argument("--skip_bad_files", action="store_true", help="warn about bad .npz files instead of failing")
    p.add_argument("--dist_timeout", type=float, default=rt.DEFAULT_DIST_TIMEOUT_S,
                   help="seconds a collective may wait" + d)
    p.add_argument("--debug", action="store_true", help="debug logs on every rank")
    p.add_argument("--test", action="store_true", help=f"quick run: {TEST_DEFAULTS}")
    add_config_flags(p.add_argument_group("DDPTrainer settings, as in ddp_training.py"), TRAINER_FLAGS, None)
    return p


# DDPTrainer's settings that this script passes on as they are (unset: the trainer's default)
TRAINER_FLAGS = ("grad_clip", "lr_schedule", "min_lr_ratio", "amp_dtype", "compile", "static_graph", "bucket_cap_mb",
                 "pin_memory", "first_step_timeout", "patience", "min_delta", "target_loss", "keep_states",
                 "keep_checkpoints", "async_checkpoint", "log_interval", "tensorboard", "memory_check_interval",
                 "max_memory_gb", "max_errors_per_epoch", "max_bad_steps", "init_from")


# What --evaluate reads (any other flag on its command line is refused: it would change nothing)
EVALUATE_FLAGS = ("evaluate", "validation_data_dir", "shuffle_actions", "rollout_horizon", "batch_size", "num_workers",
                  "loader_timeout", "skip_bad_files", "seed", "device", "dist_backend", "dist_timeout", "local_rank",
                  "debug", "config")

# Flags of one launch, not of the run: not in the run dir's config.yaml, and not taken from a --config file
NOT_RECORDED = ("help", "config", "evaluate", "shuffle_actions", "local_rank", "test")


def parse_args(argv=None):
    """Defaults < --config file < --test < flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**defaults_from_file(parser, args.config, given_flags(argv)))
    if args.test:
        parser.set_defaults(**TEST_DEFAULTS)
    args = parser.parse_args(argv)
    given = given_flags(argv)
    if "num_epochs" in given and "max_steps" not in given and args.max_steps:
        epochs_rule(args.num_epochs, args.max_steps, "--test" if args.test else f"--config {args.config}")
        args.max_steps = 0
    for flag in ("processed_data_dir", "validation_data_dir", "evaluate", "checkpoint_dir", "log_dir"):
        if getattr(args, flag) == "":  # "$DIR" with DIR unset must not mean "the default"
            parser.error(f"--{flag} must be a path, got an empty string")
    test_data = None
    if args.test and not args.evaluate and args.processed_data_dir is None and args.validation_data_dir is None:
        # --test alone trains on a tiny synthetic set, which it writes into its own run dir
        test_data = Path(args.checkpoint_dir or f"checkpoints/{args.run_name}") / TEST_DATA
        args.processed_data_dir, args.validation_data_dir = str(test_data / "train"), str(test_data / "val")
    # The run dir's config.yaml: the flags as given, before the preset and the device fill in the rest (so
    # another --preset over the file means that preset, and a GPU run's file loads on the CPU). How this
    # launch began is no property of the run: loaded again, the file continues it.
    run_config = {**{k: v for k, v in vars(args).items() if k not in NOT_RECORDED}, "resume": "auto"}
    args.test_data = test_data
    for key, value in config.PREDICTOR_PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lr = PRESET_LR[args.preset] if args.lr is None else args.lr
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.evaluate:
        if not args.validation_data_dir:
            parser.error("--evaluate needs --validation_data_dir")
        ignored = [f"--{flag}" for flag in given if flag not in EVALUATE_FLAGS]
        if ignored:  # a --depth or a --processed_data_dir that did nothing looked as if it had been used
            parser.error(f"--evaluate scores the checkpoint as it is: {' '.join(ignored)} "
                         f"{'is a training flag' if len(ignored) == 1 else 'are training flags'}, which it does not "
                         f"read; leave {'it' if len(ignored) == 1 else 'them'} out")
    elif not (args.processed_data_dir and args.validation_data_dir):
        parser.error("--processed_data_dir and --validation_data_dir are required (unless --evaluate, or --test "
                     "with neither)")
    elif args.shuffle_actions:
        parser.error("--shuffle_actions only applies to --evaluate")
    if args.no_amp and args.amp_dtype in ("bf16", "fp16"):  # fp32 would be taken without a word
        parser.error(f"--no_amp turns off the mixed precision that --amp_dtype {args.amp_dtype} asks for: give one")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available (use --device cpu --dist-backend gloo)")
    if args.device == "cpu" and args.dist_backend == "nccl":
        parser.error("--dist-backend nccl needs CUDA; use gloo with --device cpu")
    # nan passes every comparison below, and inf trained to NaN weights or overflowed a timedelta later
    for flag in [k for k, v in vars(args).items() if isinstance(v, float)]:  # a new float flag too
        if not math.isfinite(getattr(args, flag)):
            parser.error(f"--{flag} must be a finite number, got {getattr(args, flag)}")
    if args.rollout_horizon is None and not args.evaluate:  # --evaluate takes the one the checkpoint trained with
        args.rollout_horizon = config.ROLLOUT_HORIZON
    for flag in ("batch_size", "rollout_horizon", "depth", "num_heads", "predictor_dim", "grad_accum_steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_steps", "num_epochs", "warmup_steps", "num_workers", "val_every_iters", "save_every_iters",
                 "save_every_epochs", "weight_decay"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    for flag in ("lr", "dist_timeout", "loader_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag} must be > 0, got {getattr(args, flag)}")
    if not 1 <= args.dist_timeout <= MAX_TIMEOUT_S:  # under a second the rendezvous itself times out
        parser.error(f"--dist_timeout must be from 1 to {MAX_TIMEOUT_S:g} seconds, got {args.dist_timeout:g}")
    if args.loader_timeout > MAX_TIMEOUT_S:  # Python's own waits overflow past about 1e10 s
        parser.error(f"--loader_timeout must be <= {MAX_TIMEOUT_S:g} seconds, got {args.loader_timeout:g}")
    if not 0 <= args.seed < 2 ** 32:  # numpy's seeding range
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.predictor_dim % args.num_heads:
        parser.error(f"--predictor_dim {args.predictor_dim} must be divisible by --num_heads {args.num_heads}")
    if (why := rt.bad_run_name(args.run_name)) is not None:
        parser.error(f"--run_name {why} (--checkpoint_dir, --log_dir)")
    try:  # the trainer's own checks of what the flags pass on (--keep_states -1), before any process starts
        TrainConfig.from_dict(train_config(args))
    except ValueError as exc:
        parser.error(str(exc).replace("config key '", "--").replace("' ", " ", 1))
    args.run_config = run_config
    return args


def given_flags(argv) -> dict:
    """The flags on the command line itself, by destination."""
    cli = build_parser()
    for action in cli._actions:
        action.default = argparse.SUPPRESS
    return vars(cli.parse_args(argv))


def defaults_from_file(parser, path, given) -> dict:
    """A --config file's values as parser defaults, each read as its flag reads it (through the flag's type
    and choices), so a file is checked as the command line is. Another --run_name (or --test's) is another
    run: the file's own --checkpoint_dir and --log_dir are then left out, unless given as flags."""
    try:
        data = load_yaml_mapping(path)
    except ValueError as exc:
        parser.error(str(exc))
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_RECORDED}
    values = {}
    for key, value in data.items():
        if key not in actions:
            nested = (" (a flat mapping: nested sections, as in V-JEPA 2's app/data/optimization configs, are not "
                      "read)" if any(isinstance(v, dict) for v in data.values()) else "")
            launch = (f" ({'--' + key} is a flag of one launch, not a key of the run)" if key in NOT_RECORDED
                      else "")
            parser.error(f"--config {path}: unknown key {key!r}{nested}{launch}{rt.name_hint(key, actions)}; "
                         f"expected flag names: {', '.join(sorted(actions))}")
        values[key] = flag_value(parser, actions[key], f"--config {path}: key {key!r}", value)
    file_run = values.get("run_name", parser.get_default("run_name"))
    run = given.get("run_name", TEST_DEFAULTS["run_name"] if given.get("test") else file_run)
    for key in ("checkpoint_dir", "log_dir") if run != file_run else ():
        if values.get(key) is not None and key not in given:
            renamed = "--run_name" if "run_name" in given else "--test"
            rt.note(f"{renamed} replaces {key}={values[key]} of --config {path}")
            values[key] = None
    return values


def flag_value(parser, action, where, value):
    """A YAML value for one flag, as the flag would read its text."""
    expected = getattr(action.type, "__name__", "str")
    if isinstance(value, (dict, list)):
        parser.error(f"{where} must be a single value, got a {type(value).__name__}")
    if value is None:
        if action.default is not None:
            parser.error(f"{where} must not be null (default {action.default!r})")
        return None
    switch = action.nargs == 0 or action.const is True  # store_true, or a trainer's --compile [BOOL]
    if switch and isinstance(value, bool):
        return value
    if action.nargs == 0 or (switch and not isinstance(value, str)):  # a word goes on: static_graph's "auto"
        parser.error(f"{where} must be true or false, got {value!r}")
    if isinstance(value, bool):  # YAML's true/false for a number or a path
        parser.error(f"{where} expects {expected}, got {value!r}")
    try:
        read = action.type(str(value)) if action.type else str(value)
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"{where} must be true or false, got {value!r}" if switch else
                     f"{where} expects {expected}, got {value!r}")
    if action.choices and read not in action.choices:
        parser.error(f"{where} must be one of {list(action.choices)}, got {value!r}")
    return read


def train_config(args):
    """The DDPTrainer config (see ddp_training.TrainConfig) from the command line."""
    # A name every rank, every node and every relaunch agrees on without talking: a preempted or restarted
    # run finds its own states again
    checkpoint_dir = args.checkpoint_dir or f"checkpoints/{args.run_name}"
    return dict(num_epochs=args.num_epochs, batch_size=args.batch_size, num_workers=args.num_workers,
                save_every_iters=args.save_every_iters, save_interval=args.save_every_epochs, device=args.device,
                dist_backend=args.dist_backend, checkpoint_dir=checkpoint_dir,
                log_dir=args.log_dir or checkpoint_dir, learning_rate=args.lr, max_steps=args.max_steps,
                val_interval=args.val_every_iters, seed=args.seed, resume=args.resume,
                dist_timeout=args.dist_timeout, debug=args.debug, grad_accum_steps=args.grad_accum_steps,
                weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, checkpoint_prefix="vjepa2",
                use_amp=not args.no_amp, loader_timeout=args.loader_timeout,
                **{k: getattr(args, k) for k in TRAINER_FLAGS if getattr(args, k) is not None})

# -----------------------------------------------------------------------------------------------------------------
# training and evaluation


def train(args, launch):
    cfg = train_config(args)
    return train_preemptible(lambda: set_up(args, launch, cfg), cfg["log_dir"], rt.FirstSignal(EARLY_STOPS))


def set_up(args, launch, cfg):
    """The data (checked on every rank), the predictor and its DDPTrainer (`cfg`: train_config(args))."""
    # Kept, not written yet: the trainer's logger (of the same name) writes these lines into rank_N.log once
    # it holds the run dir, and a run refused there (another run's dir) writes nothing into it.
    log = rt.setup_logger(cfg["log_dir"], launch["rank"], args.debug, keep=True)
    try:
        return _set_up(args, launch, cfg, log)
    except RunDirInUse as exc:  # another run's dir: nothing of this run goes into it
        raise BadInput(str(exc)) from exc
    except KeyboardInterrupt:  # not a failure: training_logs shows the run as stopped in set-up
        rt.write_kept_logs(rt.CTRL_C_BEFORE_TRAINING, logging.WARNING)
        raise
    except BaseException as exc:  # each rank's file shows why it stopped; the console gets it from main()
        why = exc if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
        rt.write_kept_logs(f"set-up {'failed' if isinstance(exc, Exception) else 'stopped'}: {why}")
        raise


def _set_up(args, launch, cfg, log):
    backend = rt.pick_backend(args.dist_backend, args.device) if launch["world_size"] > 1 else "none (1 process)"
    log.info("[DDP] Initializing with backend=%s, device=%s", backend, args.device)
    # Every rank validates the data before any process group exists, so a bad file or a horizon that does
    # not fit fails each rank on its own within seconds instead of leaving the others waiting in a collective.
    check_disjoint(args)
    train_set = load_dataset("--processed_data_dir", args.processed_data_dir, args, log)
    val_set = load_dataset("--validation_data_dir", args.validation_data_dir, args, log)
    if val_set.geometry != train_set.geometry:
        raise BadInput(f"--validation_data_dir: geometry {val_set.geometry} differs from the training "
                       f"data's {train_set.geometry}")
    log.info("train: %s", train_set.summary())
    log.info("val: %s", val_set.summary())

    torch.manual_seed(args.seed)
    predictor = predictor_for(train_set.geometry, args)
    describe = (f"AC predictor, preset {args.preset} (depth {args.depth}, width {args.predictor_dim}, "
                f"{args.num_heads} heads), data {train_set.geometry}, rollout_horizon {args.rollout_horizon}")
    try:
        trainer = DDPTrainer(rank=launch["rank"], world_size=launch["world_size"], local_rank=launch["local_rank"],
                             config=cfg, model=predictor, train_dataset=train_set, val_dataset=val_set,
                             loss_fn=partial(vj2_loss, rollout_horizon=args.rollout_horizon),
                             checkpoint_extra={"predictor_config": predictor.config,
                                               "rollout_horizon": args.rollout_horizon,
                                               "data_geometry": list(train_set.geometry)}, weights_key="predictor",
                             count_unit="samples", describe=describe, data_fingerprint=train_set.fingerprint(),
                             run_config=args.run_config,
                             resume_must_match={"predictor": predictor.config,
                                                "rollout_horizon": args.rollout_horizon,
                                                "validation data (fingerprint)": val_set.fingerprint()})
    except RunDirInUse:
        raise
    except DataMismatch as exc:
        raise BadInput(f"{exc} (--processed_data_dir {args.processed_data_dir}, --validation_data_dir "
                       f"{args.validation_data_dir}; each rank's log names the files it skipped)") from exc
    except (ValueError, rt.CheckpointError) as exc:  # e.g. fewer trajectories per rank than --batch_size
        raise BadInput(str(exc)) from exc
    env = trainer.env
    log.info("[DDP] Rank %d/%d, local_rank=%d, device=%s", env.rank, env.world_size, env.local_rank, env.device)
    log.info("[DDP] Dataloader created with %d samples, batch_size=%d (%d batches per rank per epoch)",
             len(train_set), args.batch_size, len(trainer.train_loader))
    return trainer


def load_predictor(path):
    """The predictor, the rollout horizon it trained with and its training data's geometry (each None from
    checkpoints that predate saving it)."""
    try:
        ckpt = rt.load_checkpoint(path)  # weights_only=True, checks the .sha256 sidecar
        if "predictor_config" not in ckpt and {"optimizer", "counters"} <= set(ckpt):
            raise BadInput(f"--evaluate {path}: a resumable training state, not a predictor checkpoint; evaluate "
                           f"a weights file beside it (<prefix>_final.pt, _best.pt or _step_N.pt)")
        if not {"predictor", "predictor_config"} <= set(ckpt):
            lm = " (ddp_training.py's language model)" if "model_config" in ckpt else ""
            raise BadInput(f"--evaluate {path}: holds no predictor{lm}: its keys are {sorted(map(str, ckpt))}; "
                           f"expected a weights file of this script (keys 'predictor' and 'predictor_config')")
        predictor = ACPredictor(**ckpt["predictor_config"])
        predictor.load_state_dict(ckpt["predictor"])
        horizon = ckpt.get("rollout_horizon")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ValueError(f"rollout_horizon must be an integer >= 1, got {horizon!r}")
        geometry = ckpt.get("data_geometry")
        if geometry is not None and (not isinstance(geometry, list) or len(geometry) != 5 or
                                     not all(isinstance(g, int) and not isinstance(g, bool) for g in geometry)):
            raise ValueError(f"data_geometry must be a list of 5 integers (T, P, D, A, C), got {geometry!r}")
    except (rt.CheckpointError, KeyError, TypeError, ValueError, ArithmeticError, RuntimeError) as exc:
        raise BadInput(f"--evaluate {path}: not a usable predictor checkpoint "
                       f"({type(exc).__name__}: {exc})") from exc
    return predictor, horizon, geometry


def _console_log(name: str, shown: bool) -> logging.Logger:
    """Where --evaluate reports what training would log (skipped files; with --debug, a failed evaluation's
    traceback): stderr, as it has no run dir to log to."""
    log = logging.getLogger(f"vj2ac.evaluate.{name}")
    handler = logging.StreamHandler(sys.stderr)  # this call's stderr (main() may run more than once in a process)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    log.handlers, log.propagate = [handler], False
    log.setLevel(logging.INFO if shown else logging.CRITICAL + 1)
    return log


def evaluate(args, launch):
    predictor, trained_horizon, trained_geometry = load_predictor(args.evaluate)
    # the loss the run validated with, unless the command line asks for another
    args.rollout_horizon = args.rollout_horizon or trained_horizon or config.ROLLOUT_HORIZON
    # every rank reads the same files: rank 0 says what it skipped
    val_set = load_dataset("--validation_data_dir", args.validation_data_dir, args,
                           _console_log("data", launch["rank"] == 0))
    check_fits(predictor, val_set.geometry, "--validation_data_dir", trained_geometry)
    if args.shuffle_actions:
        val_set = ShuffledActions(val_set, args.seed)
    env = rt.setup_distributed(launch["rank"], launch["world_size"], launch["local_rank"], args.dist_backend,
                               args.device, args.dist_timeout)
    try:
        gpu = env.device.type == "cuda"  # pinned batches, copied without blocking, as the trainer's
        loader = rt.build_dataloader(val_set, args.batch_size, train=False, rank=env.rank,
                                     world_size=env.world_size, seed=args.seed, num_workers=args.num_workers,
                                     timeout_s=args.loader_timeout, pin_memory=gpu)
        loss_fn = partial(vj2_loss, rollout_horizon=args.rollout_horizon)
        result = evaluate_model(predictor.to(env.device), loader, loss_fn, env.device, non_blocking=gpu,
                                log=_console_log("traceback", args.debug))
    except EvaluationFailed as exc:
        if args.debug:
            raise
        raise EvaluationFailed(f"{exc}; --debug prints its traceback", agreed=exc.agreed) from exc.__cause__
    finally:
        rt.teardown_distributed()
    if env.is_main:
        print(json.dumps({"loss": result["loss"], "jloss": result["jloss"], "sloss": result["sloss"],
                          "samples": int(result["count"])}), flush=True)
    return 0


def write_test_data(data_dir: Path) -> None:
    """--test's data, written once: the synthetic task at its small geometry, 2 training files and 1 validation
    file of 8 trajectories. The ranks of a launch may write them at once: the same bytes, each rank through a
    temporary file of its own."""
    import create_synthetic_data as gen
    for split, seed, files in (("train", 0, 2), ("val", 1, 1)):
        out = data_dir / split
        if not all((out / name).exists() for name in gen.file_names(split, files)):
            gen.generate(out, num_files=files, trajectories_per_file=8, seed=seed, split=split)


def main(argv=None):
    args = parse_args(argv)
    try:
        launch = rt.detect_launch_env()  # LOCAL_RANK from the environment wins over --local_rank
    except rt.LaunchEnvError as exc:  # every rank says it: each may have its own wrong number
        return rt.refuse(str(exc))
    if args.test_data is not None:
        try:
            write_test_data(args.test_data)
        except (OSError, ValueError) as exc:
            return rt.refuse(f"--test: cannot write its synthetic data into {args.test_data}: "
                             f"{type(exc).__name__}: {exc}")
    if args.evaluate:  # no save to stop at: a stop ends the evaluation, as it did before the early handlers
        rt.FirstSignal(EARLY_STOPS).release()
    try:
        return evaluate(args, launch) if args.evaluate else train(args, launch)
    except BadInput as exc:
        return rt.refuse(str(exc))
    except rt.Failed as exc:  # see ddp_training's _train_and_exit_code
        return rt.failed(exc, launch["rank"])


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _SIGINT_AT_START)
    rt.run_script(main)
