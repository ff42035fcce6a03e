"""The shared runtime: launch environments, logging, memory, loaders, collectives, checkpoint I/O."""

import errno
import gc
import io
import json
import logging
import os
import re
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

import ddp_runtime as rt
from conftest import REPO, FlakyData, Indices
from dist_helpers import run_script_forked, spawn


# -- launch environments ------------------------------------------------------

@pytest.mark.parametrize("nodelist,first", [("gpu07", "gpu07"), ("gpu[07-09,12]", "gpu07"),
                                            ("node[3,5],login1", "node3"), ("a-b[001-004]", "a-b001"),
                                            ("gpu[01-02]-ib", "gpu01-ib"), ("rack[1-2]-n[01-04]", "rack1-n01")])
def test_first_slurm_host(nodelist, first):
    assert rt.first_slurm_host(nodelist) == first


# What srun adds to a task's environment (and the batch script's environment lacks).
SLURM_STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES",
                   "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                   "SLURM_NODEID")


@pytest.fixture
def no_slurm_step(no_launch_env, monkeypatch):
    for var in SLURM_STEP_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):  # detect_launch_env sets these: undo them
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


def test_detect_env_plain_and_torchrun(no_slurm_step, monkeypatch):
    assert rt.detect_launch_env() == dict(rank=0, world_size=1, local_rank=0, launcher="none")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rt.detect_launch_env() == dict(rank=3, world_size=4, local_rank=1, launcher="torchrun")


@pytest.mark.parametrize("variables, message", [
    (dict(RANK="4", WORLD_SIZE="4"), "rank 4 (local rank 4) of world size 4, from RANK=4 WORLD_SIZE=4: expected 0 <= "
                                     "rank < world size"),
    (dict(RANK="-1", WORLD_SIZE="2", LOCAL_RANK="0"), "rank -1 (local rank 0) of world size 2"),
    (dict(RANK="abc", WORLD_SIZE="2"), "RANK='abc' is not a whole number"),
    (dict(SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="gpu1"), "rank 3 (local rank 0) of world "
                                                                                   "size 2, from SLURM_PROCID=3"),
    # LOCAL_WORLD_SIZE sets the threads: 'x' was a ValueError that named no variable
    (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="x"), "LOCAL_WORLD_SIZE='x' is not a whole number"),
    # SLURM's compressed lists were a traceback (exit 1), and a node list cut short gave its first host as 'gpu'
    (dict(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="gpu[07-"),
     "SLURM_STEP_NODELIST: cannot parse SLURM node list 'gpu[07-' (set by srun)"),
    (dict(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="gpu1", SLURM_STEP_TASKS_PER_NODE="2(x"),
     "SLURM_STEP_TASKS_PER_NODE: cannot parse SLURM tasks per node '2(x' (set by srun)"),
    (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="1"),
     "local rank 1 of 1 ranks on this node, world size 2, from RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=1: "
     "expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= world size"),
])
def test_launch_variables_that_make_no_sense_are_an_error_on_every_rank(no_slurm_step, monkeypatch, tmp_path,
                                                                          variables, message):
    """A rank outside the world size was refused by the rendezvous with the message shown on rank 0 only: the
    process itself exited 2 without a word, and RANK=abc was a traceback (from a review)."""
    for var, value in variables.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(rt.LaunchEnvError, match=re.escape(message)):
        rt.detect_launch_env()
    for script, argv in (("ddp_training", ["--cpu"]),
                         ("vj2ac_train_multi_gpu", ["--processed_data_dir", "t", "--validation_data_dir", "v"])):
        code, out = run_script_forked(script, argv, tmp_path, {**os.environ})
        assert code == 2 and f"error: {message}" in out and "Traceback" not in out, (script, out)


def test_gpu_ranks_share_the_nodes_cores_for_threads_too(no_slurm_step, monkeypatch):
    """Only the CPU path shared them: under srun (no torchrun to set OMP_NUM_THREADS) each GPU rank of a node
    took every core (from a review)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(rt, "cuda_index", lambda local_rank, given=True: 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(rt.cpu_count())
        env = rt.setup_distributed(0, 1, None, None, "cuda")
        assert env.device == torch.device("cuda", 0) and torch.get_num_threads() == max(1, rt.cpu_count() // 2)
    finally:
        torch.set_num_threads(threads)


def slurm_job(monkeypatch, procid, ntasks=8):
    """The variables of a job with `ntasks` tasks on gpu[12-15], as seen by task `procid`."""
    for var, value in dict(SLURM_PROCID=procid, SLURM_NTASKS=ntasks, SLURM_LOCALID=procid % 4,
                           SLURM_JOB_NODELIST="gpu[12-15]", SLURM_JOB_ID=4242).items():
        monkeypatch.setenv(var, str(value))


def srun_step(monkeypatch, ntasks, nodelist):
    for var, value in dict(SLURM_STEP_ID=0, SLURM_STEPID=0, SLURM_STEP_NUM_TASKS=ntasks,
                           SLURM_STEP_NODELIST=nodelist).items():
        monkeypatch.setenv(var, str(value))


def test_detect_env_srun_task(no_slurm_step, monkeypatch):
    slurm_job(monkeypatch, procid=5)
    srun_step(monkeypatch, 8, "gpu[12-15]")
    assert rt.detect_launch_env() == dict(rank=5, world_size=8, local_rank=1, launcher="slurm")
    assert os.environ["MASTER_ADDR"] == "gpu12"
    assert os.environ["MASTER_PORT"] == str(20000 + 4242 % 20000)
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # a second step beside the first in the same allocation
    rt.detect_launch_env()
    assert os.environ["MASTER_PORT"] == str(20000 + 4243 % 20000)


def test_srun_tasks_share_their_node_not_the_world(no_slurm_step, monkeypatch):
    """Threads and loader workers are shared among the ranks of a node: 4 tasks on each of 16 nodes must not
    divide a node's cores by 64 (1 thread, and --num_workers silently 0)."""
    slurm_job(monkeypatch, procid=9, ntasks=64)
    srun_step(monkeypatch, 64, "gpu[01-16]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x15),3")
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert rt.detect_launch_env()["world_size"] == 64 and os.environ["LOCAL_WORLD_SIZE"] == "4"
    monkeypatch.setenv("SLURM_NODEID", "15")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    rt.detect_launch_env()
    assert os.environ["LOCAL_WORLD_SIZE"] == "3"
    assert rt.capped_workers(8, int(os.environ["LOCAL_WORLD_SIZE"]), 64) == min(8, rt.cpu_count() // 3)
    # the step's own count, not the job's (a step smaller than the job); a LOCAL_WORLD_SIZE the user set is kept
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x16)")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    rt.detect_launch_env()
    assert os.environ["LOCAL_WORLD_SIZE"] == "3"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rt.detect_launch_env()
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"


def test_srun_tasks_take_slurms_share_of_cpus_even_when_bound_to_their_own(no_slurm_step, monkeypatch):
    """srun --cpus-per-task=6 may bind each task to 6 CPUs of its own: dividing those by the node's 4 tasks
    again left each rank 1 thread and 1 loader worker (from a review of the SLURM example)."""
    slurm_job(monkeypatch, procid=1, ntasks=8)
    srun_step(monkeypatch, 8, "gpu[12-13]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    rt.detect_launch_env()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6, 12)))  # bound: this task's own 6
    assert rt.cpus_per_rank(4, 8) == 6 and rt.capped_workers(8, 4, 8) == 6
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(12)
        rt.limit_cpu_threads(4, 8)
        assert torch.get_num_threads() == 6
        torch.set_num_threads(2)  # a lower count of the process's own is kept
        rt.limit_cpu_threads(4, 8)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))  # not bound: the node's 32
    assert rt.cpus_per_rank(4, 8) == 6
    # processes started inside the tasks (--nproc: another world size; torchrun's workers) share their CPUs
    assert rt.cpus_per_rank(4, 4) == 8
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert rt.cpus_per_rank(4, 8) == 8


@pytest.mark.parametrize("local_rank, visible, bound, env, expected", [
    (1, 4, None, {}, 1), (1, 1, "3", {"SLURM_LOCALID": "1"}, 0), (1, 1, None, {"SLURM_LOCALID": "1"}, None),
    (3, 2, "0,1", {"SLURM_LOCALID": "3"}, None),
    (1, 1, "3", {"SLURM_LOCALID": "1", "LOCAL_RANK": "1"}, 0),  # a wrapper that exports LOCAL_RANK too
    # CUDA_VISIBLE_DEVICES=3 torchrun --nproc_per_node 2 (under srun or not): both ranks would share GPU 3
    (1, 1, "3", {"LOCAL_RANK": "1"}, None), (1, 1, "3", {"SLURM_LOCALID": "1", "TORCHELASTIC_RUN_ID": "x"}, None),
    (1, 1, "3", {"SLURM_LOCALID": "0"}, None),  # --nproc 2 in the batch script, task 0 of its step
])
def test_each_local_rank_gets_a_visible_gpu_or_a_clear_error(monkeypatch, local_rank, visible, bound, env,
                                                             expected):
    """srun --gpus-per-task=1 shows each task one GPU (its own CUDA_VISIBLE_DEVICES), as cuda:0, whatever its
    SLURM_LOCALID; without such a binding a second rank on the one GPU is an error, not a clash in NCCL."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_LOCALID", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    if bound is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", bound)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if expected is None:
        with pytest.raises(RuntimeError, match=f"local rank {local_rank} .*has no GPU: this process sees {visible}"):
            rt.cuda_index(local_rank)
    else:
        assert rt.cuda_index(local_rank) == expected


def test_a_rank_without_a_local_rank_beyond_the_gpus_is_told_to_pass_local_rank(monkeypatch):
    """mp.spawn on each of two nodes numbers its ranks 4..7 on the second: without local_rank= the rank picked
    the device, and the error blamed LOCAL_RANK or SLURM_LOCALID, which that launch never sets."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_LOCALID", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"^rank 5 has no GPU: this process sees 4 .*where ranks span nodes, "
                                           r"pass local_rank= \(this process's index on its node\)$"):
        rt.setup_distributed(5, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"^local rank 5 \(LOCAL_RANK or SLURM_LOCALID\) has no GPU"):
        rt.setup_distributed(5, 8, local_rank=5, device="cuda")


