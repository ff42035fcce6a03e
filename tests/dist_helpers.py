"""Run a function on N real gloo processes (forked from a preloaded server, free port, bounded timeout)."""

import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import time
import traceback
from pathlib import Path


# Ports come from a block of this test process's own (pytest-xdist worker gwN: 20000 + 1000 N), below the
# kernel's ephemeral range (32768 on): a port that bind(0) chose is free only until the test uses it, seconds
# later, and meanwhile every connection another test process opens takes a random ephemeral port (a 2-rank
# run opens dozens), so a test could lose its port to the other worker's connections (EADDRINUSE).
_PORT_BLOCK = 20000 + 1000 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
_next_port = [0]


def free_ports(n: int) -> list:
    """n distinct free ports of this process's block, each checked with a bind."""
    ports = []
    for _ in range(1000):
        port = _PORT_BLOCK + _next_port[0]
        _next_port[0] = (_next_port[0] + 1) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or not yet released by an earlier test
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in {_PORT_BLOCK}-{_PORT_BLOCK + 999}")


# Ranks are forked from a server that imported torch and the kit once, instead of spawned: a spawned
# process imports torch again (about 2 s each on a 2-core machine, most of a short test). The server
# starts fresh and runs no threads, so a fork of it is as clean as a spawn; each rank is given the test's
# environment (a forked rank would otherwise have the server's, from when it started). torch._dynamo too:
# DDP() imports it (about 800 modules, 3 s per rank here), and its import starts no thread.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy", "pytest", "ddp_runtime",
                             "ddp_training"])


_server_pid = [None]  # the forkserver _start_server last warmed


def _start_server() -> None:
    """Python 3.11's server imports its preload from its working directory (it ignores sys.path): start it
    in the repository, whatever directory the first test that spawns has moved to. A first child is forked
    and waited for here, before the caller picks a port: the server's imports (seconds) come first."""
    from multiprocessing import forkserver
    here = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[1])
    try:
        forkserver.ensure_running()
        if _server_pid[0] != getattr(forkserver._forkserver, "_forkserver_pid", None):  # new (a test killed one)
            warm = _CTX.Process(target=os.getpid)
            warm.start()
            warm.join(120)
            _server_pid[0] = getattr(forkserver._forkserver, "_forkserver_pid", None)
    finally:
        os.chdir(here)



def _entry(fn, rank, world_size, port, queue, args, env):
    # A rank's own children (DataLoader workers) are forked from it, as under torchrun or --nproc (Linux's
    # default); a forkserver child would otherwise start them from the server, and never see them die (SIGCHLD)
    mp.set_start_method("fork", force=True)
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def spawn(fn, world_size: int = 2, *args, timeout: float = 90.0) -> list:
    """Results of fn(rank, world_size, *args) per rank; raises if any rank fails or hangs."""
    _start_server()
    queue = _CTX.Queue()
    port = free_ports(1)[0]
    env = dict(os.environ)
    procs = [_CTX.Process(target=_entry, args=(fn, r, world_size, port, queue, args, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + timeout
    try:
        while len(results) < world_size and time.time() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, value)
            except queue_module.Empty:
                # A rank that died without reporting (os._exit, a signal) will never report.
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {missing} did not report (exit codes {codes}; timeout {timeout}s); "
                           f"reports: {results}")
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]


def _script_entry(module, argv, cwd, env, out):
    """Run `module`.main(argv) as `python module.py argv` would: its own start method, cwd, environment and
    output file (stdout and stderr together), its exit code the process's."""
    import importlib
    import sys
    os.setsid()  # its own group, which the parent kills whole on a timeout (--nproc ranks included)
    mp.set_start_method("fork", force=True)  # a script's default here; a forkserver child has the server's
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [f"{module}.py", *argv]
    try:
        code = importlib.import_module(module).main(argv)
    except SystemExit as exc:  # argparse's errors; as the interpreter exits for the others
        code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    import ddp_runtime
    ddp_runtime.exit_process(code)


def run_script_forked(module: str, argv: list, cwd, env: dict, timeout: float = 60.0) -> tuple:
    """(exit code, output) of `python module.py argv`, forked from the preloaded server: the same main() as
    the script, without importing torch again (about 2 s a run here). For checks of what a run says at
    start-up; a run that trains belongs in a real subprocess."""
    _start_server()
    out = Path(cwd) / f".{module}.out"
    proc = _CTX.Process(target=_script_entry, args=(module, [str(a) for a in argv], str(cwd), env, str(out)))
    proc.start()
    try:
        proc.join(timeout)
        if proc.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(10)
            raise RuntimeError(f"{module}.py {argv} did not exit within {timeout}s: {_read(out)[-2000:]}")
        return proc.exitcode, _read(out)
    finally:
        out.unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:  # the child died before it opened it
        return "(no output)"
