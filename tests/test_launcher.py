"""launch_training.sh and scripts/slurm_example.sbatch: GPU counting, numbers, the script's location, the
exit code of a preempted run, and the SLURM run name. Most cases put a fake `torchrun` (it prints its
arguments) and fake GPU tools on PATH, so they take well under a second; the signal tests run real ranks."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import SIGHUP_IGNORED, REPO, background, clean_env, metrics, run, torchrun_workers, wait_for_step
from dist_helpers import free_ports

LAUNCHER = REPO / "launch_training.sh"
SBATCH = REPO / "scripts" / "slurm_example.sbatch"
EXIT_PREEMPTED = 75


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    """A directory for fake commands, holding a `torchrun` that prints the GPUs and the shutdown grace it was
    given, each argument as [arg], and then runs FAKE_TORCHRUN_THEN (shell) if set."""
    bin_dir = tmp_path / "bin"
    executable(bin_dir / "torchrun", '#!/bin/sh\necho "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"\n'
                                     'echo "grace=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"\n'
                                     'echo "OMP_NUM_THREADS=${OMP_NUM_THREADS-unset}"\n'
                                     'printf "[%s]" "$@"; echo\neval "${FAKE_TORCHRUN_THEN:-}"\n')
    return bin_dir


def fake_env(bin_dir, **extra) -> dict:
    """`bin_dir` first on PATH, then the test's Python (as python3), and no PYTHON unless given: the launcher
    then takes the torchrun on PATH, the fake one."""
    env = {k: v for k, v in clean_env(PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin").items()
           if k != "PYTHON"}
    return {**env, **{k: str(v) for k, v in extra.items()}}


def launch(argv, cwd, bin_dir, timeout=30, launcher=LAUNCHER, **env):
    """The launcher with fake commands (see fake_env)."""
    return run(["bash", launcher, *argv], cwd=cwd, timeout=timeout, env=fake_env(bin_dir, **env))


def fake_nvidia_smi(bin_dir: Path, gpus: int) -> None:
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(gpus)))


def fake_torch(root: Path, gpus: int) -> Path:
    """A `torch` package whose only content is torch.cuda.device_count(), for the launcher's GPU count."""
    executable(root / "torch" / "__init__.py", f"class cuda:\n    device_count = staticmethod(lambda: {gpus})\n")
    return root


def failed(r, *words):
    assert r.returncode == 2 and all(w in r.stdout for w in words), r.stdout
    assert "[--standalone]" not in r.stdout  # torchrun never started


# -- GPUs and --nproc ---------------------------------------------------------------------------------------

