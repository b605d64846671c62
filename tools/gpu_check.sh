#!/usr/bin/env bash
# tools/gpu_check.sh: the one-shot check of zerodp on an NVIDIA GPU machine (issue 28, item 6).
#
#   tools/gpu_check.sh [--dry-run] [--out DIR] [--budget-s SECONDS] [--python PYTHON]
#   make gpu-check
#
# From a fresh clone, unattended (no prompts), in at most --budget-s seconds (default 560): installs
# zerodp with a CUDA torch into .venv-gpu, prints nvidia-smi / torch / CUDA / NCCL versions, runs the
# tests marked cuda and the device-following tests ($DEVICE_TESTS: each compares with plain PyTorch on
# ZERODP_TEST_DEVICE=cuda) at world size 1, and 2 when there are 2+ GPUs (ZERODP_TEST_WORLD_SIZES), trains the default GPT at stages 0-3 on one GPU for 50 steps against plain PyTorch
# on the GPU (tools/gpu_train_compare.py), and runs `zerodp bench --device cuda` (tiny preset: DDP, FSDP2,
# zerodp stages 0-3, DeepSpeed when it installed) at 1 rank, and 2 when there are 2+ GPUs, each record
# checked by tools/gpu_bench_check.py (the rows ran, losses match DDP's, peak GPU memory per rank) and
# kept as $OUT/bench_wsN/bench.json, and runs ZeRO-Offload's single-GPU headline (tools/gpu_offload_headline.py:
# the largest GPT a memory-capped GPU trains with offload_optimizer cpu and with parameters and optimizer on
# NVMe, the no-offload run of the same model out of memory), and the user-facing commands
# (tools/gpu_cli_check.sh: zerodp train, a checkpoint saved and resumed, the examples). Each part has its own time box (540 s in all on one GPU
# with --python; the install and the 2-rank parts add more, and the budget cuts what does not fit); the script goes on after a failing part, and a part that would start with less than
# 10 s of the budget left is not started (recorded as budget_spent). Everything goes to $OUT (or ./gpu_check_out, or --out): one log per part, and gpu_check.json
# with every figure and each part's status (tools/gpu_check_report.py). The last line is
# `gpu check: N/M pass`.
#
# --dry-run: argument handling and the JSON on the CPU; no part runs (each is recorded as "dry").
# --python: use this interpreter (with a CUDA torch and zerodp importable) instead of installing. On a
#   machine that reaches no package registry (this workplace's GPU machines), put src/ and zerodp's
#   missing dependencies on PYTHONPATH and pass the image's python3 (docs/gpu.md, "Running the check").
#
# It ran on one H200 on 2026-12-04 (docs/gpu_check.json); the 2-GPU parts have not run (docs/gpu.md).

set -u
cd "$(dirname "$0")/.."

DRY=0
BUDGET_S=560
OUT_DIR="${OUT:-./gpu_check_out}"
PY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) shift; OUT_DIR="${1:?--out needs a directory}" ;;
        --out=*) OUT_DIR="${1#--out=}" ;;
        --budget-s) shift; BUDGET_S="${1:?--budget-s needs a number of seconds}" ;;
        --budget-s=*) BUDGET_S="${1#--budget-s=}" ;;
        --python) shift; PY="${1:?--python needs an interpreter}" ;;
        --python=*) PY="${1#--python=}" ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1'; allowed: --dry-run, --out DIR, --budget-s SECONDS, --python PYTHON" >&2
           exit 2 ;;
    esac
    shift
done
case "$BUDGET_S" in
    ''|*[!0-9]*) echo "gpu_check: --budget-s must be a whole number of seconds, got '$BUDGET_S'" >&2; exit 2 ;;
esac

mkdir -p "$OUT_DIR/parts" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR"/parts/*.json
START=$(date +%s)
HOST_PY="$(command -v python3 || command -v python)"

# record NAME STATUS RC SECONDS NOTE: one part's outcome, $OUT/parts/NAME.json (read by the report)
record() {
    "$HOST_PY" - "$OUT_DIR/parts/$1.json" "$1" "$2" "$3" "$4" "$5" <<'EOF'
import json, sys
path, name, status, rc, seconds, note = sys.argv[1:]
json.dump({"name": name, "status": status, "rc": int(rc), "seconds": float(seconds), "note": note,
           "log": f"{name}.log"}, open(path, "w"))
EOF
}

# part NAME BOX_S COMMAND...: run COMMAND (bash -c) within min(BOX_S, what is left of the budget),
# logging to $OUT/NAME.log; pass when it exits 0. Never stops the script.
part() {
    local name="$1" box="$2"; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    if [ "$DRY" = 1 ]; then
        echo "[dry] $name (time box ${box}s): $*" | tee "$OUT_DIR/$name.log"
        record "$name" dry 0 0 "dry run: not run (time box ${box}s)"
        return 0
    fi
    if [ "$left" -lt 10 ]; then
        echo "== $name: skipped, the ${BUDGET_S}s budget is spent" | tee "$OUT_DIR/$name.log"
        record "$name" budget_spent 0 0 "the ${BUDGET_S}s budget was spent before this part"
        return 0
    fi
    [ "$box" -gt "$left" ] && box=$left
    echo "== $name (time box ${box}s)"
    local t0=$(date +%s) rc
    timeout --kill-after=10 "$box" bash -c "$*" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then
        record "$name" pass 0 "$dt" ""
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "$name" timeout "$rc" "$dt" "stopped by its ${box}s time box"
    else
        record "$name" fail "$rc" "$dt" "$(tail -n 3 "$OUT_DIR/$name.log" | tr '\n' ' ' | cut -c1-300)"
    fi
    echo "   -> rc $rc in ${dt}s (log: $OUT_DIR/$name.log)"
    tail -n 5 "$OUT_DIR/$name.log" | sed 's/^/   | /'
    return 0
}

