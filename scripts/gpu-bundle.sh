#!/usr/bin/env bash
# Builds the GPU test binaries and mscclpp-perf (release) into gpu-bundle/ (git-ignored) with a
# runner, so one `device` call runs every `#[ignore = "needs a CUDA GPU"]` test and a short perf
# sweep on the GPU machine:
#
#   scripts/gpu-bundle.sh            # here
#   device run: carry ["gpu-bundle"], command "bash gpu-bundle/run.sh"
#
# The runner writes logs under $OUT when it is set (the device tool brings them back).
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle
rm -rf "$out"
mkdir -p "$out/bin"
cargo build --release -p mscclpp-perf
cargo test --release -p mscclpp --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
want = {"cuda", "device", "mscclpp", "ib_fake", "memory_channel", "launchers"}   # GPU integration tests, kernels that communicate, library unit tests, IB on the test provider, the job torchrun-check.sh starts
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        kind = m["target"]["kind"][0]
        dst = "gpu-bundle/bin/" + ("unit-tests" if kind == "lib" else m["target"]["name"])
        shutil.copy(m["executable"], dst)
        print("bundled", dst)
'
cp target/release/mscclpp-perf "$out/bin/"
cargo build --release -p mscclpp --example memory_channel_put --example memory_channel_allgather
cp target/release/examples/memory_channel_put target/release/examples/memory_channel_allgather "$out/bin/"
cp scripts/nccl_sendrecv.py "$out/"
cp scripts/torchrun-check.sh "$out/"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU tests and a short perf sweep; logs go to $OUT (or ./logs).
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L 2>&1 | tee "$logs/gpus.txt"
rc=0
echo "== unit tests" | tee -a "$logs/tests.log"
./bin/unit-tests --test-threads=1 2>&1 | tail -3 | tee -a "$logs/tests.log" || rc=1
echo "== GPU tests (--ignored)" | tee -a "$logs/tests.log"
timeout 400 ./bin/cuda --ignored --test-threads=1 --nocapture 2>&1 | tee -a "$logs/tests.log" | grep -E "^test |RESULT|panicked|test result|differs" ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== kernels that communicate: FIFO, proxy, PortChannel (--ignored; NVRTC from the CUDA toolkit)" | tee -a "$logs/tests.log"
timeout 300 ./bin/device --ignored --test-threads=1 --nocapture 2>&1 | tee -a "$logs/tests.log" | grep -E "^test |RESULT|panicked|test result" ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== MemoryChannel, device-to-device semaphores, LL packets (--ignored; two processes) and the examples" | tee -a "$logs/tests.log"
timeout 300 ./bin/memory_channel --ignored --test-threads=1 --nocapture 2>&1 | tee -a "$logs/tests.log" | grep -E "^test |RESULT|panicked|test result|failed" ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout 60 ./bin/memory_channel_put 2>&1 | tee -a "$logs/tests.log" || rc=1
timeout 90 ./bin/memory_channel_allgather 4 2>&1 | tee -a "$logs/tests.log" || rc=1
echo "== IB on the in-process provider with GPU memory and GPU tokens (--ignored gpu_)" | tee -a "$logs/tests.log"
timeout 200 ./bin/ib_fake --ignored gpu_ --test-threads=1 --nocapture 2>&1 | tee -a "$logs/tests.log" | grep -E "^test |forwarding|registered|refused|panicked|test result" ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== perf: device (FIFO, proxy, PortChannel; one process, two ranks)" | tee "$logs/perf.txt"
timeout 200 ./bin/mscclpp-perf device --max-bytes 1G 2>&1 | tee -a "$logs/perf.txt" || rc=1
echo "== perf: CUDA IPC" | tee -a "$logs/perf.txt"
timeout 120 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --min-bytes 8 --max-bytes 1G --quiet --json "$logs/perf-ipc.json" 2>&1 | tee -a "$logs/perf.txt" || rc=1
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$ngpu" -ge 2 ]; then
  # Two GPUs: ranks 0 and 1 on GPUs 0 and 1 (the tests above already spread ranks over GPUs).
  echo "== perf: CUDA IPC, bidirectional" | tee -a "$logs/perf.txt"
  timeout 150 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --bidirectional --min-bytes 8 --max-bytes 1G --quiet --json "$logs/perf-ipc-bidir.json" 2>&1 | tee -a "$logs/perf.txt" || rc=1
  echo "== NCCL send/recv (torch.distributed), same two GPUs" | tee -a "$logs/perf.txt"
  NCCL_NVLS_ENABLE=0 timeout 200 torchrun --nproc_per_node=2 nccl_sendrecv.py --json "$logs/nccl.json" 2>&1 | grep -v Warning | tee -a "$logs/perf.txt" || rc=1
else
  echo "== perf: CUDA IPC, bidirectional, both ranks on the one GPU (the NCCL comparison needs two GPUs)" | tee -a "$logs/perf.txt"
  timeout 100 ./bin/mscclpp-perf --transport cuda-ipc --memory gpu --bidirectional --min-bytes 1M --max-bytes 256M --quiet 2>&1 | tee -a "$logs/perf.txt" || rc=1
fi
echo "== perf: Ethernet, GPU memory" | tee -a "$logs/perf.txt"
timeout 150 ./bin/mscclpp-perf --memory gpu --min-bytes 8 --max-bytes 256M --quiet --json "$logs/perf-eth-gpu.json" 2>&1 | tee -a "$logs/perf.txt" || rc=1
echo "== perf: Ethernet, host memory" | tee -a "$logs/perf.txt"
timeout 120 ./bin/mscclpp-perf --min-bytes 8 --max-bytes 256M --quiet 2>&1 | tee -a "$logs/perf.txt" || rc=1
echo "== a real torchrun starting mscclpp ranks (static, standalone, c10d; root on MASTER_PORT+1)" | tee -a "$logs/tests.log"
timeout 240 ./torchrun-check.sh 2>&1 | tee -a "$logs/tests.log" | grep -E "^(PASS|FAIL|torch)" ; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "run.sh: exit $rc"
exit $rc
RUN
chmod +x "$out/run.sh"
du -sh "$out"
