"""
Throughput, scaling and overhead figures for the kit, on whatever machine runs it.

    python benchmark.py overhead   [--steps 200 --repeats 5 --threads 2]   # DDPTrainer vs a bare PyTorch loop
    python benchmark.py scaling    [--nproc 2 --threads 1]                 # 1 vs N gloo processes, weak scaling
    python benchmark.py loader     [--workers 0,1,2]                       # VJ2 loader vs a step; peak memory
    python benchmark.py checkpoint [--sizes 128x2,512x8]                   # save/load time, size, blocking

Each prints a markdown table; with --json it prints one JSON object on stdout instead (progress goes to
stderr either way). What exactly is timed is written next to each figure, in the table and in the JSON.
Training runs on the CPU unless `--device cuda` is given (overhead, loader, checkpoint); scaling is gloo on the CPU.
"""

import argparse
import contextlib
import functools
import gc
import hashlib
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

import config
import ddp_runtime as rt
import training_logs
from ddp_training import (CausalLM, DDPTrainer, TrainConfig, amp_dtype_for, build_optimizer, build_scheduler,
                          peak_bf16_flops, pins_host_memory, spawn_local, synthetic_lm_data)

REPO = Path(__file__).resolve().parent
DEFAULTS = TrainConfig()  # the trainer's defaults, read here so they are written only once
# variables that would make a child process think it is part of someone else's distributed job
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")

# targets from the issue
TARGET_OVERHEAD_RATIO = 0.97
TARGET_SCALING_EFFICIENCY = 0.95
TARGET_LOADER_MARGIN = 5.0
# "a save blocks no longer than the write itself": the write being serialise + write + fsync of the file; the
# 10% allows for timing noise
TARGET_BLOCKED_OVER_WRITE = 1.1

# -----------------------------------------------------------------------------------------------------------------
# helpers


def say(*args):
    """Progress, on stderr, so that stdout holds only the table or the JSON object."""
    print("[benchmark]", *args, file=sys.stderr, flush=True)


def set_threads(n):
    # DDPTrainer shares the cores among ranks with torch.set_num_threads unless OMP_NUM_THREADS is set;
    # setting it pins the count we asked for, in this process and in every child.
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def cpu_stat():
    """(busy, steal) CPU seconds of the whole machine since boot from /proc/stat, or None off Linux. Busy is
    user + nice + system + irq + softirq; steal is time the hypervisor gave our virtual CPUs to someone else."""
    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / tick, f[7] / tick


def own_cpu_s():
    """CPU seconds of this process and of every child it has waited for (their children included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_START = {}


def environment(device="cpu"):
    _START.update(wall=time.perf_counter(), stat=cpu_stat(), own=own_cpu_s())
    env = {"cpu": cpu_model(), "cores": rt.cpu_count(), "torch": torch.__version__, "numpy": np.__version__,
           "python": sys.version.split()[0], "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
                      "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
                      "peak_bf16_tflops": (peak_bf16_flops(torch.device(device)) or 0) / 1e12 or None}
    return env


def check_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device")
    return torch.device(device)


def sync(device):
    """Wait for the queued device work, so that a host clock read after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def finish(out, args, table):
    env = out["env"]
    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    # the load average lags by a minute and counts this benchmark too; this is what everyone else used
    wall = time.perf_counter() - _START["wall"]
    stat = cpu_stat()
    env["wall_s"] = wall
    env["other_cpu_cores"] = env["steal_cpu_cores"] = None
    if stat and _START["stat"]:
        busy, steal = (a - b for a, b in zip(stat, _START["stat"]))
        env["other_cpu_cores"] = max(0.0, busy - (own_cpu_s() - _START["own"])) / wall
        env["steal_cpu_cores"] = steal / wall
    if args.json:
        print(json.dumps(training_logs.json_safe(out), allow_nan=False))
    else:
        print(table)
        other = "" if env["other_cpu_cores"] is None else \
            (f"; other processes used {env['other_cpu_cores']:.2f} cores on average meanwhile, the hypervisor "
             f"took {env['steal_cpu_cores']:.2f}")
        gpu = f"{env['gpu']['name']} (CUDA {env['gpu']['cuda']}), " if "gpu" in env else ""
        print(f"\n{gpu}{env['cpu']}, {env['cores']} cores, torch {env['torch']}, load average "
              f"{env['loadavg_start'][0]:.2f} at start{other}")


def markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def steady_rate(times, warmup):
    """Steps/s between the end of step `warmup` and the end of the last step; times[k] = end of step k+1."""
    steps = len(times) - warmup
    if warmup < 1 or steps < 1:
        raise ValueError(f"need >= 1 warm-up step and >= 1 timed step, got {warmup} of {len(times)} steps")
    return steps / (times[-1] - times[warmup - 1])


def step_spread_ms(times, warmup):
    """Standard deviation of the timed steps' durations in ms: how much one step varies, which a synchronous
    step pays as the wait for the slower rank."""
    durations = [b - a for a, b in zip(times[warmup - 1:], times[warmup:])]
    return statistics.pstdev(durations) * 1000 if len(durations) > 1 else 0.0


def metrics_times(log_dir):
    """End time of each training step (seconds since the loop started) from the trainer's metrics.jsonl."""
    recs = training_logs.read_metrics(Path(log_dir) / training_logs.METRICS_FILE)
    train = sorted((r for r in recs if r.get("type") == "train"), key=lambda r: r["step"])
    return [r["time"] for r in train], train


def child_env(threads):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


class RunTimeout(RuntimeError):
    """A child run went past --timeout; it and every process it had started were killed."""


def kill_family(pid):
    """SIGKILL a process and everything it started: its descendants (ranks, DataLoader workers, which outlive
    a killed parent) and its process group (those whose parent has exited already)."""
    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def run_bounded(cmd, timeout, what, **popen):
    """Run `cmd` in the repository, in a session of its own, for at most `timeout` seconds; past that, or when
    this process stops waiting for another reason (Ctrl-C), the command and all it started are killed.
    Returns (exit status, stdout, stderr) as Popen.communicate gives them."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        kill_family(proc.pid)
        proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RunTimeout(f"{what} did not finish within --timeout {timeout:g} s; it was killed with every "
                             f"process it had started") from None
        raise
    return proc.returncode, out, err


def run_child(cmd, threads, timeout, log_path, what, ok=None):
    """Run a command to completion with its output in log_path (killed past `timeout`, see run_bounded); raise
    with the tail of its output on failure, unless ok() says the run did its work anyway. Returns the exit
    status."""
    with open(log_path, "w") as log:
        try:
            rc, _, _ = run_bounded(cmd, timeout, what, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT)
        except RunTimeout as exc:
            tail = Path(log_path).read_text(errors="replace")[-3000:]
            raise RunTimeout(f"{exc}" + (f"; its output ended:\n{tail}" if tail.strip() else "")) from None
    if rc != 0 and not (ok and ok()):
        tail = Path(log_path).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what}: exit {rc}: {' '.join(map(str, cmd))}\n{tail}")
    return rc


def last_line(path, containing):
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if containing in line]
    return lines[-1].strip() if lines else None


def completed(log_dir, steps):
    """True when the trainer's metrics.jsonl ends with a completed summary after `steps` steps."""
    try:
        last = training_logs.read_metrics(Path(log_dir) / training_logs.METRICS_FILE)[-1]
    except (OSError, training_logs.LogError):
        return False
    return last.get("type") == "summary" and last.get("status") == "completed" and last.get("steps") == steps


