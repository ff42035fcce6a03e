#!/usr/bin/env bash
# Launch a kit training script through torchrun: picks GPUs (or falls back to the CPU),
# quick test and debug modes, multi-node rendezvous, elastic restarts.
# Everything after `--` is passed to the script unchanged.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: ./launch_training.sh [OPTIONS] [-- SCRIPT_ARGS...]

  -g, --gpus IDS            comma-separated GPU ids (e.g. 0,1); default: all detected GPUs
  -b, --batch-size N        batch size per process
  -e, --epochs N            number of epochs
  -l, --log-dir DIR         log directory (rank_N.log, metrics.jsonl)
  -c, --checkpoint-dir DIR  checkpoint directory
      --cpu                 train on the CPU with gloo (also the fallback when no GPU is found)
      --nproc N             processes on the CPU (default 2)
      --test                quick run: tiny model, few steps
      --debug               verbose logs from every rank, TORCH_DISTRIBUTED_DEBUG=INFO,
                            NCCL_DEBUG=INFO, CUDA_LAUNCH_BLOCKING=1
      --script FILE         training script (default ddp_training.py; e.g. vj2ac_train_multi_gpu.py)
      --nnodes N            number of nodes (default 1: torchrun --standalone)
      --node-rank R         this node's rank (multi-node)
      --master-addr HOST    rendezvous host (multi-node)
      --master-port PORT    rendezvous port (multi-node, default 29500)
      --max-restarts N      let torchrun restart the group N times after a failure (resumes)
  -h, --help                show this help

Examples:
  ./launch_training.sh --cpu --test
  ./launch_training.sh --gpus 0,1 -b 64 -e 5
  ./launch_training.sh --script vj2ac_train_multi_gpu.py --cpu -- \
      --processed_data_dir ./train_data --validation_data_dir ./val_data
EOF
}

die() { echo "launch_training.sh: error: $*" >&2; exit 2; }

gpus="" batch="" epochs="" log_dir="" ckpt_dir="" cpu=0 nproc="" test_mode=0 debug=0
script="ddp_training.py" nnodes=1 node_rank=0 master_addr="" master_port=29500 max_restarts=0
script_args=()

need() { [[ $# -ge 2 && -n "$2" && "$2" != -* ]] || die "option $1 needs a value"; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -g|--gpus)           need "$@"; gpus="$2"; shift 2 ;;
        -b|--batch-size)     need "$@"; batch="$2"; shift 2 ;;
        -e|--epochs)         need "$@"; epochs="$2"; shift 2 ;;
        -l|--log-dir)        need "$@"; log_dir="$2"; shift 2 ;;
        -c|--checkpoint-dir) need "$@"; ckpt_dir="$2"; shift 2 ;;
        --cpu)               cpu=1; shift ;;
        --nproc)             need "$@"; nproc="$2"; shift 2 ;;
        --test)              test_mode=1; shift ;;
        --debug)             debug=1; shift ;;
        --script)            need "$@"; script="$2"; shift 2 ;;
        --nnodes)            need "$@"; nnodes="$2"; shift 2 ;;
        --node-rank)         need "$@"; node_rank="$2"; shift 2 ;;
        --master-addr)       need "$@"; master_addr="$2"; shift 2 ;;
        --master-port)       need "$@"; master_port="$2"; shift 2 ;;
        --max-restarts)      need "$@"; max_restarts="$2"; shift 2 ;;
        -h|--help)           usage; exit 0 ;;
        --)                  shift; script_args=("$@"); break ;;
        *)                   die "unknown option '$1' (see --help)" ;;
    esac
done