def test_detect_env_srun_step_smaller_than_the_job(no_slurm_step, monkeypatch):
    """`srun -n 2 --preserve-env` in an 8-task job keeps SLURM_NTASKS=8: the group is the step's 2 tasks."""
    slurm_job(monkeypatch, procid=1)
    srun_step(monkeypatch, 2, "gpu[14-15]")
    assert rt.detect_launch_env() == dict(rank=1, world_size=2, local_rank=1, launcher="slurm")
    assert os.environ["MASTER_ADDR"] == "gpu14"


def test_detect_env_batch_script_is_one_process(no_slurm_step, monkeypatch):
    """`python train.py` in an sbatch script with --ntasks=8: SLURM_PROCID=0 and SLURM_NTASKS=8 are set,
    but no srun step started it, so no peer will ever join; it must not wait dist_timeout for them."""
    slurm_job(monkeypatch, procid=0)
    assert rt.detect_launch_env() == dict(rank=0, world_size=1, local_rank=0, launcher="none")
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ


def test_detect_env_slurm_task_without_step_variables_keeps_the_job_size(no_slurm_step, monkeypatch):
    """Task 5 cannot be the batch script: as before, the job's SLURM_NTASKS is the world size."""
    slurm_job(monkeypatch, procid=5)
    assert rt.detect_launch_env() == dict(rank=5, world_size=8, local_rank=1, launcher="slurm")
    assert os.environ["MASTER_ADDR"] == "gpu12"


def test_single_process_needs_no_rendezvous(no_launch_env):
    env = rt.setup_distributed(0, 1, device="cpu")
    assert env.backend is None and not dist.is_initialized()
    assert rt.all_reduce_floats([1.0, 2.0], dist.ReduceOp.MAX) == [1.0, 2.0]  # a collective is the identity


def test_multi_process_without_master_addr_is_a_clear_error(no_launch_env):
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        rt.setup_distributed(0, 2, device="cpu")


def test_nccl_on_cpu_is_refused(no_launch_env, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match="gloo"):
        rt.setup_distributed(0, 2, backend="nccl", device="cpu")


def test_a_taken_master_port_is_named(no_launch_env, monkeypatch):
    """Rank 0 of a plain env:// start (srun, the user's own variables) on a port another process holds: a
    bad input naming MASTER_PORT (it was torch's traceback); a rank > 0 that finds something else there (another
    job's store) says where it looked."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(ValueError, match=f"MASTER_PORT={port} is taken on this host: rank 0 cannot host") as taken:
        rt.setup_distributed(0, 2, device="cpu", timeout_s=2)
    assert "SLURM" not in str(taken.value)
    monkeypatch.setenv("SLURM_PROCID", "0")  # under srun the port was the runtime's pick, unless set: say how
    with pytest.raises(ValueError, match=re.escape("to a free port (under SLURM, unset, it is 20000 + (SLURM_JOB_ID "
                                                   "+ SLURM_STEP_ID) % 20000)")):
        rt.setup_distributed(0, 2, device="cpu", timeout_s=2)
    monkeypatch.delenv("SLURM_PROCID")

    def hang_up():
        while True:
            try:
                holder.accept()[0].close()
            except OSError:  # closed below
                return
    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with pytest.raises(rt.SetUpFailed, match=f"rank 1: set-up failed: no rendezvous of rank 0 at 127.0.0.1:{port} "
                                                 r"\(MASTER_ADDR:MASTER_PORT\)"):
            rt.setup_distributed(1, 2, device="cpu", timeout_s=2)
    finally:
        holder.close()
    assert not dist.is_initialized()
    # nothing there at all: still the set-up timeout, which names the wait and its flag
    with pytest.raises(rt.SetUpTimeout):
        rt.setup_distributed(1, 2, device="cpu", timeout_s=2)
    # another network error of rank 0's (a port it may not take) is no taken port: torch's error goes on

    def refused(*args, **kwargs):
        raise dist.DistNetworkError("The server socket has failed to bind: Permission denied")
    monkeypatch.setattr(dist, "rendezvous", refused)
    with pytest.raises(dist.DistNetworkError, match="Permission denied"):
        rt.setup_distributed(0, 2, device="cpu", timeout_s=2)


def test_a_long_usage_is_a_pointer_to_help_and_a_short_one_is_shown(capsys):
    """ddp_training.py's usage is dozens of lines: above a flag error it buried the error line (a README audit)."""
    many = rt.ArgumentParser(prog="long.py")
    for i in range(40):
        many.add_argument(f"--flag_number_{i}")
    few = rt.ArgumentParser(prog="short.py")
    few.add_argument("--only")
    for parser, usage in ((many, "usage: long.py [flags] (long.py --help lists them)\n"),
                          (few, "usage: short.py [-h] [--only ONLY]\n")):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--bogus"])
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"{usage}{parser.prog}: error: unrecognized arguments: --bogus\n"


def test_the_loader_backstop_for_workers_and_for_this_process():
    assert rt.loader_backstop_s(2, 10, 1800) == 40  # workers: past their own timeout, which answers first
    assert rt.loader_backstop_s(0, 10, 1800) == 1800 and rt.loader_backstop_s(0, 1000, 1800) == 4000
    assert rt.loader_backstop_s(0, 10) is None and rt.loader_backstop_s(2, None, 1800) is None


def test_two_ranks_on_one_gpu_are_told_what_to_change(no_launch_env, monkeypatch):
    """SLURM tasks of a node that share one GPU (no --gpus-per-task) each take cuda:0, and NCCL refuses the
    group with its own line in torch's traceback: the set-up failure keeps that line and says what to change.
    (NCCL is stood in for: no GPU here; the line is NCCL's, as torch raises it.)"""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(rt, "cuda_index", lambda local_rank, given=True: 0)
    monkeypatch.setattr(rt, "_meet", lambda rank, world_size, timeout: None)

    def nccl_refuses(**kwargs):
        raise dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1691, invalid usage (run with NCCL_DEBUG=WARN "
                                    "for details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects "
                                    "invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and "
                                    "rank 0 both on CUDA device 1000")
    monkeypatch.setattr(dist, "init_process_group", nccl_refuses)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(rt.SetUpFailed) as failed:
            rt.setup_distributed(1, 2, device="cuda")
    finally:
        torch.set_num_threads(threads)
    assert str(failed.value) == (
        "rank 1: set-up failed: NCCL found two ranks on one GPU (Duplicate GPU detected : rank 1 and rank 0 both on "
        "CUDA device 1000); this rank took cuda:0 of CUDA_VISIBLE_DEVICES=3: start at most one process per GPU on "
        "each node (under srun, give each task its own: --gpus-per-task=1)")


def test_name_hint_tells_other_trainers_names():
    """nanoGPT's --out_dir and Lightning's default_root_dir are our log_dir; a typo gets the close name."""
    flags = ["log_dir", "log-dir", "grad_accum_steps", "max_steps", "nproc"]
    assert rt.name_hint("--out_dir", flags) == " (this kit's name for it: --log_dir)"
    assert rt.name_hint("--save_dir", flags) == " (this kit's name for it: --log_dir)"
    assert rt.name_hint("default_root_dir", flags) == " (this kit's name for it: log_dir)"
    assert rt.name_hint("--max-iters=5", flags) == " (this kit's name for it: --max_steps)"
    assert rt.name_hint("--log_dri", flags) == " (did you mean --log_dir?)"
    assert rt.name_hint("--gpus", flags).startswith(" (the number of processes is the launcher's")
    assert rt.name_hint("--colour", flags) == ""


# -- logging and memory -------------------------------------------------------

def test_logger_files_tags_and_console(tmp_path, capsys):
    for rank in (0, 1):
        log = rt.setup_logger(tmp_path, rank)
        log.info("hello from %d", rank)
        rt.close_logger(log)
    out = capsys.readouterr().out
    assert "[RANK 0] INFO: hello from 0" in out and "hello from 1" not in out
    assert "[RANK 1] INFO: hello from 1" in (tmp_path / "rank_1.log").read_text()
    log = rt.setup_logger(tmp_path, 1, debug=True)
    log.debug("debug line")
    rt.close_logger(log)
    assert "[RANK 1] DEBUG: debug line" in capsys.readouterr().out


