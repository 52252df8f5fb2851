#!/usr/bin/env bash
# Builds what the GPU machine needs to check libmscclpp_nccl.so into the git-ignored folder
# gpu-bundle-nccl/: the release libmscclpp_nccl.so, the Python tests (torchrun script and the
# PyNCCL pytest) and the ignored Rust GPU tests of mscclpp-nccl. Then, on the GPU machine, from
# the repository root: bash scripts/gpu-nccl.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle-nccl
rm -rf "$out" && mkdir -p "$out"
cargo build --release -p mscclpp-nccl
cp target/release/libmscclpp_nccl.so "$out/"
cp crates/mscclpp-nccl/tests/python/*.py "$out/"
ls -la "$out"
