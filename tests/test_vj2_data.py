"""Tests of the VJ2 data path: synthetic generator, file validation and the trajectory dataset."""

import io
import logging
import pickle
import re
import shutil
import struct
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import config  # noqa: E402
import create_synthetic_data as gen  # noqa: E402
from vj2_dataloader import DataFileError, VJ2TrajectoryDataset, validate_npz  # noqa: E402
import vj2_dataloader  # noqa: E402

SMALL = dict(steps=4, patches=16, embed_dim=32, actions_per_step=10, channels=3)


def load(path):
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}

# -----------------------------------------------------------------------------------------------------------------
# generator


def test_generator_writes_valid_files_of_the_requested_geometry(tmp_path):
    paths = gen.generate(tmp_path, num_files=2, trajectories_per_file=5, seed=3, **SMALL)
    assert [p.name for p in paths] == ["train_00000.npz", "train_00001.npz"]
    for path in paths:
        info = validate_npz(path)
        assert (info.n, *info.geometry) == (5, 4, 16, 32, 10, 3)
        data = load(path)
        assert data["embeddings"].shape == (5, 4, 16, 32) and data["embeddings"].dtype == np.float16
        assert data["actions"].shape == (5, 3, 10, 3) and data["actions"].dtype == np.float32
        assert data["actions"].min() >= 0 and data["actions"].max() <= 1
        assert set(np.unique(data["actions"][..., 2])) <= {0.0, 1.0}
    a, b = (load(p)["actions"] for p in paths)
    assert not np.array_equal(a, b)


def test_generator_float32_and_compressed(tmp_path):
    (path,) = gen.generate(tmp_path, num_files=1, trajectories_per_file=3, dtype="float32", compress=True)
    with zipfile.ZipFile(path) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    assert validate_npz(path).dtypes == {"embeddings": "float32", "actions": "float32"}