def test_kept_log_records_go_to_their_own_file_only(tmp_path):
    """setup_logger(keep=True) holds a run dir's lines until the run has the dir: the next logger of that file
    writes them first, one of another file drops them (an earlier set-up in this process), and
    write_kept_logs() writes what a set-up that ended before its trainer kept."""
    log = rt.setup_logger(tmp_path / "a", 3, name="kept", keep=True)
    log.info("data checked")
    assert not (tmp_path / "a").exists()
    log = rt.setup_logger(tmp_path / "a", 3, name="kept")
    log.info("trainer")
    assert [line.split(": ", 1)[1] for line in (tmp_path / "a" / "rank_3.log").read_text().splitlines()] == \
        ["data checked", "trainer"]
    log = rt.setup_logger(tmp_path / "b", 3, name="kept", keep=True)
    log.info("stale")
    rt.setup_logger(tmp_path / "c", 3, name="kept")
    assert not (tmp_path / "b").exists() and (tmp_path / "c" / "rank_3.log").read_text() == ""
    log = rt.setup_logger(tmp_path / "d", 3, name="kept", keep=True)
    log.warning("stopped in set-up")
    rt.write_kept_logs()
    rt.write_kept_logs()
    assert (tmp_path / "d" / "rank_3.log").read_text().count("WARNING: stopped in set-up") == 1
    rt.close_logger(log)


def test_memory_manager_warns_and_cleans(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(rt.gc, "collect", lambda: calls.append(1))
    log = logging.getLogger("memtest")
    mm = rt.MemoryManager(torch.device("cpu"), log, check_interval=5, cleanup_interval=3, max_memory_gb=1e-6)
    with caplog.at_level(logging.WARNING, logger="memtest"):
        readings = [mm.on_step(s) for s in range(1, 11)]
    assert [i + 1 for i, r in enumerate(readings) if r] == [5, 10]
    assert readings[4]["cpu_rss_gb"] > 0.01
    assert len(calls) == 3  # steps 3, 6, 9
    assert sum("exceeds max_memory_gb" in r.message for r in caplog.records) == 2


class MemoryInfo:
    """psutil's memory_info(), as readings in GiB of RSS and of its shared (file-backed) part."""

    def __init__(self, rss, shared):
        self.rss, self.shared = int(rss * 2**30), int(shared * 2**30)


def test_memory_peaks_are_the_highest_readings_so_far(monkeypatch):
    """cpu_peak_rss_gb and cpu_peak_anon_gb (the run summary's peak_rss_gb, peak_anon_gb) hold the highest
    reading of any call, not the latest one."""
    readings = iter([(3, 1), (2, 0.5), (1, 0.25)])  # (rss, shared) in GiB, falling
    mm = rt.MemoryManager(torch.device("cpu"), logging.getLogger("memtest"))
    monkeypatch.setattr(mm.process, "memory_info", lambda: MemoryInfo(*next(readings)))
    stats = [mm.stats() for _ in range(3)]
    assert [(s["cpu_rss_gb"], s["cpu_anon_gb"]) for s in stats] == [(3, 2), (2, 1.5), (1, 0.75)]
    assert (stats[-1]["cpu_peak_rss_gb"], stats[-1]["cpu_peak_anon_gb"]) == (3, 2)


def test_the_memory_limit_warning_reads_anonymous_memory(monkeypatch, caplog):
    """max_memory_gb is compared with anonymous memory (RSS less shared, file-backed pages), not RSS: 3 GiB of
    RSS that is mostly mapped data stays under a 1 GiB limit; 1.5 GiB of anonymous memory exceeds it."""
    readings = iter([(3, 2.5), (3, 1.5)])  # (rss, shared) in GiB
    mm = rt.MemoryManager(torch.device("cpu"), logging.getLogger("memtest"), check_interval=1, max_memory_gb=1.0)
    monkeypatch.setattr(mm.process, "memory_info", lambda: MemoryInfo(*next(readings)))
    with caplog.at_level(logging.WARNING, logger="memtest"):
        mm.on_step(1)
        assert not caplog.records
        mm.on_step(2)
    assert [r.getMessage() for r in caplog.records] == ["memory 1.50 GB exceeds max_memory_gb=1.00 at step 2"]


def test_memory_limit_counts_anonymous_memory_not_mapped_file_pages(tmp_path):
    """Reading memory-mapped data raises RSS by its size; the limit watches anonymous memory."""
    import numpy as np
    path = tmp_path / "data.npy"
    np.save(path, np.ones(64 * 2**20, dtype=np.uint8))
    mm = rt.MemoryManager(torch.device("cpu"), logging.getLogger("memtest"))
    before = mm.stats()
    data = np.load(path, mmap_mode="r", allow_pickle=False)
    assert int(data.sum(dtype=np.int64)) == 64 * 2**20  # every page read
    after = mm.stats()
    assert after["cpu_rss_gb"] - before["cpu_rss_gb"] > 48 / 1024
    assert abs(after["cpu_anon_gb"] - before["cpu_anon_gb"]) < 16 / 1024
    assert after["cpu_peak_anon_gb"] >= after["cpu_anon_gb"] and after["cpu_peak_rss_gb"] >= after["cpu_rss_gb"]
    assert set(after) <= rt.MEMORY_FIELDS  # the names a loss's extras may not take


# -- data loaders ---------------------------------------------------------------
def test_a_batch_splits_its_tensors_and_its_lists_of_ids_alike():
    """What a replay or an out-of-memory retry cuts from a batch: the tensors and the ids default_collate keeps
    as a list of strings, sample for sample, in dicts, mappings (HF's BatchEncoding is a UserDict), dataclasses
    and namedtuples; a list of per-sample tensors of other lengths is cut as a list (each tensor was cut along
    its own length). Strings stay whole."""
    import collections
    import collections.abc
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        ids: list
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": torch.arange(6).view(3, 2), "id": ["a", "b", "c"], "task": "lm",
             "pair": Pair(torch.arange(3), torch.ones(3)), "seqs": [torch.ones(1), torch.ones(4), torch.ones(5)],
             "enc": collections.UserDict({"ids": torch.arange(3)}), "dc": Batch(torch.arange(3), ["a", "b", "c"])}
    part = rt.split_batch(batch, 1, 2)
    assert part["x"].tolist() == [[2, 3]] and part["id"] == ["b"] and part["task"] == "lm"
    assert isinstance(part["pair"], Pair) and part["pair"].a.tolist() == [1]
    assert [len(t) for t in part["seqs"]] == [4]
    assert isinstance(part["enc"], collections.UserDict) and part["enc"]["ids"].tolist() == [1]
    assert isinstance(part["dc"], Batch) and part["dc"].x.tolist() == [1] and part["dc"].ids == ["b"]
    assert rt.batch_len(batch) == 3 and rt.batch_len({"ntok": torch.tensor(9), "x": torch.zeros(4, 2)}) == 4
    assert rt.batch_len([["a", "b"], {"y": torch.zeros(2, 5)}]) == 2
    with pytest.raises(TypeError, match="a batch holds no tensor"):
        rt.batch_len(["a", "b"])
    # not per sample: the split would keep the whole batch's value in each part (a count: the loss would halve)
    for value, said in ((torch.tensor(12), r"batch\['v'\] is a tensor of shape \(\)"),
                        (12, r"batch\['v'\] is int 12, one value for the whole batch"),
                        (torch.zeros(7, 3), r"batch\['v'\] is a tensor of shape \(7, 3\), not 3 samples"),
                        ([64, 64, 3], r"batch\['v'\]\[0\] is int 64")):
        with pytest.raises(rt.NotSplittable, match=said):
            rt.split_batch({"x": torch.zeros(3, 2), "v": value}, 0, 2)
    # to_device goes into mappings and dataclasses too (a BatchEncoding stayed on the host)
    moved = rt.map_tensors(lambda t: t.to("meta"), batch)
    assert moved["enc"]["ids"].device.type == "meta" and moved["dc"].x.device.type == "meta"

    class TwoFields(collections.abc.Mapping):  # a mapping that is not built from a dict: its items, in a dict
        def __init__(self, x, y):
            self.d = {"x": x, "y": y}
        __getitem__, __iter__, __len__ = (lambda s, k: s.d[k]), (lambda s: iter(s.d)), (lambda s: 2)
    moved = rt.map_tensors(lambda t: t.to("meta"), TwoFields(torch.zeros(2), torch.ones(2)))
    assert type(moved) is dict and moved["y"].device.type == "meta"



