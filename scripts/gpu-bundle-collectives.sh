#!/usr/bin/env bash
# Builds what one GPU-machine call needs to check the collectives and the device side after a
# change, into the git-ignored folder gpu-bundle-coll/ (add `/gpu-bundle-coll/` and
# `/nccl-ignored/` to .git/info/exclude):
#   - release test binaries: mscclpp-collectives (gpu, gpu_procs, gpu_hier), mscclpp (unit tests,
#     device, memory_channel, timeouts, cuda), packed in bin.tar.xz;
#   - mscclpp-perf; the mscclpp_rs wheel when maturin is found (MATURIN=path);
#   - run.sh: every step under one deadline (RUN_BUDGET seconds, default 560), most important
#     first, logs and JSON under $OUT.
# NCCL for the comparison columns: nccl-ignored/libnccl.so.2.xz made by shared/tools/nccl-sm90.py
# (carry it too, or gpu-bundle-nccl, which holds a copy: run.sh looks in both; before session 16
# it looked only in nccl-ignored/, so calls that carried the NCCL bundle ran without the NCCL
# column). Device call: carry ["gpu-bundle-coll", "nccl-ignored"], command
# "bash gpu-bundle-coll/run.sh".
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle-coll
rm -rf "$out" && mkdir -p "$out/bin"
pick() { # crate, then wanted target names
  local crate=$1; shift
  cargo test --release -p "$crate" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
out, want = sys.argv[1], set(sys.argv[2:])
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        name, kind = m["target"]["name"], m["target"]["kind"][0]
        name = "unit-tests" if kind == "lib" else name
        if name in want:
            shutil.copy(m["executable"], out + "/bin/" + name)
' "$out" "$@"
}
pick mscclpp-collectives gpu gpu_procs gpu_hier
pick mscclpp unit-tests device memory_channel timeouts cuda
cargo build --release -p mscclpp-perf
cp target/release/mscclpp-perf "$out/bin/"
(cd "$out" && tar cJf bin.tar.xz bin && rm -rf bin)
if command -v "${MATURIN:-maturin}" >/dev/null; then
  "${MATURIN:-maturin}" build --release -m crates/mscclpp-py/Cargo.toml -o "$out/wheel" >/dev/null
  cp crates/mscclpp-py/tests/test_collectives.py crates/mscclpp-py/tests/test_executor.py "$out/" 2>/dev/null || true
fi
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}; mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
tar xJf bin.tar.xz
budget=${RUN_BUDGET:-560}
sum="$logs/summary.txt"; : > "$sum"
left() { local l=$((budget - SECONDS - 5)); [ "$l" -lt "$1" ] || l=$1; [ "$l" -gt 0 ] || l=0; echo "$l"; }
# step NAME CAP LOG CMD...: one step under the deadline; prints the failing tests' names and messages.
# ONLY (an extended regex) keeps the steps whose names match it, e.g. ONLY='hier|^collectives '.
step() {
  local name=$1 cap=$2 log=$3; shift 3
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  local t; t=$(left "$cap")
  if [ "$t" -le 5 ]; then echo "SKIPPED (deadline) $name" | tee -a "$sum"; return; fi
  local t0=$SECONDS
  echo "== $name" >> "$log"
  timeout "$t" "$@" >> "$log" 2>&1
  local rc=$? r=PASS
  [ "$rc" = 0 ] || r="FAIL rc=$rc"; [ "$rc" = 124 ] && r="TIMEOUT after ${t}s"
  echo "$r $name ($((SECONDS - t0))s)" | tee -a "$sum"
}
nccl=""
# NCCL for the comparison columns: nccl-ignored/ (carried alone) or the NCCL bundle's copy.
for xz in ../nccl-ignored/libnccl.so.2.xz ../gpu-bundle-nccl/nccl/libnccl.so.2.xz; do
  [ -f "$xz" ] || continue
  python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$xz'), open('/tmp/libnccl.so.2','wb'))" && nccl="--nccl /tmp/libnccl.so.2"
  break
done
T="$logs/tests.log"; P="$logs/perf.txt"
step "unit tests, away from the source tree" 60 "$T" ./bin/unit-tests --test-threads=1
# The collectives' GPU tests, each in its own process (a fault in one must not poison the next).
for t in $(./bin/gpu --list --ignored 2>/dev/null | sed -n 's/: test$//p'); do
  step "collectives $t" 150 "$T" ./bin/gpu --ignored --exact --nocapture --test-threads=1 "$t"
done
# Programmatic dependent launches (MSCCLPP_COLLECTIVES_PDL=1, off by default): the tests that
# chain dependent calls, again with them on.
for t in back_to_back_calls_read_their_predecessors_results graph_replays_ten_thousand_times_with_changing_inputs \
         two_ranks_every_collective_type_op_and_size; do
  step "collectives $t PDL" 150 "$T" env MSCCLPP_COLLECTIVES_PDL=1 ./bin/gpu --ignored --exact --nocapture --test-threads=1 "$t"
