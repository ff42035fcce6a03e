"""Shared runtime for every trainer in the kit.

One owner for each cross-cutting concern: process-group set-up and teardown,
rank-aware logging, memory monitoring, safe data loaders, collective
decisions, signals, and checkpoint I/O. Trainers import these; nothing here
knows about a particular model.
"""

from __future__ import annotations

import argparse
import atexit
import collections.abc
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import json
import logging
import numbers
import os
import queue
import random
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# Exit code of a run that stopped on SIGINT/SIGTERM/SIGUSR1 after writing its
# interrupted checkpoint (EX_TEMPFAIL: "try again later"), so a requeue script
# can tell preemption from failure.
EXIT_PREEMPTED = 75
# Exit code of bad input (a flag, a file, a refused state): as argparse exits
EXIT_BAD_INPUT = 2
# Exit code of any other failure, as Python's for an uncaught exception
EXIT_FAILURE = 1

DEFAULT_DIST_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------
# Process group
# ----------------------------------------------------------------------------

@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    backend: Optional[str]  # None when world_size == 1: no process group at all
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LaunchEnvError(ValueError):
    """Launch variables that cannot describe this process: not a number, a rank outside the world size."""


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[07-09,12],cpu3' -> 'gpu07', 'rack[1-2]-n[01-04]' -> 'rack1-n01'."""
    m = re.match(r"(?:[^,\[]|\[[^\]]*\])+(?=,|$)", nodelist.strip())  # the first entry: commas inside [] do not end it
    if not m or "[]" in m.group(0):
        raise LaunchEnvError(f"cannot parse SLURM node list {nodelist!r}")
    # each bracket's first range's first value, zero padding kept
    return re.sub(r"\[([^\]]*)\]", lambda r: r.group(1).split(",")[0].split("-")[0], m.group(0))


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's task count from SLURM's compressed list: '4(x2),3' is 4, 4, 3 tasks on nodes 0, 1, 2."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchEnvError(f"cannot parse SLURM tasks per node {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise LaunchEnvError(f"SLURM_NODEID={node_id} is not a node of tasks per node {tasks_per_node!r}")
    return counts[node_id]


# What detect_launch_env reads
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
               "SLURM_NTASKS", "SLURM_LOCALID")


def _int_env(env, name: str, default: Optional[str] = None) -> int:
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchEnvError(f"{name}={value!r} is not a whole number (set by the launcher: torchrun, srun)") from None


def detect_launch_env() -> dict:
    """Rank, local rank and world size from torchrun or SLURM; a plain process is rank 0 of 1.

    Under SLURM only the tasks of an `srun` step form a group, and the step's task count is its
    size (srun's SLURM_STEP_NUM_TASKS; SLURM_NTASKS is the job's and may be larger). The batch
    script itself is one process on the first node: SLURM sets SLURM_PROCID=0 and the job's
    SLURM_NTASKS there too, but no SLURM_STEP_* variable, so a `python train.py` in it runs alone
    instead of waiting for peers that nothing will start.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        found = dict(rank=_int_env(env, "RANK"), world_size=_int_env(env, "WORLD_SIZE"),
                     local_rank=_int_env(env, "LOCAL_RANK" if "LOCAL_RANK" in env else "RANK"), launcher="torchrun")
    else:
        found = _slurm_task(env) or dict(rank=0, world_size=1, local_rank=0, launcher="none")
    # else the process would refuse or wait at the rendezvous, and only rank 0 says why
    shown = " ".join(f"{k}={env[k]}" for k in LAUNCH_VARS if k in env)
    if not 0 <= found["rank"] < found["world_size"] or found["local_rank"] < 0:
        raise LaunchEnvError(f"rank {found['rank']} (local rank {found['local_rank']}) of world size "
                             f"{found['world_size']}, from {shown}: expected 0 <= rank < world size")
    if found["launcher"] != "none" and "LOCAL_WORLD_SIZE" in env:  # the threads and loader workers follow it
        local_ranks = _int_env(env, "LOCAL_WORLD_SIZE")
        if not found["local_rank"] < local_ranks <= found["world_size"]:
            raise LaunchEnvError(f"local rank {found['local_rank']} of {local_ranks} ranks on this node, world size "
                                 f"{found['world_size']}, from {shown}: expected 0 <= LOCAL_RANK < "
                                 f"LOCAL_WORLD_SIZE <= world size")
    return found


def local_world_size(world_size: int) -> int:
    """The ranks on this node, which share its cores (torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks on the node;
    checked by detect_launch_env). A launcher that does not say: all of them, fewer threads each rather than more
    threads than cores."""
    return _int_env(os.environ, "LOCAL_WORLD_SIZE", str(world_size))


def note(message: str) -> None:
    """A `note:` line on stderr about the flags, from the first rank only: every rank of a torchrun or srun
    launch reads the same flags."""
    try:
        first = detect_launch_env()["rank"] == 0
    except LaunchEnvError:  # refused where the trainer starts; the note is still worth a line
        first = True
    if first:
        print(f"note: {message}", file=sys.stderr)


def _slurm_step_tasks(env) -> Optional[int]:
    """The task count of the srun step this process is a task of, or None (no SLURM, or the batch script)."""
    if "SLURM_PROCID" not in env:
        return None
    if "SLURM_STEP_NUM_TASKS" in env:
        return _int_env(env, "SLURM_STEP_NUM_TASKS")
    if _int_env(env, "SLURM_PROCID") == 0 or "SLURM_NTASKS" not in env:
        return None  # the batch script (always task 0 of its own one-task step), not an srun task
    return _int_env(env, "SLURM_NTASKS")  # a task > 0 without step variables: not the batch script


def _slurm_list(var: str, read, *args):
    """`read(*args)` of SLURM's compressed list in `var`, its error naming the variable."""
    try:
        return read(*args)
    except LaunchEnvError as exc:
        raise LaunchEnvError(f"{var}: {exc} (set by srun)") from None


def _slurm_task(env) -> Optional[dict]:
    """The SLURM task this process is, or None when it is not one of a group (the batch script)."""
    ntasks = _slurm_step_tasks(env)
    if ntasks is None:
        return None
    rank = _int_env(env, "SLURM_PROCID")
    if ntasks > 1:
        # c10d's env:// rendezvous reads these; SLURM does not set them itself.
        if "MASTER_ADDR" not in env:
            var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v)), None)
            if not var:
                raise LaunchEnvError("SLURM run with several tasks but neither MASTER_ADDR nor "
                                     "SLURM_JOB_NODELIST is set")
            os.environ["MASTER_ADDR"] = _slurm_list(var, first_slurm_host, env[var])
        # the step too: two srun steps side by side in one allocation (a sweep) must not share a port
        os.environ.setdefault("MASTER_PORT", str(20000 + (_int_env(env, "SLURM_JOB_ID", "0") +
                                                          _int_env(env, "SLURM_STEP_ID", "0")) % 20000))
        # the ranks sharing this node's cores (threads, loader workers); the world size would starve them
        var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)), None)
        if var and "LOCAL_WORLD_SIZE" not in env:
            node = _int_env(env, "SLURM_NODEID", "0")
            os.environ["LOCAL_WORLD_SIZE"] = str(_slurm_list(var, slurm_tasks_on_node, env[var], node))
    return dict(rank=rank, world_size=ntasks, local_rank=_int_env(env, "SLURM_LOCALID", "0"), launcher="slurm")


