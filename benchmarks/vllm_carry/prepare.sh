#!/usr/bin/env bash
# The wheels that carry vllm 0.26.0 to the GPU machine, in chunks one device command can take.
# Run on the CPU machine (needs the package registry; never in CI):
#
#   bash benchmarks/vllm_carry/prepare.sh [OUT]     # OUT: default .vc/ (git-ignored)
#
# Downloads exactly the pinned wheels (wheels.txt: pip checks every hash) for Python 3.12 on
# manylinux x86_64, checks the set against the list, drops the vllm wheel's FlashAttention-2
# library and Rust front end, and writes OUT/part-NN (<= 60 MiB each) and OUT/lean.sha256.
# On the device (docs/benchmarks.md, "vLLM on the GPU machine"): one command per part, then
# `cat part-* > lean.tar && sha256sum -c lean.sha256`, unpack, pip install --no-deps --target.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../../.vc}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in $(seq 5 39); do platform+=(--platform "manylinux_2_${n}_x86_64"); done
platform+=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
platform+=(--platform linux_x86_64 --platform any)

rm -rf "$out/wheels"
python3 -m pip download -q --no-deps "${platform[@]}" -r "$here/wheels.txt" -d "$out/wheels"
python3 "$here/carry.py" verify "$out/wheels"
python3 "$here/carry.py" trim "$out"/wheels/vllm-0.26.0-*.whl
python3 "$here/carry.py" pack "$out/wheels" "$out"