@contextlib.contextmanager
def workdir(parent):
    path = Path(tempfile.mkdtemp(prefix="benchmark_", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def lm_config(args):
    return dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                num_heads=args.num_heads, seq_len=args.seq_len)


def add_model_flags(p, batch_size=DEFAULTS.batch_size):
    p.add_argument("--hidden_size", type=at_least(1), default=DEFAULTS.hidden_size)
    p.add_argument("--num_layers", type=at_least(1), default=DEFAULTS.num_layers)
    p.add_argument("--num_heads", type=at_least(1), default=DEFAULTS.num_heads)
    p.add_argument("--seq_len", type=at_least(1), default=DEFAULTS.seq_len)
    p.add_argument("--vocab_size", type=at_least(1), default=DEFAULTS.vocab_size)
    p.add_argument("--batch_size", type=at_least(1), default=batch_size, help="per process")

# -----------------------------------------------------------------------------------------------------------------
# overhead: DDPTrainer vs a bare loop, same model, batches, optimizer and threads


def bare_loop(model, raw_model, loader, total, cfg, device=torch.device("cpu"), timed_from=None, read_loss=False,
              at_window_start=None):
    """A plain training loop over `loader`: forward, mean cross-entropy, backward, the trainer's clipping,
    AdamW and LR schedule. `model` may be a DDP wrapper of `raw_model`. Returns end-of-step times and the
    last loss. On CUDA it takes the trainer's fast paths (its autocast dtype, fused AdamW, non-blocking copies
    from pinned batches) and waits for the device only at the ends of the timed window, after step
    `timed_from` and the last one: a bare loop at its fastest, with no host sync per step, unless `read_loss`
    (loss.item() after every step, as a loop that logs every step does). `at_window_start()`, if given, runs
    after step `timed_from`, before its end is stamped."""
    amp = amp_dtype_for(cfg, device)
    if amp == torch.float16:
        raise SystemExit("error: the bare loop has no GradScaler, so it runs bf16 or fp32 only: pass --precision "
                         "bf16 or fp32")
    opt = build_optimizer(raw_model, cfg.learning_rate, cfg.weight_decay, device)
    sched = build_scheduler(opt, cfg, total)
    model.train()
    times, loss = [], None
    for step, (x, y) in enumerate(loader):
        if step == total:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if read_loss:
            loss.item()
        if step + 1 in (timed_from, total):
            sync(device)
        if step + 1 == timed_from and at_window_start is not None:
            at_window_start()
        times.append(time.perf_counter())
    if len(times) != total:
        raise RuntimeError(f"the loader gave {len(times)} batches, {total} needed")
    return times, loss.item()


def build_lm(cfg):
    torch.manual_seed(cfg.seed)  # the trainer seeds the same way before it builds the model
    return CausalLM(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.seq_len, cfg.dropout)


def bare_run(cfg, data, warmup, read_loss=False):
    """The bare loop in this process over the same DataLoader batches the trainer sees, on the trainer's device
    (compiled if the trainer's config compiles)."""
    cfg = TrainConfig.from_dict(cfg)
    device = torch.device(cfg.device)
    raw = build_lm(cfg).to(device)
    model = torch.compile(raw) if cfg.compile else raw
    loader = rt.build_dataloader(data.train, cfg.batch_size, train=True, rank=0, world_size=1, seed=cfg.seed,
                                 pin_memory=pins_host_memory(cfg, device))
    return bare_loop(model, raw, loader, cfg.max_steps, cfg, device, timed_from=warmup, read_loss=read_loss)


def trainer_run(cfg, run_dir):
    """DDPTrainer, one process, every check at its default; end-of-step times from its metrics.jsonl."""
    cfg = dict(cfg, log_dir=str(run_dir / "logs"), checkpoint_dir=str(run_dir / "ckpt"))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # its console log; rank_0.log keeps it
        summary = DDPTrainer(rank=0, world_size=1, config=cfg).train()
    times, train = metrics_times(cfg["log_dir"])
    if summary["steps"] != cfg["max_steps"] or len(times) != cfg["max_steps"]:
        raise RuntimeError(f"trainer ran {summary['steps']} steps, expected {cfg['max_steps']}")
    return times, train[-1]["loss"]


def parse_settings(items):
    """KEY=VALUE strings -> dict; values are read as JSON where they parse (numbers, true, null), else strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def gc_collect_s(repeats=3):
    """What one gc.collect() costs in this process (the trainer's cleanup runs it every cleanup_interval steps)."""
    return timed(gc.collect, repeats)


PRECISIONS = {"auto": {}, "bf16": {"use_amp": True, "amp_dtype": "bf16"}, "fp32": {"use_amp": False}}


def cmd_overhead(args):
    set_threads(args.threads)
    device = check_device(args.device)
    total = args.warmup + args.steps
    # one epoch holds every timed step, so the per-epoch validation runs only after the last one
    dataset_size = max(DEFAULTS.dataset_size, (total + 1) * args.batch_size)
    cfg = dict(lm_config(args), batch_size=args.batch_size, dataset_size=dataset_size, max_steps=total,
               device=args.device, compile=args.compile, seed=args.seed, save_interval=0, save_every_iters=0,
               val_interval=0, resume="none", **PRECISIONS[args.precision])
    data = synthetic_lm_data(TrainConfig.from_dict(cfg))
    changed = parse_settings(args.trainer_set)  # check_args refused what the comparison cannot take
    base_cfg, cfg = cfg, dict(cfg, **changed)
    TrainConfig.from_dict(cfg)  # an unknown key fails here, before any run
    amp = amp_dtype_for(TrainConfig.from_dict(base_cfg), device)
    out = {"command": "overhead", "env": environment(args.device),
           "config": dict(dict(learning_rate=DEFAULTS.learning_rate, weight_decay=DEFAULTS.weight_decay,
                               grad_clip=DEFAULTS.grad_clip, memory_check_interval=DEFAULTS.memory_check_interval,
                               cleanup_interval=DEFAULTS.cleanup_interval, log_interval=DEFAULTS.log_interval),
                          **cfg, autocast=str(amp).replace("torch.", "") if amp else None, threads=args.threads,
                          warmup=args.warmup, steps=args.steps, repeats=args.repeats, trainer_changed=changed,
                          bare_read_loss=args.bare_read_loss),
           "timed": (f"steps {args.warmup + 1}..{total} of each run: from the end of step {args.warmup} to the end of "
                     f"step {total}, so data loading and everything the loop does per step is included; set-up, "
                     f"warm-up, the final validation and checkpoint are not. Trainer step ends come from the "
                     f"'time' field of its metrics.jsonl records"
                     + ("; on CUDA the trainer waits for the device once per step (its step result), the bare "
                        "loop only after the two steps that bound the window" if device.type == "cuda" else ""))}
    bare, trainer, bare_loss, trainer_loss, peaks = [], [], None, None, {"bare": [], "trainer": []}
    with workdir(args.dir) as tmp:
        for rep in range(args.repeats):
            reset_peak(device)
            t, bare_loss = bare_run(base_cfg, data, args.warmup, args.bare_read_loss)
            bare.append(steady_rate(t, args.warmup))
            peaks["bare"].append(peak_gib(device))
            gc.collect()
            reset_peak(device)
            t, trainer_loss = trainer_run(cfg, tmp / f"run{rep}")
            trainer.append(steady_rate(t, args.warmup))
            peaks["trainer"].append(peak_gib(device))
            gc.collect()
            say(f"overhead repeat {rep + 1}/{args.repeats}: bare {bare[-1]:.2f} steps/s, "
                f"trainer {trainer[-1]:.2f} steps/s")
    bare_med, trainer_med = statistics.median(bare), statistics.median(trainer)
    ratio = trainer_med / bare_med
    gc_s, cleanup = gc_collect_s(), cfg.get("cleanup_interval", DEFAULTS.cleanup_interval)
    tokens = args.batch_size * args.seq_len
    flops_per_step = build_lm(TrainConfig.from_dict(base_cfg)).flops_per_token() * tokens
    peak = peak_bf16_flops(device)
    loops = {}
    for name, rate in (("bare", bare_med), ("trainer", trainer_med)):
        loops[name] = {"steps_per_s": rate, "step_ms": 1000 / rate, "samples_per_s": rate * args.batch_size,
                       "tokens_per_s": rate * tokens, "mfu": rate * flops_per_step / peak if peak else None,
                       "peak_memory_gib": max(peaks[name]) if device.type == "cuda" else None}
    out.update(bare_steps_per_s=bare_med, trainer_steps_per_s=trainer_med, ratio=ratio, loops=loops,
               flops_per_step=flops_per_step, trainer_extra_ms_per_step=1000 / trainer_med - 1000 / bare_med,
               gc_collect_ms=1000 * gc_s, gc_ms_per_step=1000 * gc_s / cleanup if cleanup else 0.0,
               # a step's gc runs after its time is stamped: steps warmup..total-1 collect inside the window
               gc_in_window=(total - 1) // cleanup - (args.warmup - 1) // cleanup if cleanup else 0,
               bare_runs=bare, trainer_runs=trainer, pair_ratios=[t / b for b, t in zip(bare, trainer)],
               samples_per_step=args.batch_size, bare_final_loss=bare_loss, trainer_final_loss=trainer_loss,
               target_ratio=TARGET_OVERHEAD_RATIO, meets_target=ratio >= TARGET_OVERHEAD_RATIO)
    pr = out["pair_ratios"]
    rows = []
    for name, title, runs, loss in (("bare", "bare PyTorch", bare, bare_loss),
                                    ("trainer", "DDPTrainer", trainer, trainer_loss)):
        lp = loops[name]
        rows.append([title, f"{lp['steps_per_s']:.2f}", " ".join(f"{x:.2f}" for x in runs), f"{lp['step_ms']:.1f}",
                     f"{lp['samples_per_s']:.0f}", f"{lp['tokens_per_s']:.0f}",
                     "-" if lp["mfu"] is None else f"{lp['mfu']:.3f}",
                     "-" if lp["peak_memory_gib"] is None else f"{lp['peak_memory_gib']:.2f}",
                     "-" if loss is None or not math.isfinite(loss) else f"{loss:.4f}"])
    table = markdown(["loop", "steps/s (median)", "runs", "ms/step", "samples/s", "tokens/s", "MFU",
                      "peak GPU memory GiB", f"loss at step {total}"], rows)
    table += (f"\n\n{args.device}, autocast {out['config']['autocast']}, compile {args.compile}; "
              f"ratio trainer / bare = {ratio:.3f} (target >= {TARGET_OVERHEAD_RATIO}: "
              f"{'met' if out['meets_target'] else 'missed'}); per interleaved pair {min(pr):.3f}..{max(pr):.3f}\n"
              f"the trainer adds {out['trainer_extra_ms_per_step']:.2f} ms per step; "
              + (f"gc.collect() every cleanup_interval={cleanup} steps costs {out['gc_collect_ms']:.0f} ms here "
                 f"= {out['gc_ms_per_step']:.2f} ms per step amortised (the timed steps hold "
                 f"{out['gc_in_window']} of them)\n" if cleanup else
                 f"gc.collect() is off (cleanup_interval=0); one would cost {out['gc_collect_ms']:.0f} ms here\n")
              + (f"trainer config changed from the defaults: {changed}\n" if changed else "")
              + (f"MFU: {flops_per_step / tokens:.3g} FLOPs per token (CausalLM.flops_per_token) over the "
                 f"{peak / 1e12:.0f} TFLOP/s dense bf16 peak\n" if peak else "")
              + f"timed: {out['timed']}")
    finish(out, args, table)

# -----------------------------------------------------------------------------------------------------------------
# scaling: 1 vs N gloo processes, threads and batch per process fixed


def scaling_run(args, nproc, run_dir, dataset_size):
    total = args.warmup + args.steps
    flags = dict(lm_config(args), batch_size=args.batch_size, dataset_size=dataset_size, max_steps=total,
                 seed=args.seed, save_interval=0, save_every_iters=0, val_interval=0, resume="none",
                 log_dir=run_dir / "logs", checkpoint_dir=run_dir / "ckpt", **parse_settings(args.trainer_set))
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--nproc", nproc]
    for key, value in flags.items():
        cmd += [f"--{key}", "none" if value is None else str(value).lower() if isinstance(value, bool) else value]
    start = time.perf_counter()
    # A run that trained, validated and wrote its summary but then failed on the way out still timed its steps;
    # its exit status is kept in the figures (see BENCHMARKS.md: an abort at interpreter exit)
    rc = run_child(cmd, args.threads, args.timeout, run_dir / "output.log", f"DDPTrainer on {nproc} process(es)",
                   ok=lambda: completed(run_dir / "logs", total))
    wall = time.perf_counter() - start
    if rc:
        say(f"{nproc} process(es): exit status {rc} after a completed run: "
            f"{last_line(run_dir / 'output.log', 'terminate') or 'see its output'}")
    times, _ = metrics_times(run_dir / "logs")
    if len(times) != total:
        raise RuntimeError(f"{nproc} processes ran {len(times)} steps, expected {total}")
    steps_per_s = steady_rate(times, args.warmup)
    return {"wall_s": wall, "timed_s": args.steps / steps_per_s, "samples_per_s": steps_per_s * args.batch_size * nproc,
            "step_ms_sd": step_spread_ms(times, args.warmup), "exit_code": rc}


def file_barrier(folder, rank, world_size, timeout):
    """Return once every rank has called this: each leaves a file in `folder` and polls for the others'. For
    ranks that share no process group; it runs once, outside any timed window."""
    folder = Path(folder)
    (folder / f"ready_rank{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready_rank*"))) < world_size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: the other ranks did not reach the start of the timed window within "
                               f"--timeout {timeout:g} s")
        time.sleep(0.001)


