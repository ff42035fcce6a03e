#!/usr/bin/env bash
# The GPU checks of the kit on one CUDA machine, in one go: the GPU tests, the default LM and the VJ2 AC
# trainer through the launcher on the GPUs. Logs and run dirs go to OUTDIR (default gpu_check/). With
# --bench, then the GPU benchmarks of BENCHMARKS.md (several minutes on an H100), each table in OUTDIR/bench_*.log.
#   bash scripts/gpu_check.sh [--bench] [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
bench=0
if [[ "${1:-}" == "--bench" ]]; then bench=1; shift; fi
out="${1:-gpu_check}"
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

step pytest_gpu "$py" -m pytest -m gpu -v -p no:cacheprovider
step launch_lm ./launch_training.sh --test -l "$out/lm_test" -c "$out/lm_test/ckpt"
step vj2_data "$py" create_synthetic_data.py --output_dir "$out/vj2_data/train" --num_files 4 \
    --val_output_dir "$out/vj2_data/val" --val_fraction 0.25
step launch_vj2 ./launch_training.sh --script vj2ac_train_multi_gpu.py --test -- \
    --processed_data_dir "$out/vj2_data/train" --validation_data_dir "$out/vj2_data/val" \
    --checkpoint_dir "$out/vj2_test"
if [[ $bench -eq 1 ]]; then
    gpt=(--device cuda --hidden_size 768 --num_layers 12 --num_heads 12 --seq_len 1024 --batch_size 16 --steps 100
         --warmup 10)
    step bench_overhead "$py" benchmark.py overhead "${gpt[@]}" --repeats 3
    step bench_overhead_read_loss "$py" benchmark.py overhead "${gpt[@]}" --repeats 3 --bare_read_loss
    step bench_overhead_compile "$py" benchmark.py overhead "${gpt[@]}" --repeats 2 --compile --bare_read_loss
    step bench_checkpoint "$py" benchmark.py checkpoint --device cuda --sizes 1024x12 --repeats 3 --loop_saves 2 \
        --loop_save_every 200
    step bench_loader "$py" benchmark.py loader --device cuda --preset vjepa2_ac --workers 0,1,4 --train_warmup 5 \
        --train_steps 10
fi
exit $status