def test_cli_current_dir_bad_flags_and_leftover_files(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path / "data")
    small = ["--num_files", "2", "--trajectories_per_file", "2", "--num_steps", "3", "--patches", "2",
             "--embed_dim", "4", "--actions_per_step", "2"]
    assert gen.main(["--output_dir", ".", *small, "--val_fraction", "0.5"]) == 0
    assert sorted(p.name for p in (tmp_path / "data").glob("*.npz")) == ["train_00000.npz", "train_00001.npz"]
    assert [p.name for p in (tmp_path / "data_val").glob("*.npz")] == ["val_00000.npz"]
    # a smaller set into the same directory would be read together with the old files
    assert gen.main(["--output_dir", ".", *small[2:], "--num_files", "1"]) == 2
    assert "already holds 1 other .npz files (train_00001.npz)" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("not a directory")
    assert gen.main(["--output_dir", str(tmp_path / "a_file"), *small]) == 2
    assert f"--output_dir {tmp_path / 'a_file'}: is a file; expected a directory" in capsys.readouterr().err
    for argv, message in [(["--trajectories_per_file", "0"], "--trajectories_per_file must be >= 1"),
                          (["--noise", "-1"], "--noise must be >= 0"),
                          (["--num_steps", "1"], "--num_steps must be >= 2"),
                          (["--embed_dim", "1"], "--embed_dim must be >= 2"),
                          # refused up front, not numpy's "high <= 0" from inside the simulation
                          (["--actions_per_step", "0"], "--patches and --actions_per_step must be >= 1, got 16, 0")]:
        with pytest.raises(SystemExit) as exc:
            gen.main(["--output_dir", "x", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--noise", "nan"], "--noise must be a finite number, got nan"),
    (["--noise", "inf"], "--noise must be a finite number, got inf"),
    (["--val_fraction", "nan"], "--val_fraction must be a finite number, got nan"),
    (["--val_fraction", "inf"], "--val_fraction must be a finite number, got inf"),
    (["--val_fraction", "1.5"], "--val_fraction must be in [0, 1], got 1.5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),  # was numpy's "expected non-negative integer", after mkdir
    (["--world_seed", "-2"], "--world_seed must be >= 0, got -2"),
    # was ignored: exit 0 and no validation set
    (["--val_output_dir", "v"], "--val_output_dir v without --val_fraction: no validation set is written"),
])
def test_cli_refuses_non_finite_and_out_of_range_float_flags(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        gen.main(["--output_dir", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (dict(dtype="float64"), "--dtype must be one of float16, float32, got float64"),
    (dict(trajectories_per_file=0), "--trajectories_per_file must be >= 1, got 0"),
    (dict(num_files=0), "--num_files must be >= 1, got 0"),
    (dict(seed=-1), "--seed must be >= 0, got -1"),
])
def test_generate_refuses_what_the_loader_would_before_writing(tmp_path, change, message):
    # the command line checked these and generate() did not: it wrote files the loader then refused
    with pytest.raises(ValueError, match=re.escape(message)):
        gen.generate(tmp_path / "out", **{"num_files": 1, "trajectories_per_file": 2, **change})
    assert not (tmp_path / "out").exists()
    # numpy's own spellings of the two dtypes stay accepted
    for i, dtype in enumerate((np.float16, "f4")):
        (path,) = gen.generate(tmp_path / f"ok{i}", num_files=1, trajectories_per_file=2, dtype=dtype)
        with np.load(path, allow_pickle=False) as f:
            assert f["embeddings"].dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype, noise", [("float16", "1e6"), ("float16", "7000"), ("float32", "1e38")])
def test_noise_that_would_overflow_the_dtype_is_refused_before_writing(tmp_path, capsys, dtype, noise):
    # the loader refuses inf, so such a file would be written only to be rejected at training time
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--num_files", "2", "--trajectories_per_file", "2", "--num_steps", "3",
            "--patches", "2", "--embed_dim", "4", "--actions_per_step", "2", "--dtype", dtype, "--noise", noise,
            "--val_fraction", "0.5"]
    assert gen.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--noise {float(noise):g} with --dtype {dtype}" in err and "expected --noise <=" in err
    assert not out.exists() and not (tmp_path / "out_val").exists()
    # the largest noise the message allows writes files the loader accepts
    allowed = float(re.search(r"expected --noise <= ([0-9.e+-]+)", err).group(1))
    argv[argv.index(noise)] = str(allowed)
    assert gen.main(argv) == 0
    VJ2TrajectoryDataset(out)


def test_files_too_short_for_the_default_rollout_are_written_with_a_note(tmp_path, capsys):
    """T=2 was written without a word, and the trainer refused the files with its default horizon (user test)."""
    out = tmp_path / "out"
    assert gen.main(["--output_dir", str(out), "--num_files", "1", "--trajectories_per_file", "2",
                     "--num_steps", "2"]) == 0
    assert capsys.readouterr().err == ("note: T=2 leaves 1 step(s) to predict, fewer than the trainer's default "
                                       "--rollout_horizon 2: train on these files with --rollout_horizon 1\n")
    assert len(VJ2TrajectoryDataset(out, rollout_horizon=1)) == 2


def test_a_chunk_that_overflows_the_dtype_is_not_written(tmp_path, monkeypatch):
    # the bound on --noise leaves a margin of NOISE_SIGMAS standard deviations; past it, the file is refused
    monkeypatch.setattr(gen, "check_noise", lambda *args: None)
    with pytest.raises(ValueError, match="--noise 1e\\+06 with --dtype float16 gave embeddings beyond"):
        gen.generate(tmp_path, num_files=1, trajectories_per_file=2, noise=1e6, **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_a_write_interrupted_by_ctrl_c_leaves_no_file(tmp_path, monkeypatch):
    def interrupted(*args):
        yield from ()
        raise KeyboardInterrupt
    monkeypatch.setattr(gen, "embedding_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(tmp_path, num_files=1, trajectories_per_file=2, **SMALL)
    assert list(tmp_path.iterdir()) == []  # at real shapes a .tmp left here would hold gigabytes


def test_cli_refuses_a_validation_set_in_the_training_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    small = ["--num_files", "2", "--trajectories_per_file", "2", "--num_steps", "3", "--patches", "2",
             "--embed_dim", "4", "--actions_per_step", "2", "--val_fraction", "0.5"]
    # the loader would read the val file as training data
    with pytest.raises(SystemExit) as exc:
        gen.main(["--output_dir", "mix", "--val_output_dir", "./mix/", *small])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--val_output_dir ./mix/ and --output_dir mix are the same directory" in err
    assert not (tmp_path / "mix").exists()


@pytest.mark.parametrize("leftover, where", [("val_00000.npz", "train"), ("a_old.npz", "train"),
                                             ("train_00000.npz", "val"), ("notes.npz", "val")])
def test_cli_refuses_any_other_npz_before_writing_anything(tmp_path, capsys, leftover, where):
    dirs = {"train": tmp_path / "train", "val": tmp_path / "val"}
    dirs[where].mkdir()
    (dirs[where] / leftover).write_bytes(b"leftover")
    small = ["--num_files", "1", "--trajectories_per_file", "2", "--num_steps", "3", "--patches", "2",
             "--embed_dim", "4", "--actions_per_step", "2"]
    argv = ["--output_dir", str(dirs["train"]), "--val_fraction", "1", "--val_output_dir", str(dirs["val"]), *small]
    assert gen.main(argv) == 2
    err = capsys.readouterr().err
    flag = "--output_dir" if where == "train" else "--val_output_dir"
    assert f"already holds 1 other .npz files ({leftover})" in err and f"choose another {flag}" in err
    # both directories are checked first, so neither got a file
    assert sorted(p.name for d in dirs.values() if d.exists() for p in d.iterdir()) == [leftover]
    (dirs[where] / leftover).unlink()
    assert gen.main(argv) == 0
    # rewriting the same set over itself is allowed: it replaces exactly the files it names
    assert gen.main(argv) == 0


def test_generated_actions_stay_in_range_even_as_float16():
    rng = np.random.default_rng(0)
    low, high = config.ACTION_VALUE_RANGE
    # cursors on the screen's edges and corners, where interpolation rounding could step outside
    corners = np.array([[0, 0], [1, 1], [0, 1], [1, 0], [1, 0.5], [0, 0.5]], dtype=np.float64)
    for cursor in (np.repeat(corners, 2000, axis=0), rng.random((12000, 2))):
        xy, touch = gen.sample_gestures(rng, cursor, actions_per_step=50)
        assert xy.min() >= low and xy.max() <= high and set(np.unique(touch)) <= {0.0, 1.0}
    _, actions = gen.simulate(rng, 3000, 8, 50, channels=4)
    for stored in (actions, actions.astype(np.float16)):
        assert stored.min() >= low and stored.max() <= high
    assert not actions[..., 3:].any()  # extra channels are zero


def test_a_drag_scrolls_the_content_by_the_moves_made_while_down():
    # state: scroll x, y, cursor x, y, touch; the finger glides from the cursor to (0.5, 0.5), lands there, drags,
    # and lifts before the last move
    state = np.array([[0.2, 0.9, 0.3, 0.5, 0.0]])
    drag = np.array([[[0.5, 0.5, 1], [0.6, 0.5, 1], [0.7, 0.65, 1], [0.9, 0.9, 0]]], dtype=np.float32)
    after = gen.step_state(state, drag)[0]
    # moves while down: (+0.1, 0) and (+0.1, +0.15); the y scroll wraps around the screen
    np.testing.assert_allclose(after, [0.4, 0.05, 0.9, 0.9, 0.0], atol=1e-6)
    hover = drag.copy()
    hover[..., 2] = 0
    np.testing.assert_allclose(gen.step_state(state, hover)[0], [0.2, 0.9, 0.9, 0.9, 0.0], atol=1e-6)
    # a finger still down from the previous step drags from its first move on
    held = gen.step_state(np.array([[0.2, 0.9, 0.3, 0.5, 1.0]]), drag)[0]
    np.testing.assert_allclose(held, [0.6, 0.05, 0.9, 0.9, 0.0], atol=1e-6)


def test_cli_real_shapes_and_validation_set(tmp_path, capsys):
    out = tmp_path / "real"
    gen.main(["--output_dir", str(out), "--real_shapes", "--num_files", "1", "--trajectories_per_file", "1",
              "--val_fraction", "1"])
    printed = capsys.readouterr().out
    assert "train_00000.npz" in printed and "(1, 8, 256, 1024)" in printed and "bytes" in printed
    for path in (out / "train_00000.npz", tmp_path / "real_val" / "val_00000.npz"):
        data = load(path)
        assert data["embeddings"].shape == (1, config.NUM_STEPS, config.PATCHES_PER_STEP, config.EMBED_DIM)
        assert data["actions"].shape == (1, config.NUM_STEPS - 1, config.ACTIONS_PER_STEP, config.ACTION_CHANNELS)
        assert data["embeddings"].dtype == np.float16
        validate_npz(path)


def test_world_seed_fixes_the_encoder_and_seed_only_the_trajectories(tmp_path):
    common = dict(num_files=1, trajectories_per_file=8, dtype="float32", noise=0.0, save_states=True, **SMALL)
    (a,) = gen.generate(tmp_path / "a", seed=0, **common)
    (b,) = gen.generate(tmp_path / "b", seed=1, **common)
    a, b = load(a), load(b)
    assert not np.allclose(a["states"], b["states"]) and not np.allclose(a["embeddings"], b["embeddings"])
    # both files are the one fixed encoder applied to their own states
    world = gen.World(SMALL["patches"], SMALL["embed_dim"])
    for data in (a, b):
        np.testing.assert_allclose(world.embed(data["states"]), data["embeddings"], atol=1e-4)
    other = gen.World(SMALL["patches"], SMALL["embed_dim"], world_seed=config.WORLD_SEED + 1)
    assert not np.allclose(other.embed(a["states"]), a["embeddings"], atol=1e-2)


def ridge_error(x_train, y_train, x_test, y_test, lam=1e-4):
    """Held-out squared error of a ridge least-squares fit, relative to the target variance."""
    x_train, x_test = (np.c_[x, np.ones(len(x))] for x in (x_train, x_test))
    w = np.linalg.solve(x_train.T @ x_train + lam * len(x_train) * np.eye(x_train.shape[1]), x_train.T @ y_train)
    return ((x_test @ w - y_test) ** 2).mean() / y_test.var(0).mean()


def random_features(x, num=600, scale=1.5):
    """Random Fourier features plus x itself: lets least squares fit smooth nonlinear functions of x."""
    rng = np.random.default_rng(x.shape[1])
    w = rng.standard_normal((x.shape[1], num)) * scale / np.sqrt(x.shape[1])
    return np.c_[np.cos(x @ w + rng.uniform(0, 2 * np.pi, num)), x]


def gesture_summary(actions):
    """Generic GUI features of one step's events [..., A, 3]: final x, y, touch and the distance dragged."""
    touch = actions[..., 2] > 0.5
    held = (touch[..., 1:] & touch[..., :-1])[..., None]
    dragged = (np.diff(actions[..., :2], axis=-2) * held).sum(-2)
    return np.concatenate([actions[..., -1, :], 3 * dragged], -1)


def test_next_embedding_depends_on_the_actions(tmp_path):
    # If e_{t+1} were a function of e_t alone, knowing a_t could not lower the error on unseen trajectories
    # (the action-aware fit contains the action-blind ones). A clearly lower held-out error therefore shows
    # that the actions carry information about the next step that the current step does not.
    def pairs(seed, n):
        (path,) = gen.generate(tmp_path / str(seed), num_files=1, trajectories_per_file=n, seed=seed, **SMALL)
        data = load(path)
        emb = data["embeddings"].astype(np.float64).reshape(n, 4, -1)
        return emb[:, :-1].reshape(-1, emb.shape[-1]), gesture_summary(data["actions"]).reshape(-1, 5), \
            emb[:, 1:].reshape(-1, emb.shape[-1])
    (e_tr, a_tr, y_tr), (e_te, a_te, y_te) = pairs(1, 1500), pairs(2, 500)
    mean = e_tr.mean(0)
    basis = np.linalg.svd(e_tr - mean, full_matrices=False)[2][:12].T
    scale = ((e_tr - mean) @ basis).std(0)
    z_tr, z_te = ((e - mean) @ basis / scale for e in (e_tr, e_te))
    blind = min(ridge_error(e_tr, y_tr, e_te, y_te),
                ridge_error(z_tr, y_tr, z_te, y_te),
                ridge_error(random_features(z_tr), y_tr, random_features(z_te), y_te))
    aware = ridge_error(random_features(np.c_[z_tr, 2 * a_tr - 1]), y_tr,
                        random_features(np.c_[z_te, 2 * a_te - 1]), y_te)
    assert aware < 0.7 * blind, (aware, blind)

# -----------------------------------------------------------------------------------------------------------------
# dataset


@pytest.fixture
def data_dir(tmp_path):
    gen.generate(tmp_path / "data", num_files=3, trajectories_per_file=4, seed=5, **SMALL)
    return tmp_path / "data"


def test_dataset_items_match_the_files(data_dir):
    ds = VJ2TrajectoryDataset(data_dir, rollout_horizon=2)
    assert len(ds) == 12 and ds.skipped == [] and len(ds.files) == 3
    assert ds.geometry == (4, 16, 32, 10, 3)
    assert ds.summary() == f"{data_dir}: 3 files, 12 trajectories, 0 skipped, geometry T=4 P=16 D=32 A=10 C=3 (float16)"
    files = [load(p) for p in sorted(data_dir.glob("*.npz"))]
    for i in range(len(ds)):
        emb, act = ds[i]
        assert emb.dtype == torch.float16 and emb.shape == (4, 16, 32)
        assert act.dtype == torch.float32 and act.shape == (3, 30)
        f, row = divmod(i, 4)
        assert np.array_equal(emb.numpy(), files[f]["embeddings"][row])
        assert np.array_equal(act.numpy(), files[f]["actions"][row].reshape(3, 30))
    assert torch.equal(ds[-1][0], ds[11][0])
    with pytest.raises(IndexError):
        ds[12]


def test_memmap_and_decompressing_paths_give_identical_items(tmp_path):
    stored = gen.generate(tmp_path / "stored", num_files=3, trajectories_per_file=4, seed=9, **SMALL)
    gen.generate(tmp_path / "deflated", num_files=3, trajectories_per_file=4, seed=9, compress=True, **SMALL)
    a = VJ2TrajectoryDataset(tmp_path / "stored")
    b = VJ2TrajectoryDataset(tmp_path / "deflated", cache_files=1)
    assert stored[0].stat().st_size > (tmp_path / "deflated" / "train_00000.npz").stat().st_size
    for i in range(len(a)):
        for x, y in zip(a[i], b[i]):
            assert torch.equal(x, y)
    assert len(a._open) == 3 and not a._loaded  # stored members: read by offset from open files
    assert len(b._loaded) == 1 and not b._open  # the decompressed cache stays bounded


def test_any_stored_layout_reads_the_same_items(tmp_path):
    """Fortran-order and big-endian stored members (np.savez keeps both) give the same native items."""
    c_file = gen.generate(tmp_path / "c", num_files=1, trajectories_per_file=3, seed=4, **SMALL)[0]
    arrays = load(c_file)
    layouts = {"fortran": np.asfortranarray, "big_endian": lambda a: a.astype(a.dtype.newbyteorder(">"))}
    ref = VJ2TrajectoryDataset(tmp_path / "c")
    for name, change in layouts.items():
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / "a.npz", **{k: change(v) for k, v in arrays.items()})
        ds = VJ2TrajectoryDataset(tmp_path / name)
        for i in range(3):
            for x, y in zip(ds[i], ref[i]):
                assert x.dtype == y.dtype and torch.equal(x, y), name


def test_reading_maps_no_data_and_keeps_at_most_max_open_files_open(tmp_path):
    """A memory map keeps every page read through it in the process's RSS until it is closed: reads go by
    offset instead, so RSS does not grow with the data read. Open descriptors stay within max_open_files."""
    import psutil
    files = gen.generate(tmp_path, num_files=5, trajectories_per_file=2, seed=2, **SMALL)
    ds = VJ2TrajectoryDataset(tmp_path, max_open_files=2)
    for i in range(len(ds)):
        ds[i]
    me = psutil.Process()
    data = {str(p.resolve()) for p in files}
    assert not data & {m.path for m in me.memory_maps(grouped=True)}
    assert len(data & {f.path for f in me.open_files()}) == len(ds._open) == 2
    ds[0]
    first = ds._open[0]
    ds[2], ds[4]  # files 1 and 2: file 0 is evicted and closed now, not whenever the collector runs
    assert 0 not in ds._open and first.file.closed


def test_a_file_cut_short_after_validation_is_a_clear_error(tmp_path):
    path = gen.generate(tmp_path, num_files=1, trajectories_per_file=3, seed=2, **SMALL)[0]
    ds = VJ2TrajectoryDataset(tmp_path)
    ds[0]
    with open(path, "r+b") as f:
        f.truncate(ds.infos[0].members["embeddings"].data_offset + 100)
    with pytest.raises(DataFileError, match=rf"{path.name}: key 'embeddings' ends early: trajectory 1 has 0 of"):
        ds[1]


def test_dataset_works_in_dataloader_workers_and_pickles_without_arrays(data_dir):
    ds = VJ2TrajectoryDataset(data_dir)
    ds[0]  # opens a map in the parent before the workers start
    assert len(pickle.dumps(ds)) < 20_000
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    emb = torch.cat([e for e, _ in loader])
    assert torch.equal(emb, torch.stack([ds[i][0] for i in range(len(ds))]))

# -----------------------------------------------------------------------------------------------------------------
# bad files


def good(n=2, steps=4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, steps, 16, 32)).astype(np.float16),
            rng.random((n, steps - 1, 10, 3)).astype(np.float32))


