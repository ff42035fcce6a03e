"""benchmark.py: every sub-command runs on a tiny configuration and its --json output carries every documented
field, with positive, finite figures whose ratios agree with the rates they are computed from. No timing is
asserted: these run on busy CI machines."""

import json
import math
import os
import sys

import pytest
import torch

from conftest import REPO, run

TINY_LM = ["--hidden_size", "32", "--num_layers", "1", "--num_heads", "2", "--seq_len", "16", "--batch_size", "4"]


# runs benchmark.py on one CPU of this process's (its processes inherit the affinity): what a 1-core machine sees
ONE_CPU = [sys.executable, "-c", "import os, runpy, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"]


def bench(tmp_path, *args, timeout=120, one_cpu=False):
    """Run benchmark.py with --json, its work dir under tmp_path; stdout must be exactly one JSON object."""
    cmd = [*(ONE_CPU if one_cpu else [sys.executable]), REPO / "benchmark.py", *args, "--json", "--dir", tmp_path]
    r = run(cmd, cwd=tmp_path, timeout=timeout, merge_stderr=False)
    assert r.returncode == 0, f"exit {r.returncode}: {' '.join(map(str, cmd))}\n{r.stderr[-4000:]}"
    out = r.stdout
    return json.loads(out)  # fails on anything but one JSON document


def positive(*values):
    for v in values:
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, v


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def check_env(out, command):
    assert out["command"] == command
    env = out["env"]
    assert env["cores"] >= 1 and env["torch"] and env["cpu"]
    assert len(env["loadavg_start"]) == 3 and len(env["loadavg_end"]) == 3
    positive(env["wall_s"])
    for key in ("other_cpu_cores", "steal_cpu_cores"):  # None off Linux
        assert env[key] is None or (math.isfinite(env[key]) and env[key] >= 0)
    assert out["timed"]


def test_overhead(tmp_path):
    out = bench(tmp_path, "overhead", *TINY_LM, "--steps", 4, "--warmup", 2, "--repeats", 2, "--threads", 1)
    check_env(out, "overhead")
    assert out["config"]["threads"] == 1 and out["config"]["max_steps"] == 6
    assert out["config"]["save_interval"] == 0 and out["config"]["save_every_iters"] == 0
    assert len(out["bare_runs"]) == len(out["trainer_runs"]) == len(out["pair_ratios"]) == 2
    positive(out["bare_steps_per_s"], out["trainer_steps_per_s"], out["ratio"], *out["bare_runs"],
             *out["trainer_runs"], out["bare_final_loss"], out["trainer_final_loss"])
    assert close(out["ratio"], out["trainer_steps_per_s"] / out["bare_steps_per_s"])
    for b, t, r in zip(out["bare_runs"], out["trainer_runs"], out["pair_ratios"]):
        assert close(r, t / b)
    assert min(out["bare_runs"]) <= out["bare_steps_per_s"] <= max(out["bare_runs"])
    assert out["meets_target"] == (out["ratio"] >= out["target_ratio"]) and out["target_ratio"] == 0.97
    # same model, seed, batches and schedule: both loops do the same steps (5e-7 apart, measured; a loop that
    # skipped its optimizer steps lands 0.05 away)
    assert abs(out["bare_final_loss"] - out["trainer_final_loss"]) < 1e-4
    assert out["config"]["device"] == "cpu" and out["config"]["autocast"] is None and "gpu" not in out["env"]
    positive(out["flops_per_step"])
    for name, rate in (("bare", out["bare_steps_per_s"]), ("trainer", out["trainer_steps_per_s"])):
        loop = out["loops"][name]
        assert close(loop["steps_per_s"], rate) and close(loop["step_ms"], 1000 / rate)
        assert close(loop["samples_per_s"], 4 * rate) and close(loop["tokens_per_s"], 4 * 16 * rate)
        assert loop["mfu"] is None and loop["peak_memory_gib"] is None  # CPU: no known peak, no GPU memory


