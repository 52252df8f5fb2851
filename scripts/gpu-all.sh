#!/usr/bin/env bash
# Builds every GPU bundle (collectives + device suites, executor, NCCL library) and writes
# gpu-bundle-coll/all.sh, which runs them in one device call within RUN_BUDGET seconds (default
# 560): the collectives bundle's run.sh, the executor's, the NCCL library's, and the 1 KiB
# breakdown (bench/allpair_real.cu, compiled by nvcc there).
# Device call: carry ["gpu-bundle-coll", "gpu-bundle-exec", "gpu-bundle-nccl", "nccl-ignored"],
# command "bash gpu-bundle-coll/all.sh". MATURIN=path adds the Python wheel and its GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-bundle-collectives.sh
bash scripts/gpu-bundle-exec.sh
bash scripts/gpu-bundle-nccl.sh
mkdir -p gpu-bundle-coll/bench
cp crates/mscclpp-collectives/bench/*.cu crates/mscclpp-collectives/bench/*.cuh gpu-bundle-coll/bench/
cargo run -q -p mscclpp-collectives --example kernel_source > gpu-bundle-coll/bench/collectives_generated.cu
rm -rf gpu-bundle-coll/bench/include && cp -r crates/mscclpp/include gpu-bundle-coll/bench/include
cat > gpu-bundle-coll/all.sh <<'RUN'
#!/usr/bin/env bash
cd "$(dirname "$0")/.."
budget=${RUN_BUDGET:-560}
L=${OUT:-/tmp/out}; mkdir -p "$L"
C=gpu-bundle-coll/bench
echo "== 1 KiB breakdown"
nvcc -O3 -arch=sm_90 -I $C/include -include $C/collectives_generated.cu -o /tmp/ar $C/allpair_real.cu && timeout 30 /tmp/ar 1024
echo "== collectives and device suites"
OUT=$L/coll RUN_BUDGET=$((budget * 45 / 100)) bash gpu-bundle-coll/run.sh 2>&1 | tail -45
left=$((budget - SECONDS - 10))
echo "== executor"
OUT=$L/exec RUN_BUDGET=$((left / 2)) bash gpu-bundle-exec/run.sh 2>&1 | tail -30
left=$((budget - SECONDS - 5))
echo "== NCCL library"
OUT=$L/nccl RUN_BUDGET=$left TORCHRUN_RANKS="2 4" bash scripts/gpu-nccl.sh 2>&1 | tail -50
RUN
chmod +x gpu-bundle-coll/all.sh
du -sh gpu-bundle-coll gpu-bundle-exec gpu-bundle-nccl
