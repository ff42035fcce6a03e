"""
Summarise and plot training runs from their run directories.

A run directory is whatever `log_dir` a trainer wrote to: `metrics.jsonl` (one JSON record per line,
"type" train / val / summary, and a "start" record where each launch began), `config.yaml` and `rank_N.log`.
Only metrics.jsonl is required.

    python training_logs.py summary runs/a runs/b --format table
    python training_logs.py summary --all --format json        # every run under runs/ (or --all ROOT)
    python training_logs.py plot runs/a                        # runs/a/loss_curves.png
    python training_logs.py plot runs/a runs/b --compare --smooth 5 --output curves.png
    python training_logs.py plot runs/a --metrics loss,grad_norm,lr --x time --output grid.png

Summary columns: total_time_s is the time of every session of the run added up (a resumed run has one
session per launch; start-up and the time between launches are not counted), avg_samples_per_s is the
samples trained over that time (so it includes validation and checkpoints), mfu is the median of the
steps' model FLOPs utilisation (CUDA runs of models that count their FLOPs; "-" otherwise). A run whose
metrics.jsonl has no complete record yet (it has just started) is a row with status "no records yet",
unless its rank_0.log holds an error: "failed in set-up" (no metrics.jsonl) or "failed before its first
record"; or "stopped in set-up" when a Ctrl-C ended its launch before its first step; "not trained" for a
trainer closed without training; "ended before its first record" when the process its run-dir lock names
no longer runs on this host and nothing else says why (killed, or a second stop signal). A run with records
and no summary is "incomplete" (running, or its process elsewhere: another host or PID namespace), "failed"
where a rank's log says how, or "ended unfinished" where that process is gone.

Plot layout: the default loss-curve figure has one row per run (train loss, val loss, learning rate on a
second y axis); --compare puts every run in one axes instead. A --metrics grid has one subplot per metric
and always overlays the runs. --x epoch is step / steps per epoch, as the trainer states it in start, val
and summary records (or where the records' steps and epochs pin it down); without it, it is an error. Bad
input (no metrics.jsonl, a corrupt line, an unknown metric) exits with status 2 and a message, except a
damaged run found by --all, which is a row with status "unreadable" (the reason on stderr); a
cut-short or non-UTF-8 last line (a run killed mid-write) only warns, as does a record whose step is not a
whole number (it is skipped); plot leaves out runs with no records yet. Null, NaN and inf values (the trainer
writes null for the loss of a step skipped for a non-finite loss) are no measurement: curves leave them out.

Everything the CLI does is importable: load_run, summarize, format_summaries, series, plot_loss_curves,
plot_metrics.
"""

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

METRICS_FILE = "metrics.jsonl"
# Keys of train/val records that are coordinates or labels, not metrics to plot.
NOT_METRICS = {"type", "step", "epoch", "time", "steps_per_epoch"}
# The memory peaks a trainer logs, by where the memory is: a GPU run's host peak (torch's and CUDA's
# libraries, the loader) says nothing of its GPU memory. The anonymous-memory peak, cpu_peak_anon_gb, is
# part of the RSS one, never larger.
PEAK_KEYS = {"peak_host_gb": ("cpu_peak_rss_gb", "peak_rss_gb"), "peak_gpu_gb": ("cuda_peak_gb",)}
SUMMARY_FIELDS = ("name", "status", "steps", "sessions", "final_val_loss", "best_val_loss", "test_loss",
                  "total_time_s", "avg_samples_per_s", "mfu", "world_size", *PEAK_KEYS)
NO_RECORDS = "no records yet"
SET_UP_FAILED = "failed in set-up"
FAILED_EARLY = "failed before its first record"
STOPPED_IN_SET_UP = "stopped in set-up"
NOT_TRAINED = "not trained"
ENDED_EARLY = "ended before its first record"
ENDED_UNFINISHED = "ended unfinished"  # records, no summary, and the process the lock names is gone
UNREADABLE = "unreadable"  # a run found by --all whose files are damaged: the others are still listed
FAILED = "failed"  # no summary record, and the newest launch logged why it ended ("training failed after step N")
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[RANK \d+\] ")  # rt.setup_logger's format


class LogError(Exception):
    """Bad input. The CLI prints the message (no traceback) and exits with status 2."""


class NoRecords(LogError):
    """A metrics.jsonl with no complete record: a run that has only just started. Listings show it as a
    row (`status`, and the `error` it logged if it failed) instead of failing."""
    status = NO_RECORDS
    error: Optional[str] = None


class SetUpFailed(NoRecords):
    """A run that logged an error before it trained a step (bad input, data that differs between ranks)."""
    status = SET_UP_FAILED


class StoppedInSetUp(NoRecords):
    """A launch that a Ctrl-C ended before it trained a step (nothing failed: it was asked to stop)."""
    status = STOPPED_IN_SET_UP


class NotTrained(NoRecords):
    """A trainer built and closed without training (to evaluate a checkpoint, say)."""
    status = NOT_TRAINED


class EndedEarly(NoRecords):
    """A run whose process is gone (its run-dir lock names a pid no longer running on this host) without a
    record or an error: killed, or ended by a second stop signal, which exits at once."""
    status = ENDED_EARLY