@pytest.mark.multi
def test_scaling(tmp_path):
    out = bench(tmp_path, "scaling", *TINY_LM, "--nproc", 2, "--steps", 3, "--warmup", 2, "--repeats", 1, timeout=150)
    check_env(out, "scaling")
    assert out["config"]["threads_per_process"] == 1 and out["config"]["batch_size_per_process"] == 4
    assert out["config"]["timeout_s"] == 600.0  # the default, bounding the bare loops' runs too
    for rows, eff in ((out["rows"], out["efficiency"]), (out["bare_rows"], out["bare_efficiency"])):
        one, two = rows
        assert (one["processes"], two["processes"]) == (1, 2)
        for row in rows:
            assert row["steps"] == 3 and len(row["samples_per_s_runs"]) == len(row["exit_codes"]) == 1
            positive(row["wall_s"], row["timed_s"], row["samples_per_s"], row["speedup"], row["efficiency"])
            assert row["timed_s"] < row["wall_s"] and row["step_ms_sd"] >= 0
            assert close(row["speedup"], row["samples_per_s"] / one["samples_per_s"])
            assert close(row["efficiency"], row["speedup"] / row["processes"])
            # timed_s covers `steps` steps of processes x batch samples each
            assert close(row["samples_per_s"] * row["timed_s"], row["steps"] * 4 * row["processes"])
        assert close(one["efficiency"], 1.0) and close(eff, two["efficiency"])
    indep = out["independent_row"]
    assert indep["processes"] == 2 and indep["steps"] == 3 and close(out["independent_efficiency"], indep["efficiency"])
    assert indep["step_ms_sd"] >= 0
    assert close(indep["efficiency"], indep["samples_per_s"] / (2 * out["bare_rows"][0]["samples_per_s"]))
    assert out["meets_target"] == (out["efficiency"] >= out["target_efficiency"])


@pytest.mark.multi  # DataLoader worker processes
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="runs on one CPU, set with sched_setaffinity")
def test_loader(tmp_path):
    """On one CPU, where the loader caps workers at 1: --workers 1,2 gives one row of 1 worker that says so."""
    out = bench(tmp_path, "loader", "--workers", "0,1,2", "--files", 2, "--traj_per_file", 3, "--steps", 3,
                "--patches", 4, "--embed_dim", 8, "--actions_per_step", 5, "--batch_size", 2, "--train_steps", 1,
                "--warm_epochs", 1, "--rss_epochs", 1, "--threads", 1, one_cpu=True)
    check_env(out, "loader")
    assert out["env"]["cores"] == 1
    config = out["config"]
    assert config["workers"] == [0, 1, 2] and config["workers_used"] == [0, 1]
    assert config["workers_capped"] == {"2": 1}
    assert config["pin_memory"] is False  # the trainer pins on CUDA only
    consumer = out["consumer"]
    assert "AC predictor" in consumer["model"] or "LM" in consumer["model"]
    positive(consumer["step_s"], consumer["samples_per_s"])
    assert close(consumer["samples_per_s"], consumer["batch_size"] / consumer["step_s"])
    v = out["validation"]
    positive(v["bytes"], v["seconds"], v["gib_per_s"])
    assert close(v["gib_per_s"], v["bytes"] / 2**30 / v["seconds"]) and v["repeats"] == 3
    assert [r["workers"] for r in out["loader"]] == [0, 1]
    assert [r["requested_workers"] for r in out["loader"]] == [[0], [1, 2]]
    for r in out["loader"]:
        assert r["pin_memory"] is False
        assert r["trajectories"] == 18 and r["samples_per_epoch"] == 18 and r["evicted"] in (True, False)
        positive(r["bytes"], r["cold_samples_per_s"], r["warm_samples_per_s"], r["cold_vs_step"], r["warm_vs_step"])
        assert close(r["cold_vs_step"], r["cold_samples_per_s"] / consumer["samples_per_s"])
        assert close(r["warm_vs_step"], r["warm_samples_per_s"] / consumer["samples_per_s"])
    assert out["meets_rate_target"] == (out["loader"][1]["cold_vs_step"] >= out["target_margin"])
    assert sorted((m["workers"], m["size"]) for m in out["memory"]) == [(0, "1x"), (0, "3x"), (1, "1x"), (1, "3x")]
    for m in out["memory"]:
        assert m["trajectories"] == (6 if m["size"] == "1x" else 18) and m["pin_memory"] is False
        assert len(m["worker_peak_mb"]) == m["workers"]
        for p in [m["main_before_mb"], m["main_peak_mb"], *m["worker_peak_mb"]]:
            positive(p["rss"], p["anon"], p["uss"])
            assert p["anon"] <= p["rss"] and p["uss"] <= p["rss"]
        assert m["main_peak_mb"]["rss"] >= m["main_before_mb"]["rss"]
    assert [g["workers"] for g in out["memory_growth"]] == [0, 1]
    assert [g["requested_workers"] for g in out["memory_growth"]] == [[0], [1, 2]]
    assert isinstance(out["memory_flat"], bool) and isinstance(out["rss_flat"], bool)
    assert {"workers", "requested_workers", "anon_peak_mb_1x", "anon_peak_mb_3x", "rss_peak_mb_1x",
            "rss_peak_mb_3x"} == set(out["memory_growth"][0])


