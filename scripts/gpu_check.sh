#!/usr/bin/env bash
# The GPU checks of the kit on one CUDA machine, in one go: the GPU tests, the default LM and the VJ2 AC
# trainer through the launcher on the GPUs. Logs and run dirs go to OUTDIR (a relative one is taken from the
# current directory; default gpu_check/ in the repo); a rerun into the same OUTDIR removes its lm_test/ and
# vj2_test/ run dirs first, so the launcher runs train again instead of finding their runs finished. With
# --bench, then the GPU benchmarks of BENCHMARKS.md (several minutes on an H100), each table in OUTDIR/bench_*.log;
# --overhead runs only the two LM overhead tables of those; --workers_ab trains the vjepa2_ac predictor
# AB_STEPS steps (default 150) with AB_WORKERS loader workers (default "0 1 2 4") over real-shape
# trajectories (AB_FILES, AB_COLD: see below); --compile_overhead runs the compiled LM overhead table of --bench;
# --no_tests skips the tests and the launcher runs.
#   bash scripts/gpu_check.sh [--no_tests] [--bench | --overhead] [--compile_overhead] [--workers_ab] [OUTDIR]
set -uo pipefail
caller=$PWD  # a relative OUTDIR is the caller's, not the repo's: resolved against it after the cd below
cd "$(dirname "$0")/.." || exit 1
tests=1 bench=0 overhead=0 compile_overhead=0 workers_ab=0
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --no_tests) tests=0 ;;
        --bench) bench=1 overhead=1 compile_overhead=1 ;;
        --overhead) overhead=1 ;;
        --compile_overhead) compile_overhead=1 ;;
        --workers_ab) workers_ab=1 ;;
        *) echo "unknown flag $1 (expected --no_tests, --bench, --overhead, --compile_overhead, --workers_ab)" >&2
           exit 2 ;;
    esac
    shift
done
out="${1:-gpu_check}"
[[ -z "${1:-}" || "$out" == /* ]] || out="$caller/$out"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0

step() {  # step NAME CMD...: run, log to OUTDIR/NAME.log, report the exit status, go on
    local name="$1"; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    tail -n 15 "$out/$name.log"
    [[ $rc -eq 0 ]] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
"$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' || status=1

if [[ $tests -eq 1 ]]; then
    # one test at a time (-n 0): the out-of-memory test sizes its request by the whole card (a test hung past
    # pytest.ini's timeout then ends pytest, and the steps below run)
    step pytest_gpu "$py" -m pytest -m gpu -n 0 -v -p no:cacheprovider --durations=12
    # A previous check's runs: the trainers would resume them, or find them finished and train nothing (exit 0)
    rm -rf -- "$out/lm_test" "$out/vj2_test"
    step launch_lm ./launch_training.sh --test -l "$out/lm_test" -c "$out/lm_test/ckpt"
    step vj2_data "$py" create_synthetic_data.py --output_dir "$out/vj2_data/train" --num_files 4 \
        --val_output_dir "$out/vj2_data/val" --val_fraction 0.25
    step launch_vj2 ./launch_training.sh --script vj2ac_train_multi_gpu.py --test -- \
        --processed_data_dir "$out/vj2_data/train" --validation_data_dir "$out/vj2_data/val" \
        --checkpoint_dir "$out/vj2_test"
fi
gpt=(--device cuda --hidden_size 768 --num_layers 12 --num_heads 12 --seq_len 1024 --batch_size 16 --steps 100
     --warmup 10)
if [[ $overhead -eq 1 ]]; then
    step bench_overhead "$py" benchmark.py overhead "${gpt[@]}" --repeats 3
    step bench_overhead_read_loss "$py" benchmark.py overhead "${gpt[@]}" --repeats 3 --bare_read_loss
fi
if [[ $compile_overhead -eq 1 ]]; then
    step bench_overhead_compile "$py" benchmark.py overhead "${gpt[@]}" --repeats 2 --compile --bare_read_loss
fi
if [[ $bench -eq 1 ]]; then
    step bench_checkpoint "$py" benchmark.py checkpoint --device cuda --sizes 1024x12 --repeats 3 --loop_saves 2 \
        --loop_save_every 200
    step bench_loader "$py" benchmark.py loader --device cuda --preset vjepa2_ac --workers 0,1,4 --train_warmup 5 \
        --train_steps 10
fi
if [[ $workers_ab -eq 1 ]]; then
    # AB_FILES files of 8 trajectories (default 12: 96 trajectories, 24 steps per epoch at batch 4, 384 MiB);
    # with AB_COLD=1 the files are dropped from the page cache before each run, so the first epoch reads the
    # disk (the later ones the cache: AB_FILES=60 and AB_STEPS=120 make one cold epoch). One validation at the
    # end (8 trajectories), no checkpoints but the final ones.
    step ab_data "$py" create_synthetic_data.py --output_dir "$out/ab_data/train" --num_files "${AB_FILES:-12}" \
        --trajectories_per_file 8 --real_shapes --val_output_dir "$out/ab_data/val" \
        --val_fraction "$("$py" -c "print(1.01 / ${AB_FILES:-12})")"
    for w in ${AB_WORKERS:-0 1 2 4}; do
        if [[ "${AB_COLD:-0}" == 1 ]]; then
            sync
            "$py" -c 'import os, sys
for f in sys.argv[1:]:
    fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' \
                "$out"/ab_data/train/*.npz || status=1
        fi
        step "ab_workers_$w" "$py" vj2ac_train_multi_gpu.py --processed_data_dir "$out/ab_data/train" \
            --validation_data_dir "$out/ab_data/val" --preset vjepa2_ac --max_steps "${AB_STEPS:-150}" \
            --num_epochs 100 --val_every_iters 100000 --save_every_iters 0 --num_workers "$w" --resume none \
            --checkpoint_dir "$out/ab_workers_$w"
        rm -f "$out/ab_workers_$w"/*.pt  # 6 GB of checkpoints per run
    done
    "$py" scripts/workers_ab_table.py "$out" || status=1
fi
exit $status