class FailedEarly(NoRecords):
    """A run that logged an error after it opened its metrics file and before it wrote a record (its first
    steps: a loss_fn that returns no tensor, unused parameters)."""
    status = FAILED_EARLY


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------

@dataclass
class Run:
    name: str
    path: Path
    train: list = field(default_factory=list)
    val: list = field(default_factory=list)
    summary: Optional[dict] = None
    steps_per_epoch: Optional[int] = None
    sessions: int = 1
    earlier_sessions_s: float = 0.0  # the time of every session before the last, added up
    no_records: Optional[str] = None  # why there is nothing to show yet
    status: str = NO_RECORDS  # of a run with no records
    error: Optional[str] = None  # what a run that failed before its first record logged
    first_step: int = 0  # the step its first session began at: past 0 when it began from another run's state

    def records(self, kind: str) -> list:
        return self.train if kind == "train" else self.val


def read_metrics(path) -> list:
    """The records of one metrics.jsonl, in file order.

    A last line that does not parse (not JSON, or not even UTF-8) is what a run killed mid-write leaves
    behind: it is skipped with a warning. A bad line anywhere else means the file is damaged, and that is an
    error. A record whose step is not a whole number has no place on any axis: skipped with a warning.
    """
    path = Path(path)
    # Split bytes, decode each line: one torn line must not make the whole file unreadable.
    lines = path.read_bytes().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise NoRecords(f"{path} is empty (the run wrote no records yet)")
    records = []
    for lineno, line in enumerate(lines, 1):
        rec = parse_line(path, lineno, line, last=lineno == len(lines)) if line.strip() else None
        if rec is not None:
            records.append(rec)
    if not records:
        raise NoRecords(f"{path} holds no complete record yet")
    if all(r["type"] == "start" for r in records):
        raise NoRecords(f"{path} holds no record of a step yet")
    return records