def test_checkpoint(tmp_path):
    out = bench(tmp_path, "checkpoint", "--sizes", "32x1,64x1", "--seq_len", 16, "--repeats", 1, "--loop_saves", 2,
                "--loop_save_every", 3, "--loop_batch", 4, "--threads", 1)
    check_env(out, "checkpoint")
    assert [m["name"] for m in out["models"]] == ["32x1", "64x1"]
    for m in out["models"]:
        positive(m["params"], m["blocked_s"], m["blocked_sync_s"], m["write_s"], m["copy_s"], m["blocked_over_write"])
        for kind in ("weights", "state"):
            r = m[kind]
            positive(r["bytes"], r["snapshot_s"], r["copy_s"], r["serialize_s"], r["write_nofsync_s"], r["write_s"],
                     r["write_live_s"], r["hash_s"], r["save_s"], r["sha256_s"], r["load_s"], r["load_noverify_s"])
            assert r["rest_s"] >= 0
            if r["rest_s"] > 0:  # clamped at 0 where noise makes the parts outweigh the whole
                assert close(r["rest_s"], r["save_s"] - r["write_live_s"] - r["hash_s"])
        assert close(m["copy_s"], m["weights"]["copy_s"] + m["state"]["copy_s"])
        assert close(m["write_s"], m["weights"]["write_s"] + m["state"]["write_s"])
        # the resumable state holds the weights and AdamW's two moments besides
        assert m["state"]["bytes"] > 2 * m["weights"]["bytes"]
        assert close(m["blocked_sync_s"], m["weights"]["save_s"] + m["state"]["save_s"])
        assert close(m["blocked_over_write"], m["blocked_s"] / m["write_s"])
        assert close(m["sync_blocked_over_write"], m["blocked_sync_s"] / m["write_s"])
        assert set(m["in_loop"]) == {"async", "sync"}
        for loop in m["in_loop"].values():
            assert loop["saves"] == len(loop["blocked_runs"]) == 2 and loop["save_every_iters"] == 3
            assert loop["steps"] == 7
            positive(loop["blocked_s"], *loop["blocked_runs"], loop["step_s"], loop["step_with_save_s"])
            assert close(loop["period_blocked_s"], loop["step_with_save_s"] - loop["step_s"])
            # the window of a save: from its step to the first step that ends after its files are written
            positive(loop["write_done_s"])
            windows = loop["window_steps"]
            # saves at steps 3 and 6 of 7: a write may outlast every step left after its save (on a busy machine)
            assert len(windows) == 2 and all(w is None or 1 <= w <= 7 - s for s, w in zip((3, 6), windows)), windows
            measured = [w for w in windows if w is not None]
            if loop["window_base_step_s"] is None:  # every step after step 2 in some save's window
                assert loop["window_cost_runs"] == [] and loop["window_cost_s"] is None
            else:
                positive(loop["window_base_step_s"])
                assert len(loop["window_cost_runs"]) == len(measured)
                assert all(math.isfinite(c) for c in loop["window_cost_runs"])
                assert (loop["window_cost_s"] is None) == (not measured)
        assert close(m["in_loop"]["async"]["blocked_over_write"], m["in_loop"]["async"]["blocked_s"] / m["write_s"])
        assert m["in_loop"]["sync"]["window_steps"] == [1, 1]  # written before the save call returns
    assert out["models"][1]["weights"]["bytes"] > out["models"][0]["weights"]["bytes"]
    target = out["target_blocked_over_write"]
    assert out["meets_target"] == all(m["blocked_over_write"] <= target and
                                      m["in_loop"]["async"]["blocked_over_write"] <= target for m in out["models"])