def pick_backend(requested: Optional[str], device: str = "auto") -> str:
    if requested:
        if requested not in ("nccl", "gloo"):
            raise ValueError(f"--dist-backend must be 'nccl' or 'gloo', got {requested!r}")
        return requested
    use_cuda = torch.cuda.is_available() and device != "cpu"
    return "nccl" if use_cuda else "gloo"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def limit_cpu_threads(local_world_size: int, world_size: int) -> None:
    """Share the cores among the ranks of this node: oversubscribed intra-op threads make
    every rank slower than one process alone. An explicit OMP_NUM_THREADS wins, and the count is never raised:
    a lower one the process has (a script's torch.set_num_threads, or torch's default, the physical cores, where
    that is below the share) is kept."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cpus_per_rank(local_world_size, world_size))))


def cpus_per_rank(local_world_size: int, world_size: int) -> int:
    """The CPUs one rank may use: this process's CPUs shared among the ranks of its node; where the ranks are
    the tasks of an srun step, SLURM's share for each (SLURM_CPUS_PER_TASK), since srun may have bound each
    task to CPUs of its own already (dividing those again left a task of 8 CPUs 2 threads at 4 per node).
    0 where the node has fewer CPUs than ranks."""
    env = os.environ
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    slurm_ranks = "TORCHELASTIC_RUN_ID" not in env and _slurm_step_tasks(env) == world_size
    if slurm_ranks and per_task.isdigit() and int(per_task) > 0:
        return min(cpu_count(), int(per_task))
    return cpu_count() // max(1, local_world_size)


def cuda_index(local_rank: int, given: bool = True) -> int:
    """The visible device for this local rank: LOCAL_RANK indexes the devices this process sees, except
    where SLURM binds one GPU to each task (`srun --gpus-per-task=1` sets CUDA_VISIBLE_DEVICES per task, and
    the local rank is its SLURM_LOCALID): then each sees one, as cuda:0. The processes torchrun or --nproc
    start share one CUDA_VISIBLE_DEVICES: two ranks on one GPU would fail later, in NCCL. `given`: False where
    the local rank is the rank, for want of one (a caller's own group: mp.spawn)."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    # a SLURM task's own local rank (not --nproc's ranks in the batch script) and no torchrun worker
    bound_per_task = os.environ.get("SLURM_LOCALID") == str(local_rank) and "TORCHELASTIC_RUN_ID" not in os.environ
    if count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES") and bound_per_task:
        return 0
    seen = f"this process sees {count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
    # not a ValueError: those are printed by rank 0 only, and this one never happens on rank 0
    if not given:  # ranks spread over nodes by the caller's own launch (mp.spawn on each node)
        raise RuntimeError(f"rank {local_rank} has no GPU: {seen}, and without LOCAL_RANK, SLURM_LOCALID or "
                           f"local_rank= its rank picks it; where ranks span nodes, pass local_rank= (this "
                           f"process's index on its node)")
    raise RuntimeError(f"local rank {local_rank} (LOCAL_RANK or SLURM_LOCALID) has no GPU: {seen}; start "
                       f"at most one process per visible GPU on each node")


def setup_distributed(rank: int, world_size: int, local_rank: Optional[int] = None,
                      backend: Optional[str] = None, device: str = "auto",
                      timeout_s: float = DEFAULT_DIST_TIMEOUT_S) -> DistEnv:
    """Join the process group (only when world_size > 1) and pick this rank's device.

    A single process never rendezvouses: collectives below become local no-ops,
    so `DDPTrainer(rank=0, world_size=1)` needs no MASTER_ADDR.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world_size {world_size}")
    if world_size == 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # before the device is set: a caller that catches this must find its process as it was
        raise RuntimeError(f"a process group already exists as rank {dist.get_rank()}/{dist.get_world_size()}, "
                           f"not {rank}/{world_size}: leave rank and world_size out (they come from that group), "
                           f"or pass rank=dist.get_rank(), world_size=dist.get_world_size()")
    given, local_rank = local_rank is not None, rank if local_rank is None else local_rank
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                         f"{torch.cuda.device_count()} GPUs seen); use --device cpu or auto")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        dev = torch.device("cuda", cuda_index(local_rank, given))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    # GPU ranks too: their host work (collation, the optimizer's CPU parts) shares the node's cores
    limit_cpu_threads(local_world_size(world_size), world_size)

    if world_size == 1:
        return DistEnv(rank, local_rank, 1, None, dev)

    chosen = pick_backend(backend, "cuda" if use_cuda else "cpu")
    if chosen == "nccl" and not use_cuda:
        raise ValueError("the nccl backend needs CUDA; use --dist-backend gloo on the CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():  # the caller's group (or an earlier trainer's): used, and left to its owner
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"a process group already exists as rank {dist.get_rank()}/"
                               f"{dist.get_world_size()}, not {rank}/{world_size}")
        _start_roll_call(timeout)
        return DistEnv(rank, local_rank, world_size, dist.get_backend(), dev)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"world_size={world_size} needs {var} in the environment "
                               f"(torchrun, SLURM or --nproc set it for you)")
    store = _meet(rank, world_size, timeout)
    try:
        dist.init_process_group(backend=chosen, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=dev if chosen == "nccl" else None)
    except dist.DistError as exc:
        if "Duplicate GPU detected" in str(exc):
            raise SetUpFailed(_shared_gpu(rank, dev, exc)) from exc
        if not timed_out(exc):
            raise
        # a late rank finds the keys of those that gave up on it: they checked in, then left
        late = _gave_up(store, world_size)
        raise SetUpTimeout(rank, timeout, f"this rank arrived after {late}" if late else
                           "every rank checked in, but the process group did not form: a rank died or left in "
                           "between") from exc
    global _own_group
    _own_group = True
    _start_roll_call(timeout)
    return DistEnv(rank, local_rank, world_size, chosen, dev)


def _shared_gpu(rank: int, dev: torch.device, exc: BaseException) -> str:
    """NCCL refuses two ranks on one GPU (where tasks of a node share one CUDA_VISIBLE_DEVICES, as SLURM tasks
    given no GPU of their own do): its line, with what each rank can change."""
    said = next((line.strip() for line in str(exc).splitlines() if "Duplicate GPU" in line), "")
    return (f"rank {rank}: set-up failed: NCCL found two ranks on one GPU ({said}); this rank took {dev} of "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}: start at most one process per "
            f"GPU on each node (under srun, give each task its own: --gpus-per-task=1)")


# Whether the default group is the kit's (teardown_distributed leaves it), and how many the kit has made here
_own_group = False
_groups_made = 0


def _group_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The env:// rendezvous store, under a prefix of its own for each group this process makes. torchrun's
    store outlives a group: a second group under torch's fixed prefix (a second trainer's, or one the script
    makes after train()) met the first one's keys there, and its ranks hung in set-up. Every rank makes its
    groups in the same order, so the prefixes agree."""
    global _groups_made
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    except dist.DistNetworkError as exc:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if timed_out(exc):
            raise
        if rank != 0:  # something else answered there: the store of another job, say
            raise SetUpFailed(f"rank {rank}: set-up failed: no rendezvous of rank 0 at {where} (MASTER_ADDR:"
                              f"MASTER_PORT): {str(exc).strip().splitlines()[-1]}") from exc
        if "EADDRINUSE" not in str(exc):
            raise
        slurm = " (under SLURM, unset, it is 20000 + (SLURM_JOB_ID + SLURM_STEP_ID) % 20000)" \
            if "SLURM_PROCID" in os.environ else ""
        raise ValueError(f"MASTER_PORT={os.environ['MASTER_PORT']} is taken on this host: rank 0 cannot host the "
                         f"ranks' rendezvous at {where} (another job, or a run not yet gone, holds it); set "
                         f"MASTER_PORT to a free port{slurm}") from None
    store.set_timeout(timeout)
    _groups_made += 1
    return dist.PrefixStore(f"ddp_kit_group_{_groups_made}", store)


class Failed(RuntimeError):
    """A failure whose message already says what failed, where and (from the peers) why: a script ends with
    that one `error:` line and exit 1 (see failed), instead of Python's traceback of the kit's own frames,
    which goes to rank_N.log. `agreed`: every rank raises this same message (a decision they took together),
    so rank 0's line says it for all."""

    def __init__(self, *args, agreed: bool = False):
        super().__init__(*args)
        self.agreed = agreed

    def line(self, rank: int) -> str:
        return f"rank {rank}: {type(self).__name__}: {self}"


class SetUpFailed(Failed):
    """The ranks could not complete set-up together (one late, stuck or gone): a failure (exit 1), not bad input."""

    def line(self, rank: int) -> str:  # its message names the rank and says set-up failed
        return str(self)


class SetUpTimeout(SetUpFailed):
    """The ranks did not all meet within the set-up timeout: the line names who did not arrive and what to
    change, instead of torch's DistStoreError."""

    def __init__(self, rank: int, timeout: datetime.timedelta, what: str):
        seconds = timeout.total_seconds()
        super().__init__(f"rank {rank}: set-up timed out after {seconds:g}s: {what}; start every rank within "
                         f"{seconds:g}s of the first (each launched, each reaching MASTER_ADDR:MASTER_PORT), or give "
                         f"set-up longer with --dist_timeout (or --first_step_timeout, where it is larger)")


def _store_key(what: str, rank: int) -> str:
    """A key of the set-up check-in. Not per torchrun restart: each node's agent counts its own restarts. A store
    shared across restarts keeps an earlier attempt's keys (as it keeps torch's own): they may only change the
    words of a failure, never fail a set-up (see _meet)."""
    return f"ddp_kit_{what}_{rank}"


def timed_out(exc: BaseException) -> bool:
    """Whether a collective's or a store's error says it timed out (gloo, NCCL and c10d each word it)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _meet(rank: int, world_size: int, timeout: datetime.timedelta):
    """The group's store once every rank has reached it. torch's own waits (the rendezvous, gloo's exchange of
    addresses) end in a DistStoreError that names a store key; this check-in names the ranks instead."""
    try:
        store = _group_store(rank, world_size, timeout)
    except dist.DistError as exc:
        if not timed_out(exc):
            raise
        raise SetUpTimeout(rank, timeout, _unmet_rendezvous(rank, world_size, exc)) from exc
    keys = [_store_key("arrived", r) for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except dist.DistError as exc:
        if not timed_out(exc):
            if rank == 0:
                raise
            # rank 0 hosts a plain env:// rendezvous: it gave up on a missing rank and took its store along
            raise SetUpFailed(f"rank {rank}: set-up failed: rank 0's rendezvous at {os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')} closed while this rank waited for the others (rank 0 "
                              f"gave up on a rank that did not arrive: its error names it)") from exc
        raise SetUpTimeout(rank, timeout, _not_arrived(store, keys, rank)) from exc
    return store


def _not_arrived(store, keys: list, rank: int) -> str:
    """Who did not check in, as the store still tells, and a note there for a peer that arrives later."""
    try:
        store.set(_store_key("gave_up", rank), "1")  # a peer arriving later learns that it was the slow one
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except dist.DistError:  # the store's host (rank 0 of a plain env:// rendezvous) is gone too
        return f"not every rank of {len(keys)} arrived (the store that would name them is gone)"
    return (f"rank(s) {', '.join(map(str, missing))} of {len(keys)} did not arrive (not started, or still busy "
            f"before their process group: importing, reading data)")


def _gave_up(store, world_size: int) -> str:
    """'rank(s) N gave up waiting for the others', or '' when none did."""
    left = [r for r in range(world_size) if store.check([_store_key("gave_up", r)])]
    return f"rank(s) {', '.join(map(str, left))} gave up waiting for the others" if left else ""


def _unmet_rendezvous(rank: int, world_size: int, exc: BaseException) -> str:
    """What a failed env:// rendezvous says, in ranks: rank 0 hosts its store and counts who connected; the
    others connect to it."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    if joined:
        return (f"only {joined.group(1)} of {world_size} ranks (this one included) connected to the rendezvous "
                f"this rank hosts at {where}")
    if rank != 0:
        return (f"could not connect to rank 0's rendezvous at {where} (rank 0 not started yet, already gone, "
                f"or that address unreachable from here)")
    return f"the rendezvous at {where} failed: {str(exc).strip().splitlines()[0]}"


def _start_roll_call(timeout: datetime.timedelta) -> None:
    global _roll_call_group
    if dist.get_backend() == "gloo" and _roll_call_group is None:  # see missing_ranks
        _roll_call_group = dist.new_group(backend="gloo", timeout=timeout)


def set_collective_timeout(seconds: float) -> None:
    """Shorten the timeout once start-up (compilation, data warm-up) is over."""
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


# A second gloo group that carries nothing but missing_ranks' barrier: a collective that timed out closes the
# connections of its group, so a barrier on the default group after a timeout can never name anyone.
_roll_call_group = None


# where gloo's message of a lost peer turns to advice for its own bug reports (two wordings, and an emoji): cut there
GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by a remote worker")


def missing_ranks(timeout_s: float) -> str:
    """What gloo's monitored_barrier can tell about ranks that do not answer (rank 0 names them; the others
    learn that rank 0 did not answer them)."""
    if not (dist.is_initialized() and dist.get_backend() == "gloo" and _roll_call_group is not None):
        return "the backend cannot name the missing rank"
    try:
        dist.monitored_barrier(group=_roll_call_group, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", first)
        if named:
            return f"rank(s) that did not answer within {timeout_s:g}s: {named.group(1).strip()} (monitored_barrier)"
        return f"monitored_barrier: {GLOO_ADVICE.split(first)[0]}"
    return "monitored_barrier: every rank answered"


FAILED_PREFIX = "FAILED_rank_"


def write_failure_marker(log_dir, rank: int, step: int, exc: BaseException) -> None:
    """`FAILED_rank_N` (JSON) in the run dir: the other ranks read it to report this rank's
    error, and a requeue script tells a failure from a preemption. Written while `exc` is being raised: if
    the marker cannot be written (the full disk that caused `exc`), stderr says so and `exc` goes on."""
    record = {"rank": rank, "step": step, "error": f"{type(exc).__name__}: {exc}"}
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{FAILED_PREFIX}{rank}").write_text(json.dumps(record) + "\n")
    except OSError as marker_exc:
        try:  # a marker cut short would read as one being written: the peers would wait for it
            (Path(log_dir) / f"{FAILED_PREFIX}{rank}").unlink(missing_ok=True)
        except OSError:
            pass  # reported with the write's error just below
        print(f"[rank {rank}] could not write {FAILED_PREFIX}{rank} into {log_dir} ({marker_exc}); "
              f"the other ranks will not see this rank's error: {record['error']}", file=sys.stderr, flush=True)


def clear_failure_marker(log_dir, rank: int) -> None:
    """A previous run's marker of this rank: gone before this one trains."""
    (Path(log_dir) / f"{FAILED_PREFIX}{rank}").unlink(missing_ok=True)


PREEMPTED_MARKER = "PREEMPTED"
# launch_training.sh names each launch in this variable; the markers it reads carry it, so that another run's
# marker in a directory it searches is never taken for this run's
LAUNCH_ID_VAR = "DDP_KIT_LAUNCH_ID"


def with_launch_id(record: dict) -> dict:
    launch_id = os.environ.get(LAUNCH_ID_VAR)
    return {**record, "launch_id": launch_id} if launch_id else record


def write_preempted_marker(log_dir, record: dict) -> Path:
    """`PREEMPTED` (JSON) in the run dir: the run stopped on a signal with its state on disk, so relaunching
    the same command resumes it. Launchers and requeue scripts look for it (exit code 75 alone cannot cross
    torchrun). Written through a temp file: every rank that gives up in set-up may write it at once."""
    path = Path(log_dir) / PREEMPTED_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(with_launch_id(record)) + "\n")
    return path


def read_failure_markers(log_dir, exclude: int, wait_s: float, world_size: Optional[int] = None) -> list:
    """The FAILED markers of the other ranks (those below world_size: a larger earlier run's are stale)."""
    deadline = time.time() + wait_s
    while True:
        found = []
        for p in sorted(Path(log_dir).glob(f"{FAILED_PREFIX}*")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # being written right now
            if rec.get("rank") != exclude and (world_size is None or rec.get("rank", 0) < world_size):
                found.append(rec)
        if found or time.time() >= deadline:
            return found
        time.sleep(0.1)


def teardown_distributed(synchronize: bool = False) -> None:
    """Leave the process group the kit made; after a clean finish all ranks leave together, so no rank tears
    down its connections while a peer still uses them. A group the caller made stays theirs, to use after
    train() and to destroy (only the kit's roll-call group in it goes)."""
    global _roll_call_group, _own_group
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        if _own_group:
            dist.destroy_process_group()
        elif _roll_call_group is not None:
            dist.destroy_process_group(_roll_call_group)
    _roll_call_group, _own_group = None, False


def refuse(message: str, show: bool = True) -> int:
    """Bad input: one `error: ...` line on stderr (`show`: rank 0 prints it) and EXIT_BAD_INPUT. Under
    torchrun the reason also goes where torchrun looks for a worker's (TORCHELASTIC_ERROR_FILE, in the
    format of torch's ErrorHandler, marked as a refusal): its failure summary then shows it, and the mark is how
    the launcher tells bad input from a failure (torchrun itself exits 1 whatever its workers' codes)."""
    if not note_for_torchrun(f"error: {message}") or show:  # a reason its file lost is printed here
        print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def failed(exc: Failed, rank: int) -> int:
    """A failure that is no bad input (ranks that did not meet, a step that failed, a peer lost): one `error:`
    line on stderr from each rank that saw it, as each names what it saw (rank 0 alone where they agreed; the
    traceback is in its rank_N.log), and exit 1 as any failure. torchrun's failure summary shows it too (not
    marked as a refusal: the launcher keeps exit 1)."""
    message = f"error: {exc.line(rank)}"
    note_for_torchrun(message, refused=False)
    if rank == 0 or not exc.agreed:
        print(message, file=sys.stderr, flush=True)
    return EXIT_FAILURE


def note_for_torchrun(message: str, refused: bool = True) -> bool:
    """`message` into TORCHELASTIC_ERROR_FILE where one is set; False if it could not be written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return True
    # "refused" says it is bad input whatever exit code torchrun pairs it with: a peer that refused too may be
    # ended by torchrun's SIGTERM after writing this, and be taken for the first failure (exit -15)
    info = {"timestamp": str(int(time.time())), **({"refused": "true"} if refused else {})}
    reason = {"message": {"message": message, "extraInfo": info}}
    if not refused and refusal_in(path) is not None:  # --nproc's ranks share one file: the input ended the run
        return True
    try:  # whole or not at all: torchrun's summary fails on a file it cannot parse
        atomic_write_text(path, json.dumps(reason))
    except OSError as exc:
        print(f"cannot write torchrun's error file {path}: {exc}", file=sys.stderr)
        return False
    return True


def refusal_in(path) -> Optional[str]:
    """The message of a refusal (bad input) that note_for_torchrun wrote to `path`; None for a failure's
    note, or no note."""
    try:
        reason = json.loads(Path(path).read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(reason, dict) and reason.get("extraInfo", {}).get("refused") == "true":
        return reason["message"]
    return None


# One setting's names in other trainers (Hugging Face, Lightning, nanoGPT, the scripts our users come from),
# the kit's first: a key or flag of theirs is refused with the kit's name for it
SAME_SETTING = (
    ("learning_rate", "lr", "base_lr", "max_lr"),
    ("grad_accum_steps", "gradient_accumulation_steps", "accumulate_grad_batches", "accumulation_steps",
     "grad_accum"),
    ("batch_size", "per_device_train_batch_size", "train_batch_size", "micro_batch_size", "batch"),
    ("num_epochs", "epochs", "max_epochs", "n_epochs", "num_train_epochs"),
    ("max_steps", "max_iters", "num_steps", "total_steps", "max_iterations", "train_steps"),
    ("save_every_iters", "save_steps", "save_every", "checkpoint_every", "save_freq"),
    ("val_interval", "val_every_iters", "eval_steps", "eval_interval", "val_every", "eval_every",
     "val_check_interval"),
    ("grad_clip", "max_grad_norm", "gradient_clip_val", "clip_grad_norm", "clip_grad"),
    ("warmup_steps", "num_warmup_steps", "warmup_iters", "warmup"),
    ("dist_backend", "backend"),
    ("data_strategy", "dispatch_batches"),
    ("patience", "early_stopping_patience"),
    ("use_amp", "fp16", "amp", "mixed_precision"),
    ("log_dir", "output_dir", "logging_dir", "out_dir", "save_dir", "default_root_dir"),
    ("resume", "resume_from_checkpoint"),
    ("num_workers", "dataloader_num_workers"),
)
WORLD_SIZE_KEYS = ("world_size", "nproc", "num_gpus", "gpus", "nodes", "num_nodes")


def name_hint(name: str, known) -> str:
    """' (...)' naming the known key or flag that `name` (unknown) probably means, else ''."""
    import difflib
    known = set(known)
    bare = name.lstrip("-").split("=")[0]
    dashes = name[:len(name) - len(name.lstrip("-"))]
    for candidate in (bare.replace("-", "_"), bare.replace("_", "-")):
        if candidate != bare and candidate in known:
            return f" (did you mean {dashes}{candidate}?)"
    same = next((g for g in SAME_SETTING if bare.replace("-", "_") in g), ())
    ours = [k for k in same if k in known]
    if ours:
        return f" (this kit's name for it: {dashes}{ours[0]})"
    if bare.replace("-", "_") in WORLD_SIZE_KEYS and bare not in known:
        nproc = ", --nproc" if "nproc" in known else ""
        return f" (the number of processes is the launcher's: torchrun --nproc_per_node{nproc}, srun -n)"
    close = difflib.get_close_matches(bare, known, n=1, cutoff=0.8)
    return f" (did you mean {dashes}{close[0]}?)" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (exit 2) also reach torchrun's failure summary and the launcher (see refuse),
    that takes no abbreviated flags (the launcher reads --log_dir from the scripts' arguments as typed), that
    names the flag an unknown one probably means, and that shows a long usage as a pointer to --help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            flags = [s[2:] for a in self._actions for s in a.option_strings if s.startswith("--")]
            hints = [f"{arg}{name_hint(arg, flags)}" for arg in message.split(": ", 1)[1].split()
                     if arg.startswith("--")]
            message += "".join(f"; {h}" for h in hints if h.endswith(")"))
        note_for_torchrun(f"{self.prog}: error: {message}")
        usage = self.format_usage()
        if usage.count("\n") > 4:  # a usage of dozens of flags buries the line that says what is wrong
            usage = f"usage: {self.prog} [flags] ({self.prog} --help lists them)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def add_local_rank_flag(parser: argparse.ArgumentParser) -> None:
    """torch.distributed.launch (the launcher before torchrun) passes --local-rank=N to every worker, and sets
    LOCAL_RANK as torchrun does: the flag is taken and the environment read."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS,
                        help="ignored (torch.distributed.launch passes it); LOCAL_RANK from the environment is used")


def exit_process(code: int) -> None:
    """Flush everything and exit without running C++ static destructors: with gloo these can
    abort a finished process ("terminate called without an active exception", exit -6)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What a trainer logs, and a script prints, for a Ctrl-C that came before its first step (training_logs reads it)
CTRL_C_BEFORE_TRAINING = "stopped by Ctrl-C before any training step: nothing to save"


# Set where the process ends when its script's main() returns (run_script, an --nproc rank): the stop handlers
# then stay until the exit, so that a stop after training changes nothing (the run's outcome is decided and
# written), where Python's default would make a Ctrl-C then a KeyboardInterrupt, read as one in set-up
_main_ends_the_process = False


def main_ends_the_process(now: bool = False) -> bool:
    """Whether this process ends when its main() returns; `now`: it does, from here on."""
    global _main_ends_the_process
    _main_ends_the_process = _main_ends_the_process or now
    return _main_ends_the_process


def run_script(main: Callable[[], int]) -> None:
    """A script's main(), then exit_process with its status. Once a trainer trains it takes Ctrl-C over (a
    stop with a save): a KeyboardInterrupt that gets here came before (set-up, an evaluation), and is one line
    instead of a traceback, then death by SIGINT, as Python's own exit on Ctrl-C (a shell sees a Ctrl-C)."""
    main_ends_the_process(now=True)
    try:
        code = main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:  # a closed stderr (`| tee`, ended by the same Ctrl-C) must not keep the process from its death
            logging.shutdown()
            sys.stdout.flush()
            print(CTRL_C_BEFORE_TRAINING, file=sys.stderr, flush=True)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT  # the exit status of that death, where the signal is blocked
    exit_process(code)


# ----------------------------------------------------------------------------
# Collective decisions: every rank takes the same branch at the same step
# ----------------------------------------------------------------------------

def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_tensor(values: torch.Tensor, op=dist.ReduceOp.SUM, on_device: bool = False) -> torch.Tensor:
    """All-reduce a small tensor as float64; identity for a single process. The result comes back on the
    CPU, or with `on_device` on the device of `values` (with NCCL, no host sync on a GPU)."""
    t = values.detach().to(torch.float64)
    if dist.is_available() and dist.is_initialized():
        t = t.to(_comm_device())
        dist.all_reduce(t, op=op)
    return t.to(values.device) if on_device else t.cpu()


def all_reduce_floats(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    return all_reduce_tensor(torch.tensor(values, dtype=torch.float64), op).tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list:
    """Every rank's `obj`, on every rank (for rare events: errors, hashes)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Rank0Failed(Failed):
    """What the other ranks raise when `run_on_rank0`'s function failed on rank 0; `kind` is its error's type."""

    def __init__(self, text: str, kind: str):
        super().__init__(text)
        self.kind = kind


def run_on_rank0(fn, *args, what: str = "operation", **kwargs):
    """Run `fn` on rank 0 and make its failure an error on every rank, not a hang."""
    error = None
    result = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # re-raised below, on rank 0 as itself
            error = exc
    status = broadcast_object(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    if status is not None:
        raise Rank0Failed(f"{what} failed on rank 0: {status[0]}: {status[1]}", status[0])
    return result


# ----------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------

def setup_logger(log_dir: str | os.PathLike, rank: int, debug: bool = False, name: str = "ddp",
                 keep: bool = False, named: Optional[str] = None) -> logging.Logger:
    """`rank_N.log` for every rank; console from rank 0 only (every rank with debug). A log dir that cannot
    be written is a ValueError (bad input) that names it (`named`: as the setting the user gave for it, a
    checkpoint dir that is the log dir too, say). With `keep` (the run dir is not this run's yet: it
    may be locked by another run) the file's records are kept instead: the next call for that file writes
    them first, and write_kept_logs() writes them where set-up ends before that."""
    logger = logging.getLogger(f"{name}.rank{rank}")
    path = Path(log_dir) / f"rank_{rank}.log"
    kept = [r for h in logger.handlers if isinstance(h, _KeptRecords) and h.path == path and not keep
            for r in h.take()]  # another file's (an earlier set-up in this process) are not this run's
    if keep:
        fh = _KeptRecords(path)
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(path, mode="a")
        except OSError as exc:
            raise ValueError(f"{named or f'log_dir {log_dir}'}: cannot write rank_{rank}.log there ({type(exc).__name__}: "
                             f"{exc}){symlink_note(log_dir)}") from exc
    close_logger(logger)  # a second trainer in one process must not double lines
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [RANK {rank}] %(levelname)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    fh.setFormatter(fmt)
    for record in kept:
        fh.handle(record)
    logger.addHandler(fh)
    if rank == 0 or debug:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        logger.addHandler(sh)
    return logger


def log_failure(logger: logging.Logger, message: str, exc: BaseException) -> None:
    """An ERROR line with the traceback of `exc`, in rank_N.log only: the console gets the failure once, as the
    script's `error:` line (or, from the Python API, as the exception that ends train())."""
    log_to_file(logger, logging.ERROR, message, (type(exc), exc, exc.__traceback__))


def log_to_file(logger: logging.Logger, level: int, message: str, exc_info=None) -> None:
    """Into rank_N.log only (or the records kept for it), not the console: for an end of set-up that the
    console is told in its own words (one `error:` line, say)."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, exc_info)
    for h in logger.handlers:
        if isinstance(h, (logging.FileHandler, _KeptRecords)):
            h.handle(record)


def log_set_up_failure(log_dir, rank: int, exc: BaseException) -> None:
    """`exc` with its traceback (torch's error under it) into rank_N.log, for a set-up that failed before the
    trainer had its logger; not into a dir another run holds (see write_kept_logs). A script that keeps its
    own set-up lines (the VJ2 one) ends them with its `set-up failed:` line: the traceback goes before it."""
    logger = logging.getLogger(f"ddp.rank{rank}")
    script_keeps = any(isinstance(h, _KeptRecords) for h in logger.handlers)
    if not script_keeps:
        setup_logger(log_dir, rank, keep=True)
    log_to_file(logger, logging.ERROR, "set-up timed out" if script_keeps else f"set-up failed: {exc}",
                (type(exc), exc, exc.__traceback__))
    if not script_keeps:
        write_kept_logs()


class _KeptRecords(logging.Handler):
    """A log file to be (`path`): the records of a logger whose run dir is not known to be this run's yet."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.records = path, []
        _KEPT_LOGS.add(self)

    def emit(self, record):
        self.records.append(record)

    def take(self) -> list:
        records, self.records = self.records, []
        return records

    def write_out(self) -> None:
        records = self.take()
        if not records:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.writelines(self.format(r) + "\n" for r in records)
        except OSError as exc:  # the console had them (rank 0); the error that ends set-up goes on
            print(f"cannot write {self.path}: {exc}", file=sys.stderr)


_KEPT_LOGS: "weakref.WeakSet[_KeptRecords]" = weakref.WeakSet()


def write_kept_logs(error: Optional[str] = None, level: int = logging.ERROR) -> None:
    """Write the records kept for run dirs (setup_logger(keep=True)) into their files, for a set-up that ended
    before its trainer took the dir, and the `error` that ended it (a `level` record): not into a dir another
    run holds."""
    for handler in list(_KEPT_LOGS):
        if not handler.records:
            continue
        if error:
            handler.records.append(logging.makeLogRecord({"levelname": logging.getLevelName(level), "levelno": level,
                                                          "msg": error}))
        holder, lock = lock_unless_another_run(handler.path.parent)
        if holder is None:
            handler.write_out()
        else:
            handler.take()
            print(f"{handler.path.parent} is in use by {holder}: this run's set-up lines are not written there",
                  file=sys.stderr)
        if lock is not None:
            lock.release()


def lock_unless_another_run(log_dir, note: str = "") -> tuple:
    """(who else holds the run dir's lock, or None; the lock taken for this process when it was free, or None).
    A holder that is this process, or a rank of this same run (the rendezvous address in its note), is no
    other run."""
    run = run_identity()
    lock = RunDirLock(log_dir)
    for _ in range(20):
        holder = lock.acquire(note + run)
        if holder is None:
            return None, lock
        if not holder.startswith(RunDirLock.UNNAMED):
            break
        time.sleep(0.05)  # taken this instant, its note not written yet: a peer rank that gives up too, say
    return (None if holder.startswith(RunDirLock.this_process()) or (run and run in holder) else holder), None


def symlink_note(path) -> str:
    """Where a symlink on the way to `path` leads (a link a run left, to a dir that is gone), or ''."""
    for p in (Path(path), *Path(path).parents):
        if p.is_symlink():
            return f"; {p} is a symlink to {os.readlink(p)}"
    return ""


def unwritable_dir(path) -> Optional[str]:
    """Why files cannot be created in `path` (made if missing), or its files not listed, or None: checked at
    set-up, so that a run does not train for hours to fail at its first save, nor take a dir whose states it
    cannot see for an empty one and start afresh over them."""
    try:
        Path(path).resolve().mkdir(parents=True, exist_ok=True)  # the target of a link whose dir has gone too
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write_probe.")
        os.close(fd)
        os.unlink(probe)
        os.listdir(path)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}{symlink_note(path)}"
    return None


def pid_namespace() -> str:
    """This process's PID namespace as Linux names it ("pid:[4026531836]"), or "" where it cannot tell."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def run_identity() -> str:
    """What the ranks of one multi-process run share and another run beside it does not (its rendezvous
    address), as the run-dir lock notes it; '' for a single process."""
    port = os.environ.get("MASTER_PORT")
    return f" [run at {os.environ.get('MASTER_ADDR', '')}:{port}]" if port else ""


class RunDirLock:
    """Exclusive locks on a run's dirs (`flock` on `.lock` in each: the log dir and the checkpoint dir), held
    by rank 0 while a trainer uses them: two runs there would each set the other's states aside and prune
    them. A holder is named by what it wrote into the file (pid, host, time). The lock dies with the process
    however it ends: a forked child (a DataLoader worker) closes its copy at once, so that an orphaned
    worker of a killed rank does not hold it."""

    NAME = ".lock"
    UNNAMED = "another process"  # a holder whose note is not written yet

    def __init__(self, *directories):
        unique = {Path(d).resolve(): Path(d) for d in directories}
        self.paths = [d / self.NAME for d in unique.values()]
        self._fds: list = []
        self._pid = os.getpid()
        # a lock whose holder was dropped (a trainer built, never trained nor closed) is let go with it
        weakref.finalize(self, RunDirLock._unlock, self._fds, self._pid)

    def acquire(self, note: str = "") -> Optional[str]:
        """Take every lock; None, or who holds one (then none is taken). A file system without locks gets a
        warning, not a refusal; a dir that cannot be written is left to the set-up checks to report. `note`
        follows the holder's pid, host and time in the file."""
        for path in self.paths:
            holder = self._take(path, note)
            if holder is not None:
                self.release()
                return f"{holder} ({path})"
        return None

    def _take(self, path: Path, note: str) -> Optional[str]:
        import fcntl
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or self.UNNAMED
            os.close(fd)
            return holder
        except OSError as exc:
            os.close(fd)
            logging.getLogger(__name__).warning("cannot lock %s (%s): nothing stops a second run there", path, exc)
            return None
        os.ftruncate(fd, 0)
        # the PID namespace: a pid means this process only to readers in the same one (training_logs)
        namespace = f" [{pid_namespace()}]" if pid_namespace() else ""
        stamp = f"{self.this_process()}since {time.strftime('%Y-%m-%d %H:%M:%S')}{note}{namespace}"
        os.pwrite(fd, f"{stamp}\n".encode(), 0)
        self._fds.append(fd)
        _HELD_LOCK_FDS.add(fd)
        return None

    @staticmethod
    def this_process() -> str:
        """How a holder's text begins when this process holds the lock."""
        return f"pid {os.getpid()} on {socket.gethostname()} "

    def release(self) -> None:
        self._unlock(self._fds, self._pid)

    @staticmethod
    def _unlock(fds: list, pid: int) -> None:
        import fcntl
        if os.getpid() != pid:  # a forked child: its copies were closed at the fork
            return
        while fds:
            # off the list before it is closed: a Ctrl-C in between (a rank gets it twice, from its group and its
            # parent) must not leave a closed descriptor there for the finalizer to close again (EBADF, or another
            # file's, reused); at worst the lock stays held until the process exits
            fd = fds.pop()
            _HELD_LOCK_FDS.discard(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for a child that may still share it
            finally:
                os.close(fd)


_HELD_LOCK_FDS: set = set()


def started_by_my_parent(holder: str) -> bool:
    """Whether a lock holder's text ("pid N on HOST since ...") names a sibling of this process (one parent)."""
    m = re.match(r"pid (\d+) on (\S+) ", holder)
    if not m or m.group(2) != socket.gethostname():
        return False
    try:
        return psutil.Process(int(m.group(1))).ppid() == os.getppid()
    except psutil.Error:
        return False


def _close_held_locks_in_child() -> None:
    for fd in _HELD_LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass  # nothing to close: the lock is the parent's either way
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


def close_logger(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


# ----------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------

# The readings MemoryManager.stats() gives, which train records carry every memory_check_interval steps
MEMORY_FIELDS = frozenset({"cpu_rss_gb", "cpu_anon_gb", "cpu_peak_rss_gb", "cpu_peak_anon_gb", "cuda_allocated_gb",
                           "cuda_reserved_gb", "cuda_peak_gb"})


class MemoryManager:
    """Periodic memory readings and cleanup, driven by the optimizer step counter."""

    def __init__(self, device: torch.device, logger: logging.Logger, check_interval: int = 50,
                 cleanup_interval: int = 100, max_memory_gb: Optional[float] = None):
        self.device = device
        self.logger = logger
        self.check_interval = check_interval
        self.cleanup_interval = cleanup_interval
        self.max_memory_gb = max_memory_gb
        self.process = psutil.Process()
        self.peak_rss_gb = 0.0
        self.peak_anon_gb = 0.0

    def stats(self) -> dict:
        """RSS, and anonymous memory (RSS less file-backed and shared pages): pages of memory-mapped
        data count in RSS but the kernel can drop them at any time, so the limit applies to `anon`."""
        info = self.process.memory_info()
        rss = info.rss / 2**30
        anon = (info.rss - getattr(info, "shared", 0)) / 2**30
        self.peak_rss_gb = max(self.peak_rss_gb, rss)
        self.peak_anon_gb = max(self.peak_anon_gb, anon)
        out = {"cpu_rss_gb": round(rss, 4), "cpu_anon_gb": round(anon, 4),
               "cpu_peak_rss_gb": round(self.peak_rss_gb, 4), "cpu_peak_anon_gb": round(self.peak_anon_gb, 4)}
        if self.device.type == "cuda":
            i = self.device.index
            out.update(cuda_allocated_gb=round(torch.cuda.memory_allocated(i) / 2**30, 4),
                       cuda_reserved_gb=round(torch.cuda.memory_reserved(i) / 2**30, 4),
                       cuda_peak_gb=round(torch.cuda.max_memory_allocated(i) / 2**30, 4))
        return out

    def on_step(self, step: int) -> Optional[dict]:
        """Readings every `check_interval` steps (None otherwise); cleanup every `cleanup_interval`."""
        if self.cleanup_interval and step % self.cleanup_interval == 0:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if not self.check_interval or step % self.check_interval:
            return None
        s = self.stats()
        self.logger.debug("memory at step %d: %s", step, s)
        used = s.get("cuda_reserved_gb", s["cpu_anon_gb"])
        if self.max_memory_gb and used > self.max_memory_gb:
            self.logger.warning("memory %.2f GB exceeds max_memory_gb=%.2f at step %d",
                                used, self.max_memory_gb, step)
        return s


# ----------------------------------------------------------------------------
# Data loading
# ----------------------------------------------------------------------------

class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for exact mid-epoch resume.

    It is also used for one process (num_replicas=1) so that `world_size=2,
    batch_size=B` and `world_size=1, batch_size=2B` see the same global batches.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def set_start_index(self, index: int) -> None:
        """Skip the first `index` samples of this rank's share (applies to the next iteration only)."""
        self.start_index = index

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.start_index:]
        self.start_index = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ShardSampler(Sampler):
    """Evaluation shard: rank r takes samples r, r+W, ... with no padding, so after an
    all-reduce of sums and counts no sample is lost or counted twice."""

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        self.indices = range(rank, dataset_len, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def _init_worker(worker_id: int) -> None:
    # torchrun, SLURM and a Ctrl-C signal a rank's whole process group (SLURM: every process of the step),
    # workers included. A worker killed by the stop signal fails the rank's next batch and turns a clean stop
    # (save, exit 75) into a crash; so the workers ignore the signals the rank stops on, and the rank ends them
    # when it stops (stop_workers, with SIGKILL for a stuck one; a rank that dies outright takes them with it:
    # they watch their parent).
    for name in StopSignal.SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # Each worker's torch seed is already distinct (base_seed + id); derive the rest from it.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class _KeyedSampler(Sampler):
    """Yields (epoch, index) instead of index, for _SeededSamples; the epoch travels with each index
    because persistent workers hold a copy of the dataset made when they started."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple]:
        epoch = getattr(self.sampler, "epoch", 0)
        return ((epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def set_start_index(self, index: int) -> None:
        self.sampler.set_start_index(index)


class _Wrapped(Dataset):
    """A dataset the kit's loaders wrap: `loader.dataset` still has the caller's attributes (its tokens, vocab)."""

    def __getattr__(self, name):
        # not `dataset` (unset while a worker unpickles this: recursion), nor a protocol the wrapper does not
        # keep: the DataLoader would call a Subset's __getitems__ with this wrapper's keys
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


SAMPLE_NOTE = "(sample "


class _NamedSamples(_Wrapped):
    """A dataset whose errors name their sample, in a note (`(sample 5 of the training set)`) that a data
    error's line and a worker's traceback show: a bad file is found by its index. A dataset that reads many
    samples at once (__getitems__) is left as it is."""

    def __init__(self, dataset: Dataset, train: bool):
        self.dataset, self.what = dataset, " of the training set" if train else ""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except Exception as exc:
            # one error object raised again (a dataset that keeps its failure) would pile up every sample's note
            exc.__notes__ = [n for n in getattr(exc, "__notes__", ()) if not n.startswith(SAMPLE_NOTE)]
            exc.add_note(f"{SAMPLE_NOTE}{index}{self.what})")
            raise


def error_text(exc: BaseException) -> str:
    """'Type: message', and the notes an error carries (the sample _NamedSamples names)."""
    return " ".join([f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                     *getattr(exc, "__notes__", ())])


class _SeededSamples(_Wrapped):
    """Seeds torch, numpy and random before each sample a DataLoader worker reads, from (seed, train,
    epoch, index). A worker's streams otherwise depend on which samples it read before, which a resumed
    run (workers restarted mid-epoch) or another worker count changes: random draws in `__getitem__`
    (augmentation) then differ. Seeded per sample, they are the same in a resumed run as in an unbroken
    one, with any number of workers and under either data strategy."""

    def __init__(self, dataset: Dataset, seed: int, train: bool):
        self.dataset, self.entropy = dataset, (seed % 2**64, int(train))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple):
        epoch, index = key
        state = np.random.SeedSequence((*self.entropy, epoch, index)).generate_state(2, np.uint64)
        torch.default_generator.manual_seed(int(state[0]))  # the CPU's: torch.manual_seed costs 100 us more
        np.random.seed(int(state[1]) % 2**32)
        random.seed(int(state[1]))
        return self.dataset[index]


def capped_workers(requested: int, local_world_size: int, world_size: int) -> int:
    """At most the CPUs one rank may use (cpus_per_rank)."""
    return max(0, min(requested, cpus_per_rank(local_world_size, world_size)))


def build_dataloader(dataset: Dataset, batch_size: int, *, train: bool, rank: int, world_size: int,
                     seed: int, num_workers: int = 0, pin_memory: bool = False,
                     timeout_s: float = 120.0, collate_fn=None, local_world_size: Optional[int] = None,
                     prefetch_factor: int = 2) -> DataLoader:
    """A DataLoader that cannot desynchronise ranks.

    Training: a shuffling distributed sampler with drop_last, so every rank runs
    the same number of steps. Evaluation: a padding-free shard. Worker count is
    capped by the CPUs per rank; the loader owns its generator, so building it
    never consumes the global RNG.
    """
    if train:
        sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                              shuffle=True, seed=seed, drop_last=True)
        if len(sampler) < batch_size:
            raise ValueError(f"training set of {len(dataset)} samples gives {len(sampler)} per rank, "
                             f"fewer than batch_size={batch_size}: no full batch per epoch")
    else:
        sampler = ShardSampler(len(dataset), rank, world_size)
    workers = capped_workers(num_workers, local_world_size or world_size, world_size)
    if not hasattr(dataset, "__getitems__"):
        dataset = _NamedSamples(dataset, train)
    generator = torch.Generator()
    generator.manual_seed(seed + rank)
    kwargs = dict(num_workers=workers, pin_memory=pin_memory, drop_last=train,
                  generator=generator, collate_fn=collate_fn)
    if workers > 0:
        kwargs.update(persistent_workers=True, prefetch_factor=prefetch_factor,
                      worker_init_fn=_init_worker, timeout=timeout_s)
        # Without workers the process's own streams serve the samples, and the resumable state holds them.
        dataset, sampler = _SeededSamples(dataset, seed, train), _KeyedSampler(sampler)
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(atexit.register(_kill_leftover_workers))
    return _Loader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


class _Loader(DataLoader):
    """A DataLoader that notes its worker processes, for _kill_leftover_workers."""

    def _get_iterator(self):
        it = super()._get_iterator()
        _WORKERS.update(getattr(it, "_workers", ()))
        return it


_EXIT_HOOK: list = []
_WORKERS: "weakref.WeakSet" = weakref.WeakSet()


def _kill_leftover_workers() -> None:
    """At exit, multiprocessing ends the child processes still running with terminate() (a SIGTERM), then
    waits for them without a timeout. Our loader workers ignore SIGTERM (see _init_worker), so after an
    uncaught error or a Ctrl-C outside train() (which stops its own) the process would hang there: this runs
    first (atexit runs the handlers registered last first; multiprocessing registered its own on import) and
    kills the workers left, which have nothing to save (DataLoader's SIGCHLD handler, which would call each
    such end a crash, "Exception ignored in atexit callback", goes first)."""
    if _WORKERS and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in list(_WORKERS):
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _kill_stopped_workers(it: Any, workers: list) -> None:
    """Workers frozen whole (SIGSTOP) go first: the shutdown would wait 5 s for each, and, with pin_memory, for
    ever for the pin thread, blocked in the hand-over of a batch such a worker had queued. Out of DataLoader's
    SIGCHLD watch first, which would take their end for a crash and raise in this thread."""
    def stopped(w) -> bool:
        try:
            return w.pid is not None and psutil.Process(w.pid).status() in (psutil.STATUS_STOPPED,
                                                                          psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False
    frozen = [w for w in workers if stopped(w)]
    if not frozen:
        return
    if getattr(it, "_worker_pids_set", False):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    for w in frozen:
        w.kill()
        w.join(5.0)


def stop_workers(loader: Any) -> None:
    """Stop the persistent worker processes of a DataLoader (or of a DispatchLoader's reader) now.
    DataLoader has no public close(). Left to the garbage collector together with the trainer that
    holds it, the loader's queues can be finalized before its workers are told to stop: each worker
    then lingers, holding its memory, until it is killed after a 5 s timeout."""
    loader = getattr(loader, "reader", loader)
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        workers = list(getattr(it, "_workers", []))
        _kill_stopped_workers(it, workers)
        it._shutdown_workers()
        for w in workers:  # a stuck worker outlives terminate(): its SIGTERM is ignored (see _init_worker)
            if w.is_alive():
                w.kill()
                w.join(5.0)
        loader._iterator = None


def map_tensors(fn, obj: Any, leaf=None) -> Any:
    """`obj` with `fn` applied to every tensor in it (nested lists, tuples, namedtuples, mappings such as dicts
    and HF's BatchEncoding, and dataclasses), and to every list or tuple that `leaf(seq)` says is one value;
    other leaves are kept as they are."""
    if isinstance(obj, torch.Tensor) or (leaf is not None and isinstance(obj, (list, tuple)) and leaf(obj)):
        return fn(obj)
    return _rebuild(obj, lambda v, _: map_tensors(fn, v, leaf))


def _rebuild(obj: Any, fn) -> Any:
    """A container like `obj` whose items are fn(item, key); `obj` itself when it is no container."""
    if isinstance(obj, dict):
        out = type(obj)((k, fn(v, k)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a state_dict's module versions
            out._metadata = obj._metadata
        return out
    if isinstance(obj, collections.abc.Mapping):  # UserDict, BatchEncoding: built from a dict
        items = {k: fn(v, k) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # a mapping that is not built from a dict: its items, in a dict
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: fn(getattr(obj, f.name), f.name)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        items = [fn(v, i) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class NotSplittable(TypeError):
    """A batch holds a value that cannot be divided by sample (a count for the whole batch)."""


def split_batch(batch, part: int, parts: int):
    """Samples part, part+parts, ... of a batch of n samples (batch_len): its tensors with n rows, and its
    lists of n per-sample values (ids, which default_collate keeps as a list; variable-length tensors) alike.
    A value that is not per sample cannot be divided: a number or a 0-dim tensor (a count would stay the whole
    batch's in every part, and the loss shrink by `parts`) or a tensor of another length (time-major data);
    NotSplittable names it. Strings and None stay whole."""
    n = batch_len(batch)

    def per_sample_list(x) -> bool:  # n strings or tensors that are not fields of n rows each
        return (isinstance(x, (list, tuple)) and not hasattr(x, "_fields") and len(x) == n
                and all(isinstance(v, (str, bytes, torch.Tensor)) for v in x)
                and not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n for v in x))

    def split(x, where: str):
        if isinstance(x, torch.Tensor):
            if x.dim() >= 1 and x.shape[0] == n:
                return x[part::parts]
            raise NotSplittable(f"{where} is a tensor of shape {tuple(x.shape)}, not {n} samples along its first "
                                f"dimension")
        if isinstance(x, numbers.Number):
            raise NotSplittable(f"{where} is {type(x).__name__} {x}, one value for the whole batch")
        if x is None or isinstance(x, (str, bytes)):
            return x
        if per_sample_list(x):
            return x[part::parts]
        return _rebuild(x, lambda v, key: split(v, f"{where}[{key!r}]"))
    return split(batch, "batch")


def batch_len(batch) -> int:
    """Samples in a batch: the leading dimension of its first tensor of one dimension or more (in the order
    map_tensors walks it)."""
    rows = []
    map_tensors(lambda t: rows.append(t.shape[0]) if t.dim() >= 1 else None, batch)
    if not rows:
        raise TypeError(f"a batch holds no tensor of one dimension or more: {type(batch).__name__}")
    return rows[0]


class _DispatchSampler:
    """What the trainer asks of a train loader's sampler, forwarded to rank 0's reader; positions
    count this rank's samples, rank 0's reader counts global ones."""

    def __init__(self, inner, world_size: int):
        self.inner, self.world_size = inner, world_size

    def set_epoch(self, epoch: int) -> None:
        if self.inner is not None:
            self.inner.set_epoch(epoch)

    def set_start_index(self, index: int) -> None:
        if self.inner is not None:
            self.inner.set_start_index(index * self.world_size)


class BatchLoadError(RuntimeError):
    """A batch that rank 0 could not read for a rank under `--data_strategy dispatch`; raised by the
    loader's iterator on that rank, so the trainer handles it like a bad sample under `shard`.
    `fatal`: rank 0's reader itself broke (a dead worker, a broken stream), not one sample."""

    def __init__(self, text: str, fatal: bool = False, counted: bool = True):
        super().__init__(text)
        self.fatal, self.counted = fatal, counted


class CollectiveFailed(RuntimeError):
    """A collective outside the training step failed (a peer is gone or stuck): not a data error."""


class _FailedSample:
    """Stands in for a sample (or a rank's part) that raised while rank 0 read it. Not `counted`: a part
    that loaded but fails with another's (see _PartsCollate)."""

    def __init__(self, text: str, fatal: bool = False, counted: bool = True):
        self.text, self.fatal, self.counted = text, fatal, counted


class _TolerantDataset(Dataset):
    """Rank 0's view of a map-style dataset: a sample that raises becomes a `_FailedSample`, so one
    bad sample fails only the part that holds it, as it fails only one rank's batch under shard."""

    def __init__(self, dataset: Dataset):
        self.dataset = _NamedSamples(dataset, train=True)  # its error names the sample, as under shard

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except Exception as exc:  # reported to the rank whose part it is, in its step
            return _FailedSample(error_text(exc))


class _PartsCollate:
    """Collate a global batch as one batch per rank: samples r, r+W, ... for rank r, exactly the
    samples (and the collate call) that the sharded sampler gives rank r.

    `together` (a stream): a part that fails fails every part. A rank replays a batch it loaded before in
    place of a failed one, and a stream cannot be read again by index for one; so that every rank has
    such a batch from the same step on, or none has and all stop together, ranks load or fail alike."""

    def __init__(self, collate_fn, parts: int, together: bool = False):
        self.collate_fn, self.parts, self.together = collate_fn, parts, together

    def __call__(self, samples: list) -> list:
        parts = [self._one(samples[r::self.parts]) for r in range(self.parts)]
        failed = [(r, p) for r, p in enumerate(parts) if isinstance(p, _FailedSample)]
        if self.together and failed:
            r, first = failed[0]
            parts = [p if isinstance(p, _FailedSample) else
                     _FailedSample(f"{first.text} (in rank {r}'s part; a stream's parts load or fail together)",
                                   counted=False) for p in parts]
        return parts

    def _one(self, samples: list):
        failed = next((s for s in samples if isinstance(s, _FailedSample)), None)
        if failed is not None:
            return failed
        try:
            return self.collate_fn(samples)
        except Exception as exc:  # under shard this fails only this rank's batch too
            return _FailedSample(f"{type(exc).__name__}: {exc}")


class DispatchLoader:
    """Rank 0 reads global batches and sends every rank its part (`--data_strategy dispatch`),
    for sources that cannot be sharded, such as a stream. The end of the data travels with the
    batches, so every rank sees it at the same step; so does a part that failed to load, which its
    rank raises as a `BatchLoadError` before the loader goes on, as under shard. With the same seed
    it yields exactly the per-rank batches (and failures) of the sharded loader."""

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int,
                 collate_fn=None, peers_wait_s: float = 0.0, **loader_kwargs):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        stream = isinstance(dataset, torch.utils.data.IterableDataset)
        # a stream's reader runs in this process (no workers): its backstop comes past the peers' wait
        self.backstop_s = loader_backstop_s(0 if stream else loader_kwargs.get("num_workers", 0),
                                            loader_kwargs.get("timeout_s"), peers_wait_s)
        parts = _PartsCollate(self.collate_fn, world_size, together=stream)
        self.reader, problem = None, None
        if rank == 0 and not stream and len(dataset) < batch_size * world_size:  # told to every rank, below
            problem = (f"training set of {len(dataset)} samples gives {len(dataset) // world_size} per rank, fewer "
                       f"than batch_size={batch_size}: no full batch per epoch")
        elif rank == 0:
            if stream:
                # drop_last as for training under shard: a short last global batch would leave a rank no samples
                self.reader = DataLoader(dataset, batch_size=batch_size * world_size, collate_fn=parts,
                                         drop_last=True)
            else:
                self.reader = build_dataloader(_TolerantDataset(dataset), batch_size * world_size, train=True,
                                               rank=0, world_size=1, seed=seed, collate_fn=parts, **loader_kwargs)
        reader_sampler = getattr(self.reader, "sampler", None)
        self.sampler = _DispatchSampler(reader_sampler if hasattr(reader_sampler, "set_start_index") else None,
                                        world_size)
        self.generator = self.reader.generator if self.reader is not None and self.reader.generator is not None \
            else torch.Generator()
        length = None
        if self.reader is not None:
            try:
                length = len(self.reader)
            except TypeError:  # a stream of unknown length: the run is bounded by max_steps
                length = None
        self.length, problem = broadcast_object((length, problem))
        if problem:
            raise ValueError(problem)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("a streamed dataset has no length")
        return self.length

    def __iter__(self) -> "_DispatchIterator":
        return _DispatchIterator(self)


class LoaderStuck(RuntimeError):
    """No batch within a loader's backstop."""


def loader_backstop_s(num_workers: int, timeout_s: Optional[float], peers_wait_s: float = 0.0) -> Optional[float]:
    """The backstop of a loader with workers: well past its own timeout, which answers first when no batch comes
    at all (one next() may wait that long for each batch a worker has ahead of the one it needs). Without
    workers (peers_wait_s given) this process reads, and nothing else ends a read that hangs there, not even a
    stop signal (its flag is read between steps): under a launcher that does not end the ranks its peers leave
    (srun without --kill-on-bad-exit), the rank stayed until the job's time limit. Its alarm comes once the
    peers have given up on it too (peers_wait_s: the longest wait in a collective)."""
    if not timeout_s:
        return None
    if num_workers:
        return 4 * timeout_s
    return max(4 * timeout_s, peers_wait_s) if peers_wait_s else None


@contextlib.contextmanager
def backstop(seconds: Optional[float]):
    """LoaderStuck in the main thread after `seconds` (SIGALRM). A DataLoader's own timeout covers the wait for
    a batch, not the hand-over of its tensors: a worker frozen whole (SIGSTOP, a frozen cgroup) with a batch
    already queued holds the rank in that hand-over for good, where no signal to stop gets it out. Off in
    another thread, and while the process has a timer of its own (it is left as it is)."""
    if (seconds is None or threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        yield
        return
    armed = [True]

    def expired(signum, frame):
        if armed[0]:  # not once the wait is over: a batch that has just come is no stuck worker
            raise LoaderStuck(f"DataLoader timed out: no batch after {seconds:g} seconds")
    previous = signal.signal(signal.SIGALRM, expired)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        armed[0] = False
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A view as a tensor of its own: pickled to be sent, a view carries its whole storage (a row of a
    preloaded dataset tensor sent every sample of it)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class _DispatchIterator:
    """One epoch of a DispatchLoader. A class, not a generator: a generator that raises is over, and
    after a batch that failed to load the epoch must go on."""

    def __init__(self, loader: DispatchLoader):
        self.loader = loader
        self.batches = iter(loader.reader) if loader.reader is not None else None
        self.ended = False

    def __iter__(self) -> "_DispatchIterator":
        return self

    def __next__(self):
        if self.ended:
            raise StopIteration
        mine = self._receive(self._read() if self.batches is not None else None)
        if mine is None:
            self.ended = True
            raise StopIteration
        if isinstance(mine, _FailedSample):
            raise BatchLoadError(f"{mine.text} (read by rank 0 for rank {self.loader.rank}, data_strategy dispatch)",
                                 fatal=mine.fatal, counted=mine.counted)
        return mine

    def _read(self) -> list:
        """Rank 0: the next global batch, one part per rank; None for every rank at the end of the data."""
        world_size = self.loader.world_size
        try:
            with backstop(self.loader.backstop_s):
                parts = next(self.batches)
            return [map_tensors(_compact, part) for part in parts]
        except StopIteration:
            return [None] * world_size
        except Exception as exc:  # not one sample (a dead worker, a broken stream): the reader is done for
            return [_FailedSample(f"{type(exc).__name__}: {exc}", fatal=True)] * world_size

    @staticmethod
    def _receive(parts: Optional[list]):
        if dist.is_available() and dist.is_initialized():
            mine = [None]
            try:
                dist.scatter_object_list(mine, parts, src=0)
            except Exception as exc:  # rank 0 is gone or stuck: the trainer must not take it for bad data
                raise CollectiveFailed(f"{type(exc).__name__}: {exc}") from exc
            return mine[0]
        return parts[0]


# ----------------------------------------------------------------------------
# Signals
# ----------------------------------------------------------------------------

def ctrl_c_ignored() -> bool:
    """The shell told this process to ignore Ctrl-C (`cmd &` in a script): it stays ignored, in set-up, in training
    and in the ranks it starts."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class StopSignal:
    """Sets a flag on SIGINT/SIGTERM/SIGUSR1; the trainer agrees on it at the next step boundary.

    The handler does nothing but set the flag: no I/O, no collectives. `with StopSignal(names) as s:`
    installs it for `names` and restores the previous handlers on leaving; install() adds the others.
    """

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
    # What schedulers and launchers send to preempt. Not SIGINT: before training starts, Ctrl-C (a person)
    # should stop a set-up at once; there is nothing to save yet.
    PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, names: tuple = SIGNALS):
        self.names = names
        self.received: Optional[int] = None
        self._previous = {}

    def _handler(self, signum, frame):
        self.received = signum

    def install(self, names: Optional[tuple] = None) -> "StopSignal":
        for name in names or self.names:
            sig = getattr(signal, name, None)
            if sig == signal.SIGINT and ctrl_c_ignored():
                continue
            if sig is not None and sig not in self._previous:
                try:
                    self._previous[sig] = signal.signal(sig, self._handler)
                except ValueError:  # not the main thread (e.g. a notebook worker): no handlers
                    return self
        return self

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    @property
    def previous(self) -> dict:
        """The handlers that restore() puts back, by signal."""
        return self._previous

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def name(self) -> Optional[str]:
        return None if self.received is None else signal.Signals(self.received).name


class FirstSignal:
    """The stops a script caught from its first lines, before torch's import: its handler appends to
    `received` until train_preemptible (or spawn_local) installs its own and reads `value` after that, so no
    signal falls in between. Those handlers then give the signals back to the default (hand_over), not to the
    early handler, which would ignore every later stop; a script that does not train calls release()."""

    def __init__(self, received: list):
        self.received = received

    @property
    def value(self) -> int:
        return self.received[0] if self.received else 0

    def hand_over(self, previous: dict) -> None:
        """`previous`: the handlers that the new ones will restore; the early ones become the default."""
        for name in StopSignal.PREEMPT_SIGNALS:
            sig = getattr(signal, name)
            if sig in previous:
                previous[sig] = signal.SIG_DFL

    def release(self) -> None:
        """The default handlers back; a stop caught meanwhile is raised again, as if they had never been there."""
        for name in StopSignal.PREEMPT_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        if self.received:
            os.kill(os.getpid(), self.received[0])


# How long set-up may go on after a preempting signal before a rank gives up on it: long enough for peers
# that started a little later to join and stop together at the first step, short of the 30 s that SLURM
# (KillWait) and torchrun give by default before SIGKILL. The variable of that name sets another (read
# before any config: the watch starts first); a cluster with a longer KillWait may give set-up longer.
SETUP_STOP_GRACE_S = 20.0


def setup_stop_grace_s() -> float:
    text = os.environ.get("SETUP_STOP_GRACE_S")
    if text is None:
        return SETUP_STOP_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"SETUP_STOP_GRACE_S={text!r} in the environment: expected seconds > 0")
    return value


class SetUpWatch:
    """While set-up runs under a StopSignal. Set-up goes on after a first preempting signal, so that the
    ranks meet at their first step and stop there together. Python runs a handler only between bytecodes,
    so a rank blocked in C++ (a rendezvous waiting for a peer that died before it joined) would see the
    flag only after dist_timeout; Python's C-level handler also writes each signal to the wakeup fd, and a
    thread watches it:
    - a second such signal ends the process at once (exit 128 + signal);
    - `grace_s` (default: setup_stop_grace_s()) after the first, a set-up still running ends the process
      with EXIT_PREEMPTED, after writing the PREEMPTED marker into `log_dir` (when given). Nothing has been
      trained in this process yet, so nothing is lost: relaunching resumes from the last state on disk.
    Ctrl-C (SIGINT) is Python's KeyboardInterrupt here, which stops set-up at once; but Python drops one
    raised while a __del__ or a weakref callback runs, and set-up would go on to train. A set-up that
    ends after a SIGINT the watch saw therefore raises KeyboardInterrupt on leaving, and a second SIGINT
    ends a process still in set-up at once, as a second preempting signal does."""

    def __init__(self, names: tuple = StopSignal.PREEMPT_SIGNALS, grace_s: Optional[float] = None,
                 log_dir: Optional[str | os.PathLike] = None, received: Optional[int] = None):
        self.signums = {getattr(signal, n) for n in names if hasattr(signal, n)}
        self.grace_s = setup_stop_grace_s() if grace_s is None else grace_s
        self.log_dir = log_dir
        self.received = received  # a stop that came before the watch (its grace starts at the watch)
        self.interrupted_at: Optional[float] = None  # when the watch saw the first SIGINT
        self._previous_fd = None
        self._done = False
        # set-up finishing and the watcher giving up exclude each other: never both
        self._ending = threading.Lock()

    def __enter__(self) -> "SetUpWatch":
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no handlers were installed either
            self._close()
            return self
        self._thread = threading.Thread(target=self._watch, daemon=True, name="set-up signal watch")
        self._thread.start()
        return self

    # A stop sent to a process group and also passed on by a parent (spawn_local, a launcher) arrives twice
    # within milliseconds: that is one stop, not a second.
    REPEAT_AFTER_S = 0.5

    def _watch(self) -> None:
        first, first_signum = (None, None) if self.received is None else (time.monotonic(), self.received)
        poller = select.poll()  # not select(): it fails on a descriptor above 1023
        poller.register(self._read, select.POLLIN)
        while True:
            wait = None if first is None else max(0.0, first + self.grace_s - time.monotonic())
            if not poller.poll(None if wait is None else wait * 1000):
                return self._give_up(first_signum)
            data = os.read(self._read, 64)
            if not data:
                return
            for signum in data:
                if signum == signal.SIGINT and signum not in self.signums:  # Ctrl-C, not a stop to agree on
                    self._interrupt()
                    continue
                if signum not in self.signums:
                    continue
                if first is None:
                    first, first_signum = time.monotonic(), signum
                elif time.monotonic() - first >= self.REPEAT_AFTER_S:
                    os.write(2, f"second {signal.Signals(signum).name} during set-up: exiting at once\n".encode())
                    os._exit(128 + signum)

    def _interrupt(self) -> None:
        now = time.monotonic()
        if self.interrupted_at is None:
            self.interrupted_at = now
        elif now - self.interrupted_at >= self.REPEAT_AFTER_S:
            os.write(2, b"second SIGINT during set-up: exiting at once\n")
            os._exit(128 + signal.SIGINT)

    def _give_up(self, signum: int) -> None:
        self._ending.acquire()  # held until the process is gone
        if self._done:  # set-up finished just now: the trainer stops at its first step
            self._ending.release()
            return
        name = signal.Signals(signum).name
        where, code = "", EXIT_PREEMPTED
        holder = self._other_holder()
        if holder is not None:  # a run refused there, or about to be: the marker would be the other run's
            where, code = f"; {self.log_dir} is in use by {holder}: no marker there", 1
        elif self.log_dir is not None:
            write_kept_logs()
            record = {"step": None, "signal": name, "stopped_during": "set-up"}
            try:
                where = f"; marker {write_preempted_marker(self.log_dir, record)}"
            except OSError as exc:
                where = f"; could not write the PREEMPTED marker into {self.log_dir}: {exc}"
        os.write(2, (f"{name} {self.grace_s:g}s ago and set-up has not finished (a peer that never joined?): "
                     f"nothing was trained here, exiting {code}{where}\n").encode())
        os._exit(code)

    GIVING_UP = " (stopping in set-up)"

    def _other_holder(self) -> Optional[str]:
        """Who else holds the run dir's lock: None for nobody, this process's trainer, or a rank of this
        same run (its trainer, or one that gives up too and writes the same marker)."""
        if self.log_dir is None:
            return None
        # a lock taken here stays held until os._exit: the marker is written under it
        holder, self._held = lock_unless_another_run(self.log_dir, self.GIVING_UP)
        return holder

    def __exit__(self, exc_type, *exc) -> None:
        if self._previous_fd is None:
            return
        with self._ending:
            self._done = True
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the watcher reads end-of-file and returns
        self._thread.join()  # it has read every signal that came before the line above
        os.close(self._read)
        if self.interrupted_at is not None and exc_type is None:
            raise KeyboardInterrupt("SIGINT during set-up")

    def _close(self) -> None:
        os.close(self._write)
        os.close(self._read)


# ----------------------------------------------------------------------------
# Checkpoint I/O
# ----------------------------------------------------------------------------

class CheckpointError(Failed):
    """A checkpoint that could not be written or read; the message names the file and why."""


class CheckpointWriteHung(CheckpointError):
    """A background write still running when every rank stops waiting for it (a hung file system)."""


def bad_run_name(name: str) -> Optional[str]:
    """Why `name` cannot name a run dir under the scripts' own parent dir (None if it can): an absolute
    path or a '..' would put the run, and the states a relaunch resumes, somewhere else."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*", name):
        return (f"must be names of letters, digits, '.', '_' or '-' (not first), joined by '/', got {name!r}; "
                f"to write elsewhere, set the directories themselves")
    return None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file that hashes what goes through it, so the digest needs no second read."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as exc:  # torch.save reports it as "unexpected pos N vs M": kept, to raise instead
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _atomic_write(path: Path, write, before_replace=None) -> str:
    """Temp file in the same directory, fsync, `before_replace()`, rename, fsync the directory;
    returns the SHA-256 of what was written."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # ranks may share a file system
    try:
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            try:
                write(out)
            except Exception as exc:
                if out.error is not None and out.error is not exc:  # say "No space left on device"
                    raise out.error from exc
                raise
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return out.sha.hexdigest()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`text` into `path` through a temp file in the same directory: a reader sees the old or the new file."""
    _atomic_write(Path(path), lambda f: f.write(text.encode()))


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Write `obj` with torch.save through a temp file in the same directory, fsync, rename;
    then a `.sha256` sidecar, written the same way. The previous file at `path` survives any
    failure, and a sidecar never describes another file than the one beside it: at worst (a crash
    or a full disk between the two writes) a file has no sidecar and loads without the check."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar = path.with_name(path.name + ".sha256")

    def drop_old_sidecar():
        # Gone for good before the new file takes the name: a stale digest would fail the new file,
        # and with it the only checkpoint left, at its next load.
        if sidecar.exists():
            sidecar.unlink()
            _fsync_dir(path.parent)

    digest = _atomic_write(path, lambda f: torch.save(obj, f), before_replace=drop_old_sidecar)
    try:
        _atomic_write(sidecar, lambda f: f.write(f"{digest}  {path.name}\n".encode()))
    except OSError as exc:
        raise CheckpointError(f"{path} was written, but not its SHA-256 sidecar ({exc}); "
                              "it loads without the checksum check") from exc
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu", verify: bool = True) -> dict:
    """Load with weights_only=True (never falls back); check the SHA-256 sidecar when present."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    sidecar = path.with_name(path.name + ".sha256")
    if verify and sidecar.exists():
        try:  # a CheckpointError, like any unreadable state: the resume tries the one before it on every rank
            text = sidecar.read_text(errors="replace")
            actual = sha256_file(path)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read it to check its SHA-256: {exc}") from exc
        expected = text.split()[0] if text.split() else ""
        if not re.fullmatch(r"[0-9a-f]{64}", expected):
            raise CheckpointError(f"checkpoint {path}: its sidecar {sidecar} holds no SHA-256 digest "
                                  f"({text[:80]!r}); delete the sidecar to load the checkpoint unchecked")
        if actual != expected:
            raise CheckpointError(f"checkpoint {path} fails its SHA-256 check "
                                  f"(expected {expected[:12]}…, got {actual[:12]}…): corrupt or truncated")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} {why_not_loadable(path, exc)}") from exc


def why_not_loadable(path: Path, exc: Exception) -> str:
    """torch.load's error in one line, without its advice to load with weights_only=False (arbitrary code)."""
    import pickle
    import zipfile
    if isinstance(exc, OSError):  # is_zipfile would hide it: it takes a file it cannot read for no zip
        return f"cannot be read: {exc}"
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since torch 1.6
        return (f"cannot be loaded: not a whole zip archive as torch.save writes ({path.stat().st_size} bytes: "
                f"truncated, or another kind of file)")
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        return (f"cannot be loaded safely: it holds objects that weights_only=True refuses "
                f"({weights_only_refusal(text)})")
    return f"cannot be loaded: {type(exc).__name__}: {text.splitlines()[0] if text.strip() else 'the file ends early'}"


def weights_only_refusal(text: str) -> str:
    """What torch.load(weights_only=True) refused, from its error: without its first paragraph and numbered
    options, which advise loading with weights_only=False (arbitrary code)."""
    said = [line.strip() for line in text.splitlines()[1:]
            if line.strip() and not line.strip().startswith(("(1)", "(2)", "Check the documentation"))]
    what = said[0].split("WeightsUnpickler error:")[-1].strip().split(". ")[0].rstrip(".") if said else ""
    return what or "unnamed"


def remove_stale_temp_files(directory: str | os.PathLike, starts: tuple) -> list:
    """Delete the temp files (`.<name>.<host>.<pid>.tmp`, for names that start with one of `starts`) that a
    writer killed mid-write left behind; call before this run writes anything there."""
    stale = sorted({p for start in starts for p in Path(directory).glob(f".{start}*.tmp")})
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def keep_newest(paths: list, keep: int) -> list:
    """Delete all but the `keep` newest of `paths` (sorted oldest first), with their sidecars."""
    removed = paths[:-keep] if keep > 0 else []
    for p in removed:
        remove_with_sidecar(p)
    return removed


def remove_with_sidecar(path) -> None:
    Path(path).unlink(missing_ok=True)
    Path(str(path) + ".sha256").unlink(missing_ok=True)


def unwrap_state_dict(model: torch.nn.Module) -> dict:
    """The state dict without DDP's or torch.compile's wrapper prefixes."""
    # DDP's own wrapper only: a user's model may have a submodule named `module`
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    inner = getattr(inner, "_orig_mod", inner)
    return inner.state_dict()


def host_snapshot(obj: Any, memo: Optional[dict] = None, pin: bool = False) -> Any:
    """A copy of `obj` (nested dicts, lists, tuples) whose tensors live in fresh host memory, so
    training can go on changing the originals while the copy is written. Tensors that are the same
    view of the same storage (tied weights) stay one tensor in the copy; pass one `memo` to share
    them across several payloads (it holds each source with its copy). With `pin`, CUDA tensors are
    copied into page-locked memory without waiting for each copy, then once for all of them: a pageable copy is staged by the
    driver and runs several times slower. PyTorch keeps freed page-locked blocks cached (each
    rounded up to a power of two) for the next save, so the first one pays for pinning and later
    ones reuse it; see CheckpointWriter for how much it may pin."""
    memo = {} if memo is None else memo
    devices = set()

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), str(t.device), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype)
        if key not in memo:
            if pin and t.is_cuda:
                held = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)
                devices.add(t.device)
            else:
                held = t.detach().to("cpu", copy=True)
            # the source too: freed (a fresh RNG state), its address could come back as another tensor's
            memo[key] = (t, held)
        return memo[key][1]
    try:
        return map_tensors(copy, obj)
    finally:  # the copies are queued after the kernels that wrote the tensors; none is left running
        for device in devices:
            torch.cuda.synchronize(device)


def on_the_host(payload: Any) -> Any:
    """`payload` with its CUDA tensors copied to the host (tied ones stay tied), for a synchronous torch.save:
    its file then loads without that GPU, as the background writer's files do; a payload on the host as it is."""
    return host_snapshot(payload) if cuda_bytes(payload) else payload


def cuda_bytes(obj: Any) -> int:
    """Bytes of the CUDA tensors in `obj`."""
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.nbytes if t.is_cuda else 0
        return t
    map_tensors(add, obj)
    return total


# Page-locked memory cannot be swapped out, and PyTorch keeps it cached after a save with each block
# rounded up to a power of two: the writer pins a payload only while twice its bytes stay under this
# share of the memory this process may use, and copies larger ones to pageable memory.
PIN_MAX_HOST_FRACTION = 0.25


def usable_memory_bytes(root: Path = Path("/")) -> int:
    """The machine's memory, or less where this process's cgroup limits it (a container, a SLURM job)."""
    limit = psutil.virtual_memory().total
    cgroup = root / "sys/fs/cgroup"
    candidates = [cgroup / "memory.max", cgroup / "memory/memory.limit_in_bytes"]
    try:  # cgroup v2: "0::/some/group"; v1: "N:memory:/some/group"
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, group = line.split(":", 2)
            if controllers == "":
                candidates.insert(0, cgroup / group.lstrip("/") / "memory.max")
            elif "memory" in controllers.split(","):
                candidates.insert(0, cgroup / "memory" / group.lstrip("/") / "memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 says so with a huge number, which min() ignores
            limit = min(limit, int(text))
    return limit


class CheckpointWriter:
    """Rank 0 writes checkpoints with `atomic_save`; every rank calls `save` at the same points.

    In the background (the default) the loop waits only for a host copy of the payload: a thread
    writes the copy, in submission order, while training goes on. Payloads saved at one save point
    (`group`, e.g. the step) share their copies while any of them waits to be written; the next save
    point first waits for the previous one's writes. A copy lives only until it is written (or, saved with
    `again`, until its failed write is written again or replaced): once the queue is empty the writer holds
    no other host memory (with `pin`, the copies of CUDA tensors are
    page-locked where PIN_MAX_HOST_FRACTION allows, and PyTorch keeps those blocks cached for the next
    save point; if pinning fails, the writer copies to pageable memory from then on). A write that failed
    fails every rank at the next `flush()`, as a synchronous write fails at once; the next save point
    instead logs it, queues its own files and sets `retry_pending`, for the caller to flush them. Files
    appear only complete (temp file, fsync, rename), so a crash mid-write leaves the previous ones.
    """

    def __init__(self, background: bool = True, log: Optional[logging.Logger] = None, pin: bool = False,
                 wait_s: Optional[float] = None):
        self.background = background
        self.pin = pin
        self.wait_s = wait_s  # how long flush() waits for the writes on rank 0 (None: as long as they take)
        self._hung = False
        self._told_pageable = False
        self._told_slow = False
        self.log = log or logging.getLogger(__name__)
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[Exception] = None
        self._group: Any = None
        # Copies by source tensor, shared by the payloads of one save point. The writer thread drops
        # it when the last queued copy is written; `_pending` (under `_lock`) counts the copies
        # being made or waiting, so it is never dropped while a save still fills or needs it.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when `_pending` drops to 0
        self._memo: dict = {}
        self._pending = 0
        self.retry_pending = False  # a write failed; the save point after it writes again (see save)
        self._failed: dict = {}  # path -> the job of a failed write saved with again=True (see write_failed_again)

    def save(self, payload: Any, path: str | os.PathLike, group: Any = None, then=None, again: bool = False) -> Path:
        """Write `payload` to `path` (on rank 0), then call `then()` there (e.g. prune old files). With `again`,
        a failed background write keeps its copy for write_failed_again(), until a later save to `path`: a file
        that no later save point writes (the best weights, a step's) would otherwise stay stale."""
        path = Path(path)
        if not self.background:
            run_on_rank0(self._write_now, payload, path, then, what=f"writing {path}")
            return path
        if group is None or group != self._group:
            with self._lock:
                busy = self._pending > 0  # the previous save point's files are not all on disk yet
            if busy and not self._told_slow:
                self._told_slow = True
                self.log.warning("the previous save point's checkpoint is still being written at this one: a kill "
                                 "now loses the work since the one before it, up to two intervals (a longer "
                                 "interval, or synchronous writes, keep it to one)")
            try:
                self.flush()
            except (CheckpointError, Rank0Failed) as exc:
                if not self.worth_writing_again(exc):
                    raise
                # an earlier save point's write failed: this one's files replace it, and the caller waits for
                # them (DDPTrainer: before the next step), so that a passing failure loses no work
                self.log.error("%s; the files of this save point replace it", exc)
                self.retry_pending = True
            self._group = group
        if self.is_writer:
            self._queue(payload, path, then, again)
        return path

    def write_failed_again(self, wanted=lambda path: True) -> None:
        """Queue once more the failed writes that were saved with `again`, not replaced since, and still
        `wanted(path)` (a step file that newer ones have made one to prune is not). Call it after a flush()
        (as the trainer does): a write of the same path still queued would land before the copy."""
        with self._lock:
            jobs, self._failed = [job for job in self._failed.values() if wanted(job[1])], {}
            self._pending += len(jobs)
        for job in jobs:
            self.log.info("writing %s again", job[1])
            self._jobs.put(job)

    @staticmethod
    def worth_writing_again(exc: Exception) -> bool:
        """A failed write (a disk full for a moment), not one that hangs: one queued behind that would hang too."""
        if isinstance(exc, Rank0Failed):
            return exc.kind == CheckpointError.__name__
        return isinstance(exc, CheckpointError) and not isinstance(exc, CheckpointWriteHung)

    def _queue(self, payload: Any, path: Path, then, again: bool) -> None:
        with self._lock:
            self._pending += 1
            memo = self._memo
            self._failed.pop(path, None)  # this write replaces it
        try:
            snapshot = self._snapshot(payload, memo)
        except BaseException:
            self._release()
            raise
        self._jobs.put((snapshot, path, then, again))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="checkpoint-writer", daemon=True)
            self._thread.start()

    def _snapshot(self, payload: Any, memo: dict) -> Any:
        if not self.pin:
            return host_snapshot(payload, memo)
        size, limit = cuda_bytes(payload), PIN_MAX_HOST_FRACTION * usable_memory_bytes()
        if 2 * size > limit:
            if not self._told_pageable:
                self._told_pageable = True
                self.log.info("checkpoint payload of %.1f GiB: copied to pageable memory (pinning it could hold "
                              "twice that, over %.0f%% of this process's memory)", size / 2**30,
                              100 * PIN_MAX_HOST_FRACTION)
            return host_snapshot(payload, memo)
        try:
            return host_snapshot(payload, memo, pin=True)
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
                raise  # not a refused page-locked allocation (host memory, ulimit -l): a real CUDA error
            self.log.warning("page-locked checkpoint copies failed (%s); copying to pageable memory from now on", exc)
            self.pin = False
            return host_snapshot(payload, memo)

    def _release(self) -> None:
        """One copy written (or abandoned); after the last, no shared copy outlives its write."""
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._memo = {}
                self._idle.notify_all()

    def failed(self) -> bool:
        """Whether a background write has failed (known on rank 0 only), without waiting for any."""
        return self._error is not None

    def flush(self) -> None:
        """Wait (every rank) until rank 0 has written everything saved so far; raise on every
        rank if a write failed."""
        if self.background:
            run_on_rank0(self._wait, what="a background checkpoint write")

    def close(self, timeout_s: Optional[float] = None) -> Optional[Exception]:
        """Finish pending writes on this rank without talking to the others (for a failing run,
        whose peers may be gone); returns the first write error instead of raising it. A write still
        running after `timeout_s` (a hung filesystem) is abandoned: its temp file never replaces anything."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(0 if self._hung else timeout_s)  # a hung one: flush() has waited for it already
            if self._thread.is_alive():
                what = "is still hung" if self._hung else f"did not finish within {timeout_s:g} s"
                self.log.error("a checkpoint write %s; leaving it (the previous files are intact)", what)
                return CheckpointError(f"a checkpoint write {what}")
            self._thread = None
        with self._lock:
            self._memo, self._failed = {}, {}
        return self._error

    def _wait(self) -> None:
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, self.wait_s):
                # the other ranks stop waiting for this one after as long (dist_timeout): a hung file system
                # becomes an error on every rank; the write is left, and never replaces the previous files
                self._hung = True
                raise CheckpointWriteHung(f"a checkpoint write did not finish within {self.wait_s:g} s (a hung "
                                          f"file system?); the files written before it are intact")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, payload: Any, path: Path, then) -> None:
        start = time.perf_counter()
        atomic_save(payload, path)
        if then is not None:
            then()
        self.log.debug("wrote %s in %.3f s", path, time.perf_counter() - start)

    def _write_now(self, payload: Any, path: Path, then) -> None:
        """A synchronous write; its failure names the file, as a background write's does (a full disk's
        OSError names none)."""
        try:
            self._write(on_the_host(payload), path, then)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"writing {path} failed: {type(exc).__name__}: {exc}") from exc

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            path = job[1]
            try:
                self._write(*job[:3])
                with self._lock:  # written in order: an earlier failure to write this path is superseded
                    self._failed.pop(path, None)
            except Exception as exc:  # raised in the training thread by flush()
                # Text only: the exception's traceback holds the payload, which must not outlive the write.
                text = f"{type(exc).__name__}: {exc}"
                self.log.error("writing %s failed: %s", path, text)
                if job[3]:  # kept before the error shows: failed() answers the other ranks
                    with self._lock:
                        self._failed[path] = job
                if self._error is None:
                    self._error = CheckpointError(f"writing {path} failed: {text}")
            finally:
                # This thread's reference goes before the job counts as done, so a flush() that
                # returns leaves no host copy behind.
                job = None
                self._release()


# ----------------------------------------------------------------------------
# RNG state (stored as tensors and plain numbers so it loads with weights_only=True)
# ----------------------------------------------------------------------------

def rng_state(device: Optional[torch.device] = None) -> dict:
    """Every RNG stream of this process; on a CUDA `device`, that GPU's too (only this rank's GPU: another
    launch may see other GPUs, or number them otherwise)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    """Restore what `rng_state` captured, on a CUDA `device` its GPU's stream too. The tensors may arrive on
    another device (a checkpoint loaded with map_location='cuda'); torch, numpy, random and CUDA's own
    generators take only host data, so each is copied to the CPU first."""
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"].cpu().tolist()), p["gauss_next"]))
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):  # states before 25 Nov 2026 held every visible GPU's, by index
        cuda = cuda[device.index] if device is not None and device.index is not None and device.index < len(cuda) \
            else None
    if cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda.cpu(), device)