def parse_line(path: Path, lineno: int, line: bytes, last: bool) -> Optional[dict]:
    """The record on one line of metrics.jsonl, or None for one skipped with a warning."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        if last:
            warn(f"{path}:{lineno}: last line is cut short (run killed mid-write?); skipped")
            return None
        why = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else exc.msg
        raise LogError(f"{path}:{lineno}: not a JSON record ({why}): {_shown(line)}") from None
    if not isinstance(rec, dict) or "type" not in rec:
        raise LogError(f"{path}:{lineno}: expected a JSON object with a \"type\" key, got {_shown(line)}")
    step = rec.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        warn(f"{path}:{lineno}: step {step!r} is not a whole number; record skipped")
        return None
    lrs = rec.get("lrs")
    if isinstance(lrs, list):  # the rate of each parameter group, where they differ: a curve each
        rec.update({f"lr_group_{group}": lr for group, lr in enumerate(lrs)})
    return rec


def _shown(line: bytes) -> str:
    return repr(line[:80].decode("utf-8", errors="replace"))


def last_session(records: list, path) -> list:
    """Keep only the last run of a file that holds several, and the newest records of steps logged twice.

    The trainer never writes either: a resumed run truncates metrics.jsonl to its resume step and drops the
    stopped session's summary, so steps only go up, and a fresh run moves the old file aside. Files joined by
    hand, or written by other tools into one log_dir, can still hold a run whose step 1 follows another run's
    records, or a resumed session that repeats steps: its records replace the earlier ones from its first step
    on (a validation redone at the resume step replaces that step's validation), and a summary before it
    goes, as the trainer drops it. Records without a whole-number step are kept as they come.
    """
    kept, last_step, last_val_step, new_run, repeated, summary_before = [], 0, None, 0, 0, False
    for i, rec in enumerate(records):
        step = rec.get("step")
        stepped = isinstance(step, int) and not isinstance(step, bool) and rec["type"] in ("train", "val")
        if stepped and rec["type"] == "train" and step <= 1 <= last_step:
            kept, new_run, last_val_step = [], i, None
        elif stepped and (step < last_step or (step == last_step and (rec["type"] == "train" or
                                                                     last_val_step == step))):
            repeated += 1  # what a resumed session redoes replaces the earlier records
            kept = [r for r in kept if not superseded(r, step, rec["type"])]
            if last_val_step is not None and last_val_step >= step:  # that validation went with them
                last_val_step = None
        if stepped and summary_before:  # a session goes on after that summary: it was no run's end
            kept = [r for r in kept if r["type"] != "summary"]
        if stepped and rec["type"] == "train":
            last_step = step
        elif stepped:
            last_val_step = step
        summary_before = rec["type"] == "summary" or (summary_before and not stepped)
        kept.append(rec)
    if new_run:
        warn(f"{path} holds more than one run (log_dir reused without resume); using the last, from record "
             f"{new_run + 1}")
    if repeated:
        warn(f"{path}: a session repeats steps an earlier one logged (resumed without truncating the file); "
             f"its records replace theirs")
    return kept


def superseded(rec: dict, step: int, by: str) -> bool:
    """Whether `rec` is redone by a later session's record of type `by` at `step`: its train records from that
    step on (from the next one, for a validation redone at the step it resumed from), and its validations
    from that step on."""
    s = rec.get("step")
    if not isinstance(s, int) or isinstance(s, bool) or rec["type"] not in ("train", "val"):
        return False
    return s >= step if rec["type"] == "val" or by == "train" else s > step


def add_elapsed(records: list) -> tuple:
    """Give every record "_elapsed": its "time" made continuous across sessions. Returns the number of
    sessions and the time of all but the last, added up.

    "time" counts from the start of the session's training loop (a monotonic clock), so it falls back to ~0
    when a resumed run starts. Each session begins with a "start" record (trainers since 27 Nov 2026). In
    older files the fall of "time" is the only trace of a session: the trainer drops the interrupted
    session's summary record when it resumes. A summary's wall_time_s counts from the same start, so a
    summary shorter than the records before it is a session of its own that logged nothing else (a relaunch
    that had nothing left to train). There, a session shorter than the next one's first step cannot be told
    apart from it and is counted as part of it.
    """
    sessions, offset, prev, timed = 1, 0.0, 0.0, False
    for rec in records:
        if rec["type"] == "start":
            if timed:  # not the file's first session
                offset, sessions, timed = prev, sessions + 1, False
            continue
        t = rec.get("wall_time_s" if rec["type"] == "summary" else "time")
        if not isinstance(t, (int, float)):
            continue
        if t + offset < prev - 1e-3:  # the summary's wall_time_s is rounded to ms
            offset = prev
            sessions += 1
        timed = True
        rec["_elapsed"] = t + offset
        prev = rec["_elapsed"]
    return sessions, offset


def epoch_bounds(records: list) -> tuple:
    """The fewest and most optimizer steps per epoch (n) that the records allow.

    Steps count from 1 over the whole run. A train record carries the epoch its step ran in, so
    e*n < s <= (e+1)*n. A summary record written after an epoch's last step already carries the next epoch, as
    did val records there before 27 Nov 2026, so for those only e*n <= s <= (e+1)*n holds. A run of one epoch or
    less never crosses a boundary inside its train records; its closing validation or summary ("epochs": 1) is
    then what pins n down.
    """
    lo, hi = 1, math.inf
    for rec in records:
        summary = rec["type"] == "summary"
        s, e = rec.get("steps" if summary else "step"), rec.get("epochs" if summary else "epoch")
        if not (isinstance(s, int) and isinstance(e, int) and s >= 1 and e >= 0):
            continue
        lo = max(lo, -(-s // (e + 1)))
        if e >= 1:
            hi = min(hi, (s - 1) // e if rec["type"] == "train" else s // e)
    return lo, hi


def find_steps_per_epoch(records: list) -> Optional[int]:
    """As the trainer states it in start, val and summary records (the newest), else where the records' steps
    and epochs pin it down."""
    stated = [r["steps_per_epoch"] for r in records if isinstance(r.get("steps_per_epoch"), int)]
    if stated:
        return stated[-1]
    lo, hi = epoch_bounds(records)
    return lo if lo == hi else None


def run_dir_of(path) -> Path:
    """A run directory, also when its metrics file is named instead."""
    path = Path(path)
    if path.is_file() and path.name == METRICS_FILE:
        return path.parent
    if path.is_file():
        raise LogError(f"{path}: a file; expected a run directory (the one holding {METRICS_FILE})")
    return path


def load_run(run_dir, name: Optional[str] = None) -> Run:
    run_dir = run_dir_of(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise LogError(f"{run_dir}: no such directory")
    log = run_dir / "rank_0.log"
    if not path.is_file() and not log.is_file():
        raise LogError(f"{run_dir}: no {METRICS_FILE} here (not a run directory? "
                       f"`summary --all {run_dir}` searches below it)")
    try:
        if not path.is_file():  # the trainer opens metrics.jsonl when training starts
            raise NoRecords(f"{run_dir}: no {METRICS_FILE} yet (the run is still setting up)")
        records = read_metrics(path)
    except NoRecords:  # still starting, unless the newest launch logged an error: then it never will train
        error = first_error(log) if log.is_file() else None
        if error:
            failed = (FailedEarly(f"{run_dir}: failed before its first record: {error}") if path.is_file() else
                      SetUpFailed(f"{run_dir}: failed before its first step: {error}"))
            failed.error = error
            raise failed from None
        newest = launches(log)[-1] if log.is_file() else []
        if any(CTRL_C_IN_SET_UP.search(line) for line in newest):
            raise StoppedInSetUp(f"{run_dir}: stopped by Ctrl-C in set-up, before its first step") from None
        if any(CLOSED_UNTRAINED.search(line) for line in newest):
            raise NotTrained(f"{run_dir}: its trainer was closed without training (built to evaluate?)") from None
        gone = lock_holder_gone(run_dir)
        if gone:
            raise EndedEarly(f"{run_dir}: its process ({gone}) ended before its first record, with no error in its "
                             f"log (killed, or a second stop signal)") from None
        raise
    records = last_session(records, path)
    run = Run(name=name or run_dir.resolve().name, path=run_dir)
    run.sessions, run.earlier_sessions_s = add_elapsed(records)
    for rec in records:
        if rec["type"] == "train":
            run.train.append(rec)
        elif rec["type"] == "val":
            run.val.append(rec)
        elif rec["type"] == "summary":
            run.summary = rec
        # other types: written by a newer trainer; ignore rather than fail
    if not run.train and not run.val and run.summary is None:
        raise LogError(f"{path} holds no train, val or summary record")
    run.steps_per_epoch = find_steps_per_epoch(records)
    run.first_step = first_step(records)
    return run


def first_step(records: list) -> int:
    """The step the run's first session began at: its start record's (files since 27 Nov 2026), else the step
    before its first train record (the trainer writes one for every step)."""
    for rec in records:
        if rec["type"] == "start" and isinstance(rec.get("step"), int):
            return rec["step"]
        if rec["type"] == "train" and isinstance(rec.get("step"), int):
            return max(rec["step"] - 1, 0)
    return 0


# The first line of a launch in a rank log (the VJ2 script's, then the trainer's): rank logs are appended to
SESSION_START = re.compile(r"\] INFO: (\[DDP\] Initializing with backend|rank \d+/\d+, local_rank)")


def launches(log: Path) -> list:
    """The lines of each launch in a rank log, oldest first."""
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if i and SESSION_START.search(line)]
    return [lines[a:b] for a, b in zip([0] + starts, starts + [len(lines)])]


def lock_holder_gone(run_dir: Path) -> Optional[str]:
    """'pid N on HOST' where the run dir's lock note (the trainer's rank 0 writes it: "pid N on HOST since
    ... [pid:[NS]]") names a process that no longer runs on this host; None where it runs, or lives elsewhere
    (another host, or another PID namespace on this one: a container), or no note says. The note is read,
    never locked: a lock taken here could turn a starting run away."""
    try:
        note = (run_dir / ".lock").read_text()
    except OSError:
        return None
    m = re.match(r"pid (\d+) on (\S+) since ", note)
    if not m or m.group(2) != socket.gethostname():
        return None
    namespace = re.search(r"\[(pid:\[\d+\])\]$", note.strip())  # notes since 27 Nov 2026 name it
    if namespace and namespace.group(1) != pid_namespace():  # a container's pids: not seen from here
        return None
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return f"pid {m.group(1)} on {m.group(2)}"
    except OSError:  # EPERM: it runs, as another user
        return None
    return f"pid {m.group(1)} on {m.group(2)}" if is_zombie(int(m.group(1))) else None


def pid_namespace() -> str:
    """As ddp_runtime.pid_namespace (this module does not import torch)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def is_zombie(pid: int) -> bool:
    """Dead, and not yet reaped by its parent (torchrun, a shell busy elsewhere): signal 0 still finds it.
    Linux's /proc tells; elsewhere it counts as alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].startswith(("Z", "X"))


def first_error(log: Path, lines: Optional[list] = None) -> Optional[str]:
    """The first ERROR line of the newest launch in a rank log (its `lines`, where the caller read them)
    without its time and rank prefix, and the exception of the traceback that follows it, if one does
    ("trainer set-up failed" is followed by its traceback); the trainer's "training failed after step N"
    where it logged one, over a step's own error before it (the conclusion says where, and adds why). A
    relaunch still setting up has none, whatever an earlier launch logged."""
    lines = launches(log)[-1] if lines is None else lines
    errors = [i for i, line in enumerate(lines) if "] ERROR: " in line]
    errors = [i for i in errors if "] ERROR: training failed after step " in lines[i]] or errors
    if not errors:
        return None
    i = errors[0]
    # the logger's exception() puts "Traceback ..." on the message's own line
    message = lines[i].split("] ERROR: ", 1)[1].removesuffix("Traceback (most recent call last):")
    message = message.strip().removesuffix(":")
    after = []
    for later in lines[i + 1:]:
        if LOG_LINE.match(later):
            break
        after.append(later)
    raised = [a.strip() for a in after if a.strip() and not a.startswith((" ", "Traceback"))]
    # a failure's line already quotes its exception ("training failed after step 4: StepFailed: ..."), which the
    # traceback names with its module ("ddp_training.StepFailed: ...")
    unqualified = re.sub(r"^[\w.]+\.(\w+: )", r"\1", raised[-1]) if raised else ""
    return f"{message}: {raised[-1]}" if raised and not message.endswith(unqualified) else message


def find_runs(root) -> list:
    """Every directory under root (root included) that holds a metrics.jsonl, or a rank_0.log (a run still
    setting up), sorted."""
    root = Path(root)
    if not root.is_dir():
        raise LogError(f"{root}: no such directory")
    found = sorted(Path(d) for d, _, files in os.walk(root) if METRICS_FILE in files or "rank_0.log" in files)
    if not found:
        raise LogError(f"no {METRICS_FILE} anywhere under {root}")
    return found


def load_runs(dirs=(), root=None) -> list:
    """Runs named by the directory name; the path is used instead where names would collide."""
    named, found = [], []
    if root is not None:
        found = find_runs(root)
        for d in found:
            rel = d.relative_to(root)
            named.append((d, str(rel) if rel.parts else Path(root).resolve().name))
    named += [(run_dir_of(d), run_dir_of(d).resolve().name) for d in dirs]
    if not named:
        raise LogError("no run directories given (name some, or use --all [ROOT], ROOT runs by default)")
    names = [n for _, n in named]
    runs = []
    for d, n in named:
        name = n if names.count(n) == 1 else str(d)
        try:
            runs.append(load_run(d, name))
        except NoRecords as exc:
            runs.append(Run(name=name, path=Path(d), no_records=str(exc), status=exc.status, error=exc.error))
        except (LogError, OSError) as exc:
            if d not in found:  # a run named on the command line: its damage is the answer
                raise
            reason = str(exc) if isinstance(exc, LogError) else f"{type(exc).__name__}: {exc}"
            warn(f"{d}: {UNREADABLE}: {reason}")
            runs.append(Run(name=name, path=Path(d), no_records=reason, status=UNREADABLE))
    return runs


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------

def is_number(v) -> bool:
    """A finite int or float: null, NaN and inf are no measurement (the trainer writes null for the loss
    of a step skipped for a non-finite loss; a step skipped for its gradients keeps its measured loss)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _finite(values) -> list:
    return [v for v in values if is_number(v)]


def total_time(run: Run) -> Optional[float]:
    """Every session's time added up. The summary's wall_time_s covers its own session only, and also the
    test evaluation and final checkpoint that come after the last record."""
    s = run.summary or {}
    if isinstance(s.get("wall_time_s"), (int, float)):
        return run.earlier_sessions_s + s["wall_time_s"]
    elapsed = _finite(r.get("_elapsed") for r in run.train + run.val)
    return max(elapsed) if elapsed else None


def final_val_loss(run: Run) -> Optional[float]:
    """The last validation's loss: NaN when it was not finite (a run that diverged at its end), never an
    earlier validation's; None without validation."""
    s = run.summary or {}
    if s.get("final_val_loss") is not None:
        return s["final_val_loss"]
    last = run.val[-1].get("val_loss") if run.val else None
    return last if is_number(last) else (float("nan") if run.val else None)


def test_loss(summary: dict) -> Optional[float]:
    """NaN for a test loss that was not finite (written as null, with the test set's count), else as written."""
    if summary.get("test_loss") is None and summary.get("test_count"):
        return float("nan")
    return summary.get("test_loss")


# What a launch that never trained logs (the trainer's, then the VJ2 script's set-up); a Ctrl-C in set-up
# (ddp_runtime.CTRL_C_BEFORE_TRAINING)
SET_UP_FAILURE = re.compile(r"\] ERROR: (trainer set-up failed|set-up (failed|stopped))")
CTRL_C_IN_SET_UP = re.compile(r"\] WARNING: stopped by Ctrl-C before any training step")
CLOSED_UNTRAINED = re.compile(r"\] INFO: closed without training$")  # ddp_training.CLOSED_UNTRAINED


def world_size(run: Run) -> Optional[int]:
    """From the summary; for a run without one, from the "rank 0/N" line of the newest launch in rank_0.log
    that did not fail in set-up (each launch logs it at its start; a relaunch refused with another world size
    appends its own; counting rank_N.log files would count an earlier run's ranks in a reused dir)."""
    s = run.summary or {}
    if s.get("world_size"):
        return s["world_size"]
    try:
        logged = launches(run.path / "rank_0.log")
    except OSError:
        return None
    for lines in reversed(logged):
        launch = "\n".join(lines)
        found = re.search(r"\] INFO: rank 0/(\d+), local_rank", launch)
        if found and not SET_UP_FAILURE.search(launch) and not CTRL_C_IN_SET_UP.search(launch):
            return int(found[1])
    return None


# What every rank of a launch logs when train() ends in an exception (ddp_training.DDPTrainer.train)
TRAINING_FAILURE = re.compile(r"\] ERROR: (training failed after step \d+: .*)")


def training_failure(run: Run) -> Optional[str]:
    """'rank R: training failed after step N: ...' from the newest launch of the lowest rank that logged one
    (a killed rank logs nothing; its peers name the loss); None where no rank did: still running, or killed
    outright. Only ranks of the newest launch's world: a rank log of a larger earlier world is older news."""
    world = world_size(run)
    for log in sorted(run.path.glob("rank_*.log"), key=lambda p: (len(p.name), p.name)):
        rank = log.stem.removeprefix("rank_")
        if not rank.isdigit() or (world and int(rank) >= world):
            continue
        try:
            newest = launches(log)[-1]
        except OSError:
            continue
        for line in newest:
            found = TRAINING_FAILURE.search(line)
            if found:
                return f"rank {rank}: {found[1]}"
    return None


def set_up_failure(run: Run) -> Optional[str]:
    """Why the newest launch of a run with records failed in set-up (a relaunch refused: another world size,
    no state that loads): the run stays incomplete, and says why it did not go on."""
    log = run.path / "rank_0.log"
    try:
        newest = launches(log)[-1]
    except OSError:
        return None
    if not any(SET_UP_FAILURE.search(line) for line in newest):
        return None
    return f"its newest launch failed in set-up: {first_error(log, newest)}"


def summarize(run: Run) -> dict:
    """One run's headline numbers. Without a summary record (still running, killed, or failed) they are
    rebuilt from the train/val records and the status is "incomplete", or "failed" with the `error` its
    newest launch logged, or "ended unfinished" once the process its lock names is gone."""
    if run.no_records:
        return {**dict.fromkeys(SUMMARY_FIELDS), "name": run.name, "status": run.status,
                **({"error": run.error} if run.error else {})}
    s = run.summary or {}
    vals = _finite(r.get("val_loss") for r in run.val)
    everything = run.train + run.val + ([s] if s else [])
    peaks = {field: _finite(r.get(k) for r in everything for k in keys) for field, keys in PEAK_KEYS.items()}
    steps = s.get("steps", max((r.get("step", 0) for r in run.train), default=0))
    world = world_size(run)
    seconds = total_time(run)
    rates = [r for r in _finite(r.get("samples_per_s") for r in run.train) if r > 0]
    mfus = _finite(r.get("mfu") for r in run.train)
    if run.sessions == 1 and s.get("samples_per_s") is not None:
        rate = s["samples_per_s"]  # the trainer's own count over this one session
    elif isinstance(s.get("global_batch"), int) and seconds:  # the steps trained here, not another run's
        rate = (steps - run.first_step) * s["global_batch"] / seconds
    else:  # still running: the steps' samples over their time (so the harmonic mean of their rates, the
        # global batch being fixed), which leaves out validation and checkpoints
        rate = statistics.harmonic_mean(rates) if rates else None
    failure = None if s else training_failure(run)
    error = failure or (None if s else set_up_failure(run))  # a refused relaunch leaves the run incomplete
    status = s.get("status", FAILED if failure else "incomplete")
    gone = lock_holder_gone(run.path) if status == "incomplete" and not error else None
    if gone:  # not running any more: killed, or a second stop signal (which exits at once)
        status, error = ENDED_UNFINISHED, (f"its process ({gone}) is gone, with no error in its log (killed, or a "
                                           f"second stop signal): relaunch to resume from its newest state")
    return {
        "name": run.name,
        "status": status,
        "steps": steps,
        "sessions": run.sessions,
        "final_val_loss": final_val_loss(run),
        "best_val_loss": s["best_val_loss"] if s.get("best_val_loss") is not None
        else (min(vals) if vals else None),
        "test_loss": test_loss(s),
        "total_time_s": seconds,
        "avg_samples_per_s": rate,
        "mfu": statistics.median(mfus) if mfus else None,
        "world_size": world,
        **{field: max(values) if values else None for field, values in peaks.items()},
        **({"error": error} if error else {}),
    }


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if key.endswith("loss"):
            return f"{v:.4f}"
        if key in PEAK_KEYS:
            return f"{v:.2f}"
        if key == "mfu":
            return f"{v:.3f}"
        return f"{v:.1f}"
    return str(v)


def json_safe(v):
    """NaN and infinities as null: strict JSON has no spelling for them (a diverged run's val loss is NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def format_summaries(rows: list, fmt: str = "one-line") -> str:
    if fmt == "json":
        return json.dumps(json_safe(rows), indent=2, allow_nan=False)
    if fmt == "one-line":
        lines = []
        for r in rows:
            f = {k: _fmt(k, r[k]) for k in SUMMARY_FIELDS}
            if r["status"] in (NO_RECORDS, SET_UP_FAILED, STOPPED_IN_SET_UP, NOT_TRAINED, ENDED_EARLY, FAILED_EARLY,
                               UNREADABLE):
                lines.append(f"{f['name']}: {r['status']}" + (f": {r['error']}" if r.get("error") else ""))
                continue
            steps = f"{f['steps']} step{'s' * (r['steps'] != 1)}"
            lines.append(f"{f['name']}: {f['status']}, {steps}, val {f['final_val_loss']} "
                         f"(best {f['best_val_loss']}), test {f['test_loss']}, {f['total_time_s']} s over "
                         f"{f['sessions']} session{'s' if r['sessions'] != 1 else ''}, "
                         f"{f['avg_samples_per_s']} samples/s"
                         + (f", MFU {f['mfu']}" if r["mfu"] is not None else "")
                         + f", world {f['world_size']}, peak {f['peak_host_gb']} GB host"
                         + (f", {f['peak_gpu_gb']} GB GPU" if r["peak_gpu_gb"] is not None else "")
                         + (f"; {r['error']}" if r.get("error") else ""))
        return "\n".join(lines)
    if fmt == "table":
        cells = [[_fmt(k, r[k]) for k in SUMMARY_FIELDS] for r in rows]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(SUMMARY_FIELDS)]
        numeric = [k not in ("name", "status") for k in SUMMARY_FIELDS]

        def line(vals):
            return "| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                                     for v, w, num in zip(vals, widths, numeric)) + " |"
        rule = "|" + "|".join("-" * (w + 1) + ":" if num else "-" * (w + 2) for w, num in zip(widths, numeric)) + "|"
        errors = ["", *(f"{r['name']}: {r['error']}" for r in rows if r.get("error"))]  # below: no column for them
        return "\n".join([line(SUMMARY_FIELDS), rule] + [line(c) for c in cells] + (errors if len(errors) > 1 else []))
    raise ValueError(f"unknown format {fmt!r}")


# ----------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------

def available_metrics(runs: list) -> dict:
    """metric name -> "train" or "val": the record type it is plotted from (train wins if both)."""
    out = {}
    for kind in ("val", "train"):
        for run in runs:
            for rec in run.records(kind):
                for k, v in rec.items():
                    if k not in NOT_METRICS and not k.startswith("_") and isinstance(v, (int, float)) \
                            and not isinstance(v, bool):  # a flag ("skipped") is no curve
                        out[k] = kind
    return out


def moving_average(ys: list, n: int) -> list:
    """Trailing mean over n points; the window is shorter at the start so no point is lost."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= n:
            total -= ys[i - n]
        out.append(total / min(i + 1, n))
    return out


def x_value(run: Run, rec: dict, x: str):
    if x == "step":
        return rec.get("step")
    if x == "time":
        return rec.get("_elapsed")
    if x == "epoch":
        # Logged epochs are whole numbers (and older val records after an epoch's last step carry the next
        # one): only step / steps_per_epoch places every point right.
        check_x_axis([run], x)
        s = rec.get("step")
        return s / run.steps_per_epoch if isinstance(s, (int, float)) else None
    raise ValueError(f"unknown x axis {x!r}")


def check_x_axis(runs: list, x: str) -> None:
    """Refuse an epoch axis that would have to be guessed."""
    if x != "epoch":
        return
    for run in runs:
        if run.steps_per_epoch is None:
            lo, hi = epoch_bounds(run.train + run.val + ([run.summary] if run.summary else []))
            known = (f"at least {lo}" + ("" if hi == math.inf else f" and at most {hi}") if lo <= hi
                     else "contradictory numbers (epochs of different lengths?)")
            raise LogError(f"{run.path}: --x epoch needs the number of steps per epoch, which the trainer "
                           f"states in start, val and summary records; these records only say {known}. "
                           f"Use --x step or --x time")


def series(run: Run, metric: str, x: str = "step", smooth: int = 1, kind: Optional[str] = None):
    """The (xs, ys) plotted for one metric of one run.

    kind is the record type to read ("train"/"val"); by default the one that holds the metric. Points whose
    value is missing, null or not finite are left out, so a moving average is not poisoned by them. Only
    train series are smoothed: validation points are few and already averages.
    """
    if kind is None:
        kind = "train" if any(metric in r for r in run.train) else "val"
    xs, ys = [], []
    for rec in run.records(kind):
        xv = x_value(run, rec, x)
        if is_number(rec.get(metric)) and xv is not None:
            xs.append(xv)
            ys.append(float(rec[metric]))
    if kind == "train" and smooth > 1:
        ys = moving_average(ys, smooth)
    return xs, ys


X_LABELS = {"step": "step", "time": "time (s)", "epoch": "epoch"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    return plt


def _log_y(ax) -> None:
    from matplotlib import ticker
    ax.set_yscale("log")
    # Losses usually span less than a decade: plain numbers read better than 4 x 10^0.
    ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))