def bare_ddp_worker(rank, world_size, spec, _requested=None):
    """One rank of the bare loop under DDP (gloo), sharded like the trainer; every rank writes its step times.
    With spec["independent"] the ranks share nothing: no process group, no DDP, each trains on its own shard
    (what N processes reach on this machine when communication costs nothing). Those ranks start their timed
    window together (a file barrier after the warm-up): one that ran alone for a while would be faster."""
    torch.set_num_threads(spec["threads"])
    cfg = TrainConfig.from_dict(spec["cfg"])
    grouped = world_size > 1 and not spec.get("independent")
    together = None
    if world_size > 1 and not grouped:
        together = functools.partial(file_barrier, spec["out"], rank, world_size, spec["barrier_s"])
    if grouped:
        rt.setup_distributed(rank, world_size, backend="gloo", device="cpu")
    try:
        data = synthetic_lm_data(cfg)
        raw = build_lm(cfg)
        model = raw if not grouped else torch.nn.parallel.DistributedDataParallel(
            raw, gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb)
        loader = rt.build_dataloader(data.train, cfg.batch_size, train=True, rank=rank, world_size=world_size,
                                     seed=cfg.seed)
        times, _ = bare_loop(model, raw, loader, cfg.max_steps, cfg, timed_from=spec["warmup"],
                             at_window_start=together)
        (Path(spec["out"]) / f"times_rank{rank}.json").write_text(json.dumps(times))
    except BaseException:
        rt.teardown_distributed()
        raise
    rt.teardown_distributed(synchronize=True)
    rt.exit_process(0)  # as the trainer's ranks do: gloo's C++ destructors can abort a finished process


def bare_spawn(spec):
    """Runs in a child interpreter (see bare_scaling_run): spec["nproc"] ranks of the bare loop, spawned with
    torch.multiprocessing on a free port (what --nproc does for the trainer); one process runs without a
    process group, like the trainer's. Writes the ranks' wall time to wall.json; returns the exit status."""
    import benchmark  # the ranks import this module by name
    start = time.perf_counter()
    rc = spawn_local(spec["nproc"], spec, worker=benchmark.bare_ddp_worker)
    (Path(spec["out"]) / "wall.json").write_text(json.dumps(time.perf_counter() - start))
    return rc


def bare_scaling_run(args, nproc, run_dir, cfg, independent=False):
    """The bare loop on `nproc` processes (bare_spawn), from a child interpreter that --timeout bounds as it
    bounds the trainer's runs: past it, the child and its ranks are killed and RunTimeout says so."""
    run_dir.mkdir(parents=True)
    spec = {"threads": args.threads, "cfg": cfg, "out": str(run_dir), "independent": independent, "nproc": nproc,
            "warmup": args.warmup, "barrier_s": args.timeout}
    what = f"the bare loop{'s without communication' if independent else ''} on {nproc} process(es)"
    cmd = [sys.executable, "-c", "import benchmark, json, sys; sys.exit(benchmark.bare_spawn(json.loads(sys.argv[1])))",
           json.dumps(spec)]
    run_child(cmd, args.threads, args.timeout, run_dir / "output.log", what)  # OMP_NUM_THREADS: the ranks keep it
    wall = json.loads((run_dir / "wall.json").read_text())
    # Synchronous training runs at the pace of its slowest rank: that is what the ranks that share nothing
    # can bound (under DDP the ranks keep pace with each other, so their rates agree)
    times = [json.loads((run_dir / f"times_rank{r}.json").read_text()) for r in range(nproc)]
    steps_per_s = min(steady_rate(t, args.warmup) for t in times)
    return {"wall_s": wall, "timed_s": args.steps / steps_per_s, "samples_per_s": steps_per_s * args.batch_size * nproc,
            "step_ms_sd": max(step_spread_ms(t, args.warmup) for t in times)}


def scaling_rows(runs, steps):
    rows = []
    base = statistics.median(r["samples_per_s"] for r in runs[1])
    for n, rs in runs.items():
        sps = statistics.median(r["samples_per_s"] for r in rs)
        rows.append({"processes": n, "steps": steps, "wall_s": statistics.median(r["wall_s"] for r in rs),
                     "timed_s": statistics.median(r["timed_s"] for r in rs), "samples_per_s": sps,
                     "speedup": sps / base, "efficiency": sps / (n * base),
                     "step_ms_sd": statistics.median(r["step_ms_sd"] for r in rs),
                     "samples_per_s_runs": [r["samples_per_s"] for r in rs],
                     "exit_codes": [r.get("exit_code", 0) for r in rs]})
    return rows


def scaling_cells(r):
    return [r["processes"], r["steps"], f"{r['wall_s']:.1f}", f"{r['timed_s']:.2f}", f"{r['samples_per_s']:.1f}",
            f"{r['speedup']:.2f}", f"{r['efficiency']:.3f}", f"{r['step_ms_sd']:.1f}"]