# ----------------------------------------------------------------------------
# Replication check: every rank must hold the same weights
# ----------------------------------------------------------------------------

def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (copied to the host). Flattened first: a 0-dim tensor (a learnable scale, a
    step counter) cannot be viewed as bytes."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def parameter_digests(model: torch.nn.Module) -> list:
    return [(name, tensor_digest(p)) for name, p in model.named_parameters()]


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. DDP broadcasts them before each
    training forward, so after the last one every rank holds the statistics of its own batches: an
    evaluation would mix them, and rank 0's are the ones its checkpoints hold."""
    if dist.is_available() and dist.is_initialized():
        for b in model.buffers():
            dist.broadcast(b.data, 0)


def check_replicas(model: torch.nn.Module) -> None:
    """Compare a hash of the parameters across ranks; a mismatch names the ranks and the
    first parameter that differs (one small all-gather; per-parameter detail only on failure)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    digests = parameter_digests(model)
    overall = hashlib.sha256("".join(d for _, d in digests).encode()).hexdigest()
    everyone = gather_objects(overall)
    if len(set(everyone)) == 1:
        return
    tables = gather_objects(digests)
    reference = tables[0]
    diverged = [r for r, h in enumerate(everyone) if h != everyone[0]]
    first = next(name for i, (name, d) in enumerate(reference) if any(t[i][1] != d for t in tables))
    raise RuntimeError(f"replicas diverged: ranks {diverged} differ from rank 0; "
                       f"first differing parameter: {first} (gradients that DDP did not all-reduce: a loss_fn that "
                       f"computes through model.module or a method other than the forward; or weights changed on "
                       f"one rank outside the optimizer step)")