def _loss_axes(ax, runs: list, x: str, smooth: int, log_y: bool, colors) -> list:
    """Train loss, val loss and (on a twin axis) the learning rate of `runs`, one colour per run."""
    lr_ax = ax.twinx()
    lr_ax.set_ylabel("learning rate")
    handles = []
    for run, c in zip(runs, colors):
        tag = f"{run.name}: " if len(runs) > 1 else ""
        if smooth > 1:
            ax.plot(*series(run, "loss", x), color=c, alpha=0.25, linewidth=0.8)
        xs, ys = series(run, "loss", x, smooth)
        handles += ax.plot(xs, ys, color=c, label=f"{tag}train loss" + (f" (avg {smooth})" if smooth > 1 else ""))
        xs, ys = series(run, "val_loss", x, kind="val")
        if xs:
            handles += ax.plot(xs, ys, color=c, linestyle="--", marker="o", markersize=4, label=f"{tag}val loss")
        xs, ys = series(run, "lr", x)
        if xs:
            handles += lr_ax.plot(xs, ys, color=c, linestyle="-.", linewidth=1, alpha=0.6, label=f"{tag}lr")
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel("loss")
    if log_y:
        _log_y(ax)
    ax.grid(alpha=0.3)
    # Outside the axes: train loss falls from the top left while a warmup lr climbs from the bottom left,
    # so no corner inside is reliably free.
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.1, 1.0), borderaxespad=0)
    return handles


