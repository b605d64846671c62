#!/usr/bin/env bash
# tools/fetch_gpu_wheels.sh [DIR]: download, on a machine that reaches PyPI, the wheels zerodp needs and
# this workplace's GPU image lacks (pydantic and its own dependencies, CPython 3.12, x86-64) into DIR
# (default .whl, which tools/gpu_check_offline.sh installs on the GPU machine; keep it out of git:
# `echo /.whl/ >> .git/info/exclude`). The versions are those the 2026-12-04 H200 runs used.
set -eu
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0
ls "$DIR"