def cmd_scaling(args):
    total = args.warmup + args.steps
    dataset_size = max(DEFAULTS.dataset_size, (total + 1) * args.batch_size * args.nproc)
    out = {"command": "scaling", "env": environment(),
           "config": dict(lm_config(args), batch_size_per_process=args.batch_size, threads_per_process=args.threads,
                          nproc=args.nproc, warmup=args.warmup, steps=args.steps, repeats=args.repeats,
                          trainer_set=parse_settings(args.trainer_set),
                          dataset_size=dataset_size, backend="gloo",
                          launcher="python ddp_training.py --cpu --nproc N (torch.multiprocessing spawn, free port)",
                          timeout_s=args.timeout),
           "timed": (f"steps {args.warmup + 1}..{total}: from the end of step {args.warmup} to the end of step {total} "
                     f"on rank 0 (the trainer's metrics.jsonl 'time' field), on every rank by its own clock for the "
                     f"bare loops, of which the slowest counts (the DDP ranks keep pace anyway; the ranks without "
                     f"communication start their windows together, at a file barrier after step {args.warmup}); "
                     f"wall time: "
                     f"the trainer's whole command (start-up, data, training, final validation and checkpoint), the "
                     f"bare loop's spawned processes (start-up, data, training)")}
    bare_cfg = dict(lm_config(args), batch_size=args.batch_size, dataset_size=dataset_size, max_steps=total,
                    seed=args.seed, device="cpu")
    runs = {1: [], args.nproc: []}
    bare = {1: [], args.nproc: []}
    independent = []
    with workdir(args.dir) as tmp:
        for rep in range(args.repeats):
            for n in (1, args.nproc):  # interleaved: 1, N, 1, N, ...
                r = scaling_run(args, n, tmp / f"n{n}_rep{rep}", dataset_size)
                runs[n].append(r)
                say(f"scaling repeat {rep + 1}/{args.repeats}: DDPTrainer, {n} process(es) "
                    f"{r['samples_per_s']:.1f} samples/s (wall {r['wall_s']:.1f}s)")
                if args.bare:
                    r = bare_scaling_run(args, n, tmp / f"bare_n{n}_rep{rep}", bare_cfg)
                    bare[n].append(r)
                    say(f"scaling repeat {rep + 1}/{args.repeats}: bare DDP loop, {n} process(es) "
                        f"{r['samples_per_s']:.1f} samples/s")
                if args.bare and n > 1:
                    r = bare_scaling_run(args, n, tmp / f"indep_n{n}_rep{rep}", bare_cfg, independent=True)
                    independent.append(r)
                    say(f"scaling repeat {rep + 1}/{args.repeats}: {n} bare loops, no communication "
                        f"{r['samples_per_s']:.1f} samples/s")
    rows = scaling_rows(runs, args.steps)
    eff = rows[-1]["efficiency"]
    out.update(rows=rows, efficiency=eff, target_efficiency=TARGET_SCALING_EFFICIENCY,
               meets_target=eff >= TARGET_SCALING_EFFICIENCY)
    if args.bare:
        out["bare_rows"] = scaling_rows(bare, args.steps)
        out["bare_efficiency"] = out["bare_rows"][-1]["efficiency"]
        out["independent_row"] = scaling_rows({1: bare[1], args.nproc: independent}, args.steps)[-1]
        out["independent_efficiency"] = out["independent_row"]["efficiency"]
    table_rows = [["DDPTrainer", *scaling_cells(r)] for r in rows]
    table_rows += [["bare DDP loop", *scaling_cells(r)] for r in out.get("bare_rows", [])]
    if args.bare:
        table_rows.append(["bare loops, no communication", *scaling_cells(out["independent_row"])])
    table = markdown(["loop", "processes", "steps", "wall time (s)", "timed (s)", "samples/s", "speedup",
                      "efficiency", "step sd (ms)"], table_rows)
    table += (f"\n\nefficiency = samples/s({args.nproc}) / ({args.nproc} x samples/s(1)) = {eff:.3f} "
              f"(target >= {TARGET_SCALING_EFFICIENCY}: {'met' if out['meets_target'] else 'missed'}); "
              f"median of {args.repeats} interleaved repeats"
              + (f"; a bare DDP loop (same model, batches, clipping, AdamW; no trainer) reaches "
                 f"{out['bare_efficiency']:.3f}, and {args.nproc} bare loops that do not communicate at all (the "
                 f"ceiling on this machine, against the 1-process bare loop) {out['independent_efficiency']:.3f}"
                 if args.bare else "") + "\nstep sd: the standard deviation of one step's duration (the bare loops: "
             "their noisiest rank), what a synchronous step pays in waiting for the slower rank"
             + f"\ntimed: {out['timed']}")
    finish(out, args, table)

# -----------------------------------------------------------------------------------------------------------------
# loader: VJ2 samples/s through build_dataloader, and peak memory per process


