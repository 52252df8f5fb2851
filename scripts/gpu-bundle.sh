#!/usr/bin/env bash
# Builds the GPU test binaries and mscclpp-perf (release) into gpu-bundle/ (git-ignored) with a
# runner, so one `device` call runs every `#[ignore = "needs a CUDA GPU"]` test and a short perf
# sweep on the GPU machine:
#
#   scripts/gpu-bundle.sh            # here
#   device run: carry ["gpu-bundle"], command "bash gpu-bundle/run.sh"
#
# On the two-GPU machine (nvidia-h200-x2; issue 16), one call runs everything of the issue in
# about 8 minutes: command "bash gpu-bundle/run-x2.sh" (see run-x2.sh below).
# GPU_BUNDLE_OUT=DIR writes the bundle to DIR instead of gpu-bundle/ (e.g. a git-ignored
# gpu-bundle-<name>/ in the checkout the device tool sends).
#
# The runner writes logs under $OUT when it is set (the device tool brings them back).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${GPU_BUNDLE_OUT:-gpu-bundle}
rm -rf "$out"
mkdir -p "$out/bin"
cargo build --release -p mscclpp-perf
cargo test --release -p mscclpp --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
out = sys.argv[1]
want = {"cuda", "device", "device_header", "mscclpp", "ib_fake", "launchers", "memory_channel", "user_memory", "peer_death", "timeouts", "proxy_load"}   # GPU integration tests, kernels that communicate (and the header tests), library unit tests, IB on the test provider, the job torchrun-check.sh starts, MemoryChannel, user GPU memory, peer death, zero and unlimited waits
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        kind = m["target"]["kind"][0]
        dst = out + "/bin/" + ("unit-tests" if kind == "lib" else m["target"]["name"])
        shutil.copy(m["executable"], dst)
        print("bundled", dst)
' "$out"
cp target/release/mscclpp-perf "$out/bin/"
cargo build --release -p mscclpp --example memory_channel_put --example memory_channel_allgather
cp target/release/examples/memory_channel_put target/release/examples/memory_channel_allgather "$out/bin/"
cp scripts/nccl_sendrecv.py "$out/"
cp scripts/torchrun-check.sh "$out/"
cp scripts/x2_table.py "$out/"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU tests and a short perf sweep; logs go to $OUT (or ./logs). Exits non-zero when any
# step fails, after a "failures:" section naming each failing step and test.
set -u -o pipefail
cd "$(dirname "$0")"
logs=${OUT:-logs}
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L 2>&1 | tee "$logs/gpus.txt"
rc=0
failed=()
fail() { rc=1; failed+=("$1"); }
# suite NAME SECS PATTERN CMD...: runs a test binary (or example) under `timeout`, its whole
# output into tests.log; prints the lines matching PATTERN and, when it fails, libtest's
# "failures:" section (each failing test's output and panic message, then their names) or,
# without one (a crash, a timeout, an example), the last 40 lines; the step is then a failure.
suite() {
  local name=$1 secs=$2 pat=$3; shift 3
  local tmp code
  tmp=$(mktemp)
  echo "== $name" | tee -a "$logs/tests.log"
  timeout "$secs" "$@" 2>&1 | tee -a "$logs/tests.log" > "$tmp"
  code=${PIPESTATUS[0]}
  grep -E "$pat" "$tmp"
  if [ "$code" != 0 ]; then
    [ "$code" = 124 ] && code="$code: timed out after ${secs}s"
    fail "$name (exit $code)"
    echo "-- FAILED: $name (exit $code)"
    if grep -q '^failures:$' "$tmp"; then
      sed -n '/^failures:$/,$p' "$tmp"
    else
      tail -40 "$tmp"
    fi
  fi
  rm -f "$tmp"
}
tests="^test |RESULT|panicked|test result"
suite "unit tests" 300 "^test .*FAILED|test result" ./bin/unit-tests --test-threads=1
suite "GPU tests (--ignored)" 400 "$tests|differs" ./bin/cuda --ignored --test-threads=1 --nocapture
suite "kernels that communicate: FIFO, proxy, PortChannel (--ignored; NVRTC from the CUDA toolkit)" 300 "$tests" \
  ./bin/device --ignored --test-threads=1 --nocapture
suite "proxy under load: a million puts from 132 x 256 producers to 4 peers (--ignored)" 200 "$tests|TIMEOUT" \
  ./bin/proxy_load --ignored --test-threads=1 --nocapture
suite "MemoryChannel, device-to-device semaphores, LL packets (--ignored; two processes)" 300 "$tests|failed" \
  ./bin/memory_channel --ignored --test-threads=1 --nocapture
suite "example memory_channel_put" 60 . ./bin/memory_channel_put
suite "example memory_channel_allgather 4" 90 . ./bin/memory_channel_allgather 4
suite "IB on the in-process provider with GPU memory and GPU tokens (--ignored gpu_)" 200 \
  "^test |forwarding|registered|refused|panicked|test result" ./bin/ib_fake --ignored gpu_ --test-threads=1 --nocapture
