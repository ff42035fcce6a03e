"""The table of gpu_check.sh --workers_ab: for each ab_workers_<W> run under OUTDIR, the wall-clock rate of the
steps after the first 20 (warm-up and the cold first epoch), from the "time" of the metrics records, so batch
reading and everything else between steps counts; the median of the per-step rates; the peak GPU memory.
    python scripts/workers_ab_table.py OUTDIR"""
import json
import statistics
import sys
from pathlib import Path

SKIP = 20


def row(run: Path) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    summary = next((r for r in records if r["type"] == "summary"), None)
    if summary is None or len(train) <= SKIP + 1:
        return f"{run.name}: {len(train)} steps, {'a' if summary else 'no'} summary"
    first, last = train[SKIP - 1], train[-1]
    steps, wall = last["step"] - first["step"], last["time"] - first["time"]
    per_step = statistics.median(r["samples_per_s"] for r in train[SKIP:])
    peak = summary.get("cuda_peak_gb", float("nan"))
    return (f"{run.name:>14}  steps {first['step'] + 1}-{last['step']}: {steps * summary['global_batch'] / wall:6.1f} "
            f"samples/s over {wall:6.2f} s; median per step {per_step:6.1f}; final loss {last['loss']:.4f}; "
            f"peak GPU {peak} GiB")


def main(out: str) -> None:
    runs = sorted((p for p in Path(out).glob("ab_workers_*") if p.is_dir()), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if not runs:
        sys.exit(f"no ab_workers_<W> runs under {out}")
    for run in runs:
        print(row(run))


if __name__ == "__main__":
    main(sys.argv[1])