def _title(runs: list) -> str:
    """Run names, with the data's loss floor where the trainer logged one: drawn as a line it would squash
    the curves whenever training is far from it."""
    parts = []
    for run in runs:
        floors = _finite(r.get("loss_floor") for r in run.val)
        parts.append(run.name + (f" (loss floor {floors[-1]:.4g})" if floors else ""))
    return ", ".join(parts)


def plot_loss_curves(runs: list, output, x: str = "step", smooth: int = 1, compare: bool = False,
                     log_y: bool = False) -> None:
    check_x_axis(runs, x)
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [colors[i % len(colors)] for i in range(len(runs))]
    groups = [(runs, colors)] if compare or len(runs) == 1 else [([r], [c]) for r, c in zip(runs, colors)]
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 4.5 * len(groups)), squeeze=False)
    for ax, (group, cs) in zip(axes[:, 0], groups):
        _loss_axes(ax, group, x, smooth, log_y, cs)
        ax.set_title(_title(group))
    save_figure(fig, output)


def save_figure(fig, output) -> None:
    """Written only once the figure is drawn: a refused plot leaves no directories behind."""
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LogError(f"--output {output}: cannot write there ({type(exc).__name__}: {exc})") from None
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    _pyplot().close(fig)


def plot_metrics(runs: list, metrics: list, output, x: str = "step", smooth: int = 1,
                 log_y: bool = False) -> None:
    known = available_metrics(runs)
    unknown = [m for m in metrics if m not in known]
    if unknown:
        raise LogError(f"unknown metric {', '.join(unknown)}; these runs log: {', '.join(sorted(known))}")
    check_x_axis(runs, x)
    plt = _pyplot()
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.8 * nrows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for run in runs:
            xs, ys = series(run, metric, x, smooth, kind=known[metric])
            if xs:
                ax.plot(xs, ys, label=run.name, marker="o" if known[metric] == "val" else None, markersize=3)
        ax.set_title(metric + (f" (avg {smooth})" if smooth > 1 and known[metric] == "train" else ""))
        ax.set_xlabel(X_LABELS[x])
        if log_y:
            _log_y(ax)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    save_figure(fig, output)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------

