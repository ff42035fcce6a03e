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
      --nproc N             processes per node: on the CPU (default 2), or on the GPUs (default one per
                            selected GPU; more processes than GPUs is an error)
      --test                quick run: tiny model, few steps
      --debug               verbose logs from every rank, TORCH_DISTRIBUTED_DEBUG=INFO,
                            NCCL_DEBUG=INFO, CUDA_LAUNCH_BLOCKING=1
      --script FILE         training script (default ddp_training.py; e.g. vj2ac_train_multi_gpu.py);
                            a relative path not found in the current directory is taken from the
                            launcher's own directory, so the launcher works from any directory
      --nnodes N            number of nodes (default 1: torchrun --standalone)
      --node-rank R         this node's rank (multi-node: required, 0 on the --master-addr host,
                            unless --max-restarts lets c10d number the nodes)
      --master-addr HOST    rendezvous host (multi-node; with one node it is ignored, with a note)
      --master-port PORT    rendezvous port, 1..65535 (multi-node, default 29500; ignored with one node)
      --max-restarts N      let torchrun restart the group N times after a failure (resumes); with
                            --nnodes > 1 the nodes then meet through c10d rendezvous on
                            --master-addr:--master-port (torchrun numbers the nodes itself), since
                            static rendezvous cannot restart across nodes
      --rdzv-timeout SEC    multi-node: how long torchrun waits for every node's launcher to meet
                            (default 600, torchrun's own), before any worker starts
  -h, --help                show this help

GPUs are counted with nvidia-smi, or with torch.cuda.device_count() where nvidia-smi is missing or fails.
A CUDA_VISIBLE_DEVICES already set is read as CUDA reads it: up to its first entry that is not a GPU
(-1 hides them all) or where indices and UUIDs switch, at most the GPUs counted; a GPU listed twice hides
them all. On the CPU, OMP_NUM_THREADS defaults to the cores
divided among the processes (torchrun alone would set 1).

Signals: SIGTERM and SIGUSR1 are forwarded once to torchrun, which passes them to the workers; the
trainers save and exit. SIGINT (Ctrl-C) is forwarded as SIGTERM (torchrun ignores SIGINT for a moment at
its start). SIGHUP (a closed terminal) and SIGQUIT are forwarded as SIGTERM too: the trainers do not catch
them, and would die without a save. A stop before torchrun starts (while the GPUs are counted) exits 75:
nothing ran. Workers get TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default here 300, torchrun's own default
is 30) to finish before torchrun kills them.

Environment: PYTHON, when set, runs torchrun (python -m torch.distributed.run) and so the workers; unset,
the torchrun on PATH runs, else python3's. It also counts the GPUs where nvidia-smi cannot. With a virtual
environment that is not activated: PYTHON=.venv/bin/python.

Exit status: 0 the run finished; 75 the run was stopped by a signal and left a PREEMPTED marker in its log
dir (relaunch the same command to resume); 2 bad arguments, to this script or to the training script (a flag,
a file, a refused state); otherwise torchrun's status.
The marker is looked for in the log dir given with -l/--log-dir, else in the scripts' defaults
(runs/<run_name>/ and checkpoints/<run_name>/ for a --run_name after --, else runs/*/ and checkpoints/*/;
and the -c/--checkpoint-dir dir); pass -l when a --config file moves it.

Examples:
  ./launch_training.sh --cpu --test
  ./launch_training.sh --gpus 0,1 -b 64 -e 5
  ./launch_training.sh --script vj2ac_train_multi_gpu.py --cpu -- \
      --processed_data_dir ./train_data --validation_data_dir ./val_data
EOF
}

# Messages never change the exit status: a closed terminal (EIO) or a reader gone from a pipe (`| tee log`,
# which a Ctrl-C also stops) failed the echo, and set -e or SIGPIPE turned a preempted run's 75 into 1 or 141.
say() { printf 'launch_training.sh: %s\n' "$*" >&2 2>/dev/null || true; }
die() { say "error: $*"; exit 2; }

gpus="" batch="" epochs="" log_dir="" ckpt_dir="" cpu=0 nproc="" test_mode=0 debug=0
script="ddp_training.py" nnodes=1 node_rank="" master_addr="" master_port=29500 max_restarts=0 rdzv_timeout=600
script_args=() rendezvous_given=()  # --master-addr/--master-port as given, for the single-node note