def npy_bytes(header_shape, dtype, payload):
    """A .npy member whose header declares header_shape but which carries only `payload`."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": header_shape})
    return buf.getvalue() + payload


class Tripwire:
    """Unpickling this creates a file: proof that a loader executed the payload."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_file_swapped_for_a_pickle_after_validation_is_never_unpickled(tmp_path):
    """The reader of a validated file must keep allow_pickle=False too: a file can change after validation."""
    d = tmp_path / "data"
    d.mkdir()
    emb, act = good()
    np.savez_compressed(d / "a.npz", embeddings=emb, actions=act)  # deflated: each read loads the member whole
    ds = VJ2TrajectoryDataset(d)
    payload = np.array([Tripwire(tmp_path / "unpickled")] * 2, dtype=object)
    np.savez_compressed(d / "a.npz", embeddings=emb, actions=payload)  # pickled objects, on purpose
    with pytest.raises(ValueError, match="Object arrays cannot be loaded when allow_pickle=False"):
        ds[0]
    assert not (tmp_path / "unpickled").exists()


def write_not_zip(p):
    p.write_bytes(b"this is not an archive")


def write_truncated(p):
    np.savez(p, embeddings=good()[0], actions=good()[1])
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def write_corrupt_stream(p):
    # the embeddings' deflate stream damaged at its start: zlib's error ("invalid block type") named no key
    np.savez_compressed(p, embeddings=good()[0], actions=good()[1])
    data = bytearray(p.read_bytes())
    info = zipfile.ZipFile(p).getinfo("embeddings.npy")
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start:start + 8] = b"\xff" * 8
    p.write_bytes(bytes(data))