for pair in "batch-size:$batch" "epochs:$epochs" "nproc:$nproc" "nnodes:$nnodes" \
            "node-rank:$node_rank" "master-port:$master_port" "max-restarts:$max_restarts"; do
    name=${pair%%:*} value=${pair#*:}
    [[ -z "$value" ]] || is_uint "$value" || die "--$name expects a non-negative integer, got '$value'"
done
[[ -f "$script" ]] || die "--script '$script' does not exist"
(( nnodes >= 1 )) || die "--nnodes must be >= 1"
(( node_rank < nnodes )) || die "--node-rank $node_rank must be < --nnodes $nnodes"
if (( nnodes > 1 )) && [[ -z "$master_addr" ]]; then
    die "--nnodes $nnodes needs --master-addr (the host of node rank 0)"
fi

python=${PYTHON:-python3}

detected_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
    else
        echo 0
    fi
}

device_args=()
if (( cpu == 0 )); then
    # The GPUs this job may use: those CUDA_VISIBLE_DEVICES names when a scheduler (SLURM, Docker) set it,
    # else every GPU nvidia-smi sees. --gpus ids count within them, as CUDA numbers them.
    detected=$(detected_gpus)
    visible=()
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        IFS=',' read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
        (( detected > 0 )) || visible=()
    else
        for (( i = 0; i < detected; i++ )); do visible+=("$i"); done
    fi
    available=${#visible[@]}
    if [[ -n "$gpus" ]]; then
        IFS=',' read -r -a ids <<< "$gpus"
        (( ${#ids[@]} > 0 )) || die "--gpus expects ids like 0,1"
        seen=","
        chosen=()
        for id in "${ids[@]}"; do
            is_uint "$id" || die "--gpus: '$id' is not a GPU id"
            (( id < available )) || die "--gpus: GPU $id does not exist ($available GPU(s) visible)"
            [[ "$seen" != *",$id,"* ]] || die "--gpus: GPU $id listed twice"
            seen="$seen$id,"
            chosen+=("${visible[$id]}")
        done
        CUDA_VISIBLE_DEVICES=$(IFS=','; echo "${chosen[*]}")
        export CUDA_VISIBLE_DEVICES
        nproc=${#ids[@]}
    elif (( available > 0 )); then
        nproc=${nproc:-$available}
    else
        echo "launch_training.sh: no GPU detected, falling back to the CPU (gloo)" >&2
        cpu=1
    fi
elif [[ -n "$gpus" ]]; then
    die "--cpu and --gpus exclude each other"
fi
if (( cpu == 1 )); then
    nproc=${nproc:-2}
    device_args=(--device cpu --dist-backend gloo)
else
    device_args=(--device cuda)
fi
(( nproc >= 1 )) || die "--nproc must be >= 1"

args=("${device_args[@]}")
[[ -n "$batch" ]] && args+=(--batch_size "$batch")
[[ -n "$epochs" ]] && args+=(--num_epochs "$epochs")
[[ -n "$log_dir" ]] && args+=(--log_dir "$log_dir")
[[ -n "$ckpt_dir" ]] && args+=(--checkpoint_dir "$ckpt_dir")
(( test_mode )) && args+=(--test)
if (( debug )); then
    args+=(--debug)
    # INFO, not DETAIL: with torch 2.13 DETAIL makes DDP's constructor segfault (seen with gloo, even for a
    # bare nn.Linear); a value already in the environment wins.
    export TORCH_DISTRIBUTED_DEBUG="${TORCH_DISTRIBUTED_DEBUG:-INFO}" NCCL_DEBUG=INFO CUDA_LAUNCH_BLOCKING=1
fi
args+=("${script_args[@]+"${script_args[@]}"}")

if command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
else
    launcher=("$python" -m torch.distributed.run)
fi
if (( nnodes == 1 )); then
    launcher+=(--standalone)
else
    launcher+=(--nnodes "$nnodes" --node_rank "$node_rank" --master_addr "$master_addr" --master_port "$master_port")
fi
# SLURM can announce the end of a job with SIGUSR1 (--signal=USR1@...): forward it like SIGTERM.
launcher+=(--nproc_per_node "$nproc" --max_restarts "$max_restarts"
           --signals_to_handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
if (( max_restarts > 0 )); then
    # A restarted gloo group re-rendezvouses more reliably on its own TCP store.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi

cmd=("${launcher[@]}" "$script" "${args[@]}")
printf 'launch_training.sh: running:'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
