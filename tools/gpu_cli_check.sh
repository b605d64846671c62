#!/usr/bin/env bash
# tools/gpu_cli_check.sh: the user-facing commands on a GPU machine, each time-boxed (the part
# cli_commands of tools/gpu_check.sh, which checks the engine): `zerodp train` with its defaults (one
# rank per GPU), at stage 3 in bf16 with a checkpoint saved and resumed, and the examples (the
# README's own model, NVMe offload, the DeepSpeed drop-in script, an HF model).
#
#   tools/gpu_cli_check.sh [--python PYTHON] [--out DIR]     # zerodp importable by PYTHON
#
# Logs go to DIR (default ${OUT:-./gpu_cli_out})/NAME.log, and DIR/summary.tsv has one line per command:
# name, exit status, seconds, the log's last line. Exit status 0 when every command exited 0.
set -u
cd "$(dirname "$0")/.."
PY=python3
DIR="${OUT:-./gpu_cli_out}"
while [ $# -gt 0 ]; do
    case "$1" in
        --python) shift; PY="${1:?--python needs an interpreter}" ;;
        --out) shift; DIR="${1:?--out needs a directory}" ;;
        *) echo "gpu_cli_check: unknown argument '$1'; allowed: --python PYTHON, --out DIR" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$DIR" || exit 2
: > "$DIR/summary.tsv"
SCRATCH="$(mktemp -d)"
mkdir -p "$SCRATCH/nvme"
trap 'rm -rf "$SCRATCH"' EXIT
FAILED=0
step() {  # step NAME BOX COMMAND...
    local name="$1" box="$2"; shift 2
    local t0=$SECONDS
    timeout --kill-after=5 "$box" "$@" > "$DIR/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && FAILED=1
    local last
    last="$(grep -v '^[-=]*$' "$DIR/$name.log" | tail -n 1 | tr '\t' ' ' | cut -c1-200)"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$last" >> "$DIR/summary.tsv"
    printf '%-14s rc %-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$last"
}
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
step train_default 40 "$PY" -m zerodp.app.cli train --steps 50
step ckpt_save 40 "$PY" -m zerodp.app.cli train --steps 40 --stage 3 --bf16 --save-every 20 --save-dir "$SCRATCH/ck"
step ckpt_resume 30 "$PY" -m zerodp.app.cli train --steps 60 --stage 3 --bf16 --resume --save-dir "$SCRATCH/ck"
step example_own 20 "${RUN[@]}" examples/train_own_model.py --stage 3 --steps 30
step example_nvme 25 "${RUN[@]}" examples/offload_nvme.py --nvme-path "$SCRATCH/nvme" --steps 10
step example_ds 20 "${RUN[@]}" examples/deepspeed/train.py --epochs 1 --save-dir "$SCRATCH/ds"
step example_hf 25 "${RUN[@]}" examples/hf_model.py --steps 11
exit $FAILED