# ---- install ---------------------------------------------------------------------------------------
if [ -z "$PY" ]; then
    PY="$PWD/.venv-gpu/bin/python"
    # PyPI's Linux torch wheels are CUDA builds; the dev extra pins the tested torch version
    part install 120 "
        set -e
        [ -x '$PY' ] || '$HOST_PY' -m venv .venv-gpu
        '$PY' -m pip install -q --upgrade pip
        '$PY' -m pip install -q torch
        '$PY' -m pip install -q -e '.[dev]'
        '$PY' -c 'import torch; assert torch.cuda.is_available(), \"installed torch \" + torch.__version__ + \" sees no CUDA device\"'
    "
else
    part install 15 "'$PY' -c 'import torch, zerodp; assert torch.cuda.is_available(), \"no CUDA device\"'"
fi

# ---- versions --------------------------------------------------------------------------------------
part versions 15 "
    set -e
    nvidia-smi
    '$PY' - <<'PYEOF'
import json, torch
import torch.distributed as dist
info = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(),
        'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None}
print(json.dumps(info))
open('$OUT_DIR/versions.json', 'w').write(json.dumps(info))
PYEOF
"
GPUS=0
if [ "$DRY" = 0 ]; then
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi

# ---- tests -----------------------------------------------------------------------------------------
# the tests that follow ZERODP_TEST_DEVICE (tests/devices.py) and compare with plain PyTorch on it; every
# tests/test_*.py that calls skip_beyond_devices or too_many_ranks is here (tests/test_gpu_check.py)
DEVICE_TESTS="tests/test_stages.py::test_matches_reference tests/test_stages.py::test_bf16_matches_mixed_precision_reference \
tests/test_stages.py::test_fp16_overflow_on_one_rank_skips_on_all tests/test_grad_accumulation.py tests/test_clip_grad.py \
tests/test_deprecations.py tests/test_offload.py::test_offload_equals_non_offloaded \
tests/test_checkpoint.py::test_exact_resume_on_the_test_device \
tests/test_delayed_update.py::test_delayed_update_follows_stale_reference"
part cuda_marked_tests 45 "'$PY' -m pytest -q -m cuda tests --junitxml='$OUT_DIR/cuda_marked.xml'"
# device_part N BOX: the device-following tests at world size N only (the others skip, naming why)
device_part() {
    part "device_tests_ws$1" "$2" "ZERODP_TEST_DEVICE=cuda ZERODP_TEST_WORLD_SIZES=$1 '$PY' -m pytest -q $DEVICE_TESTS \
        --junitxml='$OUT_DIR/device_ws$1.xml'"
}
# two_gpus NAME: true where a 2-rank part can run (2+ GPUs, or a dry run); else NAME is recorded skipped
two_gpus() {
    if [ "$DRY" = 1 ] || [ "$GPUS" -ge 2 ]; then
        return 0
    fi
    echo "== $1: skipped, $GPUS GPU(s) (2 needed)" | tee "$OUT_DIR/$1.log"
    record "$1" skipped 0 0 "$GPUS GPU(s); 2 ranks need 2 GPUs"
    return 1
}
device_part 1 85
two_gpus device_tests_ws2 && device_part 2 60

# ---- training against plain PyTorch ------------------------------------------------------------------
part train_compare 30 "'$PY' tools/gpu_train_compare.py --device cuda --steps 50 --out '$OUT_DIR/train_compare.json'"

# ---- bench -----------------------------------------------------------------------------------------
# zerodp bench --device cuda at N ranks (cuda:LOCAL_RANK each, NCCL); its JSON lands in $OUT/bench_wsN/;
# pass: the bench exits 0 and gpu_bench_check.py finds the required rows ran with peak GPU memory
bench_part() {
    local n="$1"
    part "bench_ws$n" "$2" "
        set -e
        '$PY' -m zerodp.app.cli bench --device cuda --nproc $n --preset tiny --steps 3 --warmup 1 \
            --rounds 1 --probe-steps 2 --no-fresh-rss --no-plots --out '$OUT_DIR/bench_ws$n'
        '$PY' tools/gpu_bench_check.py '$OUT_DIR/bench_ws$n/bench.json'
    "
}
bench_part 1 40
two_gpus bench_ws2 && bench_part 2 45

# ---- ZeRO-Offload headline ---------------------------------------------------------------------------
# one GPU capped to 8 GiB (lowered by the tool when its 90 s do not allow that model; the JSON says why):
# offload_optimizer cpu, then offload_param + offload_optimizer nvme (swap files under $OUT), then the
# cpu mode's model without offload, which must run out of memory; figures in $OUT/offload_headline.json
part offload_headline 95 "'$PY' tools/gpu_offload_headline.py --device cuda --budget-gib 8 --time-s 90 \
    --out '$OUT_DIR/offload_headline.json'"

# ---- the user-facing commands ------------------------------------------------------------------------
# zerodp train (defaults: one rank per GPU; stage 3 bf16 with a checkpoint saved and resumed) and the
# examples, each time-boxed by tools/gpu_cli_check.sh; its logs and summary.tsv in $OUT/cli/
part cli_commands 215 "bash tools/gpu_cli_check.sh --python '$PY' --out '$OUT_DIR/cli'"

# ---- report ----------------------------------------------------------------------------------------
"$HOST_PY" tools/gpu_check_report.py "$OUT_DIR" --dry-run="$DRY" --budget-s="$BUDGET_S" \
    --seconds="$(( $(date +%s) - START ))"