def test_debug_and_restarts_set_what_torchrun_and_its_workers_read(tmp_path, fake_bin):
    show = 'echo "debug=${TORCH_DISTRIBUTED_DEBUG-unset} nccl=${NCCL_DEBUG-unset} blocking=${CUDA_LAUNCH_BLOCKING-unset} ' \
           'share=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE-unset}"'
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=show)
    assert "debug=unset nccl=unset blocking=unset share=unset" in r.stdout, r.stdout
    # INFO, not DETAIL: DDP's constructor segfaults under DETAIL with torch 2.13
    r = launch(["--cpu", "--debug", "--max-restarts", "2"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=show)
    assert "debug=INFO nccl=INFO blocking=1 share=1" in r.stdout and "[--debug]" in r.stdout, r.stdout
    assert "[--max_restarts][2]" in r.stdout, r.stdout
    r = launch(["--cpu", "--debug"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=show, TORCH_DISTRIBUTED_DEBUG="OFF")
    assert "debug=OFF " in r.stdout, r.stdout  # an exported value wins



def test_a_launcher_started_with_ctrl_c_ignored_says_how_to_stop_it(tmp_path, fake_bin):
    """`./launch_training.sh ... &` in a script starts with Ctrl-C ignored, which no trap undoes: a Ctrl-C then
    did nothing, without a word (a user test)."""
    cmd = ["bash", LAUNCHER, "--cpu"]
    r = subprocess.run(cmd, cwd=tmp_path, env=fake_env(fake_bin), capture_output=True, text=True, timeout=30,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 0 and re.search(r"note: Ctrl-C is ignored here \(started in the background by a shell "
                                           r"script\); kill -TERM \d+ stops the run with a save", r.stderr), r.stderr
    assert "Ctrl-C is ignored" not in launch(["--cpu"], tmp_path, fake_bin).stdout


def test_srun_starting_several_launchers_for_one_node_is_refused(tmp_path, fake_bin):
    """`srun -n 2 ./launch_training.sh`: each task started its own one-node torchrun group, which trained alone
    or was turned away from the other's run dir as "another run" (a SLURM review)."""
    failed(launch(["--cpu"], tmp_path, fake_bin, SLURM_STEP_NUM_TASKS=2),
           "srun started 2 launchers (SLURM_STEP_NUM_TASKS) for --nnodes 1: each would train on its own; start one "
           "per node, as srun --ntasks-per-node=1 bash -c './launch_training.sh --nnodes $SLURM_NNODES --node-rank "
           "$SLURM_NODEID")
    nodes = ["--cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    assert launch(nodes, tmp_path, fake_bin, SLURM_STEP_NUM_TASKS=2).returncode == 0  # one per node
    assert launch(["--cpu"], tmp_path, fake_bin, SLURM_STEP_NUM_TASKS=1).returncode == 0


def test_gpu_mode_refuses_more_processes_than_gpus(tmp_path, fake_bin):
    fake_nvidia_smi(fake_bin, 2)
    failed(launch(["--nproc", "4"], tmp_path, fake_bin), "--nproc 4", "2 selected")
    failed(launch(["--gpus", "0,1", "--nproc", "3"], tmp_path, fake_bin), "--nproc 3", "2 selected (--gpus 0,1)")
    r = launch(["--nproc", "2"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[--nproc_per_node][2]" in r.stdout and "[--device][cuda]" in r.stdout, r.stdout
    r = launch(["--gpus", "1"], tmp_path, fake_bin)  # one process per listed GPU
    assert r.returncode == 0 and "[--nproc_per_node][1]" in r.stdout and "CUDA_VISIBLE_DEVICES=1" in r.stdout


@pytest.mark.parametrize("nvidia_smi", ["failing", "missing"])
def test_gpus_are_counted_by_torch_without_a_working_nvidia_smi(tmp_path, fake_bin, nvidia_smi):
    if nvidia_smi == "failing":  # as in a container where the binary is mounted but NVML is not
        executable(fake_bin / "nvidia-smi", "#!/bin/sh\necho 'Failed to initialize NVML' >&2\nexit 9\n")
    elif any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has nvidia-smi in /usr/bin")
    pythonpath = f"{fake_torch(tmp_path / 'fake', 3)}{os.pathsep}{REPO}"
    r = launch([], tmp_path, fake_bin, PYTHONPATH=pythonpath)
    assert r.returncode == 0 and "[--nproc_per_node][3]" in r.stdout and "[--device][cuda]" in r.stdout, r.stdout
    failed(launch(["--nproc", "4"], tmp_path, fake_bin, PYTHONPATH=pythonpath), "--nproc 4", "3 selected")
    # torch without CUDA: the CPU, as before
    r = launch([], tmp_path, fake_bin, PYTHONPATH=f"{fake_torch(tmp_path / 'none', 0)}{os.pathsep}{REPO}")
    assert r.returncode == 0 and "falling back to the CPU" in r.stdout and "[--device][cpu]" in r.stdout, r.stdout


def test_a_set_python_runs_torchrun_itself_not_the_torchrun_on_path(tmp_path, fake_bin):
    """PYTHON=.venv/bin/python with another environment's torchrun first on PATH: that torchrun's Python would
    run the workers without the venv's packages (from a review)."""
    python = executable(tmp_path / "venv" / "python",
                        '#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2; echo "venv torchrun"; '
                        f'printf "[%s]" "$@"; echo; exit 0; fi\nexec {sys.executable} "$@"\n')
    r = launch(["--cpu"], tmp_path, fake_bin, PYTHON=python)
    assert r.returncode == 0 and "venv torchrun" in r.stdout and "grace=" not in r.stdout, r.stdout
    assert "[--standalone][--nproc_per_node][2]" in r.stdout, r.stdout
    # a PYTHON without torch is an error naming it, not a fall back to the torchrun on PATH
    no_torch = executable(tmp_path / "bare" / "python", "#!/bin/sh\nexit 1\n")
    failed(launch(["--cpu"], tmp_path, fake_bin, PYTHON=no_torch), f"PYTHON={no_torch} cannot import torch")


@pytest.mark.parametrize("visible, expected", [("-1", None), ("", None), ("1,-1,0", "1"), ("0,1,2,3,4,5", "0,1,2,3"),
                                               ("GPU-8f2c,GPU-77aa", "GPU-8f2c,GPU-77aa"),
                                               # from a review: CUDA sees no GPU, and one, where 2 were planned
                                               ("1,0,1", None), ("GPU-8f2c,0", "GPU-8f2c")])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(tmp_path, fake_bin, visible, expected):
    fake_nvidia_smi(fake_bin, 4)
    r = launch(["--test"], tmp_path, fake_bin, CUDA_VISIBLE_DEVICES=visible)
    assert r.returncode == 0, r.stdout
    if expected is None:  # "-1" hides every GPU: the CPU, not a CUDA run that fails in every worker
        assert "falling back to the CPU" in r.stdout and "[--device][cpu]" in r.stdout, r.stdout
    else:
        assert f"[--nproc_per_node][{expected.count(',') + 1}]" in r.stdout and "[--device][cuda]" in r.stdout
        assert f"CUDA_VISIBLE_DEVICES={visible}" in r.stdout  # left as it was: CUDA numbers within it


def test_cpu_ranks_share_the_cores_unless_omp_num_threads_is_set(tmp_path, fake_bin):
    cores = len(os.sched_getaffinity(0))
    for nproc in (1, 2):  # an empty value counts as unset, as for OpenMP
        r = launch(["--cpu", "--nproc", str(nproc)], tmp_path, fake_bin, OMP_NUM_THREADS="")
        assert f"OMP_NUM_THREADS={max(1, cores // nproc)}\n" in r.stdout, r.stdout  # not torchrun's 1
    r = launch(["--cpu", "--nproc", "2"], tmp_path, fake_bin, OMP_NUM_THREADS="3")
    assert "OMP_NUM_THREADS=3" in r.stdout, r.stdout


def test_multi_node_restarts_use_c10d_rendezvous(tmp_path, fake_bin):
    nodes = ["--cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600"]
    r = launch(nodes, tmp_path, fake_bin)
    assert "[--node_rank][1][--master_addr][10.0.0.1][--master_port][29600]" in r.stdout, r.stdout
    assert "[--rdzv_conf][timeout=600,join_timeout=600]" in r.stdout, r.stdout  # torchrun's own default, said
    r = launch([*nodes, "--rdzv-timeout", "45"], tmp_path, fake_bin)
    assert "[--rdzv_conf][timeout=45,join_timeout=45]" in r.stdout and "waiting up to 45s" in r.stdout, r.stdout
    r = launch([*nodes, "--max-restarts", "2"], tmp_path, fake_bin, SLURM_JOB_ID="4711")
    assert "[--rdzv_backend][c10d][--rdzv_endpoint][10.0.0.1:29600][--rdzv_id][4711]" in r.stdout, r.stdout
    assert "--node_rank" not in r.stdout and "[--max_restarts][2]" in r.stdout
    # static rendezvous needs each node's rank: two nodes that both took 0 waited until the rendezvous timed out
    failed(launch(["--cpu", "--nnodes", "2", "--master-addr", "10.0.0.1"], tmp_path, fake_bin),
           "--nnodes 2 needs --node-rank (0 on the --master-addr host, 1 on the other)")
    r = launch(["--cpu", "--nnodes", "2", "--master-addr", "10.0.0.1", "--max-restarts", "1"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[--rdzv_backend][c10d]" in r.stdout, r.stdout


def torchrun_args(r) -> list:
    """The arguments the fake torchrun received (its [arg] line)."""
    line = next(line for line in r.stdout.splitlines() if line.startswith("[--"))
    return line[1:-1].split("][")


@pytest.mark.parametrize("names", [("-b", "-e", "-l", "-c"), ("--batch-size", "--epochs", "--log-dir", "--checkpoint-dir")])
def test_each_option_reaches_torchrun_and_the_script_as_documented(tmp_path, fake_bin, names):
    """Every value is the one right after its option, in any order; `--` ends the options, and torchrun gets one
    before the script (see test_script_flags_are_never_read_by_torchrun)."""
    batch, epochs, log, ckpt = names
    r = launch(["--max-restarts", "1", batch, "64", epochs, "3", "--nproc", "3", log, "L", ckpt, "C", "--test",
                "--debug", "--cpu", "--", "--run_name", "x"], tmp_path, fake_bin)
    assert r.returncode == 0, r.stdout
    assert torchrun_args(r) == [
        "--standalone", "--nproc_per_node", "3", "--max_restarts", "1",
        "--signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",  # SIGUSR1: SLURM's --signal=USR1@...
        "--", str(REPO / "ddp_training.py"), "--device", "cpu", "--dist-backend", "gloo", "--batch_size", "64",
        "--num_epochs", "3", "--log_dir", "L", "--checkpoint_dir", "C", "--test", "--debug", "--run_name", "x"], r.stdout


def test_script_flags_are_never_read_by_torchrun(tmp_path, fake_bin):
    """torchrun's parser read the script's flags too, and stopped with its usage on one that abbreviates two of its
    options: `-- --nproc 2` gave "ambiguous option: --nproc could match --nproc-per-node" (from a walkthrough)."""
    r = launch(["--cpu", "--nproc", "1", "--", "--nproc", "2", "--test"], tmp_path, fake_bin)
    args = torchrun_args(r)
    assert r.returncode == 0 and args[args.index("--") + 1:] == [
        str(REPO / "ddp_training.py"), "--device", "cpu", "--dist-backend", "gloo", "--nproc", "2", "--test"], args
    # torch's own parser: every flag after the script is the script's, and torchrun's options are the launcher's
    executable(fake_bin / "torchrun", f"#!{sys.executable}\nimport sys\nfrom torch.distributed.run import parse_args\n"
                                      "a = parse_args(sys.argv[1:])\nprint('nproc_per_node', a.nproc_per_node, "
                                      "'script', a.training_script, 'args', a.training_script_args)\n")
    r = launch(["--cpu", "--nproc", "1", "--", "--nproc", "2", "--nnodes", "3", "--", "--test"], tmp_path, fake_bin)
    assert r.returncode == 0 and "ambiguous option" not in r.stdout, r.stdout
    assert (f"nproc_per_node 1 script {REPO / 'ddp_training.py'} args ['--device', 'cpu', '--dist-backend', 'gloo', "
            "'--nproc', '2', '--nnodes', '3', '--', '--test']") in r.stdout, r.stdout


def test_an_option_without_its_value_does_not_take_the_next_option(tmp_path, fake_bin):
    failed(launch(["-l", "--cpu"], tmp_path, fake_bin), "option -l needs a value")
    failed(launch(["--script", "--test", "--cpu"], tmp_path, fake_bin), "option --script needs a value")


def test_gpu_ids_count_within_the_visible_gpus_each_once(tmp_path, fake_bin):
    fake_nvidia_smi(fake_bin, 4)
    # a scheduler gave this job GPUs 2 and 3: -g 1 is the second of them
    r = launch(["-g", "1"], tmp_path, fake_bin, CUDA_VISIBLE_DEVICES="2,3")
    assert r.returncode == 0 and "CUDA_VISIBLE_DEVICES=3\n" in r.stdout and "[--nproc_per_node][1]" in r.stdout, r.stdout
    failed(launch(["--gpus", "2"], tmp_path, fake_bin, CUDA_VISIBLE_DEVICES="2,3"),
           "--gpus: GPU 2 does not exist (2 GPU(s) visible)")
    failed(launch(["--gpus", "0,0"], tmp_path, fake_bin), "--gpus: GPU 0 listed twice")  # two ranks on one GPU
    failed(launch(["--cpu", "--gpus", "0"], tmp_path, fake_bin), "--cpu and --gpus exclude each other")


def test_node_counts_and_ranks_that_cannot_meet_are_refused(tmp_path, fake_bin):
    failed(launch(["--cpu", "--nnodes", "0"], tmp_path, fake_bin), "--nnodes must be >= 1")
    failed(launch(["--cpu", "--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"], tmp_path, fake_bin),
           "--node-rank 2 must be < --nnodes 2")
    failed(launch(["--cpu", "--nnodes", "2", "--node-rank", "1"], tmp_path, fake_bin),
           "--nnodes 2 needs --master-addr (the host of node rank 0)")


def test_a_master_port_that_is_no_tcp_port_is_refused(tmp_path, fake_bin):
    """torchrun took port 99999 and failed with a traceback after the launcher's checks had passed (a walkthrough)."""
    nodes = ["--cpu", "--test", "--nnodes", "2", "--master-addr", "127.0.0.1", "--node-rank", "0"]
    for port in ("99999", "65536", "0", "000"):
        r = launch([*nodes, "--master-port", port], tmp_path, fake_bin)
        failed(r, "--master-port must be a TCP port in 1..65535")
        assert r.stdout.count("error") == 1, r.stdout
    failed(launch([*nodes, "--master-port", "http"], tmp_path, fake_bin),
           "--master-port expects a non-negative integer (decimal digits), got 'http'")
    r = launch([*nodes, "--master-port", "065535"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[--master_port][65535]" in r.stdout, r.stdout
    failed(launch(["--cpu", "--master-port", "99999"], tmp_path, fake_bin), "--master-port must be a TCP port")


def test_one_node_notes_that_it_ignores_master_addr_and_port(tmp_path, fake_bin):
    """torchrun --standalone picks its own rendezvous: a given --master-addr/--master-port was dropped silently."""
    r = launch(["--cpu", "--master-addr", "10.0.0.1", "--master-port", "29600"], tmp_path, fake_bin)
    args = torchrun_args(r)
    assert r.returncode == 0 and "--standalone" in args and "--master_addr" not in args, r.stdout
    notes = [line for line in r.stdout.splitlines() if "only apply with --nnodes > 1" in line]
    assert notes == ["launch_training.sh: note: --master-addr 10.0.0.1 --master-port 29600 ignored: --master-addr "
                     "and --master-port only apply with --nnodes > 1"], r.stdout
    r = launch(["--cpu", "--master-port", "29600"], tmp_path, fake_bin)
    assert r.returncode == 0 and "note: --master-port 29600 ignored" in r.stdout, r.stdout
    for argv in (["--cpu"], ["--cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]):
        r = launch(argv, tmp_path, fake_bin)
        assert r.returncode == 0 and "note:" not in r.stdout, r.stdout


def test_every_node_of_a_run_gets_the_same_rendezvous_and_launch_ids(tmp_path, fake_bin):
    """Without SLURM_JOB_ID the c10d rendezvous id and the markers' launch id come from what all nodes are given
    alike (the rank 0 node writes the marker, each node's launcher looks for its launch id in it); a single-node
    launch has an id of its own."""
    show = 'echo "launch_id=$DDP_KIT_LAUNCH_ID"'
    seen = set()
    for rank in ("0", "1"):
        r = launch(["--cpu", "--nnodes", "2", "--node-rank", rank, "--master-addr", "10.0.0.1", "--master-port", "29600",
                    "--max-restarts", "1"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=show)
        args = torchrun_args(r)
        seen.add((args[args.index("--rdzv_id") + 1], r.stdout.split("launch_id=")[1].split()[0]))
    assert len(seen) == 1 and "29600" in seen.pop()[0], seen
    ids = {launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=show).stdout.split("launch_id=")[1].split()[0]
           for _ in range(2)}
    assert len(ids) == 2, ids


def test_cpu_ranks_share_the_cores_this_process_may_use_at_least_one_thread_each(tmp_path, fake_bin):
    """Cores as `nproc` counts them, within the CPU affinity (taskset, a SLURM allocation), not the machine's."""
    core = min(os.sched_getaffinity(0))
    pinned = [sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
                                    "os.execvp('bash', ['bash', *sys.argv[1:]])", LAUNCHER]
    for nproc in ("1", "2"):  # one core: one thread per rank, never 0
        r = run([*pinned, "--cpu", "--nproc", nproc], cwd=tmp_path, timeout=30,
                env=fake_env(fake_bin, OMP_NUM_THREADS=""))
        assert r.returncode == 0 and "OMP_NUM_THREADS=1\n" in r.stdout, r.stdout
    r = launch(["--cpu", "--nproc", "0"], tmp_path, fake_bin, OMP_NUM_THREADS="")
    failed(r, "--nproc must be >= 1")  # refused before the cores are divided by it
    assert "division" not in r.stdout, r.stdout


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGHUP, marks=pytest.mark.skipif(
    SIGHUP_IGNORED, reason="started under nohup: bash cannot trap SIGHUP")), signal.SIGQUIT, signal.SIGINT])
def test_sighup_sigquit_and_sigint_reach_torchrun_as_sigterm(tmp_path, fake_bin, sig):
    """The trainers save on SIGTERM; SIGHUP (a closed terminal) or SIGQUIT passed on as such would kill them.
    A SIGINT in the first milliseconds after the start hit torchrun's wrapper while bash still had it ignored."""
    then = ('trap "echo TERM > got; exit 1" TERM; trap "echo HUP > got; exit 1" HUP; '
            'trap "echo QUIT > got; exit 1" QUIT; trap "echo INT > got; exit 1" INT; touch ready; '
            'while :; do sleep 0.1; done')
    env = fake_env(fake_bin, FAKE_TORCHRUN_THEN=then)
    with background(["bash", LAUNCHER, "--cpu"], tmp_path, env=env) as proc:
        deadline = time.time() + 20
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and proc.poll() is None, "the fake torchrun did not start"
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.communicate(timeout=20)
    assert (tmp_path / "got").read_text().strip() == "TERM"


def wait_for(condition, proc, what: str, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline and proc.poll() is None, what
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_sigterm_and_sigusr1_reach_torchrun_as_themselves(tmp_path, fake_bin, sig):
    """SLURM's --signal=USR1@... warning goes on as SIGUSR1, which the trainers save on."""
    then = ('trap "echo TERM > got; exit 1" TERM; trap "echo USR1 > got; exit 1" USR1; touch ready; '
            'while :; do sleep 0.1; done')
    with background(["bash", LAUNCHER, "--cpu"], tmp_path, env=fake_env(fake_bin, FAKE_TORCHRUN_THEN=then)) as proc:
        wait_for((tmp_path / "ready").exists, proc, "the fake torchrun did not start")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    assert (tmp_path / "got").read_text().strip() == sig.name[3:], out


def test_a_second_stop_signal_is_not_passed_on(tmp_path, fake_bin):
    """torchrun restarts its shutdown wait on a second stop signal and gives up on its workers at a third: a
    scheduler's final signal or a second Ctrl-C after the first stop reaches only the launcher."""
    then = "trap 'echo TERM >> got' TERM; touch ready; while [ ! -f done ]; do sleep 0.1; done; exit 1"
    log = tmp_path / "launcher.log"
    with open(log, "w") as out, background(["bash", LAUNCHER, "--cpu"], tmp_path, stdout=out,
                                           env=fake_env(fake_bin, FAKE_TORCHRUN_THEN=then)) as proc:
        wait_for((tmp_path / "ready").exists, proc, "the fake torchrun did not start")
        proc.send_signal(signal.SIGTERM)
        wait_for((tmp_path / "got").exists, proc, "the first SIGTERM did not reach torchrun")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "SIGINT received" in log.read_text() or len((tmp_path / "got").read_text().split()) > 1,
                 proc, "the launcher did not answer the second signal")
        (tmp_path / "done").touch()
        proc.wait(timeout=20)
    text = log.read_text()
    assert (tmp_path / "got").read_text() == "TERM\n", text
    assert "SIGINT received; already stopping on SIGTERM, the workers have up to 300s to save" in text, text


def test_a_stop_while_the_gpus_are_counted_exits_75_before_torchrun_starts(tmp_path, fake_bin):
    """The launcher set its traps only after counting the GPUs (seconds when torch has to count them): a
    SIGTERM there ended it with 143 and no word (from a review)."""
    executable(fake_bin / "nvidia-smi", "#!/bin/sh\ntouch ready\nsleep 1\necho 0\n")
    env = fake_env(fake_bin)
    with background(["bash", LAUNCHER, "--test"], tmp_path, env=env) as proc:
        deadline = time.time() + 20
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and proc.poll() is None, "the GPUs were not counted"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_PREEMPTED and "stopped by SIGTERM before torchrun started: nothing ran" in out, out
    assert "[--standalone]" not in out


def test_a_stop_to_the_launchers_process_group_while_the_gpus_are_counted_exits_75(tmp_path, fake_bin):
    """A Ctrl-C reaches the whole group: the counting subshell died of it, and set -e ended the launcher with 143
    and no word, where a stop to the launcher alone exits 75 (from a launcher test)."""
    executable(fake_bin / "nvidia-smi", "#!/bin/sh\ntouch ready\nsleep 5\necho 0\n")
    proc = subprocess.Popen(["bash", LAUNCHER, "--test"], cwd=tmp_path, env=fake_env(fake_bin), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 20
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and proc.poll() is None, "the GPUs were not counted"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED and "stopped by SIGTERM before torchrun started: nothing ran" in out, out
    assert "[--standalone]" not in out


def test_gpu_ids_may_be_written_with_spaces(tmp_path, fake_bin):
    fake_nvidia_smi(fake_bin, 2)
    r = launch(["--gpus", "0, 1"], tmp_path, fake_bin)
    assert r.returncode == 0 and "CUDA_VISIBLE_DEVICES=0,1" in r.stdout and "[--nproc_per_node][2]" in r.stdout, \
        r.stdout


def test_numbers_are_read_as_decimal(tmp_path, fake_bin):
    r = launch(["--cpu", "--nproc", "08", "-e", "010"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[--nproc_per_node][8]" in r.stdout and "[--num_epochs][10]" in r.stdout, r.stdout
    fake_nvidia_smi(fake_bin, 2)
    failed(launch(["--gpus", "09"], tmp_path, fake_bin), "GPU 9 does not exist")
    failed(launch(["--cpu", "--nproc", "1" * 19], tmp_path, fake_bin), "--nproc expects a non-negative integer")
    failed(launch(["--cpu", "--nproc", "0x2"], tmp_path, fake_bin), "--nproc expects a non-negative integer", "'0x2'")
    r = launch(["--cpu", "--nproc", "00"], tmp_path, fake_bin)
    failed(r, "--nproc must be >= 1")
    assert "division" not in r.stdout and r.stdout.count("error") == 1, r.stdout
    failed(launch(["--cpu", "--max-restarts", "-1"], tmp_path, fake_bin), "--max-restarts expects a non-negative integer",
           "'-1'")
    failed(launch(["--cpu"], tmp_path, fake_bin, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="soon"),
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT expects seconds", "'soon'")


def test_arguments_with_spaces_and_globs_reach_the_script_whole(tmp_path, fake_bin):
    (tmp_path / "a").mkdir()  # something an unquoted * would expand to
    r = launch(["--cpu", "-l", "my logs", "-c", "ckpt *", "--", "--run_name", "a b", "--data", "*"],
               tmp_path, fake_bin)
    assert r.returncode == 0, r.stdout
    for whole in ("[--log_dir][my logs]", "[--checkpoint_dir][ckpt *]", "[--run_name][a b]", "[--data][*]"):
        assert whole in r.stdout, (whole, r.stdout)


def test_script_and_launcher_paths_with_spaces_stay_whole(tmp_path, fake_bin):
    executable(tmp_path / "my scripts" / "train.py", "")
    r = launch(["--cpu", "--script", "my scripts/train.py"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[my scripts/train.py][--device]" in r.stdout, r.stdout
    kit = tmp_path / "my kit"  # the kit itself in a directory with a space, run from elsewhere
    executable(kit / "launch_training.sh", LAUNCHER.read_text())
    executable(kit / "ddp_training.py", "")
    (tmp_path / "work").mkdir()
    r = launch(["--cpu"], tmp_path / "work", fake_bin, launcher=kit / "launch_training.sh")
    assert r.returncode == 0 and f"[{kit / 'ddp_training.py'}][--device]" in r.stdout, r.stdout


def test_torchrun_gives_the_workers_300_s_to_save_unless_told_otherwise(tmp_path, fake_bin):
    r = launch(["--cpu"], tmp_path, fake_bin)
    assert r.returncode == 0 and "grace=300" in r.stdout and "running: TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300 " in r.stdout
    r = launch(["--cpu"], tmp_path, fake_bin, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="0900")
    assert r.returncode == 0 and "grace=900" in r.stdout, r.stdout


# -- where the script is --------------------------------------------------------------------------------------

def test_the_default_script_is_found_from_any_directory(tmp_path, fake_bin):
    r = launch(["--cpu"], tmp_path, fake_bin)
    assert r.returncode == 0 and f"[{REPO / 'ddp_training.py'}]" in r.stdout, r.stdout
    link = tmp_path / "tools" / "launch"  # a symlink to the launcher, as in ~/bin
    link.parent.mkdir()
    link.symlink_to(LAUNCHER)
    r = launch(["--cpu", "--script", "vj2ac_train_multi_gpu.py"], tmp_path, fake_bin, launcher=link)
    assert r.returncode == 0 and f"[{REPO / 'vj2ac_train_multi_gpu.py'}]" in r.stdout, r.stdout
    (tmp_path / "ddp_training.py").write_text("")  # a script in the current directory wins
    r = launch(["--cpu"], tmp_path, fake_bin)
    assert r.returncode == 0 and "[ddp_training.py]" in r.stdout, r.stdout
    failed(launch(["--cpu", "--script", "missing.py"], tmp_path, fake_bin), "--script 'missing.py' does not exist",
           str(REPO))


# -- exit status: 75 for a preempted run ------------------------------------------------------------------------

# a marker as the trainers write it under the launcher: with the launch's id (shell, for FAKE_TORCHRUN_THEN)
MARKER = 'printf \'{"step": 7, "launch_id": "%s"}\\n\' "$DDP_KIT_LAUNCH_ID"'


IDLE = "while :; do sleep 0.1; done"  # a fake torchrun that waits to be stopped


def write_marker(path: Path, step: int = 7) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step}) + "\n")


@pytest.mark.parametrize("argv, log_dir", [
    ([], "runs/lm"),                                                          # ddp_training.py's default
    (["--", "--run_name", "x"], "runs/x"),
    (["-l", "logs"], "logs"),
    (["--", "--log-dir=elsewhere"], "elsewhere"),
    (["--script", "vj2ac_train_multi_gpu.py", "-c", "ck"], "ck"),             # vj2ac: log dir = checkpoint dir
    (["--script", "vj2ac_train_multi_gpu.py"], "checkpoints/vj2ac"),
    (["--", "--run_name", "exp1/lr3e-4"], "runs/exp1/lr3e-4"),                # a nested run name
    (["--", "--run-name=a/b/c"], "runs/a/b/c"),
    (["--script", "vj2ac_train_multi_gpu.py", "--", "--run_name", "v/1"], "checkpoints/v/1"),
    (["--", "--log_dir", "elsewhere"], "elsewhere"),
    (["--script", "vj2ac_train_multi_gpu.py", "--", "--checkpoint-dir", "ck"], "ck"),
    (["--script", "vj2ac_train_multi_gpu.py", "-c", "ck", "--", "--run_name", "v"], "ck"),
    (["--", "--run_name", "a", "--run_name", "b"], "runs/b"),                 # argparse takes the last one
])
def test_a_failed_torchrun_with_a_new_marker_exits_75(tmp_path, fake_bin, argv, log_dir):
    # the launcher gets the stop and passes it on; the ranks save and leave the marker; torchrun exits 1
    r = launch(["--cpu", *argv], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=(
        f"save() {{ mkdir -p {log_dir} && {MARKER} > {log_dir}/PREEMPTED; exit 1; }}; trap save TERM; "
        f"kill -TERM $PPID; {IDLE}"))
    assert r.returncode == EXIT_PREEMPTED, r.stdout
    assert f"the run was preempted ({log_dir}/PREEMPTED" in r.stdout and "relaunch" in r.stdout


def test_a_preempted_run_exits_75_when_its_output_reader_is_gone(tmp_path, fake_bin):
    """`./launch_training.sh ... 2>&1 | tee train.log` and a Ctrl-C, which stops tee too (or a closed terminal):
    the launcher's last message met a pipe without a reader, and SIGPIPE turned the run's 75 into 141."""
    then = (f"save() {{ mkdir -p runs/lm && {MARKER} > runs/lm/PREEMPTED; exit 1; }}; trap save TERM; echo trapped; "
            f"{IDLE}")
    proc = subprocess.Popen(["bash", LAUNCHER, "--cpu"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=fake_env(fake_bin, FAKE_TORCHRUN_THEN=then))
    watchdog = threading.Timer(60, proc.kill)  # ends the read below if the launcher hangs without a word
    watchdog.start()
    try:
        for line in proc.stdout:  # until the fake torchrun has its trap
            if line.startswith("trapped"):
                break
        else:
            pytest.fail("the launcher ended (or hung) before torchrun set its trap")
        proc.stdout.close()  # the reader is gone
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_PREEMPTED
    finally:
        watchdog.cancel()
        proc.kill()
    assert (tmp_path / "runs" / "lm" / "PREEMPTED").exists()


def test_a_marker_without_a_stop_is_no_preemption_and_a_stop_before_training_is(tmp_path, fake_bin):
    """torchrun sends SIGTERM to the other ranks when one fails; one still in set-up writes a marker after its
    grace (rt.SetUpWatch). With no stop passed on by the launcher, that is the failure it is: no requeue."""
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=f"mkdir -p runs/lm && {MARKER} > runs/lm/PREEMPTED;"
                                                                 " exit 1")
    assert r.returncode == 1 and "preempted" not in r.stdout, r.stdout
    # a stop while the ranks still import torch kills them (no handler yet): nothing trained, a preemption
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=f"trap 'exit 1' TERM; kill -TERM $PPID; {IDLE}")
    assert r.returncode == EXIT_PREEMPTED and "before any rank began training" in r.stdout, r.stdout
    # another run's metrics.jsonl, written while this launch's ranks imported, is not this launch's training
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=(
        "mkdir -p runs/other && echo '{\"type\": \"start\", \"launch_id\": \"x\"}' > runs/other/metrics.jsonl; "
        f"trap 'exit 1' TERM; kill -TERM $PPID; {IDLE}"))
    assert r.returncode == EXIT_PREEMPTED and "before any rank began training" in r.stdout, r.stdout
    # ...but once training has begun (this launch's start record in metrics.jsonl), a stop that leaves no marker
    # is a failure
    start = MARKER.replace('"step": 7', '"type": "start", "step": 0')
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=(
        f"mkdir -p runs/lm && {start} >> runs/lm/metrics.jsonl; trap 'exit 1' TERM; kill -TERM $PPID; {IDLE}"))
    assert r.returncode == 1 and "but no PREEMPTED marker newer than the launch" in r.stdout, r.stdout


def test_an_old_marker_or_a_clean_exit_is_not_a_preemption(tmp_path, fake_bin):
    write_marker(tmp_path / "runs" / "lm" / "PREEMPTED")  # left by an earlier run
    old = time.time() - 3600
    os.utime(tmp_path / "runs" / "lm" / "PREEMPTED", (old, old))
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN="exit 3")
    assert r.returncode == 3 and "preempted" not in r.stdout, r.stdout
    # With -l the marker is only looked for there, not in other runs' dirs.
    r = launch(["--cpu", "-l", "mine"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN="touch runs/lm/PREEMPTED; exit 1")
    assert r.returncode == 1, r.stdout
    r = launch(["--cpu", "--", "--run_name", "mine"], tmp_path, fake_bin,
               FAKE_TORCHRUN_THEN="touch runs/lm/PREEMPTED; exit 1")  # nor, with a run name, in another run's
    assert r.returncode == 1, r.stdout
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=f"{MARKER} > runs/lm/PREEMPTED; exit 0")
    assert r.returncode == 0, r.stdout
    # A new marker of another run (another launch) in a dir the launcher searches: not this run's preemption
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN="touch runs/lm/PREEMPTED; exit 1")
    assert r.returncode == 1 and "preempted" not in r.stdout, r.stdout
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN="mkdir -p runs/b && DDP_KIT_LAUNCH_ID=other "
                                                                 f"&& {MARKER} > runs/b/PREEMPTED; exit 1")
    assert r.returncode == 1 and "preempted" not in r.stdout, r.stdout


def test_a_marker_of_this_launch_without_a_stop_from_the_launcher_is_said_not_taken_for_a_preemption(tmp_path,
                                                                                                     fake_bin):
    """A stop that reached only another node's launcher stopped every rank (agreed), and this node's launcher
    ended with torchrun's 1 and its traceback, saying nothing of the saved state (from a launcher test)."""
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=f"mkdir -p runs/lm && {MARKER} > runs/lm/PREEMPTED; "
                                                                 "exit 1")
    assert r.returncode == 1, r.stdout
    assert r.stdout.rstrip().endswith(
        "launch_training.sh: torchrun exited 1; the run saved and left a PREEMPTED marker of this launch "
        "(runs/lm/PREEMPTED): a stop reached another node's launcher or the ranks themselves, or torchrun stopped "
        "them after a rank failed (see above); relaunch the same command to resume"), r.stdout


def test_a_run_that_completes_while_torchrun_handles_a_stop_exits_0(tmp_path, fake_bin):
    """A stop that lands after the last step (during the final evaluation): the run completes and writes
    COMPLETED, and torchrun still exits non-zero for the signal it handled."""
    complete = (f"mkdir -p runs/lm && {MARKER} > runs/lm/COMPLETED && kill -TERM $PPID; "
                "trap 'exit 1' TERM; while :; do sleep 0.1; done")
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=complete)
    assert r.returncode == 0, r.stdout
    assert "the run completed (runs/lm/COMPLETED) before SIGTERM could stop it" in r.stdout, r.stdout
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=f"mkdir -p runs/lm && {MARKER} > "
                                                                 "runs/lm/COMPLETED; exit 1")
    assert r.returncode == 1, r.stdout  # no stop signal: a failure after the marker is a failure


def reason(code=None, message="error: --x is bad", refused=False):
    """Shell writing what torchrun leaves in its own TORCHELASTIC_ERROR_FILE: the first failed worker's reason,
    with its exit code (absent when torchrun failed on its own); `refused`: written by rt.note_for_torchrun."""
    info = {"timestamp": "1", **({"refused": "true"} if refused else {})}
    body = {"message": {"message": message, "extraInfo": info, **({"errorCode": code} if code else {})}}
    return f"echo '{json.dumps(body)}' > \"$TORCHELASTIC_ERROR_FILE\"; exit 1"


def test_a_worker_that_refused_its_input_makes_the_launcher_exit_2(tmp_path, fake_bin):
    """torchrun exits 1 whatever its workers' codes; the reason the trainers leave it carries theirs."""
    (tmp_path / "tmp").mkdir()
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=reason(2), TMPDIR=tmp_path / "tmp")
    assert r.returncode == 2 and "the script refused its input (exit 2" in r.stdout, r.stdout
    # both ranks refused, and the one torchrun took for the first failure was ended by its SIGTERM after writing
    # its reason (exit -15): bad input all the same (it exited 1, about 1 CI run in 10)
    r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=reason(-15, refused=True), TMPDIR=tmp_path / "tmp")
    assert r.returncode == 2 and "the script refused its input (exit 2" in r.stdout, r.stdout
    for other in (reason(1), reason(), reason(2).replace('{"message": {', '{"message": "new format", "x": {'),
                  "exit 1"):
        r = launch(["--cpu"], tmp_path, fake_bin, FAKE_TORCHRUN_THEN=other, TMPDIR=tmp_path / "tmp")
        assert r.returncode == 1 and "refused" not in r.stdout, r.stdout
    assert not list((tmp_path / "tmp").iterdir())  # the launcher removes its files


@pytest.mark.multi
def test_bad_input_under_the_launcher_exits_2_with_the_error_in_torchruns_summary(tmp_path):
    env = clean_env(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = run(["bash", LAUNCHER, "--cpu", "--nproc", "2", "--", "--dropout", "1.5"], cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 2, r.stdout[-3000:]
    # torchrun's failure summary shows the reason instead of a pointer to its docs
    assert "traceback : error: config key 'dropout' must be in [0, 1), got 1.5" in r.stdout, r.stdout[-3000:]
    r = run(["bash", LAUNCHER, "--cpu", "--nproc", "2", "--", "--no_such_flag"], cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 2 and "ddp_training.py: error: unrecognized arguments: --no_such_flag" in r.stdout


def launcher_run(tmp_path):
    """A real 2-rank CPU run through the launcher, from a directory without the scripts, with many steps."""
    env = clean_env(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = ["bash", LAUNCHER, "--cpu", "--nproc", "2", "-l", "logs", "-c", "ckpt", "--",
           "--test", "--max_steps", "100000", "--val_interval", "0", "--log_interval", "1"]
    return background(cmd, tmp_path, env=env)


def check_preempted(tmp_path, out: str) -> None:
    marker = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())
    assert marker["step"] >= 3 and (tmp_path / "ckpt" / f"model_state_step_{marker['step']}.pt").exists(), out
    assert "the run was preempted" in out


@pytest.mark.multi
def test_sigterm_to_the_launcher_exits_75_after_the_workers_saved(tmp_path):
    with launcher_run(tmp_path) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=90)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    check_preempted(tmp_path, out)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in out


@pytest.mark.multi
def test_repeated_ctrl_c_reaches_torchrun_once(tmp_path):
    """A Ctrl-C goes to the terminal's whole process group. torchrun gives up on its workers mid-save at its
    third stop signal (torch 2.13), so it must get a Ctrl-C only once, from the launcher. The workers are
    held stopped (a slow save) while Ctrl-C is pressed three times."""
    with launcher_run(tmp_path) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=90)
        agent, *workers = psutil.Process(proc.pid).children(recursive=True)
        assert agent.name() == "pt_elastic" and len(workers) == 2, (agent, workers)
        for p in workers:
            p.suspend()
        for _ in range(3):
            os.killpg(proc.pid, signal.SIGINT)  # the launcher leads the group, as a shell's foreground job
            time.sleep(0.5)
        assert agent.is_running() and proc.poll() is None, "torchrun gave up on its workers"
        for p in workers:
            p.resume()
        out, _ = proc.communicate(timeout=60)
        _, alive = psutil.wait_procs([agent, *workers], timeout=5)
    assert proc.returncode == EXIT_PREEMPTED and not alive, out[-4000:]
    assert out.count("SIGINT received; already stopping on SIGINT") == 2, out[-4000:]
    check_preempted(tmp_path, out)


@pytest.mark.multi
def test_two_nodes_with_max_restarts_recover_from_a_killed_worker(tmp_path):
    """Two "nodes" on this host, one CPU process each, sharing the run dirs as nodes share a file system. A
    worker killed outright: both nodes' agents restart their workers, which resume from the newest state. A
    restart to spare for a port race (see test_resume's test_sigkill_a_worker_under_max_restarts_...)."""
    port = free_ports(1)[0]
    env = clean_env(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    OMP_NUM_THREADS=1)

    def node(rank):
        return ["bash", LAUNCHER, "--cpu", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "2", "-l", "logs",
                "-c", "ckpt", "--", "--test", "--max_steps", "120", "--val_interval", "0", "--save_every_iters",
                "20", "--log_interval", "1", "--dist_timeout", "60"]

    with background(node(0), tmp_path, env=env) as first, background(node(1), tmp_path, env=env) as second:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 30, timeout=120)
        workers = {**torchrun_workers(first), **torchrun_workers(second)}
        assert sorted(workers) == [0, 1], workers
        workers[1].kill()  # SIGKILL: no handler runs, nothing is saved
        outs = [p.communicate(timeout=240)[0] for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, "\n".join(o[-3000:] for o in outs)
    assert "resumed from" in (tmp_path / "logs" / "rank_0.log").read_text()
    assert [r["step"] for r in metrics(tmp_path / "logs", "train")] == list(range(1, 121))


@pytest.mark.multi
def test_a_node_that_never_starts_ends_the_other_within_the_rendezvous_timeout_saying_so(tmp_path):
    """Node 1 never launched: node 0 waited in torchrun's rendezvous for 600 s with no word, which no trainer
    timeout bounds (from a launcher test); --rdzv-timeout bounds it, and the launcher says what to do."""
    env = clean_env(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    OMP_NUM_THREADS=1)
    t0 = time.time()
    r = run(["bash", LAUNCHER, "--cpu", "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr",
             "127.0.0.1", "--master-port", str(free_ports(1)[0]), "--rdzv-timeout", "5", "-l", "logs", "--",
             "--test"], cwd=tmp_path, timeout=120, env=env)
    assert r.returncode == 1 and time.time() - t0 < 90, r.stdout[-3000:]
    assert "waiting up to 5s for the launchers of all 2 nodes to meet at 127.0.0.1:" in r.stdout, r.stdout[-3000:]
    assert "1/2 clients joined" in r.stdout, r.stdout[-3000:]  # torchrun's own error
    assert r.stdout.rstrip().endswith("start every node's launcher within that time, with the same --nnodes, "
                                      "--master-addr and --master-port, and each node its own --node-rank (under "
                                      "srun, quote it: '--node-rank $SLURM_NODEID', not expanded by the batch "
                                      "shell)"), r.stdout[-3000:]


# -- SLURM ---------------------------------------------------------------------------------------------------

def sbatch(tmp_path, fake_bin, marker: bool, extra=(), kit=REPO, status=75, **env):
    """The sbatch script with fake srun (prints the rendezvous it was given and its arguments, optionally leaves
    a PREEMPTED marker in the --log_dir it was given and exits `status`) and scontrol (the job's nodes are node1
    and node2; prints what else it was asked)."""
    preempt = f'while [[ $1 != --log_dir ]]; do shift; done; mkdir -p "$2"; echo "{{}}" > "$2/PREEMPTED"; exit {status}\n'
    executable(fake_bin / "srun", '#!/bin/bash\necho "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"\n'
                                  'printf "[%s]" "$@"; echo\n' + (preempt if marker else ""))
    executable(fake_bin / "scontrol", '#!/bin/sh\n[ "$1" = show ] && printf "node1\\nnode2\\n" || echo "scontrol $*"\n')
    slurm = dict(SLURM_JOB_NAME="ddp-train", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[1-2]",
                 SLURM_CPUS_PER_TASK="8")
    if kit is not None:
        slurm["KIT_DIR"] = str(kit)
    return run(["bash", SBATCH, "--max_steps", "10", *extra], cwd=tmp_path, timeout=30,
               env=clean_env(PATH=f"{fake_bin}:/usr/bin:/bin", **{**slurm, **env}))


def test_slurm_run_name_is_unique_per_job_and_requeues_on_preemption(tmp_path, fake_bin):
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    # SLURM's warning signal before the time limit, to the tasks (not `B:`, the batch shell), and requeueing
    directives = [line.split()[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--signal=TERM@120" in directives and "--requeue" in directives
    r = sbatch(tmp_path, fake_bin, marker=False)
    assert r.returncode == 0, r.stdout
    assert "[--log_dir][runs/ddp-train-4242][--checkpoint_dir][checkpoints/ddp-train-4242]" in r.stdout, r.stdout
    assert "[--max_steps][10]" in r.stdout and "requeue" not in r.stdout
    assert "[--cpus-per-task=8]" in r.stdout  # srun no longer takes it from sbatch (Slurm 22.05 on)
    assert f"[python][{REPO / 'ddp_training.py'}]" in r.stdout, r.stdout
    # submitted from a directory without the kit, and no KIT_DIR: refused before srun
    r = sbatch(tmp_path, fake_bin, marker=False, kit=None)
    assert r.returncode == 2 and "no ddp_training.py in '.': submit from the kit's directory or set KIT_DIR" \
        in r.stdout and "[--max_steps]" not in r.stdout, r.stdout
    r = sbatch(tmp_path, fake_bin, marker=False, RUN_NAME="shared")
    assert "[--log_dir][runs/shared][--checkpoint_dir][checkpoints/shared]" in r.stdout, r.stdout
    r = sbatch(tmp_path, fake_bin, marker=True)
    assert r.returncode == EXIT_PREEMPTED and "scontrol requeue 4242" in r.stdout, r.stdout
    # The marker of that attempt does not requeue a later one that fails before training starts.
    r = sbatch(tmp_path, fake_bin, marker=False)
    assert "requeue" not in r.stdout, r.stdout
    # a log dir of the user's own would hide the marker from the requeue check: refused before srun
    r = sbatch(tmp_path, fake_bin, marker=True, extra=["--log_dir=elsewhere"])
    assert r.returncode == 2 and "--log_dir=elsewhere: the run dirs are runs/<run>" in r.stdout, r.stdout
    assert "[--max_steps]" not in r.stdout and not (tmp_path / "elsewhere").exists()


def test_slurm_job_meets_on_its_first_node_and_srun_gets_every_flag_whole(tmp_path, fake_bin):
    r = sbatch(tmp_path, fake_bin, marker=False, extra=["--config", "my configs/lm.yaml"], SLURM_JOB_ID="123456")
    assert r.returncode == 0, r.stdout
    # the port is left to the runtime, which picks one per job step (test_runtime): a port for the whole job
    # would be shared by two steps running side by side
    # one failed task ends the step, instead of its peers waiting for it until the time limit
    assert r.stdout.startswith("MASTER_ADDR=node1 MASTER_PORT=\n[--kill-on-bad-exit=1]"), r.stdout
    assert "[--max_steps][10][--config][my configs/lm.yaml]\n" in r.stdout, r.stdout


def test_slurm_requeues_when_the_batch_shell_is_signalled_too(tmp_path, fake_bin):
    """A stop to the batch shell itself (scancel --full or --batch, --signal=B:...) ended it at once: the tasks
    saved, but nothing requeued the job (from a launcher test). The shell passes it on to srun and waits."""
    sbatch(tmp_path, fake_bin, marker=False)  # writes the fakes; srun is then replaced by one that waits
    executable(fake_bin / "srun", '#!/bin/bash\nwhile [[ $1 != --log_dir ]]; do shift; done\n'
                                  'trap \'mkdir -p "$2"; echo "{}" > "$2/PREEMPTED"; exit 75\' TERM\n'
                                  'touch srun_ready; for _ in $(seq 300); do sleep 0.1; done; exit 0\n')
    env = clean_env(PATH=f"{fake_bin}:/usr/bin:/bin", SLURM_JOB_NAME="ddp-train", SLURM_JOB_ID="4242",
                    SLURM_JOB_NODELIST="node[1-2]", KIT_DIR=str(REPO))
    with background(["bash", SBATCH, "--max_steps", "10"], tmp_path, env=env) as proc:
        deadline = time.time() + 20
        while not (tmp_path / "srun_ready").exists():
            assert time.time() < deadline and proc.poll() is None, "srun did not start"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the batch shell only: `B:`
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED and "scontrol requeue 4242" in out, out


def test_slurm_requeues_on_the_marker_whatever_srun_exits(tmp_path, fake_bin):
    """srun's status is that of whichever task failed first (or was killed): the marker decides."""
    r = sbatch(tmp_path, fake_bin, marker=True, status=1)
    assert r.returncode == 1 and "scontrol requeue 4242" in r.stdout, r.stdout


@pytest.mark.parametrize("flag", ["--log_dir", "--log-dir", "--checkpoint_dir", "--checkpoint-dir"])
def test_slurm_refuses_a_run_dir_of_the_users_own_in_either_form(tmp_path, fake_bin, flag):
    for extra, shown in (([flag, "elsewhere"], flag), ([f"{flag}=elsewhere"], f"{flag}=elsewhere")):
        r = sbatch(tmp_path, fake_bin, marker=True, extra=extra)
        assert r.returncode == 2 and f"{shown}: the run dirs are runs/<run>, checkpoints/<run>" in r.stdout, r.stdout
        assert "[--max_steps]" not in r.stdout and not (tmp_path / "elsewhere").exists()


@pytest.mark.multi
def test_a_launcher_killed_outright_still_stops_the_run_with_a_save(tmp_path):
    # torchrun runs in a session of its own: without a parent-death signal it would train on, orphaned
    with launcher_run(tmp_path) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=90)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.communicate(timeout=30)
        _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, alive
    assert json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"] >= 3