suite "the user's own GPU memory: register_device, CudaSlice, cuMemCreate over a POSIX fd (--ignored)" 200 "$tests" \
  ./bin/user_memory --ignored --test-threads=1 --nocapture
suite "peer death: CUDA IPC sender learns its peer died (--ignored)" 200 "$tests" \
  ./bin/peer_death --ignored --test-threads=1 --nocapture
suite "zero and unlimited timeouts of the GPU waits (--ignored)" 60 "$tests" \
  ./bin/timeouts --ignored --test-threads=1 --nocapture
echo "== perf: device (FIFO, proxy, PortChannel; one process, two ranks)" | tee "$logs/perf.txt"
timeout 320 ./bin/mscclpp-perf device --max-bytes 1G 2>&1 | tee -a "$logs/perf.txt" || fail "perf: device (FIFO, proxy, PortChannel; one process, two ranks)"
echo "== perf: CUDA IPC" | tee -a "$logs/perf.txt"
timeout 120 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --min-bytes 8 --max-bytes 1G --quiet --json "$logs/perf-ipc.json" 2>&1 | tee -a "$logs/perf.txt" || fail "perf: CUDA IPC"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$ngpu" -ge 2 ]; then
  # Two GPUs: ranks 0 and 1 on GPUs 0 and 1 (the tests above already spread ranks over GPUs).
  echo "== perf: CUDA IPC, bidirectional" | tee -a "$logs/perf.txt"
  timeout 150 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --bidirectional --min-bytes 8 --max-bytes 1G --quiet --json "$logs/perf-ipc-bidir.json" 2>&1 | tee -a "$logs/perf.txt" || fail "perf: CUDA IPC, bidirectional"
  echo "== NCCL send/recv (torch.distributed), same two GPUs" | tee -a "$logs/perf.txt"
  NCCL_NVLS_ENABLE=0 timeout 200 torchrun --nproc_per_node=2 nccl_sendrecv.py --json "$logs/nccl.json" 2>&1 | grep -v Warning | tee -a "$logs/perf.txt" || fail "NCCL send/recv (torch.distributed), same two GPUs"
else
  echo "== perf: CUDA IPC, bidirectional, both ranks on the one GPU (the NCCL comparison needs two GPUs)" | tee -a "$logs/perf.txt"
  timeout 100 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --bidirectional --min-bytes 1M --max-bytes 256M --quiet 2>&1 | tee -a "$logs/perf.txt" || fail "perf: CUDA IPC, bidirectional, both ranks on the one GPU (the NCCL comparison needs two GPUs)"