done
for t in $(./bin/gpu_hier --list --ignored 2>/dev/null | sed -n 's/: test$//p'); do
  step "hier $t" 60 "$T" ./bin/gpu_hier --ignored --exact --nocapture --test-threads=1 "$t"
done
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started" >> "$T"
step "processes (MPS)" 60 "$T" ./bin/gpu_procs --ignored --test-threads=1 --nocapture
# The speed goal's harness: 2 processes under MPS, bf16, graph and eager, NCCL in the same run.
step "perf allreduce 2 processes (MPS) graph" 60 "$P" ./bin/mscclpp-perf allreduce --procs -b 1K -e 256M -d bf16 -n 50 --graph $nccl --timeout 30 --json "$logs/ar-procs-graph.json"
step "perf allreduce 2 processes (MPS) eager" 60 "$P" ./bin/mscclpp-perf allreduce --procs -b 1K -e 256M -d bf16 -n 50 --check $nccl --timeout 30 --json "$logs/ar-procs-eager.json"
step "perf allreduce 2 processes (MPS) graph PDL" 60 "$P" env MSCCLPP_COLLECTIVES_PDL=1 ./bin/mscclpp-perf allreduce --procs -b 1K -e 256M -d bf16 -n 50 --graph $nccl --timeout 30 --json "$logs/ar-procs-graph-pdl.json"
step "perf allreduce 2 processes (MPS) eager PDL" 60 "$P" env MSCCLPP_COLLECTIVES_PDL=1 ./bin/mscclpp-perf allreduce --procs -b 1K -e 256M -d bf16 -n 50 --check $nccl --timeout 30 --json "$logs/ar-procs-eager-pdl.json"
step "processes (MPS) PDL" 60 "$T" env MSCCLPP_COLLECTIVES_PDL=1 ./bin/gpu_procs --ignored --test-threads=1 --nocapture
# No NCCL column with 4 or 8 ranks on one GPU: NCCL 2.31 hangs there at 1 MiB (its kernels cannot
# be stopped, so the row ends at the step's cap with our sizes past 256 KiB untimed).
step "perf allreduce 4 processes (MPS) graph" 40 "$P" ./bin/mscclpp-perf allreduce --procs --ranks 4 -b 1K -e 64M -f 4 -d bf16 -n 20 --graph --timeout 30
echo quit | nvidia-cuda-mps-control 2>/dev/null
if [ -d wheel ]; then
  step "python" 90 "$T" bash -c 'python3 -m pip install -q --no-deps --target /tmp/pyc wheel/*.whl && PYTHONPATH=/tmp/pyc python3 -m pytest -q -x -p no:cacheprovider test_collectives.py test_executor.py'
fi
step "device (FIFO, proxy, PortChannel)" 120 "$T" ./bin/device --ignored --test-threads=1 --nocapture
step "memory_channel" 120 "$T" ./bin/memory_channel --ignored --test-threads=1 --nocapture
step "timeouts (GPU)" 40 "$T" ./bin/timeouts --ignored --test-threads=1 --nocapture
step "perf allreduce 2 ranks graph" 70 "$P" ./bin/mscclpp-perf allreduce -b 1K -e 256M -d bf16 -n 20 --graph $nccl --timeout 30 --json "$logs/ar-graph.json"
step "perf allreduce 2 ranks eager" 70 "$P" ./bin/mscclpp-perf allreduce -b 1K -e 256M -d bf16 -n 20 --check $nccl --timeout 30 --json "$logs/ar-eager.json"
step "perf allreduce 8 ranks graph" 40 "$P" ./bin/mscclpp-perf allreduce --ranks 8 -b 1K -e 64M -f 4 -d bf16 -n 20 --graph --timeout 30
step "perf allreduce 4 ranks graph" 40 "$P" ./bin/mscclpp-perf allreduce --ranks 4 -b 1K -e 64M -f 4 -d bf16 -n 20 --graph --timeout 30
step "perf allreduce zero-copy graph" 40 "$P" ./bin/mscclpp-perf allreduce --algo zerocopy -b 1M -e 256M -f 4 -d bf16 -n 20 --graph --timeout 30
step "perf allgather graph" 40 "$P" ./bin/mscclpp-perf allgather -b 1K -e 256M -f 4 -d bf16 -n 20 --graph $nccl --timeout 30
step "perf reducescatter graph" 40 "$P" ./bin/mscclpp-perf reducescatter -b 1K -e 256M -f 4 -d bf16 -n 20 --graph $nccl --timeout 30
step "cuda" 60 "$T" ./bin/cuda --ignored --test-threads=1 --nocapture
echo "== failing tests" >> "$sum"
grep -E "^---- |panicked at|^test .* FAILED" "$T" | head -40 >> "$sum"
cat "$sum"
RUN
chmod +x "$out/run.sh"
du -sh "$out"