def write_missing_key(p):
    np.savez(p, embeddings=good()[0])


def write_wrong_ndim(p):
    np.savez(p, embeddings=good()[0][:, :, 0], actions=good()[1])


def write_n_mismatch(p):
    np.savez(p, embeddings=good(n=3)[0], actions=good(n=2)[1])


def write_step_mismatch(p):
    emb, act = good()
    np.savez(p, embeddings=emb, actions=np.concatenate([act, act[:, :1]], 1))


def write_too_few_steps(p):
    emb, act = good()
    np.savez(p, embeddings=emb, actions=act[:, :-1])


def write_int_dtype(p):
    np.savez(p, embeddings=good()[0].astype(np.int32), actions=good()[1])


def write_nan(p):
    emb, act = good()
    emb[1, 2, 3, 4] = np.nan
    np.savez(p, embeddings=emb, actions=act)


def write_constant_tokens(p):
    emb, act = good()
    emb[...] = np.arange(emb.shape[0] * emb.shape[1] * emb.shape[2]).reshape(emb.shape[:3])[..., None] % 7
    np.savez(p, embeddings=emb, actions=act)


def write_int_actions(p):
    np.savez(p, embeddings=good()[0], actions=(good()[1] > 0.5).astype(np.int32))


def write_nan_action(p):
    emb, act = good()
    act[1, 0, 2, 0] = np.nan
    np.savez(p, embeddings=emb, actions=act)


def write_no_action_samples(p):
    emb, act = good()
    np.savez(p, embeddings=emb, actions=act[:, :, :0])


def write_no_patches(p):
    emb, act = good()
    np.savez(p, embeddings=emb[:, :, :0], actions=act)


def write_no_trajectories(p):
    emb, act = good()
    np.savez(p, embeddings=emb[:0], actions=act[:0])


def write_width_one(p):
    emb, act = good()
    np.savez(p, embeddings=emb[..., :1], actions=act)


def write_pixel_actions(p):
    emb, act = good()
    np.savez(p, embeddings=emb, actions=act * 1e4)  # pixel coordinates instead of fractions of the screen