fi
echo "== perf: Ethernet, GPU memory" | tee -a "$logs/perf.txt"
timeout 150 ./bin/mscclpp-perf --memory gpu --min-bytes 8 --max-bytes 256M --quiet --json "$logs/perf-eth-gpu.json" 2>&1 | tee -a "$logs/perf.txt" || fail "perf: Ethernet, GPU memory"
echo "== perf: Ethernet, host memory" | tee -a "$logs/perf.txt"
timeout 120 ./bin/mscclpp-perf --min-bytes 8 --max-bytes 256M --quiet 2>&1 | tee -a "$logs/perf.txt" || fail "perf: Ethernet, host memory"
echo "== a real torchrun starting mscclpp ranks (static, standalone, c10d; root on MASTER_PORT+1)" | tee -a "$logs/tests.log"
timeout 240 ./torchrun-check.sh 2>&1 | tee -a "$logs/tests.log" | grep -E "^(PASS|FAIL|torch)" ; [ "${PIPESTATUS[0]}" = 0 ] || fail "a real torchrun starting mscclpp ranks (static, standalone, c10d; root on MASTER_PORT+1)"
echo "== failures:"
if [ "${#failed[@]}" = 0 ]; then echo "none"; else printf '%s\n' "${failed[@]}"; fi
grep -E '^test .* FAILED$' "$logs/tests.log" || true
echo "run.sh: exit $rc (whole test log: tests.log under \$OUT)"
exit $rc
RUN
chmod +x "$out/run.sh"
cat > "$out/run-x2.sh" <<'RUNX2'
#!/usr/bin/env bash
# Issue 16 on two H200s joined by NVLink (device kind nvidia-h200-x2), in one call of at most
# about 8 minutes (a deadline cuts later steps short; nothing waits unbounded):
#   1. mscclpp-perf device --procs: two processes, GPU 0 and GPU 1, 1 KiB .. 1 GiB (semaphore and
#      raw flag ping-pong, MemoryChannel put/get uni/bidir next to the copy engine, LL16/LL8,
#      PortChannel ping-pong and bandwidth), JSON too;
#   2. NCCL send/recv through torchrun, 2 processes, the same sizes (1 KiB .. 1 GiB, x2);
#   3. mscclpp-perf device (one process, two ranks on GPU 0) for comparison;
#   4. the GPU tests, ranks spread over both GPUs (as run.sh), pass/fail.
# Logs under $OUT (or ./logs), at most 8 files (the device tool brings back 8): gpus.txt,
# perf.txt, device-procs.json, nccl.json, tests.log, summary.txt (step results, failing tests,
# and x2_table.py's table of ours / copy engine / NCCL per size with the issue's goals).
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0 (mscclpp never calls cuMulticastCreate).
# RUNX2_BUDGET=SECONDS changes the deadline (default 480).
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
budget=${RUNX2_BUDGET:-480}
sum="$logs/summary.txt"
: > "$sum"
# left CAP: seconds for the next step, at most CAP, never past the deadline (0: skip it).
left() { local l=$((budget - SECONDS - 5)); [ "$l" -lt "$1" ] || l=$1; [ "$l" -gt 0 ] || l=0; echo "$l"; }
# step NAME CAP LOG CMD...: runs CMD under `timeout`, appends its output to LOG, records the result.
perf="$logs/perf.txt"
step() {
  local name=$1 cap=$2 log=$3; shift 3
  local t; t=$(left "$cap")
  if [ "$t" -le 10 ]; then echo "SKIPPED (deadline) $name" | tee -a "$sum" "$log"; return; fi
  echo "== $name (timeout ${t}s, at ${SECONDS}s)" | tee -a "$log"
  local t0=$SECONDS
  local before; before=$( (cat "$log" 2>/dev/null || true) | wc -l)
  # Perf rows also go to stdout (the device tool returns its tail); test output only to the log.
  if [ "$log" = "$perf" ]; then
    timeout "$t" "$@" 2>&1 | grep --line-buffered -v Warning | tee -a "$log"
  else
    timeout "$t" "$@" >> "$log" 2>&1
  fi
  local rc=${PIPESTATUS[0]}
  local r=PASS; [ "$rc" = 0 ] || r="FAIL rc=$rc"; [ "$rc" = 124 ] && r="TIMEOUT after ${t}s"
  echo "$r $name ($((SECONDS - t0))s)" | tee -a "$sum"
  # A failing test binary: its "failures:" section (each failing test's output and message).
  [ "$rc" = 0 ] || tail -n +$((before + 1)) "$log" | sed -n '/^failures:$/,$p' >> "$sum"
}
{ nvidia-smi -L; nvidia-smi topo -m; } > "$logs/gpus.txt" 2>&1
cat "$logs/gpus.txt"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$ngpu" -ge 2 ] || echo "WARNING: $ngpu GPU(s): both processes share GPU 0 (slow; not issue 16's numbers)" | tee -a "$sum"
step "mscclpp-perf device --procs (GPU 0 <-> GPU 1, 1 KiB .. 1 GiB)" 170 "$perf" \
  ./bin/mscclpp-perf device --procs --device 0 --max-bytes 1G --json "$logs/device-procs.json" --timeout 30
step "NCCL send/recv, torchrun 2 processes (1 KiB .. 1 GiB)" 150 "$perf" \
  torchrun --nproc_per_node=2 nccl_sendrecv.py --min-bytes 1K --max-bytes 1G --json "$logs/nccl.json"
step "mscclpp-perf device, one process, two ranks on GPU 0" 110 "$perf" \
  ./bin/mscclpp-perf device --device 0 --max-bytes 1G --timeout 30
tests="$logs/tests.log"
step "GPU tests: cuda (--ignored)" 120 "$tests" ./bin/cuda --ignored --test-threads=1 --nocapture
step "GPU tests: device (--ignored)" 90 "$tests" ./bin/device --ignored --test-threads=1 --nocapture
step "GPU tests: memory_channel (--ignored)" 90 "$tests" ./bin/memory_channel --ignored --test-threads=1 --nocapture
step "example memory_channel_put" 30 "$tests" ./bin/memory_channel_put
step "example memory_channel_allgather 4" 40 "$tests" ./bin/memory_channel_allgather 4
step "GPU tests: user_memory (--ignored)" 60 "$tests" ./bin/user_memory --ignored --test-threads=1 --nocapture
step "GPU tests: peer_death (--ignored)" 60 "$tests" ./bin/peer_death --ignored --test-threads=1 --nocapture
step "GPU tests: timeouts (--ignored)" 60 "$tests" ./bin/timeouts --ignored --test-threads=1 --nocapture
step "GPU tests: ib_fake gpu_ (--ignored)" 60 "$tests" ./bin/ib_fake --ignored gpu_ --test-threads=1 --nocapture
step "GPU tests: device_header (--ignored)" 60 "$tests" ./bin/device_header --ignored --test-threads=1 --nocapture
step "unit tests (with the ignored GPU ones)" 90 "$tests" ./bin/unit-tests --include-ignored --test-threads=1
grep -hE "^(test |test result)|panicked" "$tests" | grep -vE " ok$" | head -40 >> "$sum"
# Issue 16's table: ours, the copy engine and NCCL per size, and the goals.
python3 x2_table.py "$logs/device-procs.json" "$logs/nccl.json" >> "$sum" 2>&1
echo "== summary (${SECONDS}s)"
cat "$sum"
! grep -qE "^(FAIL|TIMEOUT|SKIPPED)" "$sum"
RUNX2
chmod +x "$out/run-x2.sh"
du -sh "$out"