# A bare DDP run of scaling far longer than its --timeout, in a process of its own (bounded by run's timeout, so a
# broken kill fails the test instead of hanging it): it must stop at the timeout with an error naming the flag,
# and leave no process behind (the spawned ranks outlive a killed parent unless they are killed too).
OVERRUN = """
import argparse, ctypes, json, sys, time
from pathlib import Path
import psutil
import benchmark
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned ranks of a killed run become children here
steps, timeout = 20000, float(sys.argv[2])
# 25 ms a step here: minutes of work, which a machine 10x as fast would still take far past the timeout to do
cfg = dict(vocab_size=64, hidden_size=128, num_layers=2, num_heads=2, seq_len=32, batch_size=4, seed=0, device="cpu",
           max_steps=steps, dataset_size=(steps + 1) * 4 * 2)
args = argparse.Namespace(threads=1, warmup=1, timeout=timeout)
start, error = time.monotonic(), None
try:
    benchmark.bare_scaling_run(args, 2, Path(sys.argv[1]) / "bare", cfg)
except benchmark.RunTimeout as exc:
    error = str(exc)
seconds = time.monotonic() - start
def alive():
    return [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
deadline = time.monotonic() + 10  # a SIGKILL lands at once; a process it missed would still run at the end
while alive() and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"error": error, "seconds": seconds, "left": alive()}))
"""


@pytest.mark.multi
def test_a_bare_run_past_timeout_is_killed_with_a_clear_error(tmp_path):
    timeout = 15
    r = run([sys.executable, "-c", OVERRUN, tmp_path, timeout], cwd=tmp_path, timeout=120, merge_stderr=False)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] and "the bare loop on 2 process(es) did not finish within --timeout 15 s" in out["error"]
    assert timeout <= out["seconds"] < timeout + 30 and out["left"] == []