def write_touch_just_above_one_float16(p):
    emb, act = good()
    act[0, 1, 2, 2] = np.nextafter(np.float16(1), np.float16(2))  # 1.00098, the first float16 past the range
    np.savez(p, embeddings=emb, actions=act.astype(np.float16))


def write_float64(p):
    emb, act = good()
    np.savez(p, embeddings=emb.astype(np.float64), actions=act)


def write_one_step(p):
    emb, act = good()
    np.savez(p, embeddings=emb[:, :1], actions=act[:, :0])  # T=1: nothing to predict, no action between steps


def write_header_longer_than_data(p):
    # a header declaring two trajectories over the bytes of one: refused from the header, before any data is read
    emb, act = good()
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("embeddings.npy", npy_bytes(emb.shape, np.float16, emb[:1].tobytes()))
        zf.writestr("actions.npy", npy(act))


def write_negative_touch_float16(p):
    emb, act = good()
    act[1, 2, 3, 2] = -1
    np.savez(p, embeddings=emb, actions=act.astype(np.float16))


def write_pickle(p):
    payload = np.array([Tripwire(p.with_name("unpickled"))], dtype=object)
    np.savez(p, embeddings=good()[0], actions=payload)  # unsafe-on-purpose: np.savez pickles object arrays


def write_bomb_header(p):
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("embeddings.npy", npy_bytes((10 ** 6, 8, 256, 1024), np.float16, b"\0" * 64))
        zf.writestr("actions.npy", npy_bytes((2, 3, 10, 3), np.float32, np.zeros(180, np.float32).tobytes()))


def write_unterminated_header(p):
    # a header dict whose closing brace rotted: numpy's fallback parser fails with tokenize's error, no ValueError
    emb, act = good()
    header = npy(emb)
    brace = header.index(b"}")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("embeddings.npy", header[:brace] + b" " + header[brace + 1:])
        zf.writestr("actions.npy", npy(act))


def write_mangled_descr(p):
    # a dtype string '02f2': a SyntaxError from numpy's dtype parser
    emb, act = good()
    header = npy(emb)
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("embeddings.npy", header.replace(b"'<f2', ", b"'02f2',", 1))
        zf.writestr("actions.npy", npy(act))


BAD_FILES = {
    "not_zip": (write_not_zip, ["not a zip archive"]),
    "truncated": (write_truncated, ["not a readable .npz archive"]),
    "corrupt_stream": (write_corrupt_stream, ["not a readable .npz archive (key 'embeddings') (error: Error -3 "
                                              "while decompressing data"]),
    "missing_key": (write_missing_key, ["missing key 'actions'", "found keys: ['embeddings']"]),
    "wrong_ndim": (write_wrong_ndim, ["key 'embeddings'", "(3-D)", "expected 4-D [N, T, P, D]"]),
    "n_mismatch": (write_n_mismatch, ["key 'actions'", "N=2", "N=3", "expected the same N"]),
    "step_mismatch": (write_step_mismatch, ["key 'actions'", "has 4 steps", "expected T-1 = 3"]),
    # found by its check, not by a reshape in training that names no file (from a mutation review)
    "too_few_steps": (write_too_few_steps, ["key 'actions'", "has 2 steps", "expected T-1 = 3"]),
    "int_dtype": (write_int_dtype, ["key 'embeddings'", "dtype int32", "expected float16 or float32"]),
    "nan": (write_nan, ["key 'embeddings'", "NaN or inf", "trajectory 1", "expected finite"]),
    # each token constant over D (zeros, a fill value): trained without a word on nothing (from a user test)
    "constant_tokens": (write_constant_tokens, ["key 'embeddings'", "every token's D=32 values are equal",
                                                "nothing to predict"]),
    "int_actions": (write_int_actions, ["key 'actions'", "dtype int32", "expected float16 or float32"]),
    "nan_action": (write_nan_action, ["key 'actions'", "NaN or inf", "trajectory 1", "expected finite"]),
    "no_action_samples": (write_no_action_samples, ["'actions' (2, 3, 0, 3)", "empty dimension",
                                                    "expected P, D, A, C >= 1"]),
    "no_patches": (write_no_patches, ["'embeddings' (2, 4, 0, 32)", "empty dimension"]),
    "no_trajectories": (write_no_trajectories, ["key 'embeddings'", "(0, 4, 16, 32)", "N=0", "expected N >= 1"]),
    "width_one": (write_width_one, ["key 'embeddings'", "D=1", "expected D >= 2", "layer-norms"]),
    "pixel_actions": (write_pixel_actions, ["key 'actions'", "channel 0 (x) from", "channel 1 (y) from",
                                            "channel 2 (touch) from", "expected every [x, y, touch] value in [0, 1]"]),
    "negative_touch": (write_negative_touch_float16, ["key 'actions'", "channel 2 (touch) from -1 to 0.99",
                                                      "expected every [x, y, touch] value in [0, 1]"]),
    "touch_just_above_one": (write_touch_just_above_one_float16, ["key 'actions'",
                                                                  "channel 2 (touch) from ", " to 1.00098;"]),
    # a float64 file is refused, not trained as float64 (tests from a mutation review, as the three below)
    "float64": (write_float64, ["key 'embeddings'", "dtype float64", "expected float16 or float32"]),
    "one_step": (write_one_step, ["key 'embeddings'", "T=1 steps", "expected T >= 2"]),
    "header_longer_than_data": (write_header_longer_than_data, [
        "key 'embeddings' header declares shape (2, 4, 16, 32) float16 = 8,192 bytes but the member holds 4,096"]),
    "pickle": (write_pickle, ["key 'actions'", "pickle", "refusing to unpickle"]),
    "unterminated_header": (write_unterminated_header, ["key 'embeddings' is not a valid .npy array"]),
    "mangled_descr": (write_mangled_descr, ["key 'embeddings' is not a valid .npy array"]),
    "bomb_header": (write_bomb_header, ["key 'embeddings'", "declares shape (1000000, 8, 256, 1024)", "zip bomb"]),
}


@pytest.mark.parametrize("kind", BAD_FILES)
def test_bad_file_gets_an_error_naming_file_and_key(tmp_path, kind):
    write, expected = BAD_FILES[kind]
    path = tmp_path / "bad.npz"
    write(path)
    with pytest.raises(DataFileError) as err:
        validate_npz(path)
    assert str(path) in str(err.value)
    for text in expected:
        assert text in str(err.value)
    assert not (tmp_path / "unpickled").exists()
    with pytest.raises(DataFileError, match="bad.npz"):
        VJ2TrajectoryDataset(tmp_path)


