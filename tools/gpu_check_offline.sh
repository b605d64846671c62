#!/usr/bin/env bash
# tools/gpu_check_offline.sh: tools/gpu_check.sh on a GPU machine that reaches no package registry and
# returns at most a few files (this workplace's lent GPU machines: docs/gpu.md, "Running the check").
#
#   tools/gpu_check_offline.sh [--budget-s SECONDS] [--wheels DIR] [--python PYTHON]
#
# Installs the wheels in DIR (default .whl: zerodp's dependencies the machine's image lacks, pydantic and
# its own; fetched beforehand with `pip download`) into a scratch site directory, puts it and src/ on
# PYTHONPATH, runs tools/gpu_check.sh --python PYTHON (default python3, the image's torch) with its
# output in ./gpu_check_out, and packs that folder into $OUT/gpu_check_logs.tgz beside a copy of
# $OUT/gpu_check.json ($OUT unset: ./gpu_check_out only). Exit status: gpu_check.sh's.
set -u
cd "$(dirname "$0")/.."
BUDGET_S=560
WHEELS=.whl
PY=python3
while [ $# -gt 0 ]; do
    case "$1" in
        --budget-s) shift; BUDGET_S="${1:?--budget-s needs a number of seconds}" ;;
        --wheels) shift; WHEELS="${1:?--wheels needs a directory}" ;;
        --python) shift; PY="${1:?--python needs an interpreter}" ;;
        *) echo "gpu_check_offline: unknown argument '$1'; allowed: --budget-s SECONDS, --wheels DIR, --python PYTHON" >&2
           exit 2 ;;
    esac
    shift
done
SITE="${TMPDIR:-/tmp}/zerodp-gpu-site"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || { echo "gpu_check_offline: installing the wheels in $WHEELS failed" >&2; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
df -hT "$PWD" "${TMPDIR:-/tmp}" 2>/dev/null
rm -rf gpu_check_out
bash tools/gpu_check.sh --python "$PY" --out gpu_check_out --budget-s "$BUDGET_S"
rc=$?
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_check_logs.tgz" gpu_check_out && cp gpu_check_out/gpu_check.json "$OUT/" 2>/dev/null
fi
exit $rc
