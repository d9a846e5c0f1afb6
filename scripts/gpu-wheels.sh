#!/bin/sh
# The wheels a GPU machine without network needs to run k3's GPU tests (pytest-xdist: run_h200.sh's processes)
# and benchmarks, into .whl/ (carry it;
# benchmarks/run_h200.sh installs them into /tmp/k3-site). Versions: the lock's, fla's from the gpu extra; the
# target is CPython 3.12 on x86-64 Linux (the H200 machines' Python). Packages such a machine already has
# (torch, triton, transformers, httpx, ...) are left out.
#   sh scripts/gpu-wheels.sh [DIR]
set -eu
dir=${1:-.whl}
lock=$(dirname "$0")/../requirements-lock.txt
pin() { v=$(grep -i "^$1==" "$lock" | cut -d= -f3); [ -n "$v" ] || { echo "$1 is not in $lock" >&2; exit 1; }; echo "$1==$v"; }
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
pkgs="flash-linear-attention==0.6.0 fla-core==0.6.0"
for p in fastapi starlette uvicorn uvloop httptools pydantic pydantic-core annotated-types typing-inspection llguidance openai \
         jiter sniffio httpx2 httpcore2 truststore anyio opentelemetry-api annotated-doc pytest-xdist execnet; do
    pkgs="$pkgs $(pin $p)"
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform any -d "$dir" $pkgs
ls "$dir"