def npy(array):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
@pytest.mark.parametrize("second", ["embeddings", "embeddings.npy"])
def test_a_key_held_by_two_members_is_refused(tmp_path, compression, second):
    """np.load reads a bare 'embeddings' member before 'embeddings.npy': a valid .npy beside a NaN bare
    member (or a second member of the same name) must not pass as the valid one."""
    emb, act = good()
    path = tmp_path / "twice.npz"
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w", compression) as zf:
        warnings.simplefilter("ignore")  # zipfile warns about a duplicate name: that is the point
        zf.writestr("embeddings.npy", npy(emb))
        zf.writestr(second, npy(np.full_like(emb, np.nan)))
        zf.writestr("actions.npy", npy(act))
    assert np.isnan(load(path)["embeddings"]).all()  # what np.load would have trained on
    with pytest.raises(DataFileError) as err:
        validate_npz(path)
    message = str(err.value)
    assert str(path) in message and "key 'embeddings' is held by 2 zip members" in message
    assert f"'embeddings.npy', '{second}'" in message and "expected exactly one" in message


def test_a_deflated_file_is_read_from_the_member_that_was_validated(tmp_path):
    path = gen.generate(tmp_path, num_files=1, trajectories_per_file=3, seed=2, compress=True, **SMALL)[0]
    ds = VJ2TrajectoryDataset(tmp_path)
    expected = load(path)["embeddings"]
    # a bare 'embeddings' member added after validation is what np.load(path)["embeddings"] would return
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("embeddings", npy(np.full_like(expected, np.nan)))
    assert np.isnan(load(path)["embeddings"]).all()
    assert ds.infos[0].members["embeddings"].name == "embeddings.npy"
    for i in range(3):
        assert np.array_equal(ds[i][0].numpy(), expected[i])


def test_data_fingerprint_is_equal_for_copies_and_other_layouts_of_the_same_arrays(tmp_path):
    a = gen.generate(tmp_path / "a", num_files=2, trajectories_per_file=2, seed=2, **SMALL)
    (b,) = gen.generate(tmp_path / "b", num_files=1, trajectories_per_file=2, seed=2, compress=True, **SMALL)
    fingerprints = [vj2_dataloader.data_fingerprint(p) for p in (*a, b)]
    assert fingerprints[0] == fingerprints[2] and fingerprints[0] != fingerprints[1]
    write_not_zip(tmp_path / "junk.npz")
    write_missing_key(tmp_path / "half.npz")
    assert vj2_dataloader.data_fingerprint(tmp_path / "junk.npz") is None
    assert vj2_dataloader.data_fingerprint(tmp_path / "half.npz") is None
    # a central directory entry asking for a zip version Python cannot extract: NotImplementedError
    newer = tmp_path / "newer.npz"
    data = bytearray(a[0].read_bytes())
    entry = data.rindex(b"PK\x01\x02")
    data[entry + 6] = 64  # "version needed to extract": 6.4
    newer.write_bytes(bytes(data))
    assert vj2_dataloader.data_fingerprint(newer) is None


def test_high_compression_ratio_is_refused(tmp_path):
    path = tmp_path / "zeros.npz"
    pattern = np.broadcast_to(np.arange(32, dtype=np.float16) % 2, (64, 4, 16, 32))  # tokens vary over D, repeat
    np.savez_compressed(path, embeddings=pattern, actions=good(64)[1])
    validate_npz(path)
    with pytest.raises(DataFileError, match="key 'embeddings'.*zip bomb"):
        validate_npz(path, max_ratio=10)


def test_a_file_whose_first_tokens_are_constant_is_accepted(tmp_path):
    """The constant-token check compares a chunk's first 64 tokens, and the whole chunk only where those are all
    constant (blank first frames): a file with varying tokens after them is real data."""
    emb, act = good(n=2, steps=4)  # 2 x 4 x 16 tokens: the first 64 are trajectory 0's
    emb[0] = 0
    np.savez(tmp_path / "blank_start.npz", embeddings=emb, actions=act)
    assert len(VJ2TrajectoryDataset(tmp_path)) == 2


def test_constant_actions_compressed_by_numpy_are_no_zip_bomb(tmp_path):
    """Idle recordings (all-zero actions) deflate at ~1016x, over the 1000x the guard allowed; deflate itself
    stops near 1032x."""
    emb, act = good(512, steps=4)
    act = np.zeros((512, 3, 250, 3), np.float32)
    np.savez_compressed(tmp_path / "idle.npz", embeddings=emb, actions=act)
    info = zipfile.ZipFile(tmp_path / "idle.npz").getinfo("actions.npy")
    assert info.file_size > 1000 * info.compress_size
    validate_npz(tmp_path / "idle.npz")


def test_actions_need_the_x_y_touch_channels(tmp_path):
    emb, act = good(2)
    np.savez(tmp_path / "two.npz", embeddings=emb, actions=act[..., :2])
    with pytest.raises(DataFileError, match=r"two.npz: key 'actions' has C=2 channels; expected at least 3: "
                                            r"\['x', 'y', 'touch'\]"):
        validate_npz(tmp_path / "two.npz")


def test_actions_stored_channels_first_are_refused(tmp_path):
    """[N, T-1, C, A] read as A=3 actions of 10 channels, all in range: it trained without a word. A few
    actions of a few extra channels are no such layout."""
    emb, act = good(2)
    assert act.shape[2:] == (10, 3)
    np.savez(tmp_path / "cf.npz", embeddings=emb, actions=np.ascontiguousarray(act.swapaxes(2, 3)))
    with pytest.raises(DataFileError, match=r"cf.npz: key 'actions' has shape \(2, 3, 3, 10\), A=3 actions of C=10 "
                                            r"channels, more than the 8 an action may have: actions stored "
                                            r"channels-first \(\[N, T-1, C, A\]\) read so"):
        validate_npz(tmp_path / "cf.npz")
    np.savez(tmp_path / "extra.npz", embeddings=emb, actions=np.concatenate([act[:, :, :3], act[:, :, :3, :1]], -1))
    validate_npz(tmp_path / "extra.npz")  # A=3 actions of 4 channels
    with pytest.raises(ValueError, match="--action_channels must be <= 8, got 9"):
        gen.generate(tmp_path / "nine", num_files=1, trajectories_per_file=1, channels=9)