def test_table_output(tmp_path, capsys, no_launch_env):
    """Without --json: markdown tables and the machine line on stdout (in this process, no start-up cost)."""
    import benchmark
    assert benchmark.main(["checkpoint", "--sizes", "32x1", "--seq_len", "16", "--repeats", "1",
                           "--loop_saves", "0", "--threads", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| model (params) | payload |" in out and "| 32x1 (0.02M) | weights |" in out and "torch" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_json_output_stays_strict_when_a_figure_is_not_finite(capsys):
    """A diverged loss (NaN) or a zero-time rate (inf) becomes null: `json.loads` of the output never fails."""
    import argparse
    import benchmark
    out = {"env": benchmark.environment(), "trainer_final_loss": math.nan, "ratio": math.inf, "runs": [1.0, math.nan]}
    benchmark.finish(out, argparse.Namespace(json=True), table="")
    printed = json.loads(capsys.readouterr().out)
    assert (printed["trainer_final_loss"], printed["ratio"], printed["runs"]) == (None, None, [1.0, None])


@pytest.mark.parametrize("argv,message", [
    (["scaling", "--nproc", "1"], "argument --nproc: expected an integer >= 2, got 1"),
    (["overhead", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["overhead", "--steps", "many"], "argument --steps: expected an integer >= 1, got 'many'"),
    (["overhead", "--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    (["scaling", "--warmup", "0"], "argument --warmup: expected an integer >= 1, got 0"),  # timed from its end
    (["overhead", "--trainer_set", "bogus=1"], "--trainer_set or the model flags: unknown config key 'bogus'"),
    (["overhead", "--hidden_size", "16", "--num_heads", "3"], "hidden_size=16 must be divisible by num_heads=3"),
    (["scaling", "--trainer_set", "val_interval=5"], "--trainer_set val_interval: set by scaling itself"),
    (["scaling", "--trainer_set", "hidden_size=64"], "--trainer_set hidden_size: set by scaling itself, or would "
                                                     "change the work of a step"),
    # the bare loop would not stop there, or trains without dropout: refused for overhead too, not only scaling
    (["overhead", "--trainer_set", "max_steps=3"], "--trainer_set max_steps: set by overhead itself"),
    (["overhead", "--trainer_set", "dropout=0.1"], "--trainer_set dropout: set by overhead itself, or would change "
                                                   "the work of a step or its data"),
    (["scaling", "--trainer_set", "grad_clip=0"], "--trainer_set grad_clip: set by scaling itself"),
    (["overhead", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),  # numpy's error, later
    (["scaling", "--timeout", "0"], "argument --timeout: expected a finite number of seconds > 0, got '0'"),
    (["loader", "--timeout", "nan"], "argument --timeout: expected a finite number of seconds > 0, got 'nan'"),
    (["loader", "--steps", "2"], "argument --steps: expected an integer >= 3, got 2"),
    (["loader", "--files", "1", "--traj_per_file", "1"], "--files 1 x --traj_per_file 1 trajectories are fewer "
                                                         "than one --batch_size 4"),
    (["overhead", "--trainer_set", "patience"], "--trainer_set: expected KEY=VALUE, got 'patience'"),
    (["checkpoint", "--loop_save_every", "2"], "argument --loop_save_every: expected an integer >= 3, got 2"),
    (["checkpoint", "--sizes", "64"], "argument --sizes: expected comma-separated HIDDENxLAYERS (e.g. 128x4), got '64'"),
    (["checkpoint", "--dir", "/no/such/dir"], "argument --dir: '/no/such/dir' is not an existing directory"),
    (["loader", "--workers", "0,-1"], "argument --workers: expected an integer >= 0, got -1"),
    (["loader", "--batch_size", "0"], "argument --batch_size: expected an integer >= 1, got 0"),
])
def test_bad_arguments_are_refused_before_any_run(argv, message, capsys):
    import benchmark
    with pytest.raises(SystemExit) as stop:
        benchmark.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["overhead", "loader", "checkpoint"])
def test_cuda_without_a_gpu_is_a_flag_error(command, capsys):
    import benchmark
    with pytest.raises(SystemExit) as stop:
        benchmark.main([command, "--device", "cuda"])
    assert stop.value.code == 2 and "--device cuda, but torch sees no CUDA device" in capsys.readouterr().err


def test_a_relative_dir_is_taken_from_where_the_command_runs(tmp_path, monkeypatch):
    """The scaling and loader runs start processes in the repository: a relative --dir made them write there."""
    import benchmark
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    assert benchmark.build_parser().parse_args(["checkpoint", "--dir", "work"]).dir == str(tmp_path / "work")