need() {
    [[ ! "${2:-}" =~ ^-[0-9]+$ ]] || die "$1 expects a non-negative integer, got '$2'"
    [[ $# -ge 2 && -n "$2" && "$2" != -* ]] || die "option $1 needs a value"
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
# Decimal, whatever the leading zeros: bash arithmetic reads 08 as (invalid) octal. At most 18 digits,
# so the value fits bash's 64-bit arithmetic instead of wrapping around.
to_uint() { is_uint "$1" && (( ${#1} <= 18 )) && echo "$((10#$1))"; }

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
        --master-addr)       need "$@"; master_addr="$2"; rendezvous_given+=("$1 $2"); shift 2 ;;
        --rdzv-timeout)      need "$@"; rdzv_timeout="$2"; shift 2 ;;
        --master-port)       need "$@"; master_port="$2"; rendezvous_given+=("$1 $2"); shift 2 ;;
        --max-restarts)      need "$@"; max_restarts="$2"; shift 2 ;;
        -h|--help)           usage; exit 0 ;;
        --)                  shift; script_args=("$@"); break ;;
        *)                   die "unknown option '$1' (see --help; the training script's flags go after --)" ;;
    esac
done

for pair in batch-size:batch epochs:epochs nproc:nproc nnodes:nnodes node-rank:node_rank \
            master-port:master_port max-restarts:max_restarts rdzv-timeout:rdzv_timeout; do
    flag=${pair%%:*} var=${pair#*:}
    value=${!var}
    [[ -n "$value" ]] || continue
    number=$(to_uint "$value") || die "--$flag expects a non-negative integer (decimal digits), got '$value'"
    printf -v "$var" '%s' "$number"
done
[[ "$nproc" != 0 ]] || die "--nproc must be >= 1"  # before the cores are shared out by it
(( rdzv_timeout >= 1 )) || die "--rdzv-timeout must be >= 1 second"
# a TCP port: torchrun would only fail on it with a traceback, after the checks below passed
(( master_port >= 1 && master_port <= 65535 )) || die "--master-port must be a TCP port in 1..65535, got $master_port"
grace=$(to_uint "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}") || die "TORCH_ELASTIC_SHUTDOWN_TIMEOUT expects" \
    "seconds as a non-negative integer, got '$TORCH_ELASTIC_SHUTDOWN_TIMEOUT'"

# Forward the first signal only. torchrun restarts its shutdown wait on a second stop signal and, on a
# third, gives up on its workers mid-save and exits (torch 2.13, elastic agent run()); repeated Ctrl-C or a
# scheduler's warning and final signals must not get there.
forwarded="" child=""
forward() {
    if [[ -n "$forwarded" ]]; then
        say "SIG$1 received; already stopping on SIG$forwarded, the workers have up to ${grace}s to save"
        return 0  # a bare return in a trap gives the interrupted wait's status (> 128), and set -e exits
    fi
    forwarded=$1
    [[ -n "$child" ]] || return 0  # not started yet: sent right after the start below
    kill -s "$(stop_signal "$1")" "$child" 2>/dev/null || true
}

# The trainers save on SIGTERM, SIGINT and SIGUSR1; a closed terminal's SIGHUP or a SIGQUIT would kill them.
# SIGINT goes on as SIGTERM too: torchrun's wrapper below starts with it ignored (bash starts background
# jobs so) until it restores the default, and a Ctrl-C in those first milliseconds was lost.
stop_signal() { case $1 in HUP|QUIT|INT) echo TERM ;; *) echo "$1" ;; esac; }
# From here on: a stop while the GPUs are counted (torch imports for seconds without nvidia-smi) is kept
# and answered below, before torchrun starts
# A script's background job (`launch_training.sh ... &`) starts with Ctrl-C ignored, which no trap undoes: say
# so, or a Ctrl-C that does nothing looks like a hang
if [[ "$(trap -p INT)" == "trap -- '' SIGINT" ]]; then
    say "note: Ctrl-C is ignored here (started in the background by a shell script); kill -TERM $$ stops the run with a save"
fi
for sig in TERM INT HUP QUIT USR1; do trap "forward $sig" "$sig"; done
stop_if_stopped() {
    if [[ -n "$forwarded" ]]; then
        say "stopped by SIG$forwarded before torchrun started: nothing ran; relaunch the same command"
        exit 75
    fi
}