def test_eight_action_channels_the_stated_most_are_written_and_read(tmp_path):
    """config.MAX_ACTION_CHANNELS is the most an action may have, not the first count refused."""
    assert config.MAX_ACTION_CHANNELS == 8
    (path,) = gen.generate(tmp_path, num_files=1, trajectories_per_file=2, **{**SMALL, "channels": 8})
    assert validate_npz(path).geometry.channels == 8
    assert VJ2TrajectoryDataset(tmp_path)[1][1].shape == (3, 10 * 8)


def test_a_file_linked_twice_in_a_directory_is_refused_and_a_file_is_no_directory(tmp_path):
    gen.generate(tmp_path / "d", num_files=2, trajectories_per_file=2)
    (tmp_path / "d" / "latest.npz").symlink_to(tmp_path / "d" / "train_00001.npz")
    with pytest.raises(DataFileError, match=r"train_00001.npz are the same file \(a link\); its trajectories "
                                            r"would be read twice"):
        vj2_dataloader.list_files(tmp_path / "d")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="notes.txt is a file, not a directory"):
        vj2_dataloader.list_files(tmp_path / "notes.txt")


def test_nan_is_found_in_a_later_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(vj2_dataloader, "SCAN_BYTES", 1024)
    emb, act = good(n=6)
    emb[4, 3, 15, 31] = np.inf
    np.savez_compressed(tmp_path / "late.npz", embeddings=emb, actions=act)
    with pytest.raises(DataFileError, match="trajectory 4"):
        validate_npz(tmp_path / "late.npz")


@pytest.mark.parametrize("fortran", [False, True])
def test_action_range_is_checked_per_channel_in_any_chunk_and_layout(tmp_path, monkeypatch, fortran):
    monkeypatch.setattr(vj2_dataloader, "SCAN_BYTES", 100)  # many chunks, cutting through channel blocks
    emb, _ = good(n=5)
    act = np.random.default_rng(1).random((5, 3, 10, 4)).astype(np.float32)
    act[0, 0, 0, :3], act[0, 0, 1, :3] = 0.0, 1.0  # the bounds themselves are valid
    act[..., 3] = 7.0  # a fourth channel is not [x, y, touch]: the format says nothing about its range
    layout = np.asfortranarray if fortran else np.ascontiguousarray
    np.savez(tmp_path / "ok.npz", embeddings=emb, actions=layout(act))
    assert validate_npz(tmp_path / "ok.npz").members["actions"].fortran_order == fortran
    act[4, 2, 9, 1] = 1.5  # the last y value of the file
    np.savez(tmp_path / "bad.npz", embeddings=emb, actions=layout(act))
    with pytest.raises(DataFileError) as err:
        validate_npz(tmp_path / "bad.npz")
    message = str(err.value)
    assert "key 'actions'" in message and "channel 1 (y) from 0 to 1.5" in message
    assert "channel 0" not in message and "channel 2" not in message and "channel 3" not in message


def test_geometry_mismatch_names_both_files(tmp_path):
    gen.generate(tmp_path, num_files=1, trajectories_per_file=2, **SMALL)
    np.savez(tmp_path / "zz_other.npz", embeddings=np.random.default_rng(0).standard_normal((2, 4, 16, 8)).astype(
        np.float16), actions=good()[1])
    with pytest.raises(DataFileError) as err:
        VJ2TrajectoryDataset(tmp_path)
    message = str(err.value)
    assert "zz_other.npz" in message and "train_00000.npz" in message
    assert "D=8" in message and "D=32" in message


def test_empty_and_missing_directories(tmp_path, monkeypatch):
    with pytest.raises(DataFileError, match="no \\*.npz files found; expected"):
        VJ2TrajectoryDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist$"):
        VJ2TrajectoryDataset(tmp_path / "nowhere")
    # from a user test: a relative path said nothing of where it was looked for, nor a dir of dirs where not
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"data directory nowhere does not exist \\(relative to the "
                                                f"working directory {re.escape(str(tmp_path))}\\)"):
        VJ2TrajectoryDataset("nowhere")
    (tmp_path / "day1").mkdir()
    with pytest.raises(DataFileError, match="no \\*.npz files found \\(its subdirectories are not searched\\)"):
        VJ2TrajectoryDataset(tmp_path)


def test_skip_bad_files_skips_counts_and_warns(data_dir, caplog):
    write_nan(data_dir / "nan.npz")
    write_not_zip(data_dir / "junk.npz")
    with pytest.warns(UserWarning, match="skipping bad data file"):
        ds = VJ2TrajectoryDataset(data_dir, skip_bad_files=True)
    assert len(ds) == 12 and len(ds.files) == 3
    assert sorted(p.name for p, _ in ds.skipped) == ["junk.npz", "nan.npz"]
    assert "2 skipped" in ds.summary()
    with caplog.at_level(logging.WARNING):
        VJ2TrajectoryDataset(data_dir, skip_bad_files=True, logger=logging.getLogger("vj2test"))
    assert sum("skipping bad data file" in r.message for r in caplog.records) == 2


def test_skip_bad_files_skips_files_without_trajectories_and_refuses_an_empty_dataset(data_dir):
    write_no_trajectories(data_dir / "empty.npz")
    with pytest.warns(UserWarning, match="empty.npz.*N=0"):
        ds = VJ2TrajectoryDataset(data_dir, skip_bad_files=True)
    assert len(ds) == 12 and [p.name for p, _ in ds.skipped] == ["empty.npz"]
    for path in data_dir.glob("train_*.npz"):
        path.unlink()
    with pytest.warns(UserWarning), pytest.raises(DataFileError) as err:
        VJ2TrajectoryDataset(data_dir, skip_bad_files=True)
    assert "no usable trajectories: all 1 .npz files were skipped" in str(err.value)
    assert "empty.npz" in str(err.value) and "expected at least one valid file" in str(err.value)


def geometry_mix(root, old_trajectories, good_trajectories):
    """A leftover a_old.npz with T=5 that sorts first, and two good T=4 files."""
    gen.generate(root, num_files=2, trajectories_per_file=good_trajectories, **SMALL)
    (old,) = gen.generate(root / "old", num_files=1, trajectories_per_file=old_trajectories, **{**SMALL, "steps": 5})
    old.rename(root / "a_old.npz")
    return root


