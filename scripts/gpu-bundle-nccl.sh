#!/usr/bin/env bash
# Builds what the GPU machine needs to check libmscclpp_nccl.so into the git-ignored folder
# gpu-bundle-nccl/: the release libmscclpp_nccl.so, the Python tests (torchrun script and the
# PyNCCL pytest), and in bin.tar.xz the release GPU test binary of the device point-to-point path
# (mscclpp-collectives' gpu_p2p) and the overhead driver (mscclpp-nccl's nccl_overhead example).
# Then, on the GPU machine, from the repository root: bash scripts/gpu-nccl.sh
# (device call: carry ["gpu-bundle-nccl"], command "bash scripts/gpu-nccl.sh").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-binary.sh
out=gpu-bundle-nccl
rm -rf "$out" && mkdir -p "$out/bin"
cargo build --release -p mscclpp-nccl --lib --example nccl_overhead
cp target/release/libmscclpp_nccl.so "$out/"
cp target/release/examples/nccl_overhead "$out/bin/"
test_binary mscclpp-collectives gpu_p2p "$out/bin/gpu_p2p"
(cd "$out" && tar cJf bin.tar.xz bin && rm -rf bin)
cp crates/mscclpp-nccl/tests/python/*.py "$out/"
# A real NCCL for the fallback step, when one was made (python3 ../shared/tools/nccl-sm90.py ...
# nccl-ignored/libnccl.so.2.xz; see that tool's header).
if [ -f nccl-ignored/libnccl.so.2.xz ]; then
  mkdir -p "$out/nccl" && cp nccl-ignored/libnccl.so.2.xz "$out/nccl/"
else
  echo "no nccl-ignored/libnccl.so.2.xz: the GPU run skips the NCCL fallback step" >&2
fi
ls -la "$out"
du -sh "$out"
