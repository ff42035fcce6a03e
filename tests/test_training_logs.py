"""training_logs.py over real run directories: two short CPU trainings made once for the module."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ddp_runtime as rt
import training_logs as tl
from conftest import LAUNCH_VARS, REPO, clean_env, metrics
from ddp_training import DDPTrainer

LRS = {"lr_3e-3": 3e-3, "lr_1e-2": 1e-2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """root/lr_3e-3 and root/lr_1e-2: 20 steps each, validation every 5."""
    root = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:  # a plain single process, whatever launched pytest
            mp.delenv(var, raising=False)
        # One intra-op thread: on a small shared machine more threads only wait on each other.
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            for name, lr in LRS.items():
                run = root / name
                DDPTrainer(rank=0, world_size=1, config={
                    "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 16, "dataset_size": 256,
                    "batch_size": 16, "max_steps": 20, "val_interval": 5, "learning_rate": lr, "device": "cpu",
                    "resume": "none", "log_dir": str(run), "checkpoint_dir": str(run / "ckpt")}).train()
        finally:
            torch.set_num_threads(threads)
    return root


def summary_record(run_dir):
    (rec,) = metrics(run_dir, "summary")
    return rec


def copy_run(runs, tmp_path, name="lr_3e-3"):
    dst = tmp_path / name
    shutil.copytree(runs / name, dst, ignore=shutil.ignore_patterns("ckpt"))
    return dst


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), len(data)


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------

def test_summary_json_has_the_runs_values(runs, capsys):
    dirs = [str(runs / n) for n in LRS]
    assert tl.main(["summary", *dirs, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(LRS)
    for row, d in zip(rows, dirs):
        s = summary_record(d)
        assert row["status"] == "completed" and row["steps"] == 20 == s["steps"]
        assert row["final_val_loss"] == s["final_val_loss"] == metrics(d, "val")[-1]["val_loss"]
        assert row["best_val_loss"] == s["best_val_loss"] == min(r["val_loss"] for r in metrics(d, "val"))
        assert row["test_loss"] == s["test_loss"]
        assert row["sessions"] == 1
        assert row["total_time_s"] == s["wall_time_s"] and row["avg_samples_per_s"] == s["samples_per_s"]
        assert row["world_size"] == 1
        assert row["peak_host_gb"] >= s["peak_rss_gb"] > 0 and row["peak_gpu_gb"] is None
    # the two learning rates really made two different runs
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]


def test_summary_one_line_and_table(runs, capsys):
    d = runs / "lr_1e-2"
    s = summary_record(d)
    assert tl.main(["summary", str(d)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("lr_1e-2: completed, 20 steps, ")
    assert f"val {s['final_val_loss']:.4f}" in line and f"(best {s['best_val_loss']:.4f})" in line

    assert tl.main(["summary", str(runs / "lr_3e-3"), str(d), "--format", "table"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| name ") and set(lines[1]) <= set("|-:")
    assert len({len(x) for x in lines}) == 1, "columns are not aligned"
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    row = dict(zip(tl.SUMMARY_FIELDS, cells))
    assert row["name"] == "lr_1e-2" and row["steps"] == "20" and row["status"] == "completed"
    assert row["final_val_loss"] == f"{s['final_val_loss']:.4f}"


def test_summary_all_via_cli(runs):
    out = subprocess.run([sys.executable, str(REPO / "training_logs.py"), "summary", "--all", str(runs),
                          "--format", "json"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert sorted(r["name"] for r in rows) == sorted(LRS)
    for r in rows:
        assert r["final_val_loss"] == summary_record(runs / r["name"])["final_val_loss"]
    # summary works where matplotlib is missing: it never imports it
    code = (f"import sys, training_logs; training_logs.main(['summary', {str(runs / 'lr_3e-3')!r}]); "
            "assert 'matplotlib' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("lr_3e-3: completed, 20 steps")


def test_incomplete_run_is_summarised_from_its_records(runs, tmp_path, capsys):
    d = copy_run(runs, tmp_path)
    path = d / "metrics.jsonl"
    kept = [l for l in path.read_text().splitlines() if json.loads(l)["type"] != "summary"]
    path.write_text("\n".join(kept[:-3]) + "\n")  # killed after step 18 or so
    assert tl.main(["summary", str(d), "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    vals = [r["val_loss"] for r in metrics(d, "val")]
    train = metrics(d, "train")
    assert row["status"] == "incomplete"
    assert row["steps"] == train[-1]["step"] < 20
    assert row["final_val_loss"] == vals[-1] and row["best_val_loss"] == min(vals)
    assert row["total_time_s"] == pytest.approx(max(r["time"] for r in train + metrics(d, "val")))
    # without a summary (which states the global batch): the steps' samples over their time
    rates = [r["samples_per_s"] for r in train]
    assert row["avg_samples_per_s"] == pytest.approx(len(rates) / sum(1 / r for r in rates))
    assert row["world_size"] == 1  # from rank_0.log
    assert row["test_loss"] is None


# ----------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------

PLOTS = {
    "loss_curves": ["--loss-curves"],
    "metrics_grid": ["--metrics", "loss,val_loss,lr,grad_norm,tokens_per_s"],
    "compare": ["--compare"],
    "smooth": ["--compare", "--smooth", "5"],
    "x_time": ["--x", "time"],
    "x_epoch_log_y": ["--x", "epoch", "--log-y"],
}


@pytest.mark.parametrize("name", PLOTS)
def test_plot_writes_a_png(runs, tmp_path, name):
    out = tmp_path / f"{name}.png"
    assert tl.main(["plot", *(str(runs / n) for n in LRS), "--output", str(out), *PLOTS[name]]) == 0
    width, height, size = png_size(out)
    assert width >= 400 and height >= 300 and size > 10_000


def test_the_defaults_users_of_other_log_tools_reach_for(runs, tmp_path, capsys, monkeypatch):
    """`summary --all` with no root, `plot` with no --output (reference 004's habits): --all reads runs/, the
    trainers' default root, and a plot goes into the run dir it draws (or --all's root), never elsewhere."""
    (tmp_path / "runs").mkdir()
    for name in LRS:
        shutil.copytree(runs / name, tmp_path / "runs" / name, ignore=shutil.ignore_patterns("ckpt"))
    monkeypatch.chdir(tmp_path)
    assert tl.main(["summary", "--all"]) == 0
    assert sorted(line.split(":")[0] for line in capsys.readouterr().out.splitlines()) == sorted(LRS)
    one = tmp_path / "runs" / "lr_1e-2"
    assert tl.main(["plot", str(one)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {one / 'loss_curves.png'}"
    assert png_size(one / "loss_curves.png")[2] > 10_000
    assert tl.main(["plot", "--all", "--metrics", "loss,lr"]) == 0
    assert png_size(tmp_path / "runs" / "metrics.png")[2] > 10_000
    assert tl.main(["plot", *(str(tmp_path / "runs" / n) for n in LRS)]) == 2
    assert "--output is needed for several runs named one by one" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written beside them


def test_a_plot_without_a_suffix_is_written_where_it_says(runs, tmp_path, capsys):
    assert tl.main(["plot", str(runs / "lr_1e-2"), "--output", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curves.png'}"
    assert png_size(tmp_path / "curves.png")[2] > 10_000


def test_a_metrics_file_stands_for_its_run_and_another_file_is_refused(runs, tmp_path, capsys):
    assert tl.main(["summary", str(runs / "lr_1e-2" / "metrics.jsonl"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["name"] == "lr_1e-2"
    (tmp_path / "notes.txt").write_text("x")
    assert tl.main(["summary", str(tmp_path / "notes.txt")]) != 0
    assert "notes.txt: a file; expected a run directory (the one holding metrics.jsonl)" in capsys.readouterr().err


def test_plotted_series_come_from_the_run(runs):
    d = runs / "lr_1e-2"
    run = tl.load_run(d)
    train, val = metrics(d, "train"), metrics(d, "val")
    assert tl.series(run, "loss") == ([r["step"] for r in train], [r["loss"] for r in train])
    assert tl.series(run, "val_loss") == ([r["step"] for r in val], [r["val_loss"] for r in val])
    assert tl.series(run, "lr", x="time") == ([r["time"] for r in train], [r["lr"] for r in train])
    # smoothing: trailing mean over 5 points, train curves only
    xs, ys = tl.series(run, "loss", smooth=5)
    losses = [r["loss"] for r in train]
    assert len(ys) == 20 and ys[0] == losses[0]
    assert ys[10] == pytest.approx(sum(losses[6:11]) / 5)
    assert tl.series(run, "val_loss", smooth=5)[1] == [r["val_loss"] for r in val]
    # epoch axis: fractional, consistent with the whole epochs the trainer logged, from the steps per epoch it
    # states
    assert all(r["steps_per_epoch"] == run.steps_per_epoch for r in val + metrics(d, "summary"))
    assert metrics(d, "summary")[0]["global_batch"] == 16
    xs, _ = tl.series(run, "loss", x="epoch")
    assert all(int((s - 1) // run.steps_per_epoch) == r["epoch"] for s, r in zip([r["step"] for r in train], train))
    assert xs == [r["step"] / run.steps_per_epoch for r in train]


# ----------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------

def test_directory_without_metrics(tmp_path, capsys):
    assert tl.main(["summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no metrics.jsonl" in err and str(tmp_path) in err
    assert tl.main(["summary", "--all", str(tmp_path)]) == 2
    assert "no metrics.jsonl anywhere" in capsys.readouterr().err


def test_empty_metrics_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert tl.main(["plot", str(tmp_path), "--output", str(tmp_path / "x.png")]) == 2
    assert "is empty" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_truncated_last_line_warns_and_works(runs, tmp_path, capsys):
    d = copy_run(runs, tmp_path)
    path = d / "metrics.jsonl"
    text = path.read_text()
    n = len(text.splitlines())
    path.write_text(text + '{"type": "train", "step": 21, "epoch": 1, "lo')  # killed mid-write
    assert tl.main(["summary", str(d), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert f"{path}:{n + 1}" in out.err and "cut short" in out.err
    assert json.loads(out.out)[0]["final_val_loss"] == summary_record(runs / "lr_3e-3")["final_val_loss"]
    assert tl.main(["plot", str(d), "--output", str(tmp_path / "t.png")]) == 0
    assert png_size(tmp_path / "t.png")[2] > 10_000


def test_bad_line_in_the_middle_is_an_error(runs, tmp_path, capsys):
    d = copy_run(runs, tmp_path)
    path = d / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[4] = lines[4][:30]
    path.write_text("\n".join(lines) + "\n")
    assert tl.main(["summary", str(d)]) == 2
    assert f"{path}:5: not a JSON record" in capsys.readouterr().err


def test_unknown_metric_names_the_available_ones(runs, tmp_path, capsys):
    out = tmp_path / "m.png"
    assert tl.main(["plot", str(runs / "lr_3e-3"), "--metrics", "loss,nope", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown metric nope" in err
    for name in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
        assert name in err
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--metrics", ""], "--metrics needs at least one name, got ''"),  # drew the loss curves without a word
    (["--metrics", " , "], "--metrics needs at least one name, got ' , '"),
    (["--metrics", "loss", "--compare"], "--compare is for the loss curves; a --metrics grid always overlays"),
])
def test_a_plot_request_that_would_be_ignored_is_refused(runs, tmp_path, capsys, flags, message):
    out = tmp_path / "m.png"
    assert tl.main(["plot", str(runs / "lr_3e-3"), *flags, "--output", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_reused_log_dir_and_resume_time(runs, tmp_path, capsys):
    """A fresh run appended to an old one keeps only the newest; time restarting at a resume is stitched."""
    d = copy_run(runs, tmp_path)
    path = d / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines) + "\n")  # the same run twice: log_dir reused without resume
    run = tl.load_run(d)
    assert "more than one run" in capsys.readouterr().err
    assert [r["step"] for r in run.train] == list(range(1, 21)) and run.summary is not None

    # as if resumed after step 10: later records count time from ~0 again
    recs = [json.loads(l) for l in lines]
    cut = next(i for i, r in enumerate(recs) if r.get("step") == 11)
    t_cut = recs[cut - 1]["time"]
    for r in recs[cut:]:
        if "time" in r:
            r["time"] -= recs[cut]["time"] - 0.01
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    xs, _ = tl.series(tl.load_run(d), "loss", x="time")
    assert xs == sorted(xs) and xs[10] == pytest.approx(t_cut + 0.01)


# ----------------------------------------------------------------------------
# hand-written run directories, shaped like what DDPTrainer writes
# ----------------------------------------------------------------------------

def write_run(d, records):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def train_recs(steps, spe, t0=0.0, dt=1.0):
    """Train records as the trainer writes them: "epoch" is the epoch the step ran in."""
    return [{"type": "train", "step": s, "epoch": (s - 1) // spe, "loss": 5.0 - 0.1 * s, "lr": 1e-3,
             "samples_per_s": 100.0, "time": t0 + dt * (i + 1)} for i, s in enumerate(steps)]



def test_the_rates_of_parameter_groups_are_curves_of_their_own(tmp_path):
    """The trainer's `lrs` (each group's rate, where they differ) become lr_group_N curves, plotted like lr."""
    recs = train_recs(range(1, 5), 10)
    for r in recs:
        r["lrs"] = [r["lr"], 10 * r["lr"]]
    run = tl.load_run(write_run(tmp_path / "run", recs))
    assert {"lr", "lr_group_0", "lr_group_1"} <= set(tl.available_metrics([run]))
    assert tl.series(run, "lr_group_1") == ([1, 2, 3, 4], [1e-2] * 4)
    out = tmp_path / "lr.png"
    assert tl.main(["plot", str(tmp_path / "run"), "--metrics", "lr_group_0,lr_group_1", "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_an_incomplete_run_takes_its_best_loss_and_peak_memory_from_any_record(tmp_path, capsys):
    """The best validation and the memory peak in the middle of the run, not at its end (a resume at step 4
    started the peaks again)."""
    recs = train_recs(range(1, 7), spe=6)
    for r, (rss, cuda) in zip(recs, [(1.0, None), (1.5, 4.0), (1.5, 4.0), (1.1, None), (1.3, 2.0), (1.3, 2.5)]):
        r.update(cpu_peak_rss_gb=rss, **({"cuda_peak_gb": cuda} if cuda else {}))
    vals = [{"type": "val", "step": s, "epoch": 0, "val_loss": v, "time": s + 0.5}
            for s, v in [(2, 3.0), (4, 2.2), (6, 2.6)]]
    d = write_run(tmp_path / "killed", recs[:2] + vals[:1] + recs[2:4] + vals[1:2] + recs[4:] + vals[2:])
    assert tl.main(["summary", str(d), "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "incomplete" and row["steps"] == 6
    assert row["final_val_loss"] == 2.6 and row["best_val_loss"] == 2.2
    assert row["peak_host_gb"] == 1.5 and row["peak_gpu_gb"] == 4.0  # each where it is, not the larger of them
    assert tl.main(["summary", str(d)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(", peak 1.50 GB host, 4.00 GB GPU")


def test_epoch_axis_of_a_one_epoch_run(tmp_path):
    """--num_epochs 1: every train record says epoch 0, the closing validation and the summary epoch 1."""
    recs = train_recs(range(1, 9), spe=8) + [
        {"type": "val", "step": 8, "epoch": 1, "val_loss": 4.0, "time": 8.5},
        {"type": "summary", "status": "completed", "steps": 8, "epochs": 1, "wall_time_s": 9.0}]
    run = tl.load_run(write_run(tmp_path / "one", recs))  # no steps_per_epoch stated: the records pin it down
    assert run.steps_per_epoch == 8
    assert tl.series(run, "loss", x="epoch")[0] == [s / 8 for s in range(1, 9)]
    assert tl.series(run, "val_loss", x="epoch")[0] == [1.0]


def test_epoch_axis_inside_the_first_epoch_reads_the_stated_steps_per_epoch(tmp_path, capsys):
    """max_steps stopped the run 6 steps into an epoch of 10: only the trainer's steps_per_epoch says how long
    the epoch is."""
    recs = train_recs(range(1, 7), spe=10) + [
        {"type": "val", "step": 6, "epoch": 0, "steps_per_epoch": 10, "val_loss": 4.0, "time": 6.5},
        {"type": "summary", "status": "completed", "steps": 6, "epochs": 0, "steps_per_epoch": 10,
         "wall_time_s": 7.0}]
    d = write_run(tmp_path / "short", recs)
    run = tl.load_run(d)
    assert run.steps_per_epoch == 10
    assert tl.series(run, "loss", x="epoch")[0] == [s / 10 for s in range(1, 7)]
    assert tl.series(run, "val_loss", x="epoch")[0] == [0.6]

    # without it (an older trainer), the axis would be a guess: refused
    write_run(d, [{k: v for k, v in r.items() if k != "steps_per_epoch"} for r in recs])
    out = tmp_path / "e.png"
    assert tl.main(["plot", str(d), "--x", "epoch", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--x epoch needs the number of steps per epoch" in err and "at least 6" in err and str(d) in err
    assert not out.exists()
    assert tl.main(["plot", str(d), "--x", "step", "--output", str(out)]) == 0  # other axes still work
    # a run killed before its first validation: its start record says it (since 27 Nov 2026)
    start = {"type": "start", "run_id": "ab12", "step": 0, "world_size": 1, "steps_per_epoch": 10}
    assert tl.series(tl.load_run(write_run(d, [start] + train_recs(range(1, 7), spe=10))), "loss",
                     x="epoch")[0] == [s / 10 for s in range(1, 7)]


def test_summary_all_shows_runs_with_no_records_yet(runs, tmp_path, capsys):
    """A run that has just started (empty metrics.jsonl, or a first line still being written) is a row,
    not the end of the whole listing."""
    root = tmp_path / "root"
    copy_run(runs, root)
    (root / "b").mkdir()
    (root / "b" / "metrics.jsonl").write_text("")
    (root / "c").mkdir()
    (root / "c" / "metrics.jsonl").write_text('{"type": "train", "st')
    (root / "d").mkdir()  # still setting up: the trainer opens metrics.jsonl when training starts
    (root / "d" / "rank_0.log").write_text("2026-11-26 04:00:00 [RANK 0] INFO: rank 0/2, local_rank 0, ...\n")
    assert tl.main(["summary", "--all", str(root), "--format", "json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["lr_3e-3"]["final_val_loss"] == summary_record(runs / "lr_3e-3")["final_val_loss"]
    for name in "bcd":
        assert rows[name]["status"] == "no records yet" and rows[name]["steps"] is None
    assert tl.main(["summary", str(root / "d")]) == 0
    assert capsys.readouterr().out == "d: no records yet\n"

    assert tl.main(["summary", "--all", str(root), "--format", "table"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6 and len({len(x) for x in lines}) == 1
    assert tl.main(["summary", "--all", str(root)]) == 0
    assert "b: no records yet" in capsys.readouterr().out

    # plot draws the others and says which it left out
    out = tmp_path / "all.png"
    assert tl.main(["plot", "--all", str(root), "--output", str(out)]) == 0
    assert png_size(out)[2] > 10_000
    err = capsys.readouterr().err
    assert f"{root / 'b'}: not plotted" in err and "is empty" in err


def resumed_run(d, summary=True):
    """Interrupted after 4 steps at 5.4 s (the trainer drops that session's summary when it resumes), then
    resumed: its records' "time" starts again from 0, its summary covers only itself (6.1 s)."""
    recs = train_recs(range(1, 5), spe=100, dt=1.35) + train_recs(range(5, 9), spe=100, dt=1.4)
    recs.append({"type": "val", "step": 8, "epoch": 0, "val_loss": 4.0, "time": 5.8})
    if summary:
        recs.append({"type": "summary", "status": "completed", "steps": 8, "resumed_from": "ckpt/state_4.pt",
                     "epochs": 0, "wall_time_s": 6.1, "samples_per_s": 4 * 8 / 6.1, "world_size": 1,
                     "global_batch": 8})
    return write_run(d, recs)


def test_the_rate_of_a_run_begun_from_another_runs_state_counts_only_its_own_steps(tmp_path):
    """A run started from another run's state at step 384 and resumed once counted all 420 steps as trained in
    its 2 sessions (5173 samples/s for a run of about 450; a user's exploratory test): 36 were."""
    recs = [{"type": "start", "run_id": "ab", "step": 384, "resumed_from": "other/state_384.pt", "world_size": 1}]
    recs += train_recs(range(385, 401), spe=128, dt=0.1)
    recs += [{"type": "start", "run_id": "ab", "step": 400, "resumed_from": "ckpt/state_400.pt", "world_size": 1}]
    recs += train_recs(range(401, 421), spe=128, dt=0.1)
    recs.append({"type": "summary", "status": "completed", "steps": 420, "epochs": 3, "wall_time_s": 2.0,
                 "samples_per_s": 20 * 32 / 2.0, "world_size": 1, "global_batch": 32})
    row = tl.summarize(tl.load_run(write_run(tmp_path / "r", recs)))
    assert (row["steps"], row["sessions"]) == (420, 2)
    assert row["total_time_s"] == pytest.approx(1.6 + 2.0)
    assert row["avg_samples_per_s"] == pytest.approx(36 * 32 / 3.6)
    # a file from before the start records: the step before its first train record
    old = tl.load_run(write_run(tmp_path / "old", [r for r in recs if r["type"] != "start"]))
    assert old.first_step == 384


def test_summary_of_a_resumed_run_totals_its_sessions(tmp_path, capsys):
    d = resumed_run(tmp_path / "resumed")
    row = tl.summarize(tl.load_run(d))
    assert row["sessions"] == 2
    assert row["total_time_s"] == pytest.approx(5.4 + 6.1)
    assert row["avg_samples_per_s"] == pytest.approx(8 * 4 * 2 / (5.4 + 6.1))  # 8 steps of 4 x 2 accum x 1 rank

    # still running in its second session: no summary, the time its records reach and the mean step rate
    row = tl.summarize(tl.load_run(resumed_run(tmp_path / "running", summary=False)))
    assert row["sessions"] == 2 and row["status"] == "incomplete"
    assert row["total_time_s"] == pytest.approx(5.4 + 5.8)
    assert row["avg_samples_per_s"] == pytest.approx(100.0)

    assert tl.main(["summary", str(d), "--format", "table"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "| sessions |" in header and "| total_time_s |" in header and "| avg_samples_per_s |" in header
    assert tl.main(["summary", str(d)]) == 0
    assert "11.5 s over 2 sessions" in capsys.readouterr().out


def test_a_relaunch_that_only_wrote_its_summary_is_a_session_of_its_own(tmp_path):
    """An early-stopped run relaunched with more max_steps stops again at once: its session writes only a
    summary (wall_time_s 0.05, samples_per_s 0.0). Its time was taken for the whole run's (0.05 s,
    0 samples/s), and, after a resumed session, it stood in for that session (whose time was lost)."""
    recs = train_recs([1, 2], spe=4) + [{"type": "val", "step": 2, "epoch": 0, "val_loss": 1.4, "time": 2.5}]
    stop = {"type": "summary", "status": "early_stopped", "steps": 2, "resumed_from": "ckpt/state_2.pt",
            "wall_time_s": 0.05, "samples_per_s": 0.0, "world_size": 1, "global_batch": 8}
    row = tl.summarize(tl.load_run(write_run(tmp_path / "a", recs + [stop])))
    assert row["sessions"] == 2 and row["total_time_s"] == pytest.approx(2.55)
    assert row["avg_samples_per_s"] == pytest.approx(2 * 8 / 2.55)

    recs = train_recs([1, 2], spe=4, dt=10.0) + train_recs([3, 4], spe=4, dt=10.0)  # 20 s, resumed, 20 s
    done = {**stop, "status": "completed", "steps": 4, "wall_time_s": 5.0}
    row = tl.summarize(tl.load_run(write_run(tmp_path / "b", recs + [done])))
    assert row["sessions"] == 3 and row["total_time_s"] == pytest.approx(45.0)
    assert row["avg_samples_per_s"] == pytest.approx(4 * 8 / 45.0)


def test_start_records_tell_apart_sessions_that_time_cannot(tmp_path):
    """A session of two 0.1 s steps, resumed: the next session's first step ends at 0.3 s, later than the
    first session's last record, so "time" never falls back. The start record each session begins with
    (trainers since 27 Nov 2026) counts it; so does a file that began before start records were written."""
    def start(step):
        return {"type": "start", "run_id": "ab12", "step": step, "resumed_from": None, "world_size": 1}
    first, second = train_recs([1, 2], spe=10, dt=0.1), train_recs([3, 4], spe=10, t0=0.2, dt=0.1)
    row = tl.summarize(tl.load_run(write_run(tmp_path / "a", [start(0), *first, start(2), *second])))
    assert row["sessions"] == 2 and row["total_time_s"] == pytest.approx(0.2 + 0.4)
    row = tl.summarize(tl.load_run(write_run(tmp_path / "b", [*first, start(2), *second])))
    assert row["sessions"] == 2 and row["total_time_s"] == pytest.approx(0.2 + 0.4)
    row = tl.summarize(tl.load_run(write_run(tmp_path / "c", [*first, *second])))  # what time alone tells
    assert row["sessions"] == 1 and row["total_time_s"] == pytest.approx(0.4)


def test_the_rate_of_a_running_run_is_its_samples_over_its_steps_time(tmp_path):
    # two steps of 0.08 s and two of 0.32 s, 8 samples each: 32 samples in 0.8 s (the mean of the rates: 62.5)
    recs = train_recs([1, 2, 3, 4], spe=10)
    for rec, rate in zip(recs, (100.0, 25.0, 100.0, 25.0)):
        rec["samples_per_s"] = rate
    assert tl.summarize(tl.load_run(write_run(tmp_path / "a", recs)))["avg_samples_per_s"] == pytest.approx(40.0)


def test_summary_reports_the_median_mfu_of_cuda_runs(tmp_path, capsys):
    """A CUDA run's train records carry mfu: the summary's mfu column is their median; a CPU run's is empty."""
    recs = train_recs(range(1, 6), spe=100)
    for r, mfu in zip(recs, (0.05, 0.26, 0.24, 0.25, 0.27)):  # the first step pays for warm-up
        r["mfu"] = mfu
    gpu = write_run(tmp_path / "gpu", recs)
    assert tl.summarize(tl.load_run(gpu))["mfu"] == pytest.approx(0.25)
    cpu = write_run(tmp_path / "cpu", train_recs(range(1, 6), spe=100))
    assert tl.summarize(tl.load_run(cpu))["mfu"] is None
    assert tl.main(["summary", str(gpu), str(cpu)]) == 0
    gpu_line, cpu_line = capsys.readouterr().out.strip().splitlines()
    assert "MFU 0.250" in gpu_line and "MFU" not in cpu_line
    assert tl.main(["summary", str(gpu), str(cpu), "--format", "table"]) == 0
    header, _, gpu_row, cpu_row = capsys.readouterr().out.strip().splitlines()
    cells = lambda line: dict(zip(tl.SUMMARY_FIELDS, (c.strip() for c in line.strip("|").split("|"))))  # noqa: E731
    assert " mfu |" in header and cells(gpu_row)["mfu"] == "0.250" and cells(cpu_row)["mfu"] == "-"


def test_skipped_steps_leave_no_loss_points(tmp_path):
    """A step skipped for a non-finite loss logs its loss and loss extras as null: no point on a curve and no
    weight in a moving average. A step skipped for its gradients keeps its measured loss."""
    recs = train_recs(range(1, 7), spe=100)
    for r in recs:
        r.update(jloss=r["loss"] / 2, skipped=False)
    recs[2].update(loss=None, jloss=None, skipped=True, grad_norm=None)  # step 3: a non-finite loss
    recs[3].update(skipped=True, grad_norm=None)  # step 4: non-finite gradients, finite loss
    recs[4]["loss"] = float("nan")  # step 5: an older trainer's NaN
    run = tl.load_run(write_run(tmp_path / "skips", recs))
    kept = [r for r in recs if r["step"] not in (3, 5)]
    assert tl.series(run, "loss") == ([r["step"] for r in kept], [r["loss"] for r in kept])
    assert 3 not in tl.series(run, "jloss")[0]
    _, smoothed = tl.series(run, "loss", smooth=2)
    assert smoothed[2] == pytest.approx((kept[1]["loss"] + kept[2]["loss"]) / 2)  # steps 2 and 4, not 0.0
    # the step still happened: lr and the step count keep it
    assert 3 in tl.series(run, "lr")[0] and tl.summarize(run)["steps"] == 6


def test_last_line_not_utf8_warns_and_works(tmp_path, capsys):
    d = write_run(tmp_path / "torn", train_recs(range(1, 5), spe=100))
    path = d / "metrics.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"type": "train", "step": 5, "lo\xff\xfe\x80')  # killed mid-write, torn bytes
    assert tl.main(["summary", str(d), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert f"{path}:5: last line is cut short" in out.err and "skipped" in out.err
    assert json.loads(out.out)[0]["steps"] == 4

    # the same bytes before other records: the file is damaged, an error with the line number
    path.write_bytes(b'{"type": "train", "step": 1, "lo\xff\xfe\n' + path.read_bytes())
    assert tl.main(["summary", str(d)]) == 2
    assert f"{path}:1: not a JSON record (not UTF-8)" in capsys.readouterr().err
    # found by --all, the damaged run is a row that says so, and the others are still listed and plotted
    write_run(tmp_path / "good", train_recs(range(1, 5), spe=100))
    assert tl.main(["summary", "--all", str(tmp_path), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert [(r["name"], r["status"], r["steps"]) for r in json.loads(out.out)] == [
        ("good", "incomplete", 4), ("torn", "unreadable", None)]
    assert f"warning: {d}: unreadable: {path}:1: not a JSON record (not UTF-8)" in out.err
    assert tl.main(["plot", "--all", str(tmp_path), "--output", str(tmp_path / "x.png")]) == 0
    assert f"{d}: not plotted: {path}:1: not a JSON record" in capsys.readouterr().err


def test_record_whose_step_is_not_a_whole_number_is_skipped(tmp_path, capsys):
    recs = train_recs(range(1, 7), spe=100)
    recs[1]["step"] = None
    recs[3]["step"] = "4"
    recs[4]["step"] = 4.5
    path = write_run(tmp_path / "steps", recs) / "metrics.jsonl"
    run = tl.load_run(path.parent)
    assert [r["step"] for r in run.train] == [1, 3, 6]
    err = capsys.readouterr().err
    for lineno, step in ((2, "None"), (4, "'4'"), (5, "4.5")):
        assert f"{path}:{lineno}: step {step} is not a whole number; record skipped" in err
    assert tl.main(["summary", str(path.parent)]) == 0
    assert "6 steps" in capsys.readouterr().out


def test_summary_json_is_strict_json_for_a_diverged_run(tmp_path, capsys):
    """NaN and infinities are not JSON: a diverged run's values are null."""
    recs = train_recs(range(1, 5), spe=100) + [
        {"type": "val", "step": 4, "epoch": 0, "val_loss": float("nan"), "time": 4.5},
        {"type": "summary", "status": "completed", "steps": 4, "final_val_loss": float("nan"),
         "best_val_loss": 3.5, "test_loss": float("inf"), "wall_time_s": 5.0}]
    d = write_run(tmp_path / "nan", recs)  # json.dumps writes NaN/Infinity, as the trainer's writer may
    assert tl.main(["summary", str(d), "--format", "json"]) == 0

    def refuse(name):
        raise ValueError(f"{name} in JSON output")
    (row,) = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert row["final_val_loss"] is None and row["test_loss"] is None and row["best_val_loss"] == 3.5
    assert row["steps"] == 4


def test_a_last_validation_that_was_not_finite_is_the_final_loss_not_an_earlier_one(tmp_path, capsys):
    """The trainer writes null for a NaN loss: the summary showed the previous finite validation instead, and
    a run that diverged at its end looked healthy."""
    vals = [{"type": "val", "step": 2, "epoch": 0, "val_loss": 3.0, "time": 2.5},
            {"type": "val", "step": 4, "epoch": 0, "val_loss": None, "time": 4.5}]
    summary = {"type": "summary", "status": "completed", "steps": 4, "final_val_loss": None, "best_val_loss": 3.0,
               "test_loss": None, "wall_time_s": 5.0}
    for name, recs in [("done", train_recs(range(1, 5), spe=100) + vals + [summary]),
                       ("killed", train_recs(range(1, 5), spe=100) + vals)]:
        row = tl.summarize(tl.load_run(write_run(tmp_path / name, recs)))
        assert math.isnan(row["final_val_loss"]) and row["best_val_loss"] == 3.0, name
    assert tl.main(["summary", str(tmp_path / "done"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["final_val_loss"] is None
    # a test loss that was not finite is null too; the test set's count tells it from no test set
    tested = write_run(tmp_path / "tested", train_recs(range(1, 5), spe=100) + vals + [dict(summary, test_count=96)])
    assert math.isnan(tl.summarize(tl.load_run(tested))["test_loss"])
    assert tl.main(["summary", str(tested)]) == 0
    assert "val nan (best 3.0000), test nan," in capsys.readouterr().out
    assert tl.summarize(tl.load_run(tmp_path / "done"))["test_loss"] is None
    assert tl.summarize(tl.load_run(write_run(tmp_path / "none", train_recs(range(1, 3), spe=9))))[
        "final_val_loss"] is None


def test_a_session_that_repeats_steps_replaces_their_records(tmp_path, capsys):
    """Resumed at step 6 without the file cut back (another tool, a copied file): steps 1-5 stay, 6-10 are the
    second session's, and the time of both sessions is counted."""
    first = train_recs(range(1, 11), spe=100, dt=0.1)
    second = train_recs(range(6, 21), spe=100, dt=0.1)
    row = tl.summarize(tl.load_run(write_run(tmp_path / "r", first + second)))
    assert "repeats steps an earlier one logged" in capsys.readouterr().err
    run = tl.load_run(tmp_path / "r")
    assert [r["step"] for r in run.train] == list(range(1, 21)) and run.train[5]["time"] == pytest.approx(0.1)
    assert row["sessions"] == 2 and row["total_time_s"] == pytest.approx(0.5 + 1.5)
    # a validation redone at the step the second session resumed from replaces the first one's
    val = {"type": "val", "epoch": 0, "val_loss": 3.0, "step": 5}
    recs = first[:5] + [dict(val, time=0.55)] + first[5:] + [dict(val, val_loss=2.5, time=0.05)] + second
    run = tl.load_run(write_run(tmp_path / "v", recs))
    assert [(r["step"], r["val_loss"]) for r in run.val] == [(5, 2.5)] and len(run.train) == 20
    # records without a step number are kept as they come, not taken for repeats
    steps = tl.load_run(write_run(tmp_path / "n", [{k: v for k, v in r.items() if k != "step"} for r in first]))
    assert len(steps.train) == 10


def test_the_world_size_of_a_running_run_is_its_own_not_the_dirs_earlier_one(tmp_path):
    d = write_run(tmp_path / "reused", train_recs(range(1, 3), spe=9))
    (d / "rank_1.log").write_text("2026-11-25 10:00:00 [RANK 1] INFO: rank 1/2, local_rank 1, device cpu\n")
    (d / "rank_0.log").write_text("2026-11-25 10:00:00 [RANK 0] INFO: rank 0/2, local_rank 0, device cpu\n"
                                  "2026-11-25 11:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n")
    assert tl.summarize(tl.load_run(d))["world_size"] == 1
    # a relaunch with another world size, refused (a state of another world size), is not the run's
    with open(d / "rank_0.log", "a") as f:
        f.write("2026-11-25 12:00:00 [RANK 0] INFO: rank 0/4, local_rank 0, device cpu\n"
                "2026-11-25 12:00:01 [RANK 0] ERROR: trainer set-up failed\nTraceback (most recent call last):\n"
                "  File \"x.py\", line 1, in <module>\nValueError: ... was written with world_size=1\n"
                # the VJ2 script's own set-up, failed before its trainer logged a line
                "2026-11-25 13:00:00 [RANK 0] INFO: [DDP] Initializing with backend=gloo, device=cpu\n"
                "2026-11-25 13:00:01 [RANK 0] ERROR: set-up failed: --processed_data_dir d: no .npz files\n")
    assert tl.summarize(tl.load_run(d))["world_size"] == 1


def test_a_run_whose_newest_launch_failed_in_training_says_failed_and_why(tmp_path, capsys):
    """Without a summary record a run is "incomplete" (running, or killed outright), unless a rank of its newest
    launch logged how training ended: then "failed", with the lowest such rank's line (a killed rank 0 logs
    nothing; its peer names the loss). A relaunch that runs again, or a rank log of an earlier larger world,
    is not this launch's failure."""
    d = write_run(tmp_path / "r", train_recs(range(1, 6), spe=9))
    start = "2026-11-27 10:00:00 [RANK {r}] INFO: rank {r}/2, local_rank {r}, device cpu\n"
    failure = ("2026-11-27 10:00:09 [RANK {r}] ERROR: training failed after step 5: StepFailed: step 6: a peer was "
               "lost (...)\nTraceback (most recent call last):\n  File \"x.py\", line 1, in _step\n"
               "StepFailed: step 6: a peer was lost (...)\n")
    (d / "rank_0.log").write_text(start.format(r=0))
    (d / "rank_1.log").write_text(start.format(r=1) + failure.format(r=1))
    (d / "rank_2.log").write_text(start.format(r=2) + failure.format(r=2).replace("step 6", "step 2"))
    row = tl.summarize(tl.load_run(d))
    assert (row["status"], row["error"]) == ("failed", "rank 1: training failed after step 5: StepFailed: step 6: "
                                                       "a peer was lost (...)")
    assert tl.main(["summary", str(d)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; rank 1: training failed after step 5: StepFailed: step 6: "
                                                     "a peer was lost (...)")
    with open(d / "rank_1.log", "a") as f:  # relaunched: the newest launch has not failed
        f.write(start.format(r=1))
    row = tl.summarize(tl.load_run(d))
    assert row["status"] == "incomplete" and "error" not in row
    # the failed line of the newest launch, not the traceback's repeat of its exception
    with open(d / "rank_0.log", "a") as f:
        f.write(failure.format(r=0))
    assert tl.first_error(d / "rank_0.log") == "training failed after step 5: StepFailed: step 6: a peer was lost (...)"
    assert tl.summarize(tl.load_run(d))["error"].startswith("rank 0: training failed after step 5")


def test_a_run_whose_relaunch_failed_in_set_up_stays_incomplete_and_says_why(tmp_path):
    """A run killed at step 5 whose states no longer load: its relaunch failed in set-up, and the summary said
    only "incomplete", as if a relaunch would go on (from a chaos test)."""
    d = write_run(tmp_path / "r", train_recs(range(1, 6), spe=9))
    start = "2026-11-27 10:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n"
    refused = ("2026-11-27 10:05:00 [RANK 0] ERROR: trainer set-up failed\nTraceback (most recent call last):\n"
               "  File \"x.py\", line 1, in _resume\nddp_runtime.CheckpointError: none of the 2 resumable states in "
               "ck loads (see the warnings above)\n")
    (d / "rank_0.log").write_text(start + start + refused)
    row = tl.summarize(tl.load_run(d))
    assert (row["status"], row["steps"], row["error"]) == (
        "incomplete", 5, "its newest launch failed in set-up: trainer set-up failed: ddp_runtime.CheckpointError: "
                         "none of the 2 resumable states in ck loads (see the warnings above)")
    (d / "rank_0.log").write_text(start + refused + start)  # relaunched since: that failure is older news
    assert "error" not in tl.summarize(tl.load_run(d))


def test_a_flag_is_no_metric_and_an_unknown_image_format_is_refused(runs, tmp_path, capsys):
    assert "skipped" not in tl.available_metrics([tl.load_run(runs / "lr_3e-3")])
    plt = tl._pyplot()
    mine = plt.figure()  # a caller's figure is left alone
    tl.check_format(tmp_path / "a.png")
    assert plt.fignum_exists(mine.number)
    plt.close(mine)
    assert tl.main(["plot", str(runs / "lr_3e-3"), "--output", str(tmp_path / "out.xyz")]) == 2
    assert "matplotlib cannot write '.xyz' files; use one of" in capsys.readouterr().err
    assert not (tmp_path / "out.xyz").exists()


def test_an_output_that_cannot_be_written_is_a_clear_error(runs, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "curves.png"  # below a file: no directory can be made there
    assert tl.main(["plot", str(runs / "lr_3e-3"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"training_logs.py: error: --output {out}: cannot write there (") and "Traceback" not in err
    (tmp_path / "dir.png").mkdir()  # savefig's own open fails: a directory where the image goes
    assert tl.main(["plot", str(runs / "lr_3e-3"), "--output", str(tmp_path / "dir.png")]) == 2
    assert capsys.readouterr().err.startswith("training_logs.py: error: IsADirectoryError: ")


def test_a_run_that_failed_in_set_up_says_so_and_why(tmp_path, capsys, no_launch_env):
    """A run dir with a rank_0.log and no metrics file is still setting up, unless its log has an error:
    then it never will train (bad input found after the logger started, data that differs between ranks)."""
    (tmp_path / "empty.txt").write_text("")
    cfg = {"device": "cpu", "data": str(tmp_path / "empty.txt"), "log_dir": str(tmp_path / "runs" / "a"),
           "checkpoint_dir": str(tmp_path / "runs" / "a" / "ckpt"), "resume": "none"}
    with pytest.raises(ValueError, match="the file is empty"):
        DDPTrainer(config=cfg)
    import ddp_runtime as rt
    log = rt.setup_logger(tmp_path / "runs" / "b", 0, keep=True)  # the VJ2 script's set-up, before its trainer
    log.info("[DDP] Initializing with backend=gloo, device=cpu")
    rt.write_kept_logs("set-up failed: --processed_data_dir d: no .npz files")
    rt.close_logger(log)
    capsys.readouterr()  # what the trainer logged to the console
    assert tl.main(["summary", "--all", str(tmp_path / "runs"), "--format", "json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["a"]["status"] == rows["b"]["status"] == "failed in set-up"
    assert rows["b"]["error"] == "set-up failed: --processed_data_dir d: no .npz files"  # summary says why too
    assert tl.main(["summary", str(tmp_path / "runs" / "a")]) == 0
    assert capsys.readouterr().out == (f"a: failed in set-up: trainer set-up failed: ValueError: --data "
                                       f"{tmp_path / 'empty.txt'}: the file is empty\n")
    assert tl.main(["summary", str(tmp_path / "runs" / "b"), "--format", "table"]) == 0
    assert capsys.readouterr().out.endswith("\n\nb: set-up failed: --processed_data_dir d: no .npz files\n")
    assert tl.main(["plot", "--all", str(tmp_path / "runs"), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'runs' / 'a'}: failed before its first step: trainer set-up failed: ValueError: --data " \
           f"{tmp_path / 'empty.txt'}: the file is empty" in err, err
    assert f"{tmp_path / 'runs' / 'b'}: failed before its first step: set-up failed: --processed_data_dir d: no .npz " \
           f"files" in err, err


def test_a_run_that_failed_in_its_first_step_says_so_and_why(tmp_path, capsys, no_launch_env):
    """The trainer opens metrics.jsonl before its first step: a run whose loss_fn fails there leaves only its start record,
    and its error in rank_0.log (it was shown as "no records yet", like a run just starting)."""
    def no_tensor(model, batch):
        return "not a loss"
    run = tmp_path / "runs" / "a"
    cfg = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "seq_len": 8, "dataset_size": 64, "batch_size": 8,
           "max_steps": 5, "device": "cpu", "resume": "none", "log_dir": str(run), "checkpoint_dir": str(run / "c")}
    with pytest.raises(Exception):
        DDPTrainer(rank=0, world_size=1, config=cfg, loss_fn=no_tensor).train()
    assert [json.loads(line)["type"] for line in (run / "metrics.jsonl").read_text().splitlines()] == ["start"]
    capsys.readouterr()
    assert tl.main(["summary", "--all", str(tmp_path / "runs"), "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "failed before its first record"
    assert tl.main(["plot", str(run), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    # the trainer's conclusion (where, and its hint), not the step's own error line before it
    assert f"{run}: failed before its first record: training failed after step 0: StepFailed: step 1 failed on " \
           f"rank 0: TypeError in forward: loss_fn must return (loss_sum, count)" in err, err
    assert "ddp_training.StepFailed" not in err  # the traceback's repeat of it
    # a run whose first steps are only slow has no error: no records yet
    (run / "rank_0.log").write_text("")
    with pytest.raises(tl.NoRecords, match="holds no record of a step yet") as exc:
        tl.load_run(run)
    assert exc.type is tl.NoRecords


def test_a_summary_rounded_below_the_last_record_is_the_same_session(tmp_path):
    # wall_time_s is rounded to ms: 0.3 ms after a record at 2.0004 s it reads 2.0, and was a second session
    recs = train_recs([1, 2], spe=4, dt=1.0002)
    recs.append({"type": "summary", "status": "completed", "steps": 2, "resumed_from": None, "wall_time_s": 2.0,
                 "samples_per_s": 8.0, "world_size": 1, "global_batch": 8})
    row = tl.summarize(tl.load_run(write_run(tmp_path / "a", recs)))
    assert row["sessions"] == 1 and row["total_time_s"] == 2.0 and row["avg_samples_per_s"] == 8.0


def test_a_stopped_session_followed_by_its_resume_in_an_uncut_file_is_one_run(tmp_path, capsys):
    """Stopped at step 5 (its summary written), resumed without the file cut back: the trainer drops the
    stopped session's summary, and so does the reader; the file was read as a second run that dropped
    session one (from a review of training_logs)."""
    stopped = {"type": "summary", "status": "interrupted", "steps": 5, "resumed_from": None, "wall_time_s": 0.6,
               "samples_per_s": 50.0, "world_size": 1, "global_batch": 8}
    done = dict(stopped, status="completed", steps=10, resumed_from="state_step_5.pt", wall_time_s=0.55)
    # the second session ends its first step's window 0.1 s after its start, as the first one did
    recs = train_recs(range(1, 6), spe=100, dt=0.1) + [stopped] + train_recs(range(6, 11), spe=100, dt=0.1) + [done]
    run = tl.load_run(write_run(tmp_path / "r", recs))
    assert "more than one run" not in capsys.readouterr().err
    assert [r["step"] for r in run.train] == list(range(1, 11)) and run.summary["status"] == "completed"
    row = tl.summarize(run)
    assert row["sessions"] == 2 and row["total_time_s"] == pytest.approx(0.5 + 0.55)
    # a step 1 after a summary is still another run
    tl.load_run(write_run(tmp_path / "again", recs + train_recs(range(1, 4), spe=100)))
    assert "holds more than one run" in capsys.readouterr().err


def test_a_validation_redone_at_the_last_step_of_an_uncut_file_replaces_it(tmp_path, capsys):
    """Killed after its validation at step 8, resumed from step 8: the resumed session validates step 8 again
    (it was kept twice)."""
    val = {"type": "val", "epoch": 0, "step": 8, "val_loss": 3.0, "time": 0.85}
    recs = train_recs(range(1, 9), spe=100, dt=0.1) + [val, dict(val, val_loss=2.9, time=0.05)] + \
        train_recs(range(9, 11), spe=100, t0=0.05, dt=0.1)
    run = tl.load_run(write_run(tmp_path / "r", recs))
    assert [(r["step"], r["val_loss"]) for r in run.val] == [(8, 2.9)] and len(run.train) == 10
    assert "repeats steps an earlier one logged" in capsys.readouterr().err


def test_a_set_up_failure_is_the_newest_launchs(tmp_path):
    """Rank logs are appended to: a relaunch still setting up is not "failed in set-up" by an earlier launch's
    error, and of two failed launches the newest one's error is named."""
    failed = ("2026-11-26 09:01:56 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu, backend none\n"
              "2026-11-26 09:01:56 [RANK 0] ERROR: trainer set-up failed\nTraceback (most recent call last):\n"
              "  File \"ddp_training.py\", line 1, in <module>\nValueError: --data {}: the file is empty\n")
    relaunch = "2026-11-26 09:30:00 [RANK 0] INFO: [DDP] Initializing with backend=gloo, device=cpu\n"
    d = tmp_path / "r"
    d.mkdir()
    (d / "rank_0.log").write_text(failed.format("a.txt") + relaunch)
    with pytest.raises(tl.NoRecords):
        tl.load_run(d)
    (d / "rank_0.log").write_text(failed.format("a.txt") + failed.format("b.txt"))
    with pytest.raises(tl.SetUpFailed, match=r"trainer set-up failed: ValueError: --data b.txt: the file is empty$"):
        tl.load_run(d)
    # a launch that a Ctrl-C ended in set-up: stopped, not failed, and not still setting up; a relaunch after it is
    stopped = ("2026-11-26 10:00:00 [RANK 0] INFO: rank 0/2, local_rank 0, device cpu, backend gloo\n"
               f"2026-11-26 10:00:01 [RANK 0] WARNING: {rt.CTRL_C_BEFORE_TRAINING}\n")
    (d / "rank_0.log").write_text(failed.format("a.txt") + stopped)
    with pytest.raises(tl.StoppedInSetUp, match="stopped by Ctrl-C in set-up, before its first step$"):
        tl.load_run(d)
    assert tl.summarize(tl.load_runs([str(d)])[0])["status"] == "stopped in set-up"
    (d / "rank_0.log").write_text(stopped + relaunch)
    with pytest.raises(tl.NoRecords) as caught:
        tl.load_run(d)
    assert caught.value.status == "no records yet"


def test_a_run_whose_process_is_gone_without_a_record_is_not_still_setting_up(tmp_path, capsys):
    """A run killed (or ended by a second stop signal, which exits at once) before its first record was shown as
    "no records yet (the run is still setting up)" for ever. Its run-dir lock names its process: gone from this
    host, the run ended. A live process, or one on another host, leaves it as it was."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "rank_0.log").write_text("2026-11-27 10:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, host = int(gone.stdout), socket.gethostname()
    for note, status in ((f"pid {pid} on {host} since 2026-11-27 10:00:00\n", "ended before its first record"),
                         (f"pid {os.getpid()} on {host} since 2026-11-27 10:00:00\n", "no records yet"),
                         (f"pid {pid} on another-{host} since 2026-11-27 10:00:00\n", "no records yet"),
                         # the same host name in another PID namespace (a container): its pids are not ours
                         (f"pid {pid} on {host} since 2026-11-27 10:00:00 [pid:[1]]\n", "no records yet"),
                         (f"pid {pid} on {host} since 2026-11-27 10:00:00 [{tl.pid_namespace()}]\n",
                          "ended before its first record"),
                         ("", "no records yet")):
        (d / ".lock").write_text(note)
        with pytest.raises(tl.NoRecords) as caught:
            tl.load_run(d)
        assert caught.value.status == status, note
    (d / ".lock").write_text(f"pid {pid} on {host} since 2026-11-27 10:00:00\n")
    assert tl.main(["summary", str(d)]) == 0
    assert capsys.readouterr().out == "r: ended before its first record\n"
    (d / "metrics.jsonl").write_text('{"type": "start", "run_id": "ab", "step": 0}\n')  # killed in its first step
    with pytest.raises(tl.EndedEarly, match=rf"its process \(pid {pid} on {host}\) ended before its first record"):
        tl.load_run(d)
    # killed, and not yet reaped by its parent (a zombie): ended too
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while not tl.is_zombie(zombie.pid) and time.time() < deadline:
        time.sleep(0.02)
    try:
        (d / ".lock").write_text(f"pid {zombie.pid} on {host} since 2026-11-27 10:00:00\n")
        with pytest.raises(tl.EndedEarly, match=rf"its process \(pid {zombie.pid} on {host}\) ended before"):
            tl.load_run(d)
    finally:
        zombie.wait()


def test_a_run_with_records_whose_process_is_gone_ended_unfinished(tmp_path, capsys):
    """A run SIGKILLed after its first records stayed "incomplete", as one still running (a user test): its
    lock's process, gone from this host, says it ended. Running, or failed with an error, it is as before."""
    d = write_run(tmp_path / "r", train_recs(range(1, 13), spe=9))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, host = int(gone.stdout), socket.gethostname()
    (d / ".lock").write_text(f"pid {os.getpid()} on {host} since 2026-11-27 10:00:00\n")
    assert tl.summarize(tl.load_run(d))["status"] == "incomplete"
    (d / ".lock").write_text(f"pid {pid} on {host} since 2026-11-27 10:00:00\n")
    row = tl.summarize(tl.load_run(d))
    assert (row["status"], row["steps"]) == ("ended unfinished", 12)
    assert row["error"] == (f"its process (pid {pid} on {host}) is gone, with no error in its log (killed, or a "
                            f"second stop signal): relaunch to resume from its newest state")
    assert tl.main(["summary", str(d)]) == 0
    assert capsys.readouterr().out.startswith("r: ended unfinished, 12 steps, ")
    (d / "rank_0.log").write_text("2026-11-27 10:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n"
                                  "2026-11-27 10:00:09 [RANK 0] ERROR: training failed after step 12: StepFailed: "
                                  "step 13: x\n")
    assert tl.summarize(tl.load_run(d))["status"] == "failed"


def test_a_trainer_closed_without_training_is_not_trained(tmp_path, no_launch_env):
    cfg = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "seq_len": 8, "dataset_size": 64, "batch_size": 8,
           "device": "cpu", "log_dir": str(tmp_path / "run"), "checkpoint_dir": str(tmp_path / "run" / "c")}
    trainer = DDPTrainer(rank=0, world_size=1, config=cfg)
    assert math.isfinite(trainer.evaluate()["loss"])
    trainer.close()
    with pytest.raises(tl.NotTrained, match="closed without training"):
        tl.load_run(tmp_path / "run")
    DDPTrainer(rank=0, world_size=1, config={**cfg, "max_steps": 2}).train()  # a later launch that trains
    assert tl.summarize(tl.load_run(tmp_path / "run"))["status"] == "completed"


def test_a_refused_plot_makes_no_directories(runs, tmp_path, capsys):
    short = write_run(tmp_path / "short", train_recs(range(1, 4), spe=100))  # no epoch ended, none stated
    for run, flags in ((runs / "lr_3e-3", ["--metrics", "nosuch"]), (short, ["--x", "epoch"])):
        out = tmp_path / "new" / "dir" / "curves.png"
        assert tl.main(["plot", str(run), *flags, "--output", str(out)]) == 2
        assert "error: " in capsys.readouterr().err and not (tmp_path / "new").exists(), flags


def test_the_val_loss_curve_is_read_from_the_validation_records(runs):
    """A train record's field of the same name (an extra of another trainer's loss) is not the validation."""
    run = tl.load_run(runs / "lr_3e-3")
    for rec in run.train:
        rec["val_loss"] = 99.0
    plt = tl._pyplot()
    fig, ax = plt.subplots()
    (val,) = [h for h in tl._loss_axes(ax, [run], "step", 1, False, ["C0"]) if h.get_label() == "val loss"]
    plt.close(fig)
    assert list(val.get_xdata()) == [r["step"] for r in run.val] == [5, 10, 15, 20]
    assert list(val.get_ydata()) == [r["val_loss"] for r in run.val]


def test_steps_per_epoch_of_a_run_that_logs_every_few_steps(tmp_path):
    """With log_interval > 1 (and no steps_per_epoch stated, as by an older trainer) no record sits at an epoch's
    last step: the bounds e*n < step <= (e+1)*n of the logged steps still pin n down (from a mutation review)."""
    # steps 3, 6, 9 logged, 5 steps per epoch; the summary closes epoch 2 at step 10
    logged = train_recs([3, 6, 9], spe=5) + [{"type": "summary", "status": "completed", "steps": 10, "epochs": 2,
                                               "wall_time_s": 10.5}]
    run = tl.load_run(write_run(tmp_path / "a", logged))
    assert tl.epoch_bounds(logged) == (5, 5) and run.steps_per_epoch == 5  # 9 in epoch 1: n >= 4.5
    assert tl.series(run, "loss", x="epoch")[0] == [0.6, 1.2, 1.8]
    # still running, every second step logged: step 6 in epoch 1 and step 12 in epoch 2 both say n <= 5
    running = tl.load_run(write_run(tmp_path / "b", train_recs([2, 4, 6, 8, 10, 12], spe=5)))
    assert running.steps_per_epoch == 5


def test_a_metric_of_train_and_val_records_is_plotted_from_the_train_records(runs):
    run = tl.load_run(runs / "lr_3e-3")
    for rec in run.val:
        rec["lr"] = 0.5
    assert tl.available_metrics([run])["lr"] == "train" and tl.available_metrics([run])["val_loss"] == "val"


def test_runs_of_the_same_name_are_told_apart_by_their_paths(runs, tmp_path, capsys):
    """sweep_a/lr_3e-3 and sweep_b/lr_3e-3: two rows both named lr_3e-3 could not be told apart."""
    a, b = copy_run(runs, tmp_path / "sweep_a"), copy_run(runs, tmp_path / "sweep_b")
    other = runs / "lr_1e-2"
    assert [r.name for r in tl.load_runs([a, b, other])] == [str(a), str(b), "lr_1e-2"]
    assert tl.main(["summary", str(a), str(b), "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == [str(a), str(b)]


def test_loss_curves_have_one_row_per_run_unless_compared(runs, tmp_path):
    dirs = [str(runs / n) for n in LRS]
    assert tl.main(["plot", *dirs, "--output", str(tmp_path / "rows.png")]) == 0
    assert tl.main(["plot", *dirs, "--compare", "--output", str(tmp_path / "one.png")]) == 0
    # figsize 12 x 4.5 inches per row at 100 dpi
    assert png_size(tmp_path / "rows.png")[:2] == (1200, 900) and png_size(tmp_path / "one.png")[:2] == (1200, 450)


def test_smoothed_loss_curve_is_drawn_over_the_raw_one(runs, tmp_path, capsys):
    run = tl.load_run(runs / "lr_3e-3")
    raw = [r["loss"] for r in run.train]
    plt = tl._pyplot()
    fig, ax = plt.subplots()
    handles = {h.get_label(): h for h in tl._loss_axes(ax, [run], "step", 5, False, ["C0"])}
    plt.close(fig)
    smooth = handles["train loss (avg 5)"]
    assert list(smooth.get_ydata()) == tl.moving_average(raw, 5) != raw
    assert [list(line.get_ydata()) for line in ax.lines if line.get_alpha() == 0.25] == [raw]
    out = tmp_path / "x.png"
    assert tl.main(["plot", str(runs / "lr_3e-3"), "--smooth", "0", "--output", str(out)]) == 2
    assert "--smooth must be at least 1" in capsys.readouterr().err and not out.exists()


def test_a_record_whose_step_is_true_is_skipped(tmp_path, capsys):
    """JSON true is a Python bool, an int to isinstance: it is no step number."""
    recs = train_recs(range(1, 4), spe=100)
    recs[1]["step"] = True
    run = tl.load_run(write_run(tmp_path / "b", recs))
    assert [r["step"] for r in run.train] == [1, 3]
    assert "metrics.jsonl:2: step True is not a whole number; record skipped" in capsys.readouterr().err


def test_a_metric_in_train_and_val_records_is_read_from_the_train_records_by_default(tmp_path):
    """series() without a kind takes the train records of a metric both kinds hold (as available_metrics says)."""
    recs = []
    for s in range(1, 7):  # as the trainer writes them: a step's validation after its train record
        recs.append({"type": "train", "step": s, "loss": 1.0 / s, "lr": 0.1 * s, "time": float(s)})
        if s % 3 == 0:
            recs.append({"type": "val", "step": s, "val_loss": 1.0, "lr": 0.5, "time": s + 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = tl.load_run(tmp_path)
    assert tl.available_metrics([run])["lr"] == "train"
    xs, ys = tl.series(run, "lr")
    assert xs == list(range(1, 7)) and ys == [0.1 * s for s in range(1, 7)]


def test_a_refused_relaunch_of_a_run_whose_process_is_gone_stays_incomplete(tmp_path):
    d = write_run(tmp_path / "r", train_recs(range(1, 6), spe=9))
    (d / "rank_0.log").write_text("2026-11-27 10:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n"
                                  "2026-11-27 10:05:00 [RANK 0] ERROR: trainer set-up failed: ValueError: no\n")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (d / ".lock").write_text(f"pid {int(gone.stdout)} on {socket.gethostname()} since 2026-11-27 10:05:00\n")
    row = tl.summarize(tl.load_run(d))
    assert (row["status"], row["error"]) == ("incomplete", "its newest launch failed in set-up: trainer set-up "
                                                           "failed: ValueError: no")


def test_first_error_is_the_first_error_line_where_none_concludes_training(tmp_path):
    log = tmp_path / "rank_0.log"
    log.write_text("2026-11-27 10:00:00 [RANK 0] INFO: rank 0/1, local_rank 0, device cpu\n"
                   "2026-11-27 10:00:01 [RANK 0] ERROR: set-up failed: ValueError: first\n"
                   "2026-11-27 10:00:02 [RANK 0] ERROR: closing: OSError: second\n")
    assert tl.first_error(log) == "set-up failed: ValueError: first"