def test_skip_bad_files_keeps_the_geometry_of_most_trajectories_not_the_first_file(tmp_path):
    data = geometry_mix(tmp_path, old_trajectories=2, good_trajectories=5)
    with pytest.raises(DataFileError) as err:
        VJ2TrajectoryDataset(data)
    for text in ("a_old.npz", "train_00000.npz", "train_00001.npz", "T=5", "T=4", "expected one geometry"):
        assert text in str(err.value)
    with pytest.warns(UserWarning, match="a_old.npz: geometry T=5 .* differs from T=4"):
        ds = VJ2TrajectoryDataset(data, skip_bad_files=True)
    assert ds.geometry.steps == 4 and len(ds) == 10
    assert [p.name for p in ds.files] == ["train_00000.npz", "train_00001.npz"]
    assert [p.name for p, _ in ds.skipped] == ["a_old.npz"]


def test_skip_bad_files_counts_trajectories_not_files(tmp_path):
    data = geometry_mix(tmp_path, old_trajectories=7, good_trajectories=3)
    with pytest.warns(UserWarning, match="geometry T=4 .* differs from T=5"):
        ds = VJ2TrajectoryDataset(data, skip_bad_files=True)
    assert ds.geometry.steps == 5 and len(ds) == 7
    assert [p.name for p, _ in ds.skipped] == ["train_00000.npz", "train_00001.npz"]


def test_geometry_tie_is_an_error_even_with_skip_bad_files(tmp_path):
    data = geometry_mix(tmp_path, old_trajectories=6, good_trajectories=3)
    with pytest.raises(DataFileError) as err:
        VJ2TrajectoryDataset(data, skip_bad_files=True)
    message = str(err.value)
    assert "no geometry is held by the most trajectories" in message
    for text in ("T=5", "a_old.npz (6 trajectories)", "T=4", "train_00000.npz, ", "train_00001.npz (6 trajectories)"):
        assert text in message


def test_rollout_horizon_longer_than_trajectories_is_refused(data_dir):
    VJ2TrajectoryDataset(data_dir, rollout_horizon=3)
    with pytest.raises(ValueError, match="T=4.*rollout_horizon=4"):
        VJ2TrajectoryDataset(data_dir, rollout_horizon=4)


def test_mixed_float16_and_float32_files_read_as_float32_without_rounding(tmp_path):
    """Items of every file come out in the widest stored dtype, so a batch stacks and float32 data keeps its
    precision (the first file's float16 would round the others)."""
    gen.generate(tmp_path, num_files=1, trajectories_per_file=2, seed=1, dtype="float16", **SMALL)
    (wide,) = gen.generate(tmp_path / "wide", num_files=1, trajectories_per_file=2, seed=2, dtype="float32", **SMALL)
    wide.rename(tmp_path / "z_wide.npz")  # sorts after the float16 file
    ds = VJ2TrajectoryDataset(tmp_path)
    assert ds.dtype == np.float32 and ds.summary().endswith("(float32)")
    expected = load(tmp_path / "z_wide.npz")["embeddings"]
    assert not np.array_equal(expected, expected.astype(np.float16).astype(np.float32))
    for i in (2, 3):
        assert ds[i][0].dtype == torch.float32 and np.array_equal(ds[i][0].numpy(), expected[i - 2])
    assert ds[0][0].dtype == torch.float32


def test_dataset_fingerprint_follows_the_files_order_not_where_the_directory_is(tmp_path):
    """A resume checks it: the same files renamed into another order are another order of trajectories
    (other batches); the same directory moved elsewhere (another mount, a relative path) is the same data."""
    gen.generate(tmp_path / "a", num_files=2, trajectories_per_file=2, seed=3, **SMALL)
    reference = VJ2TrajectoryDataset(tmp_path / "a").fingerprint()
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert VJ2TrajectoryDataset(tmp_path / "moved").fingerprint() == reference
    (tmp_path / "moved" / "train_00000.npz").rename(tmp_path / "moved" / "train_00002.npz")  # now read second
    assert VJ2TrajectoryDataset(tmp_path / "moved").fingerprint() != reference


def test_train_and_val_files_of_one_seed_hold_different_trajectories(tmp_path):
    """file_rng keeps the splits apart whatever --seed: a validation set written with the training set's seed
    must not repeat its trajectories."""
    (train,) = gen.generate(tmp_path / "t", num_files=1, trajectories_per_file=3, seed=0, **SMALL)
    (val,) = gen.generate(tmp_path / "v", num_files=1, trajectories_per_file=3, seed=0, split="val", **SMALL)
    assert val.name == "val_00000.npz"
    a, b = load(train), load(val)
    assert not np.isclose(a["actions"], b["actions"]).all(axis=(1, 2, 3)).any()


@pytest.mark.parametrize("num_files, per_file, fraction, expected", [
    (3, 10, 0.1, (1, 3)),  # 3 trajectories: one file of 3, not of the training files' 10
    (2, 10, 0.75, (2, 8)),  # 15 trajectories: 2 files (no file holds more than a training file), 16 in all
    (2, 2, 0.01, (1, 1)),  # at least one
])
def test_validation_split_sizes(num_files, per_file, fraction, expected):
    assert gen.val_split(num_files, per_file, fraction) == expected


def test_cli_val_fraction_writes_that_share_of_trajectories(tmp_path):
    argv = ["--output_dir", str(tmp_path / "t"), "--num_files", "3", "--trajectories_per_file", "10",
            "--num_steps", "3", "--patches", "2", "--embed_dim", "4", "--actions_per_step", "2", "--val_fraction", "0.1"]
    assert gen.main(argv) == 0
    assert len(VJ2TrajectoryDataset(tmp_path / "t")) == 30 and len(VJ2TrajectoryDataset(tmp_path / "t_val")) == 3


def test_embeddings_written_in_several_chunks_are_the_encoders_output(tmp_path, monkeypatch):
    """At real shapes a file is written a few trajectories at a time; no trajectory may be lost or shifted at a
    chunk boundary."""
    monkeypatch.setattr(gen, "CHUNK_ELEMENTS", 2 * 4 * 16 * 64)  # 2 trajectories per chunk (hidden width 64)
    (path,) = gen.generate(tmp_path, num_files=1, trajectories_per_file=5, dtype="float32", noise=0.0,
                           save_states=True, **SMALL)
    data = load(path)
    assert data["embeddings"].shape == (5, 4, 16, 32)
    world = gen.World(SMALL["patches"], SMALL["embed_dim"])
    np.testing.assert_allclose(data["embeddings"], world.embed(data["states"]), atol=1e-4)
    validate_npz(path)