def with_records(runs: list) -> list:
    """The runs that have something to plot; the others are named in a warning."""
    for run in runs:
        if run.no_records:
            warn(f"{run.path}: not plotted: {run.no_records}")
    left = [run for run in runs if not run.no_records]
    if not left:
        raise LogError("nothing to plot: " + "; ".join(run.no_records for run in runs))
    return left


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="training_logs.py", description="Summarise and plot training runs.")
    sub = p.add_subparsers(dest="command", required=True)

    def add_runs(sp):
        sp.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (each holds metrics.jsonl)")
        sp.add_argument("--all", metavar="ROOT", nargs="?", const="runs",
                        help="every directory under ROOT (runs, the trainers' default, when not given) that holds "
                             "metrics.jsonl")

    s = sub.add_parser("summary", help="one line per run: status, steps, sessions, val/test loss, time over all "
                                       "sessions, samples/s, world size, memory")
    add_runs(s)
    s.add_argument("--format", choices=("one-line", "table", "json"), default="one-line",
                   help="table: aligned markdown; json: one list")

    pl = sub.add_parser("plot", help="loss curves or a grid of logged metrics, to a PNG")
    add_runs(pl)
    pl.add_argument("--output", "-o", metavar="FILE.png",
                    help="default: loss_curves.png (metrics.png with --metrics) in the one run dir, or in --all's ROOT")
    what = pl.add_mutually_exclusive_group()
    what.add_argument("--loss-curves", action="store_true",
                      help="train/val loss and learning rate vs x, one row per run (default)")
    what.add_argument("--metrics", metavar="A,B,C", help="one subplot per metric, runs overlaid")
    pl.add_argument("--compare", action="store_true", help="loss curves of all runs in one axes")
    pl.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average of train curves over N points")
    pl.add_argument("--x", choices=("step", "time", "epoch"), default="step", help="x axis")
    pl.add_argument("--log-y", action="store_true", help="log scale for losses/metrics")
    return p


