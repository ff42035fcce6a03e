#!/usr/bin/env bash
# The GPU checks of the kit on one CUDA machine, in one go: the GPU tests, the default LM and the VJ2 AC
# trainer through the launcher on the GPUs. Logs and run dirs go to OUTDIR (default gpu_check/).
#   bash scripts/gpu_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
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
exit $status
