#!/usr/bin/env bash
# tools/gpu_cli_check.sh: the user-facing commands on a GPU machine, each time-boxed, after
# tools/gpu_check.sh (which checks the engine): `zerodp train` with its defaults (one rank per GPU),
# at stage 3 in bf16, a checkpoint saved and resumed, and the README's own-model example.
#
#   tools/gpu_cli_check.sh [--python PYTHON]      # zerodp importable (tools/gpu_check_offline.sh's PYTHONPATH)
#
# Logs go to ${OUT:-./gpu_cli_out}/NAME.log; one line per command: name, exit status, seconds and the
# log's last line. Exit status 0 when every command exited 0.
set -u
cd "$(dirname "$0")/.."
PY=python3
[ "${1:-}" = "--python" ] && PY="${2:?--python needs an interpreter}"
DIR="${OUT:-./gpu_cli_out}"
mkdir -p "$DIR"
CK="$(mktemp -d)"
FAILED=0
step() {  # step NAME BOX COMMAND...
    local name="$1" box="$2"; shift 2
    local t0=$SECONDS
    timeout --kill-after=5 "$box" "$@" > "$DIR/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && FAILED=1
    printf '%-14s rc %-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$DIR/$name.log" | cut -c1-150)"
}
step train_default 40 "$PY" -m zerodp.app.cli train --steps 100
step train_s3_bf16 40 "$PY" -m zerodp.app.cli train --steps 100 --stage 3 --bf16
step ckpt_save 30 "$PY" -m zerodp.app.cli train --steps 40 --stage 3 --save-every 20 --save-dir "$CK"
step ckpt_resume 30 "$PY" -m zerodp.app.cli train --steps 60 --stage 3 --resume --save-dir "$CK"
step example_own 30 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_own_model.py --stage 3
rm -rf "$CK"
exit $FAILED