def evict(paths):
    """Drop our files' pages from the page cache (posix_fadvise), so the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


class MemorySampler:
    """Samples rss, anonymous memory (rss - shared: not file-backed, not shared memory) and uss of this
    process and its children (DataLoader workers) every `interval` seconds; keeps per-process peaks."""

    def __init__(self, interval=0.02):
        self.interval = interval
        self.me = psutil.Process()
        self.cmdline = self.me.cmdline()
        self.peaks = {}  # pid -> {rss, anon, uss}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        # DataLoader workers are forks of this process (same command line); skip helpers such as
        # multiprocessing's resource tracker
        for p in [self.me] + [c for c in self.me.children(recursive=True) if self._is_fork(c)]:
            try:
                full = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            now = {"rss": full.rss, "anon": full.rss - full.shared, "uss": full.uss}
            old = self.peaks.setdefault(p.pid, now)
            for k, v in now.items():
                old[k] = max(old[k], v)

    def _is_fork(self, proc):
        try:
            return proc.cmdline() == self.cmdline
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def epoch_rate(loader):
    """Samples/s of one epoch, timed from the arrival of its first batch (which pays for worker start-up and
    the prefetch queue filling) to the end, over the samples of the later batches."""
    start, n, first = None, 0, 0
    for emb, act in loader:
        if start is None:
            start, first = time.perf_counter(), emb.shape[0]
        n += emb.shape[0]
    if n == first:
        raise ValueError("an epoch of one batch cannot be timed: use more trajectories or a smaller batch")
    return (n - first) / (time.perf_counter() - start), n


def memory_epochs(loader, epochs):
    """Peak rss / anon / uss (MiB) of this process and of each DataLoader worker over `epochs` epochs."""
    gc.collect()
    before = psutil.Process().memory_full_info()
    with MemorySampler() as mem:
        for _ in range(epochs):
            for batch in loader:
                del batch
    me = os.getpid()
    mb = lambda d: {k: round(v / 2**20, 1) for k, v in d.items()}  # noqa: E731
    return {"main_before_mb": mb({"rss": before.rss, "anon": before.rss - before.shared, "uss": before.uss}),
            "main_peak_mb": mb(mem.peaks[me]),
            "worker_peak_mb": [mb(v) for pid, v in sorted(mem.peaks.items()) if pid != me]}


def loader_figures(spec):
    """Runs in a fresh process (see probe), for one worker count: memory over the 1x dataset, then over the 3x
    dataset, then samples/s over the 3x dataset with a new loader, cold (evicted) and warm page cache. Each
    phase has a loader of its own, deleted (workers stopped, maps closed) before the next one starts."""
    from vj2_dataloader import VJ2TrajectoryDataset
    torch.set_num_threads(1)
    kwargs = {} if spec["max_open_files"] is None else {"max_open_files": spec["max_open_files"]}

    def open_loader(size):
        ds = VJ2TrajectoryDataset(spec["data_dirs"][size], **kwargs)
        loader = rt.build_dataloader(ds, spec["batch_size"], train=True, rank=0, world_size=1, seed=0,
                                     num_workers=spec["workers"], pin_memory=spec["pin_memory"])
        info = {"workers": loader.num_workers, "pin_memory": loader.pin_memory, "trajectories": len(ds),
                "max_open_files": ds.max_open_files,
                "bytes": sum(Path(p).stat().st_size for p in ds.files)}
        return ds, loader, info

    out = {"memory": []}
    for size in ("1x", "3x"):
        ds, loader, info = open_loader(size)
        out["memory"].append(dict(info, size=size, **memory_epochs(loader, spec["rss_epochs"])))
        del ds, loader
        gc.collect()
    ds, loader, info = open_loader("3x")
    rate = dict(info, evicted=evict(ds.files))
    rate["cold_samples_per_s"], rate["samples_per_epoch"] = epoch_rate(loader)
    rate["warm_samples_per_s"] = statistics.median([epoch_rate(loader)[0] for _ in range(spec["warm_epochs"])])
    out["rate"] = rate
    del ds, loader
    return out


def probe(spec, timeout):
    """loader_figures(spec) in a fresh interpreter, so that every probe starts from the same memory baseline
    and its DataLoader workers are started the way a training script's would be."""
    cmd = [sys.executable, "-c", "import benchmark, json, sys; print(json.dumps(benchmark.loader_figures("
                                 "json.loads(sys.argv[1]))))", json.dumps(spec)]
    rc, out, err = run_bounded(cmd, timeout, f"the loader probe with {spec['workers']} worker(s)", env=child_env(1),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if rc != 0:
        raise RuntimeError(f"loader probe {spec} failed (exit {rc}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def worker_plan(requested):
    """{workers used: [requested counts]} in the order first requested: build_dataloader caps a count at the
    CPUs one process may use (ddp_runtime.capped_workers), so counts above that run as the cap, once."""
    plan = {}
    for w in requested:
        plan.setdefault(rt.capped_workers(w, 1, 1), []).append(w)
    return plan


def consumer_rate(args, data_dir):
    """Samples/s of one training step (forward, backward, AdamW) of the model the loader feeds: the AC
    predictor at --preset, on --device with the trainer's default autocast there (bf16 on CUDA) and the batch
    already on the device."""
    import vj2ac_train_multi_gpu as vj2ac
    from vj2_dataloader import VJ2TrajectoryDataset
    device = torch.device(args.device)
    ds = VJ2TrajectoryDataset(data_dir)
    batch = torch.utils.data.default_collate([ds[i % len(ds)] for i in range(args.batch_size)])
    batch = rt.map_tensors(lambda t: t.to(device), batch)
    preset = dict(config.PREDICTOR_PRESETS[args.preset])
    torch.manual_seed(0)
    model = vj2ac.predictor_for(ds.geometry, argparse.Namespace(**preset)).to(device)
    loss_fn = lambda m, b: vj2ac.vj2_loss(m, b, config.ROLLOUT_HORIZON)  # noqa: E731
    amp = amp_dtype_for(DEFAULTS, device)
    name = (f"AC predictor, preset {args.preset} {preset}, rollout_horizon {config.ROLLOUT_HORIZON}, data "
            f"{ds.geometry}, {device.type}, autocast {str(amp).replace('torch.', '') if amp else None}")
    opt = build_optimizer(model, 1e-3, 0.04, device)
    times = []
    for _ in range(args.train_warmup + args.train_steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = loss_fn(model, batch)
        (out[0] / out[1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[args.train_warmup:])
    return {"model": name, "batch_size": args.batch_size, "threads": torch.get_num_threads(), "step_s": step_s,
            "samples_per_s": args.batch_size / step_s, "step_s_runs": times[args.train_warmup:], "device": device.type,
            "peak_memory_gib": peak_gib(device)}


def validation_rate(data_dir, repeats=3):
    """How fast VJ2TrajectoryDataset validates its files at start-up (headers, shapes, a NaN/inf scan of every
    value), from the page cache (the files were just written): median of `repeats`."""
    from vj2_dataloader import VJ2TrajectoryDataset
    size = sum(f.stat().st_size for f in Path(data_dir).glob("*.npz"))
    seconds = timed(lambda: VJ2TrajectoryDataset(data_dir), repeats)
    return {"bytes": size, "seconds": seconds, "gib_per_s": size / 2**30 / seconds, "repeats": repeats}


def link_subset(files, dest):
    dest.mkdir()
    for f in files:
        try:
            os.link(f, dest / f.name)
        except OSError:
            os.symlink(f, dest / f.name)


def cmd_loader(args):
    set_threads(args.threads)
    check_device(args.device)
    geometry = dict(steps=args.steps, patches=args.patches, embed_dim=args.embed_dim,
                    actions_per_step=args.actions_per_step, channels=args.channels)
    plan = worker_plan(args.workers)
    capped = {str(w): used for used, asked in plan.items() for w in asked if w != used}
    pin = pins_host_memory(DEFAULTS, torch.device(args.device))
    out = {"command": "loader", "env": environment(args.device),
           "config": dict(geometry, dtype="float16", batch_size=args.batch_size, workers=args.workers,
                          workers_used=list(plan), workers_capped=capped, pin_memory=pin, device=args.device,
                          preset=args.preset,
                          files_1x=args.files, files_3x=3 * args.files, trajectories_per_file=args.traj_per_file,
                          max_open_files=args.max_open_files, rss_epochs=args.rss_epochs, threads=args.threads,
                          train_warmup=args.train_warmup, train_steps=args.train_steps),
           "timed": ("loader: epochs of the training loader (rt.build_dataloader, shuffled, drop_last) in a fresh "
                     "process per worker count, each timed from its first batch to its end (worker start-up and the "
                     "first batch excluded); 'cold' right after evicting the files from the page cache "
                     "(posix_fadvise DONTNEED), 'warm' the median of the later epochs. Memory: sampled every 20 ms "
                     "over rss_epochs epochs of the 1x dataset, then of the 3x dataset, in that process before the "
                     "rate epochs, a loader per phase. step: forward + backward + AdamW step of one batch, median "
                     f"of train_steps after {args.train_warmup} warm-up step(s), in this process")}
    import create_synthetic_data
    with workdir(args.dir) as tmp:
        start = time.perf_counter()
        files = create_synthetic_data.generate(tmp / "all", num_files=3 * args.files,
                                               trajectories_per_file=args.traj_per_file, dtype="float16", **geometry)
        say(f"generated {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.0f} MiB "
            f"in {time.perf_counter() - start:.1f}s")
        link_subset(files[:args.files], tmp / "1x")
        sets = {"1x": tmp / "1x", "3x": tmp / "all"}
        validation = validation_rate(sets["3x"])
        say(f"start-up validation: {validation['gib_per_s']:.2f} GiB/s")
        consumer = consumer_rate(args, sets["3x"])
        say(f"training step: {consumer['samples_per_s']:.2f} samples/s ({consumer['model']})")
        base = dict(batch_size=args.batch_size, max_open_files=args.max_open_files, warm_epochs=args.warm_epochs,
                    rss_epochs=args.rss_epochs, pin_memory=pin)
        rates, memory = [], []
        for w, asked in plan.items():
            res = probe(dict(base, data_dirs={k: str(v) for k, v in sets.items()}, workers=w), args.timeout)
            memory += res["memory"]
            r = dict(res["rate"], requested_workers=asked)
            r["cold_vs_step"] = r["cold_samples_per_s"] / consumer["samples_per_s"]
            r["warm_vs_step"] = r["warm_samples_per_s"] / consumer["samples_per_s"]
            rates.append(r)
            say(f"loader, {w} workers: cold {r['cold_samples_per_s']:.1f}, warm {r['warm_samples_per_s']:.1f} "
                f"samples/s")
    out.update(consumer=consumer, loader=rates, memory=memory, validation=validation)
    # verdicts: throughput with one worker (cold cache, the pessimistic case); memory: the largest per-process
    # peak must not grow from the 1x to the 3x dataset (16 MiB + 10% slack), for non-file-backed memory
    # (memory_flat) and for the whole resident set (rss_flat)
    one = next((r for r in rates if r["workers"] == 1), None)
    out["target_margin"] = TARGET_LOADER_MARGIN
    out["meets_rate_target"] = None if one is None else one["cold_vs_step"] >= TARGET_LOADER_MARGIN
    growth = []
    for w, asked in plan.items():
        runs = [m for m in memory if m["workers"] == w]
        row = {"workers": w, "requested_workers": asked}
        for kind in ("anon", "rss"):
            for m in runs:
                row[f"{kind}_peak_mb_{m['size']}"] = max([m["main_peak_mb"][kind]]
                                                         + [p[kind] for p in m["worker_peak_mb"]])
        growth.append(row)
    out["memory_growth"] = growth

    def flat(kind):
        return all(g[f"{kind}_peak_mb_3x"] <= 1.1 * g[f"{kind}_peak_mb_1x"] + 16 for g in growth)
    out["memory_flat"], out["rss_flat"] = flat("anon"), flat("rss")

    t1 = markdown(["workers", "requested", "cold samples/s", "warm samples/s", "cold / step", "warm / step"],
                  [[r["workers"], ",".join(map(str, r["requested_workers"])), f"{r['cold_samples_per_s']:.1f}",
                    f"{r['warm_samples_per_s']:.1f}", f"{r['cold_vs_step']:.1f}x", f"{r['warm_vs_step']:.1f}x"]
                   for r in rates])
    if capped:
        t1 += (f"\n\n--workers {', '.join(f'{w} ran as {used}' for w, used in capped.items())}: build_dataloader "
               f"caps workers at the CPUs one process may use ({rt.cpus_per_rank(1, 1)} here)")
    rows = []
    for m in memory:
        procs = [("main", m["main_peak_mb"])] + [(f"worker {i}", p) for i, p in enumerate(m["worker_peak_mb"])]
        for name, p in procs:
            rows.append([m["size"], f"{m['bytes'] / 2**20:.0f}", m["workers"], name, p["rss"], p["anon"], p["uss"]])
    t2 = markdown(["dataset", "MiB", "workers", "process", "peak RSS MiB", "peak anon MiB", "peak USS MiB"], rows)
    traj_mib = 2 * args.steps * args.patches * args.embed_dim / 2**20
    table = (f"training step: {consumer['samples_per_s']:.2f} samples/s ({consumer['step_s']:.3f} s/step, "
             f"{consumer['threads']} threads): {consumer['model']}\n\n"
             f"start-up validation of the 3x dataset (every rank does it): {validation['bytes'] / 2**20:.0f} MiB in "
             f"{validation['seconds']:.3f} s, {validation['gib_per_s']:.2f} GiB/s from the page cache\n\n{t1}\n\n"
             f"target: one worker >= {TARGET_LOADER_MARGIN:g}x the step's rate (cold cache): "
             f"{'met' if out['meets_rate_target'] else 'missed' if one else 'not measured (no 1-worker run)'}\n\n"
             f"{t2}\n\nbatches in page-locked memory (pin_memory, the trainer's rule on {args.device}): {pin}. "
             f"anon = rss - shared (psutil): memory that is neither file-backed nor shared. The dataset "
             f"reads trajectories ({traj_mib:.1f} MiB each) by offset from at most max_open_files = "
             f"{rates[0]['max_open_files'] if rates else '?'} open files per process, mapping none. From 1x to 3x, "
             f"anon does not grow: {'yes' if out['memory_flat'] else 'NO'}; rss does not grow: "
             f"{'yes' if out['rss_flat'] else 'NO'}\n"
             f"timed: {out['timed']}")
    finish(out, args, table)

# -----------------------------------------------------------------------------------------------------------------
# checkpoint: save/load time and size, and how long a save holds up the training loop


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def payloads(hidden, layers, heads, seq_len, vocab, run_dir, device):
    """The trainer's own two checkpoint payloads (DDPTrainer.checkpoint_payload and state_payload) after one
    training step, so the AdamW state is fully populated; their tensors live on `device`."""
    cfg = dict(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, seq_len=seq_len,
               max_steps=1, device=device, save_interval=0, resume="none", log_dir=str(run_dir / "logs"),
               checkpoint_dir=str(run_dir / "ckpt"))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        trainer = DDPTrainer(rank=0, world_size=1, config=cfg)
        trainer.train()
    return trainer.raw_model, trainer.checkpoint_payload(), trainer.state_payload()


def write_file(obj, path, durable=True):
    """The write itself: serialise into a file (and fsync it), no rename, no hash."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def copy_then_write(obj, path, repeats, pin):
    """What the background writer does with a payload: a host copy (host_snapshot, page-locked where the
    trainer pins), then the write of that copy. Median seconds of each part."""
    copies, writes = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        host = rt.host_snapshot(obj, pin=pin)
        copied = time.perf_counter()
        write_file(host, path)
        writes.append(time.perf_counter() - copied)
        copies.append(copied - start)
        del host
    return statistics.median(copies), statistics.median(writes)


def hash_in_memory_s(obj, repeats):
    """SHA-256 of `obj` serialized, the bytes already in memory: what atomic_save adds by hashing as it writes."""
    serialized = io.BytesIO()
    torch.save(obj, serialized)
    return timed(lambda: hashlib.sha256(serialized.getbuffer()), repeats)


def save_load(obj, path, repeats, device):
    plain = path.with_suffix(".plain")
    res = {"snapshot_s": timed(lambda: rt.host_snapshot(obj), repeats)}
    if device.type == "cuda":  # the trainer's default there: page-locked copies (pin_memory)
        empty = getattr(torch.accelerator, "empty_host_cache", None)  # torch >= 2.13; before, the first in the process
        if empty:
            empty()
        res["snapshot_pinned_first_s"] = timed(lambda: rt.host_snapshot(obj, pin=True), 1)
        res["snapshot_pinned_s"] = timed(lambda: rt.host_snapshot(obj, pin=True), repeats)
    # the write figures are of a host copy, as the background writer writes one (on CUDA, torch.save of the
    # live payload would time its device-to-host copies too); write_live_s is of the payload itself, as
    # atomic_save writes it in a synchronous save
    host = rt.host_snapshot(obj)
    res["copy_s"], res["write_s"] = copy_then_write(obj, plain, repeats, pins_host_memory(DEFAULTS, device))
    res.update({
           "serialize_s": timed(lambda: torch.save(host, io.BytesIO()), repeats),
           "write_nofsync_s": timed(lambda: write_file(host, plain, durable=False), repeats),
           "write_live_s": timed(lambda: write_file(obj, plain), repeats),
           "hash_s": hash_in_memory_s(host, repeats),
           "save_s": timed(lambda: rt.atomic_save(obj, path), repeats),
           "sha256_s": timed(lambda: rt.sha256_file(path), repeats),
           "load_s": timed(lambda: rt.load_checkpoint(path), repeats),
           "load_noverify_s": timed(lambda: rt.load_checkpoint(path, verify=False), repeats),
           "bytes": path.stat().st_size})
    # atomic_save = the write of the live payload, hashed as it goes (hash_s: the same bytes hashed in memory),
    # then the rename, the sidecar (write, fsync, rename) and two directory fsyncs: the rest
    res["rest_s"] = max(0.0, res["save_s"] - res["write_live_s"] - res["hash_s"])
    return res


def snapshot_both(weights, state, pin):
    """What a save point costs the loop with async_checkpoint: one host copy of both payloads (shared weights)."""
    memo = {}
    rt.host_snapshot(weights, memo, pin)
    rt.host_snapshot(state, memo, pin)


def in_loop_blocking(args, hidden, layers, heads, run_dir, background, pin=True):
    """A real DDPTrainer run saving weights + resumable state every `every` steps. The loop calls
    save_checkpoint and save_state and waits for them to return (with async_checkpoint: the host copy, and any
    write of the previous save point still running), so their durations (timed by wrapping the two methods of
    this trainer object) are what it is held up; the step period that contains a save, minus the median of the
    others, also catches any after-effect on the next steps (a background write competing for the cores)."""
    every = args.loop_save_every
    total = every * args.loop_saves + 1  # the last save is followed by one more step
    cfg = dict(vocab_size=args.vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
               seq_len=args.seq_len, batch_size=args.loop_batch, dataset_size=max(1024, (total + 1) * args.loop_batch),
               max_steps=total, device=args.device, save_interval=0, save_every_iters=every, val_interval=0,
               resume="none", log_dir=str(run_dir / "logs"), checkpoint_dir=str(run_dir / "ckpt"),
               async_checkpoint=background, pin_memory=pin)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        trainer = DDPTrainer(rank=0, world_size=1, config=cfg)
        calls = []  # (method, tag, seconds)
        for name in ("save_checkpoint", "save_state"):
            def timed_call(*a, _orig=getattr(trainer, name), _name=name, **k):
                start = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    calls.append((_name, a[0] if a else None, time.perf_counter() - start))
            setattr(trainer, name, timed_call)
        written = {}  # save point (global step) -> when the last of its files was written (time.monotonic)
        trainer.writer.save = functools.partial(note_written, trainer.writer.save, written)
        trainer.train()
    # a loop save is save_checkpoint("step_N") and the save_state call right after it
    events = [c[2] + n[2] for c, n in zip(calls, calls[1:])
              if c[0] == "save_checkpoint" and str(c[1]).startswith("step_") and n[0] == "save_state"]
    times, _ = metrics_times(cfg["log_dir"])
    periods = {k + 1: times[k] - times[k - 1] for k in range(2, len(times))}  # period ending at step k+1
    with_save = [p for step, p in periods.items() if (step - 1) % every == 0]
    plain = [p for step, p in periods.items() if (step - 1) % every != 0]
    saves = range(every, total, every)
    done = {s: written[s] - trainer.t0 for s in saves}  # on the clock of metrics.jsonl's 'time'
    return {"steps": total, "save_every_iters": every, "batch_size": args.loop_batch, "saves": len(events),
            "blocked_s": statistics.median(events), "blocked_runs": events,
            "step_s": statistics.median(plain), "step_with_save_s": statistics.median(with_save),
            "period_blocked_s": statistics.median(with_save) - statistics.median(plain),
            **write_window_cost(times, periods, done)}


def note_written(save, written, payload, path, group=None, then=None, again=False):
    """CheckpointWriter.save, noting in `written[group]` when each file of the save point has been written
    (its `then` runs right after the write, in the writer's thread or, synchronous, in the loop's)."""
    def after_write():
        if then is not None:
            then()
        written[group] = time.monotonic()
    return save(payload, path, group=group, then=after_write, again=again)


def write_window_cost(times, periods, done):
    """What each save costs the loop until its files are on disk: a background write that outlasts a step
    slows the next ones too. A save at step s has a window of steps s+1..e, e the first step to end after
    its last file was written; its cost is the time of those steps minus as many baseline steps, the median
    of the periods (from step 3) in no window. `done`: save step -> when its writes ended; `times[k]`: the
    end of step k+1. A window that the run's end cuts short is left out (None in window_steps)."""
    windows = {}
    for s, end in done.items():
        windows[s] = next((k for k in range(s + 1, len(times) + 1) if times[k - 1] >= end), None)
    busy = {k for s, e in windows.items() for k in range(s + 1, (e or len(times)) + 1)}
    clean = [p for step, p in periods.items() if step not in busy]
    base = statistics.median(clean) if clean else None
    costs = [times[e - 1] - times[s - 1] - (e - s) * base for s, e in windows.items() if e and base is not None]
    return {"write_done_s": statistics.median(end - times[s - 1] for s, end in done.items()),
            "window_steps": [e - s if e else None for s, e in windows.items()],
            "window_base_step_s": base, "window_cost_runs": costs,
            "window_cost_s": statistics.median(costs) if costs else None}


def cmd_checkpoint(args):
    set_threads(args.threads)
    device = check_device(args.device)
    cuda = device.type == "cuda"
    out = {"command": "checkpoint", "env": environment(args.device),
           "config": dict(sizes=",".join(name for name, _, _ in args.sizes), seq_len=args.seq_len,
                          vocab_size=args.vocab_size, repeats=args.repeats, threads=args.threads, device=args.device,
                          dir=str(args.dir or tempfile.gettempdir())),
           "timed": ("median of repeats. copy: ddp_runtime.host_snapshot of the payload (page-locked where the "
                     "trainer pins), what the background writer writes; serialize: torch.save of that copy into "
                     "memory; write: torch.save of that copy into a file and fsync it (write w/o fsync also given); "
                     "write_live: the same of the payload itself (on CUDA it copies each tensor to the host as it "
                     "goes); save: "
                     "ddp_runtime.atomic_save (temp file, fsync, rename, SHA-256 sidecar, directory fsync), what "
                     "rank 0 runs for DDPTrainer.save_checkpoint/save_state; hash: SHA-256 of the serialized bytes "
                     "in memory, what atomic_save adds as it writes; rest: save - write_live - hash (rename, sidecar, "
                     "directory fsyncs); sha256: a separate re-read and hash of the file, what a load verifies; "
                     "snapshot: ddp_runtime.host_snapshot, the "
                     "host copy the loop waits for with async_checkpoint (the default; the write then runs on a "
                     "thread). blocked_s: both snapshots of a save point (async); blocked_sync_s: both atomic saves "
                     "(async_checkpoint=false, every rank waits for them); write_s: both writes + fsync of the "
                     "copies, copy_s: both copies. load: "
                     "ddp_runtime.load_checkpoint (SHA-256 check + torch.load weights_only=True). in_loop: a real "
                     "DDPTrainer run with save_every_iters, async and sync: the save_checkpoint + save_state calls "
                     "of a save (median), and the step period with a save minus the median period; window_cost: "
                     "the steps from a save until the first to end after its files are written, minus as many "
                     "steps of the periods in no such window (window_base_step)"
                     + (". On CUDA the payloads' tensors are on the GPU; snapshot_pinned: the host copy into "
                        "page-locked memory (the trainer's default there, pin_memory), first call (after emptying "
                        "PyTorch's page-locked cache where torch has torch.accelerator.empty_host_cache; else it may "
                        "reuse blocks of earlier copies) and median of the later ones; blocked_s and in_loop async "
                        "are pinned, blocked_pageable_s and in_loop "
                        "async_pageable are not" if cuda else ""))}
    models = []
    with workdir(args.dir) as tmp:
        for size, hidden, layers in args.sizes:
            heads = DEFAULTS.num_heads if hidden % DEFAULTS.num_heads == 0 else 1
            model, weights, state = payloads(hidden, layers, heads, args.seq_len, args.vocab_size,
                                             tmp / f"payload_{size}", args.device)
            entry = {"name": size, "hidden_size": hidden, "num_layers": layers, "num_heads": heads,
                     "params": sum(p.numel() for p in model.parameters())}
            entry["weights"] = save_load(weights, tmp / f"{size}_weights.pt", args.repeats, device)
            entry["state"] = save_load(state, tmp / f"{size}_state.pt", args.repeats, device)
            entry["write_s"] = entry["weights"]["write_s"] + entry["state"]["write_s"]
            entry["copy_s"] = entry["weights"]["copy_s"] + entry["state"]["copy_s"]
            entry["blocked_s"] = timed(functools.partial(snapshot_both, weights, state, pins_host_memory(DEFAULTS, device)),
                                       args.repeats)
            if cuda:
                entry["blocked_pageable_s"] = timed(functools.partial(snapshot_both, weights, state, False),
                                                    args.repeats)
            entry["blocked_sync_s"] = entry["weights"]["save_s"] + entry["state"]["save_s"]
            entry["blocked_over_write"] = entry["blocked_s"] / entry["write_s"]
            entry["sync_blocked_over_write"] = entry["blocked_sync_s"] / entry["write_s"]
            if args.loop_saves:
                modes = ("async", "sync") + (("async_pageable",) if cuda else ())
                entry["in_loop"] = {mode: in_loop_blocking(args, hidden, layers, heads, tmp / f"loop_{size}_{mode}",
                                                           background=mode != "sync", pin=mode != "async_pageable")
                                    for mode in modes}
                entry["in_loop"]["async"]["blocked_over_write"] = entry["in_loop"]["async"]["blocked_s"] / entry["write_s"]
            models.append(entry)
            say(f"checkpoint {size}: weights {entry['weights']['bytes'] / 2**20:.1f} MiB, "
                f"state {entry['state']['bytes'] / 2**20:.1f} MiB, blocks {entry['blocked_s'] * 1000:.1f} ms")
            del model, weights, state
    out["models"] = models
    out["target_blocked_over_write"] = TARGET_BLOCKED_OVER_WRITE
    out["meets_target"] = all(m["blocked_over_write"] <= TARGET_BLOCKED_OVER_WRITE and
                              m.get("in_loop", {}).get("async", {}).get("blocked_over_write", 0)
                              <= TARGET_BLOCKED_OVER_WRITE for m in models)
    rows = []
    for m in models:
        for kind in ("weights", "state"):
            r = m[kind]
            pinned = ([f"{r['snapshot_pinned_first_s'] * 1e3:.1f}", f"{r['snapshot_pinned_s'] * 1e3:.1f}"]
                      if cuda else [])
            ms = [f"{r[k] * 1e3:.1f}" for k in ("copy_s", "serialize_s", "write_nofsync_s", "write_s", "save_s",
                                                 "write_live_s", "hash_s", "rest_s", "sha256_s", "load_s",
                                                 "load_noverify_s")]
            rows.append([f"{m['name']} ({m['params'] / 1e6:.2f}M)", kind, f"{r['bytes'] / 2**20:.2f}",
                         f"{r['snapshot_s'] * 1e3:.1f}", *pinned, *ms])
    pinned = ["pinned snapshot, first ms", "pinned snapshot ms"] if cuda else []
    t1 = markdown(["model (params)", "payload", "MiB", "snapshot ms", *pinned, "copy ms", "serialize copy ms",
                   "write copy ms", "write+fsync copy ms", "save ms", "of which write+fsync ms",
                   "of which hashing ms", "of which rest ms", "re-read + sha256 ms", "load ms",
                   "load w/o verify ms"], rows)
    rows = []
    for m in models:
        for mode, blocked in (("async", m["blocked_s"]), ("sync", m["blocked_sync_s"]))\
                + ((("async_pageable", m["blocked_pageable_s"]),) if cuda else ()):
            loop = m.get("in_loop", {}).get(mode)
            rows.append([m["name"], mode, f"{m['write_s'] * 1e3:.1f}", f"{blocked * 1e3:.1f}",
                         f"{blocked / m['write_s']:.2f}",
                         "-" if not loop else f"{loop['blocked_s'] * 1e3:.1f}",
                         "-" if not loop else f"{loop['period_blocked_s'] * 1e3:.1f}",
                         "-" if not loop or loop["window_cost_s"] is None else f"{loop['window_cost_s'] * 1e3:.1f}",
                         "-" if not loop else f"{loop['step_s'] * 1e3:.1f}"])
    t2 = markdown(["model", "writer", "write weights+state ms", "save blocks ms", "blocks / write", "in a real "
                   "loop: saves block ms", "step period with a save - without ms",
                   "steps until written - as many without ms", "step ms"], rows)
    table = (f"{t1}\n\ncopy, serialize, write: of a host copy of the payload, as the background writer writes it; "
             f"save: atomic_save of the payload itself = its write+fsync, hashed as it goes (hashing: the same bytes "
             f"in memory), and the rest (rename, sidecar, directory fsyncs); re-read + sha256: what a load "
             f"verifies\n\n{t2}\n\ntarget: a save blocks no longer than the write itself (write+fsync, "
             f"x{TARGET_BLOCKED_OVER_WRITE:g} for noise), with the default async writer, directly and in the loop: "
             f"{'met' if out['meets_target'] else 'missed'}\n"
             f"timed: {out['timed']}")
    finish(out, args, table)

# -----------------------------------------------------------------------------------------------------------------


def at_least(minimum):
    """An argparse type: an integer >= minimum, refused with the flag's name before anything runs."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def worker_counts(text):
    return [at_least(0)(w) for w in text.split(",")]


def model_sizes(text):
    """HIDDENxLAYERS,... -> [(name, hidden, layers)]."""
    out = []
    for size in text.split(","):
        hidden, x, layers = size.lower().partition("x")
        if not (x and hidden.isdigit() and layers.isdigit() and int(hidden) >= 1 and int(layers) >= 1):
            raise argparse.ArgumentTypeError(f"expected comma-separated HIDDENxLAYERS (e.g. 128x4), got {size!r}")
        out.append((size, int(hidden), int(layers)))
    return out


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def existing_dir(text):
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
    return str(Path(text).resolve())  # the child processes run in the repository


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    common.add_argument("--dir", type=existing_dir,
                        help="parent of the temporary work directory; None: the system temp dir")
    common.add_argument("--timeout", type=positive_seconds, default=600.0,
                        help="seconds one run of scaling (trainer or bare loop, all its processes) or one loader "
                             "probe may take; past it the run is killed and the benchmark stops with an error")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    o = sub.add_parser("overhead", parents=[common], formatter_class=fmt,
                       help="DDPTrainer (1 process, all checks on) vs a bare PyTorch loop, interleaved")
    add_model_flags(o)
    o.add_argument("--steps", type=at_least(1), default=200, help="timed steps per run")
    o.add_argument("--warmup", type=at_least(1), default=5, help="untimed steps at the start of each run")
    o.add_argument("--repeats", type=at_least(1), default=5, help="interleaved pairs (bare, trainer)")
    o.add_argument("--threads", type=at_least(1), default=rt.cpu_count(), help="intra-op threads, both loops")
    o.add_argument("--seed", type=at_least(0), default=DEFAULTS.seed)
    o.add_argument("--trainer_set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a trainer config key for the trainer runs only (repeatable), e.g. cleanup_interval=0")
    o.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both loops train")
    o.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                   help="both loops; auto: the trainer's default (bf16 autocast on CUDA where supported, fp32 on "
                        "the CPU)")
    o.add_argument("--compile", action="store_true", help="torch.compile the model in both loops")
    o.add_argument("--bare_read_loss", action="store_true",
                   help="the bare loop reads its loss after every step (loss.item()), as a loop that logs every step "
                        "does: on CUDA one host sync per step, as the trainer has")
    o.set_defaults(fn=cmd_overhead)

    s = sub.add_parser("scaling", parents=[common], formatter_class=fmt,
                       help="weak scaling: 1 vs --nproc gloo processes, batch and threads per process fixed")
    add_model_flags(s)
    s.add_argument("--nproc", type=at_least(2), default=2)
    s.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads per process")
    s.add_argument("--steps", type=at_least(1), default=60, help="timed steps per run")
    s.add_argument("--warmup", type=at_least(1), default=10, help="untimed steps at the start of each run")
    s.add_argument("--repeats", type=at_least(1), default=3, help="interleaved repeats (1, N, 1, N, ...)")
    s.add_argument("--seed", type=at_least(0), default=DEFAULTS.seed)
    s.add_argument("--trainer_set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a trainer config key for the trainer runs (repeatable), e.g. static_graph=false")
    s.add_argument("--bare", type=int, default=1, choices=[0, 1],
                   help="also time a bare DDP loop (same model, data, optimizer) at 1 and N processes, and N bare "
                        "loops with no communication (the machine's ceiling)")
    s.set_defaults(fn=cmd_scaling)

    ld = sub.add_parser("loader", parents=[common], formatter_class=fmt,
                        help="VJ2TrajectoryDataset samples/s (0, 1, 2 workers) vs a training step; peak memory")
    ld.add_argument("--workers", type=worker_counts, default="0,1,2", help="comma-separated worker counts")
    ld.add_argument("--batch_size", type=at_least(1), default=4,
                    help="trajectories per batch (the AC trainer's default)")
    ld.add_argument("--files", type=at_least(1), default=12,
                    help="files of the 1x dataset; the 3x dataset has 3x as many")
    ld.add_argument("--traj_per_file", type=at_least(1), default=2)
    ld.add_argument("--steps", type=at_least(config.ROLLOUT_HORIZON + 1), default=config.NUM_STEPS,
                    help="T (T - 1 >= the rollout horizon the training step uses)")
    ld.add_argument("--patches", type=at_least(1), default=config.PATCHES_PER_STEP, help="P")
    ld.add_argument("--embed_dim", type=at_least(config.MIN_EMBED_DIM), default=config.EMBED_DIM, help="D")
    ld.add_argument("--actions_per_step", type=at_least(1), default=config.ACTIONS_PER_STEP, help="A")
    ld.add_argument("--channels", type=at_least(len(config.ACTION_CHANNEL_NAMES)), default=config.ACTION_CHANNELS,
                    help="C")
    ld.add_argument("--max_open_files", type=at_least(1),
                    help="the dataset's LRU of open files; None: the dataset's own default")
    ld.add_argument("--warm_epochs", type=at_least(1), default=2, help="timed epochs after the cold one")
    ld.add_argument("--rss_epochs", type=at_least(1), default=2, help="epochs over each dataset while sampling memory")
    ld.add_argument("--train_steps", type=at_least(1), default=3, help="timed training steps, after --train_warmup")
    ld.add_argument("--train_warmup", type=at_least(0), default=1,
                    help="untimed training steps first (on a GPU the first few steps still pick kernels: take more)")
    ld.add_argument("--threads", type=at_least(1), default=rt.cpu_count(), help="intra-op threads of the training step")
    ld.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the training step runs")
    ld.add_argument("--preset", default=config.DEFAULT_PREDICTOR_PRESET, choices=list(config.PREDICTOR_PRESETS),
                    help="the AC predictor the training step trains")
    ld.set_defaults(fn=cmd_loader)

    c = sub.add_parser("checkpoint", parents=[common], formatter_class=fmt,
                       help="save/load time and size of weights-only and full resumable checkpoints")
    c.add_argument("--sizes", type=model_sizes, default=f"{DEFAULTS.hidden_size}x{DEFAULTS.num_layers},512x8",
                   help="comma-separated HIDDENxLAYERS of the LM")
    c.add_argument("--seq_len", type=at_least(1), default=DEFAULTS.seq_len)
    c.add_argument("--vocab_size", type=at_least(1), default=DEFAULTS.vocab_size)
    c.add_argument("--repeats", type=at_least(1), default=5)
    c.add_argument("--threads", type=at_least(1), default=rt.cpu_count())
    c.add_argument("--loop_saves", type=at_least(0), default=3, help="saves timed inside a real training run; 0 = skip")
    c.add_argument("--loop_save_every", type=at_least(3), default=4,
                   help="save_every_iters of that run (>= 3: the step periods without a save are the baseline)")
    c.add_argument("--loop_batch", type=at_least(1), default=4, help="batch size of that run")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the payloads' tensors live")
    c.set_defaults(fn=cmd_checkpoint)
    return p


# What `overhead` and `scaling` set in the trainer's runs themselves, or what would change the work of a step or
# its data (the bare loops would then train another model, or the timed window hold an epoch's end): not for
# --trainer_set, whose keys apply to the trainer's runs only
SET_BY_THE_BENCHMARK = {"batch_size", "dataset_size", "max_steps", "num_epochs", "seed", "data", "markov_branching",
                        "val_fraction", "save_interval", "save_every_iters", "val_interval", "resume", "run_name",
                        "log_dir", "checkpoint_dir", "grad_accum_steps", "device", "compile", "use_amp", "amp_dtype",
                        "dropout", "grad_clip"}


def check_args(parser, args) -> None:
    """Bad settings refused before any run, as flag errors (exit 2), not as a traceback minutes later."""
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    try:
        changed = parse_settings(getattr(args, "trainer_set", []))
    except ValueError as exc:
        parser.error(f"--trainer_set: {exc}")
    model = lm_config(args) if hasattr(args, "hidden_size") else {}
    if own := sorted(set(changed) & (SET_BY_THE_BENCHMARK | set(model))):
        parser.error(f"--trainer_set {', '.join(own)}: set by {args.command} itself, or would change the work of a "
                     f"step or its data (the bare loops would then train another model); use the sub-command's flags")
    try:  # an unknown key or a bad value (the runs always set max_steps)
        TrainConfig.from_dict({"max_steps": 1, **model, **changed})
    except ValueError as exc:
        parser.error(f"--trainer_set or the model flags: {exc}")
    if args.command == "loader" and args.files * args.traj_per_file < args.batch_size:
        parser.error(f"--files {args.files} x --traj_per_file {args.traj_per_file} trajectories are fewer than one "
                     f"--batch_size {args.batch_size}")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        args.fn(args)
    except RunTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