# The kit's scripts live next to the launcher: `--script ddp_training.py` (the default) must work from
# any directory, while a script in the current directory still wins.
self=$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null) || self=${BASH_SOURCE[0]}  # through a symlink in ~/bin
here=$(CDPATH='' cd -- "$(dirname -- "$self")" && pwd)
if [[ ! -f "$script" && "$script" != /* && -f "$here/$script" ]]; then
    script="$here/$script"
fi
[[ -f "$script" ]] || die "--script '$script' does not exist (looked in the current directory and in $here)"
(( nnodes >= 1 )) || die "--nnodes must be >= 1"
(( node_rank < nnodes )) || die "--node-rank $node_rank must be < --nnodes $nnodes"
# `srun -n N ./launch_training.sh` starts N launchers: with one node each makes its own group (--standalone)
# and trains alone, or meets another's run dir as another run's; one launcher per node, and --nnodes says so
step_tasks=${SLURM_STEP_NUM_TASKS:-1}
if [[ "$step_tasks" =~ ^[0-9]+$ ]] && (( step_tasks > 1 && step_tasks != nnodes )); then
    die "srun started $step_tasks launchers (SLURM_STEP_NUM_TASKS) for --nnodes $nnodes: each would train on its" \
        "own; start one per node, as srun --ntasks-per-node=1 bash -c './launch_training.sh --nnodes \$SLURM_NNODES" \
        "--node-rank \$SLURM_NODEID --master-addr HOST ...' (quoted: each node's own SLURM_NODEID), or let srun" \
        "start the ranks itself: srun python ddp_training.py ..."
fi
if (( nnodes > 1 )) && [[ -z "$master_addr" ]]; then
    die "--nnodes $nnodes needs --master-addr (the host of node rank 0)"
fi
# Static rendezvous numbers the nodes by this flag: two nodes that both default to 0 would wait for the
# missing one until the rendezvous times out (with --max-restarts, c10d numbers them itself)
if (( nnodes > 1 && max_restarts == 0 )) && [[ -z "$node_rank" ]]; then
    others="1 to $((nnodes - 1)) on the others"
    (( nnodes > 2 )) || others="1 on the other"
    die "--nnodes $nnodes needs --node-rank (0 on the --master-addr host, $others)"
fi
node_rank=${node_rank:-0}
if (( nnodes == 1 && ${#rendezvous_given[@]} )); then  # torchrun --standalone picks its own endpoint
    say "note: ${rendezvous_given[*]} ignored: --master-addr and --master-port only apply with --nnodes > 1"
fi

python=${PYTHON:-python3}

# How many GPUs this node has. Containers often ship the CUDA runtime without nvidia-smi (or with one that
# cannot reach NVML); torch then answers. It counts only the GPUs CUDA_VISIBLE_DEVICES leaves visible,
# which the caller handles like nvidia-smi's full count.
detected_gpus() {
    local listing count
    if listing=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null); then
        grep -c . <<< "$listing" || true
        return
    fi
    if ! count=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null); then
        say "no nvidia-smi, and $python cannot import torch to count the GPUs: none counted (a virtual" \
            "environment not activated? set PYTHON=/path/to/its/python)"
        count=0
    fi
    is_uint "$count" && echo "$count" || echo 0
}

device_args=()
if (( cpu == 0 )); then
    # The GPUs this job may use: those CUDA_VISIBLE_DEVICES names when a scheduler (SLURM, Docker) set it,
    # else every GPU nvidia-smi sees. --gpus ids count within them, as CUDA numbers them.
    detected=$(detected_gpus) || true  # a stop to this process group ends the count too: answered below
    stop_if_stopped
    visible=()
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        # CUDA stops at the first entry that names no GPU: "-1" (the usual "hide them all") leaves none;
        # also where indices and UUIDs switch; a GPU listed twice leaves none (as torch reads it)
        IFS=',' read -r -a listed <<< "$CUDA_VISIBLE_DEVICES"
        kind=""
        for entry in "${listed[@]+"${listed[@]}"}"; do
            entry=${entry// /}
            case "$entry" in
                GPU-*|MIG-*) this=uuid ;;
                *) [[ "$entry" =~ ^[0-9]+$ ]] || break; this=index ;;
            esac
            [[ -z "$kind" || "$kind" == "$this" ]] || break
            kind=$this
            (( ${#visible[@]} < detected )) || break
            if [[ " ${visible[*]-} " == *" $entry "* ]]; then
                visible=()
                break
            fi
            visible+=("$entry")
        done
    else
        for (( i = 0; i < detected; i++ )); do visible+=("$i"); done
    fi
    available=${#visible[@]}
    if [[ -n "$gpus" ]]; then
        IFS=',' read -r -a ids <<< "$gpus"
        (( ${#ids[@]} > 0 )) || die "--gpus expects ids like 0,1"
        seen=","
        chosen=()
        for given in "${ids[@]}"; do
            given=${given// /}  # "0, 1", as CUDA_VISIBLE_DEVICES may be written
            id=$(to_uint "$given") || die "--gpus: '$given' is not a GPU id"
            (( id < available )) || die "--gpus: GPU $id does not exist ($available GPU(s) visible)"
            [[ "$seen" != *",$id,"* ]] || die "--gpus: GPU $id listed twice"
            seen="$seen$id,"
            chosen+=("${visible[$id]}")
        done
        CUDA_VISIBLE_DEVICES=$(IFS=','; echo "${chosen[*]}")
        export CUDA_VISIBLE_DEVICES
        selected=${#ids[@]} selection="--gpus $gpus"
    elif (( available > 0 )); then
        selected=$available selection="$available GPU(s) visible"
    else
        say "no GPU detected, falling back to the CPU (gloo)"
        cpu=1
    fi
elif [[ -n "$gpus" ]]; then
    die "--cpu and --gpus exclude each other"
fi
if (( cpu == 1 )); then
    nproc=${nproc:-2}
    device_args=(--device cpu --dist-backend gloo)
    # torchrun sets OMP_NUM_THREADS=1 for several processes, and the trainers take a set value as the
    # user's: every rank would compute on one thread. Share the cores instead, as `--nproc` spawning does.
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
        cores=$(command nproc 2>/dev/null || echo 1)
        export OMP_NUM_THREADS=$(( cores / nproc > 0 ? cores / nproc : 1 ))
    fi
else
    # Each worker takes cuda:LOCAL_RANK; a process past the last GPU would fail only once CUDA starts.
    nproc=${nproc:-$selected}
    if (( nproc > selected )); then
        die "--nproc $nproc asks for more processes than GPUs: $selected selected ($selection);" \
            "one process per GPU, or --cpu for CPU processes"
    fi
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

has_torch() { "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; }
# A PYTHON that is set runs the workers: a torchrun found first on PATH may belong to another environment
# (a system-wide torch), whose Python would then run the script without this environment's packages.
if [[ -n "${PYTHON:-}" ]]; then
    has_torch || die "PYTHON=$python cannot import torch: set PYTHON to the python of the environment that has torch"
    launcher=("$python" -m torch.distributed.run)
elif command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
elif has_torch; then
    launcher=("$python" -m torch.distributed.run)
else  # typically a virtual environment that is not activated
    die "no torchrun on PATH, and $python cannot import torch: activate the environment that has torch," \
        "or set PYTHON=/path/to/its/python"
fi
if (( nnodes == 1 )); then
    launcher+=(--standalone)
elif (( max_restarts > 0 )); then
    # Static rendezvous cannot restart: a restarted node's workers meet peers that never come back. The
    # agents of all nodes restart together through a c10d rendezvous (the id only has to agree across nodes).
    launcher+=(--nnodes "$nnodes" --rdzv_backend c10d --rdzv_endpoint "$master_addr:$master_port"
               --rdzv_id "${SLURM_JOB_ID:-ddp-kit-$master_port}")
else
    launcher+=(--nnodes "$nnodes" --node_rank "$node_rank" --master_addr "$master_addr" --master_port "$master_port")
fi
if (( nnodes > 1 )); then
    # how long torchrun's agents wait for every node's agent (static rendezvous: timeout; c10d: join_timeout),
    # before any worker exists: the trainers' --dist_timeout cannot bound it
    launcher+=(--rdzv_conf "timeout=$rdzv_timeout,join_timeout=$rdzv_timeout")
    say "waiting up to ${rdzv_timeout}s for the launchers of all $nnodes nodes to meet at" \
        "$master_addr:$master_port (--rdzv-timeout)"
fi
# SLURM can announce the end of a job with SIGUSR1 (--signal=USR1@...): forward it like SIGTERM. The `--`
# ends torchrun's options: without it, its parser (argparse) reads every --flag of the command line, the
# script's too, and stops with its usage on one that abbreviates two of its own options (the script's
# --nproc: --nproc-per-node or --nproc_per_node?).
launcher+=(--nproc_per_node "$nproc" --max_restarts "$max_restarts"
           --signals_to_handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --)
if (( max_restarts > 0 )); then
    # A restarted gloo group re-rendezvouses more reliably on its own TCP store.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi

# torchrun's default of 30 s before it SIGKILLs workers after a stop signal can cut a large checkpoint
# write short (a resumable state is about 3x the fp32 weights, written after the in-flight async write);
# 300 s covers several GB on slow shared storage. The variable, not --shutdown_timeout: a torch without it
# ignores a variable but rejects an unknown flag.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$grace

cmd=("${launcher[@]}" "$script" "${args[@]}")
printf -v shown ' %q' "${cmd[@]}"
say "running: TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$grace$shown"

# -- preemption ------------------------------------------------------------------------------------------
# torchrun turns a stop signal into exit 1 and a traceback, even when every worker saved and exited 75, and
# it does not pass the workers' codes on. The trainer's own proof of a resumable stop is the PREEMPTED
# marker, written by rank 0 only once the state is on disk and removed when a run starts. So torchrun runs
# as a child and the launcher exits 75 when it passed a stop on, torchrun failed, and a marker newer than this
# launch exists in the run's log dir; a --config file can name another log dir, which the launcher does not
# read. The markers carry this launch's id (DDP_KIT_LAUNCH_ID), so another run's marker in a searched dir
# does not count. A run that completed (COMPLETED, newer, this launch's) while torchrun handled a stop exits 0.
marker_dirs() {
    local explicit=() ckpts=() names=() i a
    [[ -n "$log_dir" ]] && explicit+=("$log_dir")
    [[ -n "$ckpt_dir" ]] && ckpts+=("$ckpt_dir")
    for (( i = 0; i < ${#script_args[@]}; i++ )); do
        a=${script_args[i]}
        case "$a" in
            --log_dir=*|--log-dir=*)               explicit+=("${a#*=}") ;;
            --log_dir|--log-dir)                   explicit+=("${script_args[i + 1]:-}") ;;
            --checkpoint_dir=*|--checkpoint-dir=*) ckpts+=("${a#*=}") ;;
            --checkpoint_dir|--checkpoint-dir)     ckpts+=("${script_args[i + 1]:-}") ;;
            --run_name=*|--run-name=*)             names+=("${a#*=}") ;;
            --run_name|--run-name)                 names+=("${script_args[i + 1]:-}") ;;
        esac
    done
    if (( ${#explicit[@]} )); then
        printf '%s\n' "${explicit[@]}"
    elif (( ${#names[@]} )); then  # a run name may nest (exp1/lr3e-4): no glob one level deep finds it
        printf '%s\n' "${ckpts[@]+"${ckpts[@]}"}" "runs/${names[-1]}" "checkpoints/${names[-1]}"
    else  # ddp_training.py: runs/<run_name>; vj2ac_train_multi_gpu.py: the checkpoint dir (checkpoints/<run_name>)
        printf '%s\n' "${ckpts[@]+"${ckpts[@]}"}" runs/* checkpoints/*
    fi
}

new_file() {  # new_file NAME [TEXT]: the first NAME newer than this launch in the run's dirs (holding TEXT)
    local dir
    while IFS= read -r dir; do
        if [[ -n "$dir" && -f "$dir/$1" && "$dir/$1" -nt "$stamp" ]] \
                && { [[ -z "${2:-}" ]] || grep -qF -- "$2" "$dir/$1"; }; then
            echo "$dir/$1"
            return
        fi
    done < <(marker_dirs)
}
new_marker() { new_file "$1" "\"launch_id\": \"$DDP_KIT_LAUNCH_ID\""; }  # PREEMPTED|COMPLETED of this launch

stamp=$(mktemp "${TMPDIR:-/tmp}/launch_training.XXXXXX") || die "cannot create a file in ${TMPDIR:-/tmp} (set TMPDIR)"
# torchrun copies the first failed worker's reason here, with its exit code (see rt.refuse)
export TORCHELASTIC_ERROR_FILE="$stamp.error.json"
trap 'rm -f "$stamp" "$TORCHELASTIC_ERROR_FILE"' EXIT
# one id for all nodes of a multi-node run (rank 0 writes the markers, every node's launcher reads them)
if (( nnodes == 1 )); then
    DDP_KIT_LAUNCH_ID="${HOSTNAME:-host}-$$-${stamp##*.}"
else
    DDP_KIT_LAUNCH_ID="${SLURM_JOB_ID:-ddp-kit}-$master_addr-$master_port"
fi
export DDP_KIT_LAUNCH_ID

# A session of its own, so a Ctrl-C on the terminal (or a signal to this script's process group) reaches
# only this script, which forwards it once, and not torchrun as well. Bash starts background jobs with
# SIGINT and SIGQUIT ignored and stdin on /dev/null: torchrun gets the defaults and the real stdin back
# (a breakpoint() in a worker can read the terminal).
stop_if_stopped
"$python" -c 'import ctypes, os, signal, sys
os.setsid()
for s in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(s, signal.SIG_DFL)
try:  # Linux: a launcher killed outright (SIGKILL, the OOM killer) still stops torchrun, which saves
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, kept across exec
except (OSError, AttributeError):
    pass
os.execvp(sys.argv[1], sys.argv[1:])' "${cmd[@]}" <&0 &
child=$!
trap '' PIPE  # after torchrun's start, which keeps the default; see say()
[[ -z "$forwarded" ]] || kill -s "$(stop_signal "$forwarded")" "$child" 2>/dev/null || true

# A trapped signal cuts `wait` short (status > 128) while torchrun still runs: wait again. The last wait
# gives torchrun's own status even when a signal cut the one before short.
while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done
status=0
wait "$child" || status=$?

# Only a stop that this launcher passed on is a preemption: torchrun also sends SIGTERM to the other ranks
# when one fails, and a rank still in set-up then writes a marker too (see rt.SetUpWatch).
if (( status != 0 )) && [[ -n "$forwarded" ]]; then
    marker=$(new_marker PREEMPTED)
    if [[ -n "$marker" ]]; then
        say "the run was preempted ($marker: $(head -c 300 "$marker" | tr -d '\n'));" \
            "exiting 75, relaunch the same command to resume"
        exit 75
    fi
    marker=$(new_marker COMPLETED)
    if [[ -n "$marker" ]]; then
        say "the run completed ($marker) before SIG$forwarded could stop it;" \
            "torchrun's status $status was its answer to the signal: exiting 0"
        exit 0
    fi
fi
# The exit code of the worker that failed first, where it left torchrun its reason (the trainers do for bad input)
if (( status != 0 )) && [[ -s "$TORCHELASTIC_ERROR_FILE" ]] && [[ "$("$python" -c 'import json, sys
reason = json.load(open(sys.argv[1]))["message"]
refused = isinstance(reason, dict) and (reason.get("errorCode") == 2 or reason.get("extraInfo", {}).get("refused") == "true")
print(2 if refused else "")' "$TORCHELASTIC_ERROR_FILE")" == 2 ]]; then
    say "the script refused its input (exit 2, the error above): exiting 2"
    exit 2
fi
# A stop this launcher did not pass on (one that reached another node's launcher, or the ranks themselves), or
# torchrun's SIGTERM to the others after a rank failed: not a preemption here, but the state is on disk
if (( status != 0 )) && [[ -z "$forwarded" ]] && marker=$(new_marker PREEMPTED) && [[ -n "$marker" ]]; then
    say "torchrun exited $status; the run saved and left a PREEMPTED marker of this launch ($marker): a stop" \
        "reached another node's launcher or the ranks themselves, or torchrun stopped them after a rank failed" \
        "(see above); relaunch the same command to resume"
fi
if (( status != 0 && nnodes > 1 )) && [[ -z "$forwarded" && -z "$(new_marker metrics.jsonl)" ]]; then
    say "torchrun exited $status before any rank began training: if the nodes did not all meet within" \
        "--rdzv-timeout ${rdzv_timeout}s (its error above: 'clients joined', a rendezvous timeout), start every" \
        "node's launcher within that time, with the same --nnodes, --master-addr and --master-port, and each" \
        "node its own --node-rank (under srun, quote it: '--node-rank \$SLURM_NODEID', not expanded by the batch shell)"
fi
if (( status != 0 )) && [[ -n "$forwarded" ]]; then
    # training never began (no start record of this launch): the ranks died of the signal while importing
    if [[ -z "$(new_marker metrics.jsonl)" ]]; then
        say "stopped by SIG$forwarded before any rank began training (no metrics.jsonl of this launch" \
            "in: $(marker_dirs | tr '\n' ' ')): nothing to save; exiting 75 (pass -l when a" \
            "--config sets the log dir)"
        exit 75
    fi
    say "stopped by SIG$forwarded, but no PREEMPTED marker newer than the launch in:" \
        "$(marker_dirs | tr '\n' ' ')(pass -l when a --config sets the log dir)"
fi
exit "$status"