@pytest.mark.parametrize("batch", [4, 5])  # 4 divides the 52 samples a padding sampler would give each rank
def test_loader_does_not_touch_global_rng_and_drops_last(batch):
    state = torch.get_rng_state()
    loaders = [rt.build_dataloader(Indices(103), batch, train=True, rank=r, world_size=2, seed=3) for r in (0, 1)]
    assert torch.equal(state, torch.get_rng_state())
    batches = [[b.tolist() for b in ld] for ld in loaders]
    assert len(batches[0]) == len(batches[1]) == 51 // batch  # equal step counts on both ranks
    assert all(len(b) == batch for bs in batches for b in bs)
    seen = [i for bs in batches for b in bs for i in b]
    assert len(seen) == len(set(seen))  # no sample twice in one epoch


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_samples_error_names_its_index(workers):
    """A data error's line said what failed, not where: the loader's samples add a note naming the index, which
    the trainer's line (rt.error_text) and a worker's traceback show (from a user test)."""
    data = FlakyData([torch.tensor([float(i)]) for i in range(8)], bad=[5])
    for train, where in ((True, "(sample 5 of the training set)"), (False, "(sample 5)")):
        loader = rt.build_dataloader(data, 4, train=train, rank=0, world_size=1, seed=0, num_workers=workers)
        with pytest.raises(OSError) as failed:
            list(loader)
        assert where in rt.error_text(failed.value), rt.error_text(failed.value)
        assert loader.dataset.bad == {5}  # the dataset's own attributes, through the wrapper
        del loader
    # a Subset reads many samples at once (__getitems__): its batches come whole, with workers too, where the
    # wrapper that seeds each sample once handed its own keys to the Subset's __getitems__ (from a review)
    subset = torch.utils.data.Subset(data.base, range(8))
    loader = rt.build_dataloader(subset, 4, train=False, rank=0, world_size=1, seed=0, num_workers=workers)
    assert torch.equal(torch.cat(list(loader)), torch.arange(8.0).unsqueeze(1))

    class KeepsItsError(FlakyData):  # one error object raised again: one note, this read's (they piled up)
        error = OSError("shard 3 unreadable")

        def __getitem__(self, i):
            if i % 4 == 1:
                raise self.error
            return self.base[i]
    loader = rt.build_dataloader(KeepsItsError(data.base, ()), 1, train=False, rank=0, world_size=1, seed=0,
                                 num_workers=workers)
    texts, batches = [], iter(loader)
    for _ in range(8):
        try:
            next(batches)
        except OSError as exc:
            texts.append(" ".join(rt.error_text(exc).split()))  # a worker's: its traceback, the note last
    assert len(texts) == 2 and texts[0].endswith("OSError: shard 3 unreadable (sample 1)") and \
        texts[1].endswith("OSError: shard 3 unreadable (sample 5)"), texts


def test_distributed_and_single_process_loaders_give_the_same_global_batches():
    two = [list(rt.build_dataloader(Indices(64), 4, train=True, rank=r, world_size=2, seed=7)) for r in (0, 1)]
    one = list(rt.build_dataloader(Indices(64), 8, train=True, rank=0, world_size=1, seed=7))
    assert len(one) == len(two[0]) == len(two[1]) == 8
    for step, big in enumerate(one):
        assert sorted(big.tolist()) == sorted(two[0][step].tolist() + two[1][step].tolist())


def test_eval_shards_cover_every_sample_once():
    loaders = [rt.build_dataloader(Indices(11), 4, train=False, rank=r, world_size=3, seed=0) for r in range(3)]
    seen = sorted(i for ld in loaders for b in ld for i in b.tolist())
    assert seen == list(range(11))


def test_workers_are_capped_and_configured():
    ld = rt.build_dataloader(Indices(40), 4, train=True, rank=0, world_size=1, seed=0, num_workers=64,
                             timeout_s=30)
    assert 1 <= ld.num_workers <= rt.cpu_count()
    assert ld.persistent_workers and ld.timeout == 30 and ld.prefetch_factor == 2
    assert sorted(i for b in ld for i in b.tolist()) == list(range(40))
    ld0 = rt.build_dataloader(Indices(40), 4, train=True, rank=0, world_size=1, seed=0, num_workers=0)
    assert ld0.timeout == 0 and not ld0.persistent_workers


class Draws(torch.utils.data.Dataset):
    """Sample i is [i, a torch draw, a numpy draw, a random draw]: augmentation's random numbers, made visible."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)


def test_worker_draws_are_new_each_epoch_and_the_same_in_a_rebuilt_loader():
    """With loader workers each sample's random draws depend on (seed, epoch, index): another epoch augments a
    sample anew, and a loader built again (a resumed run) repeats the epoch's draws exactly."""
    def draws(epoch):
        ld = rt.build_dataloader(Draws(), 4, train=True, rank=0, world_size=1, seed=3, num_workers=1, timeout_s=30)
        try:
            ld.sampler.set_epoch(epoch)
            return {int(row[0]): row[1:] for row in torch.cat(list(ld))}
        finally:
            rt.stop_workers(ld)
    first, second, again = draws(0), draws(1), draws(1)
    assert sorted(first) == sorted(second) == list(range(8))
    assert all(torch.equal(second[i], again[i]) for i in range(8))
    assert all((first[i] != second[i]).all() for i in range(8))


def test_resumable_sampler_skips_the_consumed_part_once():
    s = rt.ResumableDistributedSampler(Indices(20), num_replicas=2, rank=1, shuffle=True, seed=1, drop_last=True)
    full = list(s)
    s.set_start_index(4)
    assert list(s) == full[4:] and list(s) == full


def test_too_small_training_set_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than batch_size"):
        rt.build_dataloader(Indices(6), 4, train=True, rank=0, world_size=2, seed=0)


# -- dispatch: a bad sample fails its rank's part at the same step as under shard ----------------------

class FailsAt(Indices):
    """Indices whose samples in `bad` fail to load."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = set(bad)

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"sample {i} unreadable")
        return super().__getitem__(i)


def read_epoch(batches) -> list:
    """An epoch read the way the trainer reads it: each batch's samples, or the error raised in its place."""
    out = []
    while True:
        try:
            out.append(next(batches).tolist())
        except StopIteration:
            return out
        except Exception as exc:  # noqa: BLE001 -- recorded, then reading goes on
            out.append(rt.error_text(exc))


def _dispatched_epoch(rank, world_size, n, bad):
    rt.setup_distributed(rank, world_size, device="cpu", timeout_s=30)
    try:
        loader = rt.DispatchLoader(FailsAt(n, bad), 4, rank=rank, world_size=world_size, seed=3)
        loader.sampler.set_epoch(1)
        return read_epoch(iter(loader))
    finally:
        rt.teardown_distributed()


@pytest.mark.multi
def test_dispatch_fails_only_the_part_with_a_bad_sample_and_reads_on_like_shard():
    bad = {5, 17, 30}
    dispatched = spawn(_dispatched_epoch, 2, 40, bad, timeout=60)
    errors = 0
    for rank in (0, 1):
        shard = rt.build_dataloader(FailsAt(40, bad), 4, train=True, rank=rank, world_size=2, seed=3)
        shard.sampler.set_epoch(1)
        expected = read_epoch(iter(shard))
        assert len(dispatched[rank]) == len(expected) == 5  # 40 samples, 2 ranks x 4: every rank 5 steps
        for got, want in zip(dispatched[rank], expected):
            if isinstance(want, str):  # the same sample fails the same rank's batch at the same step
                errors += 1
                assert got == f"BatchLoadError: {want} (read by rank 0 for rank {rank}, data_strategy dispatch)"
                assert want.endswith(" of the training set)")  # both name the sample
            else:
                assert got == want
    assert errors == len(bad)  # 40 = 2 x 4 x 5: no sample dropped, each bad one fails one batch


TRAIN_CFG = dict(hidden_size=32, num_layers=1, num_heads=2, seq_len=16, dataset_size=200, batch_size=8,
                 max_steps=12, learning_rate=1e-2, warmup_steps=2, log_interval=100, val_interval=0,
                 save_interval=0, save_every_iters=0, resume="none", device="cpu", dist_timeout=30,
                 max_errors_per_epoch=10)


def _train_flaky(rank, world_size, root, strategy):
    # Imported here: the rest of this file tests the runtime without the trainer.
    from ddp_training import CausalLM, DDPTrainer, TrainConfig, synthetic_lm_data
    cfg = {**TRAIN_CFG, "data_strategy": strategy, "log_dir": str(Path(root) / "logs"),
           "checkpoint_dir": str(Path(root) / "ckpt")}
    data = synthetic_lm_data(TrainConfig.from_dict(TRAIN_CFG))
    torch.manual_seed(0)
    s = DDPTrainer(rank=rank, world_size=world_size, config=cfg, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=FlakyData(data.train, range(0, 200, 37)), val_dataset=data.val).train()
    return s["status"], s["steps"]