def default_output(args) -> str:
    """Where a plot goes without --output: into the one run dir, or --all's ROOT (never elsewhere)."""
    name = "metrics.png" if args.metrics is not None else "loss_curves.png"
    if args.all is None and len(args.runs) == 1:
        return str(run_dir_of(args.runs[0]) / name)
    if args.all is not None and not args.runs:
        return str(Path(args.all) / name)
    raise LogError("--output is needed for several runs named one by one (the default goes into the one run dir, "
                   "or into --all's ROOT)")


def check_format(output) -> None:
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(output).suffix[1:].lower() not in formats:
        raise LogError(f"--output {output}: matplotlib cannot write {Path(output).suffix!r} files; use one of "
                       f"{', '.join('.' + f for f in sorted(formats))}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.runs, args.all)
        if args.command == "summary":
            print(format_summaries([summarize(r) for r in runs], args.format))
            return 0
        if args.smooth < 1:
            raise LogError("--smooth must be at least 1")
        args.output = args.output or default_output(args)
        runs = with_records(runs)
        if not Path(args.output).suffix:  # what matplotlib would write: name.png
            args.output += ".png"
        check_format(args.output)
        if args.metrics is not None:  # "" too: a list that came out empty is no request for the loss curves
            metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
            if not metrics:
                raise LogError(f"--metrics needs at least one name, got {args.metrics!r}")
            if args.compare:
                raise LogError("--compare is for the loss curves; a --metrics grid always overlays the runs")
            plot_metrics(runs, metrics, args.output, args.x, args.smooth, args.log_y)
        else:
            plot_loss_curves(runs, args.output, args.x, args.smooth, args.compare, args.log_y)
        print(f"wrote {args.output}")
        return 0
    except LogError as exc:
        print(f"training_logs.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unreadable metrics file, an image that cannot be written: the error names the path
        print(f"training_logs.py: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
