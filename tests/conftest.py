"""Shared test helpers: run real processes with bounded timeouts, never hang CI."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

# One intra-op thread per process: tests run several processes at once on small machines, and
# oversubscribed threads make each far slower than one thread alone. Children inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A suite started as a background job of a script (`pytest &`) inherits SIGINT and SIGQUIT ignored, and so would
# every process it starts: bash cannot trap a signal ignored at its start, and the Ctrl-C tests would fail for it.
# SIGHUP ignored (nohup) is left as it is, on purpose: the one test that needs it skips.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
SIGHUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one test process per core this process may use, at most 4. Two on a 2-core
    machine took the suite from about 14 to about 8 minutes, with other changes (BENCHMARKS.md); more than 4
    would run more multi-process tests at once than a small machine's memory and timeouts were sized for."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

class Indices(torch.utils.data.Dataset):
    """Sample i is the number i: which samples a loader or shard delivered is plain to see."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(float(i))


class FlakyData(torch.utils.data.Dataset):
    """A dataset with some samples that fail to load (an unreadable record)."""

    def __init__(self, base, bad):
        self.base, self.bad = base, set(bad)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"sample {i} unreadable")
        return self.base[i]


# Variables that would make a "plain" process think it is part of a distributed job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_STEP_NUM_TASKS",
               "TORCHELASTIC_RUN_ID", "DDP_KIT_LAUNCH_ID")


class Augmented(torch.utils.data.Dataset):
    """Token windows with two input tokens replaced at random, drawn from torch, numpy and random:
    augmentation whose draws a resumed run must repeat exactly."""

    def __init__(self, base, vocab: int):
        self.base, self.vocab = base, vocab

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        x = x.clone()
        where = torch.randint(len(x), (2,))
        x[where] = torch.tensor([np.random.randint(self.vocab), random.randrange(self.vocab)])
        return x, y


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd, timeout=180, env=None, check=False, merge_stderr=True) -> subprocess.CompletedProcess:
    """Run a command in its own session; on timeout kill the whole group and fail the test.
    With merge_stderr=False, stdout stays clean (e.g. for one JSON document)."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{(err or out)[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err or "")
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{(out + (err or ''))[-6000:]}")
    return result


@contextlib.contextmanager
def background(cmd, cwd, env=None, **popen):
    """A command running in its own session while the test acts on it. On leaving, whatever happened,
    its whole process group is killed, so no stray trainer slows the tests after it."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), start_new_session=True,
                            **options)
    try:
        yield proc
    finally:
        kill_tree(proc)
        proc.communicate(timeout=30)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process, every descendant (torchrun starts its workers in groups of their own) and its
    process group (children whose parent already exited)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(nproc: int, script: str, *args, extra=()) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *extra, str(REPO / script), *args]


def wait_for_step(metrics: Path, step: int, timeout: float = 90) -> None:
    """Until metrics.jsonl holds the train record of `step` (the run is past its start-up)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and f'{{"type": "train", "step": {step},' in metrics.read_text():
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {metrics} within {timeout}s")


def torchrun_workers(agent: subprocess.Popen) -> dict:
    """rank -> psutil.Process of the workers a torchrun agent started."""
    out = {}
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            out[int(env["RANK"])] = child
    return out


def metrics(log_dir, kind: str = None) -> list:
    """The records of log_dir/metrics.jsonl, only those of type `kind` when given."""
    recs = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    return recs if kind is None else [r for r in recs if r["type"] == kind]


def make_vj2_data(root: Path, train_files: int, per_file: int, val_trajectories: int) -> Path:
    """A VJ2 training set (seed 0) and a validation set (seed 1) sharing one synthetic encoder."""
    import create_synthetic_data as gen
    gen.generate(root / "train", num_files=train_files, trajectories_per_file=per_file, seed=0)
    gen.generate(root / "val", num_files=1, trajectories_per_file=val_trajectories, seed=1)
    return root


@pytest.fixture
def no_launch_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def cpu_fp16(monkeypatch):
    """CUDA's fp16 path on the CPU: fp16 autocast and a CPU GradScaler; call it with the scaler's settings."""
    import ddp_training
    real = torch.amp.GradScaler

    def use(**scaler):
        monkeypatch.setattr(ddp_training, "amp_dtype_for", lambda cfg, device: torch.float16)
        monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: real("cpu", **scaler))
    return use