@pytest.mark.multi
def test_dispatch_trains_through_bad_samples_exactly_like_shard(tmp_path):
    """Before: rank 0's reader died with the bad sample and left the others in a collective until
    dist_timeout ("rank is stuck"). Now both strategies skip the same batches: the same weights."""
    for strategy in ("shard", "dispatch"):
        assert spawn(_train_flaky, 2, str(tmp_path / strategy), strategy, timeout=150) == [("completed", 12)] * 2
    logs = {s: (tmp_path / s / "logs" / "rank_0.log").read_text() for s in ("shard", "dispatch")}
    assert logs["shard"].count("failed to load") == logs["dispatch"].count("failed to load") > 0
    a, b = (torch.load(tmp_path / s / "ckpt" / "model_final.pt", weights_only=True)["model"]
            for s in ("shard", "dispatch"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- collectives on real processes ---------------------------------------------------

def _collectives(rank, world_size, root):
    rt.setup_distributed(rank, world_size, device="cpu", timeout_s=30)
    try:
        out = dict(maxed=rt.all_reduce_floats([float(rank == 1)], dist.ReduceOp.MAX),
                   bcast=rt.broadcast_object({"from": rank}), gathered=rt.gather_objects(rank * 10),
                   summed=rt.all_reduce_floats([rank, 1.0]))

        def failing():
            raise OSError("disk full")
        try:
            rt.run_on_rank0(failing, what="writing x")
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        # A background write that fails on rank 0 fails every rank at the next flush.
        (Path(root) / "a_file").write_text("not a directory")
        writer = rt.CheckpointWriter(background=True)
        writer.save({"w": torch.ones(2)}, Path(root) / "a_file" / "x.pt", group=1)
        try:
            writer.flush()
        except Exception as exc:
            out["background_error"] = f"{type(exc).__name__}: {exc}"
        writer.save({"w": torch.ones(2)}, Path(root) / "ok.pt", group=2)
        writer.flush()
        writer.close()
        return out
    finally:
        rt.teardown_distributed()


@pytest.mark.multi
def test_collective_decisions_agree_on_every_rank(tmp_path):
    r0, r1 = spawn(_collectives, 2, str(tmp_path))
    for r in (r0, r1):
        assert r["maxed"] == [1.0]  # rank 1's flag, on both
        assert r["bcast"] == {"from": 0} and r["gathered"] == [0, 10] and r["summed"] == [1.0, 2.0]
    assert r0["error"] == "OSError: disk full"
    assert r1["error"] == "Rank0Failed: writing x failed on rank 0: OSError: disk full"
    assert r0["background_error"].startswith(f"CheckpointError: writing {tmp_path / 'a_file' / 'x.pt'} failed: ")
    assert r1["background_error"].startswith("Rank0Failed: a background checkpoint write failed on rank 0: "
                                             "CheckpointError: writing ")
    assert torch.equal(rt.load_checkpoint(tmp_path / "ok.pt")["w"], torch.ones(2))


# -- signals ----------------------------------------------------------------------

def test_stop_signal_only_sets_a_flag():
    stop = rt.StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.name == "SIGUSR1"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_stop_signal_for_set_up_leaves_ctrl_c_alone_until_training():
    before = signal.getsignal(signal.SIGINT)
    with rt.StopSignal(rt.StopSignal.PREEMPT_SIGNALS) as stop:  # set-up: a scheduler's signals only
        assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == stop._handler
        stop.install(rt.StopSignal.SIGNALS)  # train(): Ctrl-C too; installing SIGTERM again keeps its original
        assert signal.getsignal(signal.SIGINT) == stop._handler
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL



def test_a_scripts_early_stop_handlers_give_the_signals_back_to_the_default(tmp_path, no_launch_env):
    """The handlers a script installs before torch's import only collect stops: left in place after training,
    or through an evaluation, they ignored every later SIGTERM (found by a review of that change)."""
    from ddp_training import DDPTrainer, train_preemptible
    early = []
    previous = {sig: signal.signal(sig, lambda signum, frame: early.append(signum))
                for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        cfg = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "seq_len": 8, "dataset_size": 64, "max_steps": 1,
               "val_interval": 0, "device": "cpu", "log_dir": str(tmp_path), "checkpoint_dir": str(tmp_path / "ck")}
        assert train_preemptible(lambda: DDPTrainer(config=cfg), tmp_path, rt.FirstSignal(early)) == 0
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # a script that does not train lets them go, and a stop they caught is raised again: the default kills
    code = (f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r}); import ddp_runtime as rt; caught = []\n"
            "signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))\n"
            "os.kill(os.getpid(), signal.SIGTERM); rt.FirstSignal(caught).release(); print('alive')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM and "alive" not in r.stdout, r.stdout + r.stderr


_SET_UP = """
import sys, time
sys.path.insert(0, {repo!r})
import ddp_runtime as rt
with rt.StopSignal(rt.StopSignal.PREEMPT_SIGNALS):
    with rt.SetUpWatch(grace_s=1.5, log_dir={log_dir!r}):
        print("in set-up", flush=True)
        time.sleep({set_up_s})
    print("set-up done", flush=True)
    time.sleep(2)  # past the grace: a finished set-up is never ended by the watch
"""


@pytest.mark.parametrize("set_up_s", [0.5, 60])
def test_set_up_still_running_past_the_grace_after_a_stop_exits_75_with_the_marker(tmp_path, set_up_s):
    """A set-up blocked in C++ (a rendezvous for a peer that died) sees no Python handler: the watch ends it
    grace_s after the stop, with the PREEMPTED marker. One that finishes in time goes on to train."""
    code = _SET_UP.format(repo=str(REPO), log_dir=str(tmp_path / "run"), set_up_s=set_up_s)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in set-up\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if set_up_s < 1:
        assert proc.returncode == 0 and "set-up done" in out, err
        assert not (tmp_path / "run" / "PREEMPTED").exists()
        return
    assert proc.returncode == rt.EXIT_PREEMPTED and 1.4 < time.monotonic() - t0 < 15, err
    assert rt.SETUP_STOP_GRACE_S < 30  # SLURM's KillWait and torchrun's shutdown wait: SIGKILL after 30 s
    assert "SIGTERM 1.5s ago and set-up has not finished" in err and "nothing was trained here" in err
    marker = json.loads((tmp_path / "run" / "PREEMPTED").read_text())
    assert marker == {"step": None, "signal": "SIGTERM", "stopped_during": "set-up"}


def test_a_stop_received_before_the_watch_starts_its_grace(tmp_path):
    """A stop that came before the watch (spawn_local passed it on, or it fell between the handler and
    the watch) starts the grace when the watch starts: no further signal is needed."""
    code = (f"import signal, sys, time; sys.path.insert(0, {str(REPO)!r}); import ddp_runtime as rt\n"
            f"with rt.SetUpWatch(grace_s=1, log_dir={str(tmp_path)!r}, received=signal.SIGUSR1):\n"
            f"    time.sleep(60)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    # the grace (1 s) and torch's import (3 s here, 10 s with the CPU three times as busy), not the sleep (60 s)
    assert r.returncode == rt.EXIT_PREEMPTED and time.monotonic() - t0 < 45, r.stderr
    assert json.loads((tmp_path / "PREEMPTED").read_text())["signal"] == "SIGUSR1"


def test_a_set_up_that_gives_up_writes_no_marker_into_a_run_dir_another_run_holds(tmp_path):
    """A second launch into a run dir in use, stopped in its set-up (torchrun tearing it down after a peer
    failed): its marker would tell the first run's requeue script to requeue a run that finished."""
    lock = rt.RunDirLock(tmp_path)
    assert lock.acquire() is None
    try:
        code = (f"import signal, sys, time; sys.path.insert(0, {str(REPO)!r}); import ddp_runtime as rt\n"
                f"with rt.SetUpWatch(grace_s=0.5, log_dir={str(tmp_path)!r}, received=signal.SIGTERM):\n"
                f"    time.sleep(60)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    finally:
        lock.release()
    assert r.returncode == 1 and f"is in use by pid {os.getpid()} on " in r.stderr and "no marker there" in r.stderr
    assert not (tmp_path / "PREEMPTED").exists()
    # a rank of the same run (its rendezvous address) holds it, rank 0's trainer or a peer giving up too: the
    # marker is this run's, and every rank that gives up exits 75
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29123"}
    peer = rt.RunDirLock(tmp_path)
    assert peer.acquire(" [run at 127.0.0.1:29123]") is None
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    finally:
        peer.release()
    assert r.returncode == rt.EXIT_PREEMPTED and (tmp_path / "PREEMPTED").exists(), r.stderr


_LOST_CTRL_C = """
import sys, time
sys.path.insert(0, {repo!r})
import ddp_runtime as rt

class Closing:
    def __del__(self):  # Python drops a KeyboardInterrupt raised while this runs ("Exception ignored in")
        print("closing", flush=True)
        time.sleep(1)

with rt.StopSignal(rt.StopSignal.PREEMPT_SIGNALS):
    try:
        with rt.SetUpWatch(grace_s=30):
            for _ in range({closings}):
                Closing()
            print("set-up done", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("training", flush=True)
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_in_set_up_stops_it_even_when_python_drops_its_keyboard_interrupt(signals):
    """Ctrl-C during set-up is Python's KeyboardInterrupt, but one raised while a __del__ runs is dropped and
    set-up goes on: it then ends with KeyboardInterrupt when set-up does (not with training: a CI run once
    trained to the end after a Ctrl-C), and a second Ctrl-C ends it at once."""
    code = _LOST_CTRL_C.format(repo=str(REPO), closings=1 if signals == 1 else 60)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "closing\n"
        proc.send_signal(signal.SIGINT)
        if signals == 2:
            time.sleep(rt.SetUpWatch.REPEAT_AFTER_S + 0.3)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Exception ignored in" in err and "KeyboardInterrupt" in err, err
    assert "training" not in out
    if signals == 1:
        assert out.endswith("set-up done\ninterrupted\n"), out
    else:
        assert "second SIGINT during set-up: exiting at once" in err and "set-up done" not in out


def test_a_watch_that_takes_sigint_for_a_stop_leaves_it_to_the_stop():
    """Only Ctrl-C outside the watch's signals is a KeyboardInterrupt at the end of set-up."""
    with rt.StopSignal(rt.StopSignal.SIGNALS) as stop:
        try:
            with rt.SetUpWatch(rt.StopSignal.SIGNALS, grace_s=30):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        except KeyboardInterrupt:
            pytest.fail("a SIGINT the watch was given as a stop became a KeyboardInterrupt")
    assert stop.received == signal.SIGINT


def test_the_set_up_grace_comes_from_the_environment_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.delenv("SETUP_STOP_GRACE_S", raising=False)
    assert rt.SetUpWatch().grace_s == rt.SETUP_STOP_GRACE_S == 20
    monkeypatch.setenv("SETUP_STOP_GRACE_S", "7.5")
    assert rt.SetUpWatch().grace_s == 7.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("SETUP_STOP_GRACE_S", bad)
        with pytest.raises(ValueError, match=f"SETUP_STOP_GRACE_S='{bad}' in the environment: expected seconds > 0"):
            rt.SetUpWatch()

# -- checkpoint I/O -----------------------------------------------------------------

@pytest.mark.parametrize("sidecar", ["", "\n", "abc123  a.pt\n"])
def test_a_sidecar_without_a_digest_is_a_checkpoint_error_naming_it(tmp_path, sidecar):
    path = rt.atomic_save({"w": torch.arange(4.0)}, tmp_path / "a.pt")
    (tmp_path / "a.pt.sha256").write_text(sidecar)  # e.g. a copy of the run dir cut short by a full disk
    with pytest.raises(rt.CheckpointError, match=r"a.pt: its sidecar .*a.pt.sha256 holds no SHA-256 digest"):
        rt.load_checkpoint(path)
    assert torch.equal(rt.load_checkpoint(path, verify=False)["w"], torch.arange(4.0))


def test_a_failed_write_that_a_later_write_of_its_path_replaced_is_not_written_again(tmp_path, monkeypatch):
    """Two saves of one path at one save point (a step file saved again with its val_loss): the first fails after
    the second was queued, the second is written. Writing the failed ones again must not put the older copy
    back over the newer file."""
    save, calls = rt.atomic_save, []

    def first_fails_slowly(obj, path):
        calls.append(obj["v"].item())
        if len(calls) == 1:
            time.sleep(0.3)  # the second save is queued meanwhile
            raise OSError(28, "No space left on device")
        return save(obj, path)
    monkeypatch.setattr(rt, "atomic_save", first_fails_slowly)
    writer = rt.CheckpointWriter()
    path = tmp_path / "model_step_4.pt"
    writer.save({"v": torch.tensor(1.0)}, path, group=4, again=True)
    writer.save({"v": torch.tensor(2.0)}, path, group=4, again=True)
    with pytest.raises(rt.CheckpointError, match="No space left on device"):
        writer.flush()
    writer.write_failed_again()
    writer.flush()
    assert calls == [1.0, 2.0] and torch.load(path, weights_only=True)["v"] == 2.0
    assert writer.close() is None


def test_atomic_save_syncs_the_file_before_the_rename_and_the_dir_after(tmp_path, monkeypatch):
    """Without the first fsync a crash can leave the new name on a file with no data; without the second, the old
    file back under the name after a crash that followed the save."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", Path(a).name, Path(b).name))
        return real_replace(a, b)
    monkeypatch.setattr(rt.os, "fsync", fsync)
    monkeypatch.setattr(rt.os, "replace", replace)
    rt.atomic_save({"w": torch.ones(2)}, tmp_path / "m.pt")
    i = next(k for k, e in enumerate(events) if e[0] == "replace" and e[2] == "m.pt")
    assert ("fsync", events[i][1]) in events[:i], events  # the data reached the disk before the name did
    assert ("fsync", tmp_path.name) in events[i + 1:], events  # and the rename was made durable


def test_atomic_save_roundtrip_and_hash(tmp_path):
    path = rt.atomic_save({"w": torch.arange(4.0), "step": 3}, tmp_path / "a.pt")
    assert (tmp_path / "a.pt.sha256").read_text().split()[0] == rt.sha256_file(path)
    loaded = rt.load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["step"] == 3
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(rt.CheckpointError, match="SHA-256"):
        rt.load_checkpoint(path)


def test_pruning_removes_the_older_files_with_their_sidecars_and_keeps_the_newest(tmp_path):
    """keep_newest deletes all but the newest `keep` of the paths (oldest first) and each one's .sha256 sidecar;
    keep=0 keeps them all."""
    paths = [rt.atomic_save({"step": n}, tmp_path / f"s_{n}.pt") for n in (1, 2, 3)]
    assert rt.keep_newest(paths, 0) == [] and len(list(tmp_path.iterdir())) == 6
    assert rt.keep_newest(paths, 2) == paths[:1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s_2.pt", "s_2.pt.sha256", "s_3.pt", "s_3.pt.sha256"]
    assert rt.load_checkpoint(paths[2])["step"] == 3


def test_a_ctrl_c_inside_a_lock_release_never_closes_its_descriptor_twice(tmp_path, monkeypatch):
    """A rank gets a Ctrl-C twice (its group's and its parent's): the second landed in release() after the
    close and before the list was cleared, and the finalizer closed the descriptor again (EBADF, a traceback
    in the set-up's one line; or another file's descriptor, reused meanwhile)."""
    lock = rt.RunDirLock(tmp_path)
    assert lock.acquire() is None
    real_close = os.close

    def close_then_ctrl_c(fd):
        real_close(fd)
        raise KeyboardInterrupt
    monkeypatch.setattr(rt.os, "close", close_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        lock.release()
    monkeypatch.undo()
    lock.release()  # and the finalizer, later: nothing left to close
    assert rt.RunDirLock(tmp_path).acquire() is None


def test_a_run_dir_lock_dies_with_its_process_not_with_the_children_it_forked(tmp_path):
    """A rank killed outright while its forked DataLoader workers linger (they exit seconds later) must not
    leave the dir locked for a relaunch, and release() lets go even while such a child lives."""
    holder = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import ddp_runtime as rt
lock = rt.RunDirLock({str(tmp_path)!r})
assert lock.acquire() is None
worker = os.fork()
if worker == 0:  # a worker that outlives its rank
    time.sleep(30)
    os._exit(0)
print("locked", worker, flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
    left = []  # only these: the others among this process's children (the forkserver ranks fork from) stay
    try:
        word, worker = holder.stdout.readline().split()
        left.append(int(worker))
        assert word == "locked"
        lock = rt.RunDirLock(tmp_path)
        assert lock.acquire().startswith(f"pid {holder.pid} on ")
        holder.kill()
        holder.wait(10)
        assert lock.acquire() is None  # the forked child, still asleep, holds nothing
        if (child := os.fork()) == 0:
            time.sleep(30)
            os._exit(0)
        left.append(child)
        lock.release()
        other = rt.RunDirLock(tmp_path)
        assert other.acquire() is None  # released, though this process's child lives on
        other.release()
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left[1:]:
            os.waitpid(left[1], 0)


def test_a_failure_marker_that_cannot_be_written_says_so_and_lets_the_error_through(tmp_path, capsys):
    rt.write_failure_marker(tmp_path / "logs", 1, 7, ValueError("bad"))
    assert json.loads((tmp_path / "logs" / "FAILED_rank_1").read_text()) == {"rank": 1, "step": 7,
                                                                             "error": "ValueError: bad"}
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(OSError, match="No space"):  # the error being raised, not the marker's
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            rt.write_failure_marker(not_a_dir, 0, 3, exc)
            raise
    err = capsys.readouterr().err
    assert f"[rank 0] could not write FAILED_rank_0 into {not_a_dir}" in err
    assert "the other ranks will not see this rank's error: OSError: [Errno 28] No space left on device" in err


def test_a_read_error_while_checking_a_checkpoint_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch):
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "c.pt")

    def eio(p, chunk=0):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(rt, "sha256_file", eio)
    with pytest.raises(rt.CheckpointError, match=f"checkpoint {path}: cannot read it to check its SHA-256: .*"
                                                 f"Input/output error"):
        rt.load_checkpoint(path)


def test_background_writer_saves_the_values_of_the_moment_it_was_called(tmp_path, monkeypatch):
    release = threading.Event()
    real = rt.atomic_save
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: (release.wait(10), real(obj, path))[1])
    emb = torch.arange(6.0).reshape(2, 3)
    payload = {"emb": emb, "head": emb.detach(), "opt": {"state": {0: {"m": torch.ones(3)}}}, "step": 4}
    writer = rt.CheckpointWriter(background=True)
    order = []
    writer.save(payload, tmp_path / "a.pt", group=4, then=lambda: order.append("a"))
    writer.save({"head": payload["head"]}, tmp_path / "b.pt", group=4, then=lambda: order.append("b"))
    emb.add_(100.0)  # training goes on while the writes wait
    payload["opt"]["state"][0]["m"].zero_()
    assert not (tmp_path / "a.pt").exists()
    release.set()
    writer.flush()
    assert order == ["a", "b"]
    a = rt.load_checkpoint(tmp_path / "a.pt")
    assert torch.equal(a["emb"], torch.arange(6.0).reshape(2, 3)) and a["step"] == 4
    assert torch.equal(a["opt"]["state"][0]["m"], torch.ones(3))
    assert a["emb"].data_ptr() == a["head"].data_ptr()  # tied weights stay tied in the file
    assert torch.equal(rt.load_checkpoint(tmp_path / "b.pt")["head"], torch.arange(6.0).reshape(2, 3))
    assert writer.close() is None


def test_a_save_point_never_takes_a_freed_tensors_copy_for_a_new_one(tmp_path, monkeypatch):
    """Payloads of one save point share host copies by source address; a source freed after its save
    (RNG states are fresh tensors each time) must not hand its copy to a later tensor at that address."""
    release = threading.Event()
    real = rt.atomic_save
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: (release.wait(10), real(obj, path))[1])
    writer = rt.CheckpointWriter(background=True)
    writer.save({"rng": torch.full((256,), 1, dtype=torch.uint8)}, tmp_path / "first.pt", group=7)
    for i in range(20):  # the first payload's tensor is gone; new ones of its size, at any free address
        writer.save({"rng": torch.full((256,), i + 2, dtype=torch.uint8)}, tmp_path / f"s{i}.pt", group=7)
    release.set()
    writer.flush()
    def holds(name, value):
        return torch.equal(rt.load_checkpoint(tmp_path / name)["rng"], torch.full((256,), value, dtype=torch.uint8))
    assert holds("first.pt", 1)
    for i in range(20):
        assert holds(f"s{i}.pt", i + 2), i
    assert writer.close() is None


def test_host_snapshot_copies_tensors_and_keeps_state_dict_versions():
    bn = torch.nn.BatchNorm1d(3)
    sd = bn.state_dict()
    snap = rt.host_snapshot(sd)
    assert snap._metadata == sd._metadata and list(snap) == list(sd)
    bn.running_mean.add_(1.0)
    assert torch.equal(snap["running_mean"], torch.zeros(3)) and not torch.equal(sd["running_mean"], torch.zeros(3))


def test_writer_pins_within_its_host_memory_share_and_falls_back_to_pageable(tmp_path, monkeypatch, caplog):
    """With pin (CUDA), a payload is copied to page-locked memory only while twice its CUDA bytes fit in
    PIN_MAX_HOST_FRACTION of host memory; a failed pinned copy turns pinning off and the save still happens."""
    calls = []
    real = rt.host_snapshot

    def snapshot(obj, memo=None, pin=False):
        calls.append(pin)
        if pin and fail_pinning:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(obj, memo)
    monkeypatch.setattr(rt, "host_snapshot", snapshot)
    host = rt.usable_memory_bytes()
    writer = rt.CheckpointWriter(background=True, pin=True)
    fail_pinning = False
    monkeypatch.setattr(rt, "cuda_bytes", lambda obj: int(rt.PIN_MAX_HOST_FRACTION * host / 2) - 1)
    writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    monkeypatch.setattr(rt, "cuda_bytes", lambda obj: int(rt.PIN_MAX_HOST_FRACTION * host / 2) + 1)
    with caplog.at_level(logging.INFO):
        writer.save({"w": torch.ones(2)}, tmp_path / "b.pt", group=2)
        writer.save({"w": torch.ones(2)}, tmp_path / "c.pt", group=3)
    assert calls == [True, False, False] and writer.pin
    assert sum("copied to pageable memory" in r.message for r in caplog.records) == 1  # said once
    monkeypatch.setattr(rt, "cuda_bytes", lambda obj: 0)
    fail_pinning = True
    writer.save({"w": torch.full((2,), 7.0)}, tmp_path / "d.pt", group=4)
    writer.save({"w": torch.ones(2)}, tmp_path / "e.pt", group=5)
    writer.flush()
    assert calls == [True, False, False, True, False, False] and not writer.pin
    assert any("page-locked checkpoint copies failed" in r.message for r in caplog.records)
    assert torch.equal(rt.load_checkpoint(tmp_path / "d.pt")["w"], torch.full((2,), 7.0))
    assert writer.close() is None


def test_writer_raises_a_cuda_error_that_is_not_a_refused_pinned_allocation(tmp_path, monkeypatch):
    def snapshot(obj, memo=None, pin=False):
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setattr(rt, "host_snapshot", snapshot)
    monkeypatch.setattr(rt, "cuda_bytes", lambda obj: 0)
    writer = rt.CheckpointWriter(background=True, pin=True)
    with pytest.raises(RuntimeError, match="device-side assert"):
        writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    assert writer.pin and not (tmp_path / "a.pt").exists()
    assert writer.close() is None


@pytest.mark.parametrize("v2", [True, False])
def test_usable_memory_is_the_cgroup_limit_where_one_is_set(tmp_path, v2):
    machine = psutil.virtual_memory().total
    (tmp_path / "proc/self").mkdir(parents=True)
    if v2:
        (tmp_path / "proc/self/cgroup").write_text("0::/job42/step0\n")
        limit_file, no_limit = tmp_path / "sys/fs/cgroup/job42/step0/memory.max", "max"
    else:
        (tmp_path / "proc/self/cgroup").write_text("9:cpu,cpuacct:/job42\n4:memory:/job42\n")
        limit_file, no_limit = tmp_path / "sys/fs/cgroup/memory/job42/memory.limit_in_bytes", str(2**63 - 4096)
    limit_file.parent.mkdir(parents=True)
    limit_file.write_text(f"{2**30}\n")
    assert rt.usable_memory_bytes(tmp_path) == min(machine, 2**30)
    limit_file.write_text(no_limit + "\n")
    assert rt.usable_memory_bytes(tmp_path) == machine
    assert 0 < rt.usable_memory_bytes() <= machine  # this machine, whatever its cgroups say


def test_cuda_bytes_counts_only_cuda_tensors():
    assert rt.cuda_bytes({"a": torch.ones(4), "b": [torch.zeros(2, dtype=torch.float64)], "n": 3}) == 0


def test_background_writer_gives_up_on_a_write_that_hangs(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: release.wait(30))
    writer = rt.CheckpointWriter(background=True)
    writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    error = writer.close(timeout_s=0.5)
    release.set()
    assert isinstance(error, rt.CheckpointError) and str(error) == "a checkpoint write did not finish within 0.5 s"
    assert not (tmp_path / "a.pt").exists()


def test_flush_gives_up_on_a_write_that_hangs_after_wait_s(tmp_path, monkeypatch):
    """On several ranks the others stop waiting for rank 0's flush after dist_timeout (wait_s): rank 0 must
    not wait on for ever behind a hung file system."""
    release = threading.Event()
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: release.wait(30))
    writer = rt.CheckpointWriter(background=True, wait_s=0.5)
    writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    t0 = time.monotonic()
    with pytest.raises(rt.CheckpointWriteHung, match=r"a checkpoint write did not finish within 0.5 s \(a hung "):
        writer.flush()
    assert 0.5 <= time.monotonic() - t0 < 5
    # the next save point does not queue its files behind the hung write (and wait for it again): it stops
    with pytest.raises(rt.CheckpointWriteHung):
        writer.save({"w": torch.ones(2)}, tmp_path / "b.pt", group=2)
    t0 = time.monotonic()
    assert str(writer.close(timeout_s=30)) == "a checkpoint write is still hung"
    assert time.monotonic() - t0 < 5  # not another 30 s
    release.set()


def test_a_write_still_running_at_the_next_save_point_is_told_once(tmp_path, monkeypatch, caplog):
    """While a background write runs, a kill loses the work since the save point before it: up to two
    intervals when writes take as long as the interval. The user is told once, at the first such wait."""
    release = threading.Event()
    real_save = rt.atomic_save
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: release.wait(30) and real_save(obj, path))
    writer = rt.CheckpointWriter(background=True)
    told = "the previous save point's checkpoint is still being written at this one"
    writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    threading.Timer(0.3, release.set).start()
    with caplog.at_level(logging.WARNING):
        writer.save({"w": torch.ones(2)}, tmp_path / "b.pt", group=2)  # waits for a.pt
        assert (tmp_path / "a.pt").exists() and caplog.text.count(told) == 1
        writer.flush()
        assert (tmp_path / "b.pt").exists()
        release.clear()
        writer.save({"w": torch.ones(2)}, tmp_path / "c.pt", group=3)
        threading.Timer(0.3, release.set).start()
        writer.save({"w": torch.ones(2)}, tmp_path / "d.pt", group=4)  # waits for c.pt: not told again
    assert writer.close(timeout_s=30) is None
    assert all((tmp_path / f"{name}.pt").exists() for name in "abcd") and caplog.text.count(told) == 1


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "c.pt")
    real_save = torch.save

    def half_then_fail(obj, f):
        real_save(obj, f)  # the bytes reach the temp file; the disk then "fills up"
        raise OSError("No space left on device")
    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        rt.atomic_save({"v": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(rt.load_checkpoint(path)["v"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.sha256"]


def test_a_full_disk_during_torch_save_is_named_as_such(tmp_path, monkeypatch):
    """torch.save turns the OSError of a write into "unexpected pos N vs M"; the disk's own error is raised."""
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "c.pt")
    real_open = open

    class FillsUp:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += len(data)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(rt, "open", lambda p, mode="r": FillsUp(real_open(p, mode)), raising=False)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device"):
        rt.atomic_save({"v": torch.zeros(100_000)}, path)
    monkeypatch.undo()
    assert torch.equal(rt.load_checkpoint(path)["v"], torch.ones(3))  # the previous file, intact


def test_a_failed_synchronous_write_names_the_file(tmp_path, monkeypatch):
    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rt, "atomic_save", full_disk)
    with pytest.raises(rt.CheckpointError, match=r"writing .*state.pt failed: OSError: .*No space left"):
        rt.CheckpointWriter(background=False).save({"w": torch.ones(2)}, tmp_path / "state.pt")


def fail_on_sidecar(monkeypatch):
    """The disk fills up while the `.sha256` sidecar is written (after the checkpoint itself)."""
    real = rt._atomic_write

    def write(path, *args, **kwargs):
        if path.name.endswith(".sha256"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)
    monkeypatch.setattr(rt, "_atomic_write", write)


def test_failed_sidecar_write_leaves_a_checkpoint_that_loads(tmp_path, monkeypatch):
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "best.pt")
    fail_on_sidecar(monkeypatch)
    with pytest.raises(rt.CheckpointError, match="was written, but not its SHA-256 sidecar .*No space left"):
        rt.atomic_save({"v": torch.zeros(3)}, path)
    monkeypatch.undo()
    # The old sidecar went before the new file took the name: the new file loads (unchecked), not
    # "fails its SHA-256 check" with nothing else left to load.
    assert torch.equal(rt.load_checkpoint(path)["v"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    rt.atomic_save({"v": torch.full((3,), 2.0)}, path)  # the next save checks again
    assert (tmp_path / "best.pt.sha256").read_text().split()[0] == rt.sha256_file(path)


def test_crash_between_sidecar_removal_and_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "c.pt")
    real_replace = os.replace

    def crash(src, dst):
        if Path(dst) == path:
            raise OSError(errno.EIO, "killed before the rename")
        return real_replace(src, dst)
    monkeypatch.setattr(rt.os, "replace", crash)
    with pytest.raises(OSError, match="killed before the rename"):
        rt.atomic_save({"v": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(rt.load_checkpoint(path)["v"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_background_writer_holds_no_host_copy_once_written(tmp_path, monkeypatch):
    """Payloads of one save point share host copies while one of them waits; after the writes the
    writer holds none (before: its memo kept weights + optimizer in host RAM until the next save)."""
    release = threading.Event()
    copies, weight_ptrs = [], []
    real = rt.atomic_save

    def recording(obj, path):
        rt.map_tensors(lambda t: copies.append(weakref.ref(t)), obj)
        weight_ptrs.append(obj["model"]["weight"].data_ptr())
        release.wait(10)
        return real(obj, path)
    monkeypatch.setattr(rt, "atomic_save", recording)
    model = torch.nn.Linear(256, 256)
    state = {"exp_avg": torch.randn(256, 256)}
    writer = rt.CheckpointWriter(background=True)
    writer.save({"model": model.state_dict()}, tmp_path / "weights.pt", group=7)
    writer.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "state.pt", group=7)
    release.set()
    writer.flush()
    assert len(weight_ptrs) == 2 and weight_ptrs[0] == weight_ptrs[1]  # one host copy of the weights
    gc.collect()
    assert copies and not [r for r in copies if r() is not None]
    assert torch.equal(rt.load_checkpoint(tmp_path / "state.pt")["model"]["weight"], model.weight.detach())
    assert writer.close() is None


class OffHost(torch.Tensor):
    """Stands in for a tensor on an accelerator (map_location='cuda') on a machine without one: used
    directly it is a meta tensor, which torch, numpy and random refuse as they refuse CUDA tensors;
    its values come only through a copy to the host, `.cpu()`."""

    @staticmethod
    def __new__(cls, host):
        t = torch.Tensor._make_subclass(cls, torch.empty_like(host, device="meta"))
        t.host = host
        return t

    def cpu(self, *args, **kwargs):
        return self.host.clone()


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_rng_state_restores_from_tensors_off_the_host():
    state = rt.rng_state()
    expected = draws()
    off_host = rt.map_tensors(OffHost, state)
    assert isinstance(off_host["torch"], OffHost) and off_host["torch"].device.type == "meta"
    rt.set_rng_state(off_host)  # before: TypeError: RNG state must be a torch.ByteTensor
    assert draws() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_state_restores_after_loading_onto_cuda(tmp_path):
    gpu = torch.device("cuda", torch.cuda.current_device())
    path = rt.atomic_save({"rng": rt.rng_state(gpu)}, tmp_path / "state.pt")
    expected = draws() + (torch.rand(3, device=gpu).tolist(),)
    loaded = rt.load_checkpoint(path, map_location="cuda")["rng"]  # what a resume with map_location=device did
    assert loaded["torch"].is_cuda and loaded["cuda"].is_cuda
    rt.set_rng_state(loaded, gpu)
    assert draws() + (torch.rand(3, device=gpu).tolist(),) == expected


def test_a_state_holds_the_rng_of_its_ranks_gpu_only(monkeypatch):
    """Another launch may see other GPUs (--gpus 0,1 on an 8-GPU node, one GPU per SLURM task): a state with
    every visible GPU's stream (as before 25 Nov) failed to resume there with an IndexError. It holds the
    rank's own GPU's; an old state gives the stream at the rank's index, where there is one."""
    streams = {0: torch.full((4,), 10, dtype=torch.uint8), 1: torch.full((4,), 11, dtype=torch.uint8)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: streams[device.index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.update({device.index: state}))
    assert "cuda" not in rt.rng_state(torch.device("cpu")) and "cuda" not in rt.rng_state()
    state = rt.rng_state(torch.device("cuda", 1))
    assert torch.equal(state["cuda"], streams[1])
    rt.set_rng_state(state, torch.device("cuda", 0))  # resumed where the rank's GPU has another number
    assert list(restored) == [0] and torch.equal(restored.pop(0), streams[1])
    old = {**state, "cuda": [streams[0], streams[1]]}
    rt.set_rng_state(old, torch.device("cuda", 1))
    assert list(restored) == [1] and torch.equal(restored.pop(1), streams[1])
    rt.set_rng_state({**old, "cuda": [streams[0]]}, torch.device("cuda", 1))  # before: IndexError
    rt.set_rng_state(old, torch.device("cpu"))
    assert restored == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_snapshot_of_cuda_tensors_is_a_finished_copy(tmp_path):
    """The writer's page-locked copies are queued without blocking and waited for once: when host_snapshot
    returns, the copy holds the values of that moment, even of a tensor still being written by queued work;
    tied tensors stay one, and CPU tensors are copied as before."""
    source = torch.randn(1024, 1024, device="cuda")
    expected = source.cpu()
    weight = torch.zeros_like(source)
    torch.cuda._sleep(10**9)  # ~0.5 s of queued device work before the write that the copy must wait for
    weight.copy_(source)
    payload = {"model": {"w": weight, "tied": weight}, "step": 3, "cpu": torch.arange(4)}
    copy = rt.host_snapshot(payload, pin=True)
    w = copy["model"]["w"]
    assert w.device.type == "cpu" and w.is_pinned() and torch.equal(w, expected)  # no device sync in between
    weight.mul_(2)  # training goes on changing the original
    torch.cuda.synchronize()
    assert torch.equal(w, expected)
    assert copy["model"]["tied"] is w and copy["step"] == 3 and not copy["cpu"].is_pinned()
    path = rt.atomic_save(copy, tmp_path / "snap.pt")
    assert torch.equal(rt.load_checkpoint(path)["model"]["w"], expected)


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > boom.txt",))


def test_pickle_payload_is_refused_without_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buf = io.BytesIO()
    torch.save({"model": Boom()}, buf)
    (tmp_path / "evil.pt").write_bytes(buf.getvalue())
    with pytest.raises(rt.CheckpointError, match="cannot be loaded safely: it holds objects that weights_only=True "
                       r"refuses \(Trying to load unsupported GLOBAL posix.system whose module posix is blocked\)$"):
        rt.load_checkpoint(tmp_path / "evil.pt")
    assert not (tmp_path / "boom.txt").exists()


def test_a_file_that_is_no_checkpoint_gets_one_line_without_torchs_advice_to_load_it_unsafely(tmp_path):
    """torch.load's own message runs over lines and says that weights_only=False would likely succeed."""
    whole = io.BytesIO()
    torch.save({"w": torch.ones(100)}, whole)
    files = {"config.yaml": b"run_name: a\nlr: 0.001\n", "empty.pt": b"", "cut.pt": whole.getvalue()[:400],
             "noise.pt": bytes(random.Random(0).randbytes(1000))}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(rt.CheckpointError) as err:
            rt.load_checkpoint(tmp_path / name)
        assert str(err.value) == (f"checkpoint {tmp_path / name} cannot be loaded: not a whole zip archive as "
                                  f"torch.save writes ({len(data)} bytes: truncated, or another kind of file)")
    with pytest.raises(rt.CheckpointError, match=f"^checkpoint {tmp_path} is a directory$"):
        rt.load_checkpoint(tmp_path)
    # a file that cannot be read is not called truncated (is_zipfile takes it for no zip)
    error = rt.why_not_loadable(tmp_path / "empty.pt", PermissionError(13, "Permission denied"))
    assert error == "cannot be read: [Errno 13] Permission denied"


UNCAUGHT_IN_A_LOADER_LOOP = """
import torch, ddp_runtime as rt
class Bad(torch.utils.data.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        if i == 50:
            raise ValueError("sample 50 cannot be read")
        return torch.tensor([i])
for batch in rt.build_dataloader(Bad(), 4, train=False, rank=0, world_size=1, seed=0, num_workers=1,
                                 local_world_size=1):
    pass
"""


@pytest.mark.multi  # a loader worker process
def test_a_script_that_fails_in_a_loader_loop_exits_at_once(tmp_path):
    """The workers ignore SIGTERM (a preemption must not kill them), and multiprocessing's exit handler stops
    leftover workers with SIGTERM and then waits for them without a timeout: the loaders stop them first."""
    import sys
    from conftest import REPO, clean_env, run
    (tmp_path / "fails.py").write_text(UNCAUGHT_IN_A_LOADER_LOOP)
    r = run([sys.executable, tmp_path / "fails.py"], cwd=REPO, timeout=60, env=clean_env())
    assert r.returncode == 1 and "ValueError: sample 50 cannot be read" in r.stdout, r.stdout[-2000:]
