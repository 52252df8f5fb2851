#!/usr/bin/env bash
# Builds gpu-bundle-eth/ (git-ignored): the Ethernet transport with GPU memory on the GPU
# machine (issue 25 item 1): the library's `cuda` GPU tests (Ethernet with GPU memory, small
# GPU writes landing in order before the signal) and mscclpp-perf for the Ethernet proxy load
# rows. Built on branch `eth-gather` (gathered staging) with PERF_BEFORE pointing at a main
# build's mscclpp-perf, one call compares the two. PERF_BEFORE=PATH adds a second mscclpp-perf (e.g. one built before a change) whose
# rows run in the same call, for a same-machine comparison.
#
#   scripts/gpu-bundle-eth.sh
#   device run: carry ["gpu-bundle-eth"], command "bash gpu-bundle-eth/run.sh" (OUT, RUN_BUDGET)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-binary.sh
out=gpu-bundle-eth
rm -rf "$out"
mkdir -p "$out/bin"
test_binary mscclpp cuda "$out/bin/cuda"
cargo build --release -p mscclpp-perf
cp target/release/mscclpp-perf "$out/bin/"
if [ -n "${PERF_BEFORE:-}" ]; then cp "$PERF_BEFORE" "$out/bin/mscclpp-perf-before"; fi
# Compressed: the device tool carries at most 64 MiB with the whole working tree.
tar cJf "$out/bin.tar.xz" -C "$out" bin && rm -rf "$out/bin"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# The Ethernet GPU tests, then the Ethernet proxy load rows (this build, then the one before if
# bundled). Logs under $OUT.
cd "$(dirname "$0")"
tar xJf bin.tar.xz
L=${OUT:-/tmp/out-eth}; mkdir -p "$L"
budget=${RUN_BUDGET:-300}
for t in ethernet_with_gpu_memory ethernet_small_gpu_writes_land_in_order_before_the_signal \
         ethernet_small_gpu_writes_with_nothing_after_them_land host_to_device_semaphore_over_ipc_and_ethernet; do
  timeout 120 ./bin/cuda --ignored --exact --test-threads=1 "$t" > "$L/$t.log" 2>&1
  echo "test $t: rc=$? $(grep -E '^test result' "$L/$t.log")"
  grep -E "panicked|assert|Error" "$L/$t.log" | head -5
done
for b in mscclpp-perf mscclpp-perf-before; do
  [ -x "bin/$b" ] || continue
  left=$((budget - SECONDS - 5)); [ "$left" -gt 20 ] || { echo "$b: SKIPPED (budget)"; continue; }
  echo "== $b device --parts load-eth (up to ${left}s)"
  timeout "$left" "./bin/$b" device --timeout 20 --parts load-eth 2>&1 | tee "$L/$b-load-eth.txt" | grep -v "^ *$"
done
RUN
chmod +x "$out/run.sh"
du -sh "$out"
