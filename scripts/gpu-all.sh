#!/usr/bin/env bash
# Builds every GPU bundle (collectives + device suites, executor, NCCL library) and writes
# gpu-bundle-coll/all.sh, which runs them in one device call within RUN_BUDGET seconds (default
# 560): the 1 KiB breakdown (bench/allpair_real.cu, compiled by nvcc there), the collectives
# bundle's run.sh, the executor's, the NCCL library's, Ethernet p2p rows; and, not in the
# default list, `mscclpp-perf device` (part "device"), issue 28's two-node runs (part "twonode")
# and the executor GPU tests in one process (part "exectests"), and the Ethernet bundle's run.sh
# (part "eth", when gpu-bundle-eth/ is carried too), and a compact A/B of programmatic
# dependent launches (part "pdl": carry gpu-bundle-coll and gpu-bundle-nccl). PARTS picks
# and orders them (e.g. PARTS=exec for a call of its own).
# At the end all.sh packs the parts' log folders under $OUT into $OUT/logs.tgz (the device tool
# returns only so many files; KEEP_LOGS=1 keeps them apart).
# Device call: carry ["gpu-bundle-coll", "gpu-bundle-exec", "gpu-bundle-nccl"] (the NCCL bundle
# holds nccl-ignored/libnccl.so.2.xz already; carrying both passes the 64 MiB limit),
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
# PARTS picks and orders the parts (default: "breakdown coll exec nccl p2p"; also pdl, eth,
# device, twonode, exectests); each part gets its share of RUN_BUDGET as it starts (exec and
# nccl: what is left, divided by the parts left).
cd "$(dirname "$0")/.."
budget=${RUN_BUDGET:-560}
L=${OUT:-/tmp/out}; mkdir -p "$L"
C=gpu-bundle-coll/bench
parts=(${PARTS:-breakdown coll exec nccl p2p})
n=${#parts[@]}
for i in "${!parts[@]}"; do
  part=${parts[$i]}
  left=$((budget - SECONDS - 5)); share=$((left / (n - i)))
  [ "$share" -gt 10 ] || { echo "== $part: SKIPPED (budget)"; continue; }
  echo "== $part (up to ${share}s)"
  case "$part" in
    breakdown)
      nvcc -O3 -arch=sm_90 -I $C/include -include $C/collectives_generated.cu -o /tmp/ar $C/allpair_real.cu && timeout 30 /tmp/ar 1024
      # The same with the rank count compiled in (kernels.cu `nranks_of`): does it pay?
      echo "-- with -DMSCCLPP_COLL_NRANKS=2"
      nvcc -O3 -arch=sm_90 -DMSCCLPP_COLL_NRANKS=2 -I $C/include -include $C/collectives_generated.cu -o /tmp/ar2 $C/allpair_real.cu && timeout 30 /tmp/ar2 1024 ;;
    coll)
      OUT=$L/coll RUN_BUDGET=$share bash gpu-bundle-coll/run.sh 2>&1 | tail -45 ;;
    pdl)
      # Programmatic dependent launches, compact A/B (an estimated 4 minutes), the deciding rows
      # first: 2 processes under MPS, graph up to 1 MiB with PDL off then on (NCCL beside); the
      # three tests that chain dependent calls with MSCCLPP_COLLECTIVES_PDL=1; eager with --check
      # off and on; graph off and on again; the process tests with it on; graph 2 MiB-256 MiB
      # with it on. Each step is capped by what is left of the part's share (`capped`).
      end=$((SECONDS + share))
      capped() {
        local c=$1 l=$((end - SECONDS)); shift
        [ "$l" -lt "$c" ] || l=$c
        if [ "$l" -le 5 ]; then echo "SKIPPED (budget): ${*: -1}"; return 124; fi
        timeout "$l" "$@"
      }
      (cd gpu-bundle-coll && tar xJf bin.tar.xz); B=gpu-bundle-coll/bin; mkdir -p "$L/pdl"
      nc=""; xz=gpu-bundle-nccl/nccl/libnccl.so.2.xz
      [ -f $xz ] && python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$xz'), open('/tmp/libnccl.so.2','wb'))" && nc="--nccl /tmp/libnccl.so.2"
      export NCCL_NVLS_ENABLE=0
      nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
      graph() { for pdl in 0 1; do
        echo "-- graph, MSCCLPP_COLLECTIVES_PDL=$pdl"
        capped 60 env MSCCLPP_COLLECTIVES_PDL=$pdl $B/mscclpp-perf allreduce --procs -b 1K -e 1M -d bf16 -n 50 --graph "$@" --timeout 30 2>&1 | grep -vE "^#  |^ *$" | tail -14
      done; }
      graph $nc
      for t in back_to_back_calls_read_their_predecessors_results graph_replays_ten_thousand_times_with_changing_inputs two_ranks_every_collective_type_op_and_size; do
        t0=$SECONDS; capped 150 env MSCCLPP_COLLECTIVES_PDL=1 $B/gpu --ignored --exact --nocapture --test-threads=1 $t > "$L/pdl/$t.log" 2>&1
        echo "rc=$? $t PDL ($((SECONDS - t0))s)"; grep -E "^test |panicked|SKIPPED" "$L/pdl/$t.log" | head -8
      done
      for pdl in 0 1; do
        echo "-- eager --check, MSCCLPP_COLLECTIVES_PDL=$pdl"
        capped 60 env MSCCLPP_COLLECTIVES_PDL=$pdl $B/mscclpp-perf allreduce --procs -b 1K -e 1M -d bf16 -n 50 --check --timeout 30 2>&1 | grep -vE "^#  |^ *$" | tail -13
      done
      graph
      t0=$SECONDS; capped 60 env MSCCLPP_COLLECTIVES_PDL=1 $B/gpu_procs --ignored --test-threads=1 --nocapture > "$L/pdl/procs.log" 2>&1
      echo "rc=$? processes (MPS) PDL ($((SECONDS - t0))s)"; grep -E "test result|panicked|SKIPPED" "$L/pdl/procs.log"
      echo "-- graph 2M-256M --check, MSCCLPP_COLLECTIVES_PDL=1"
      capped 60 env MSCCLPP_COLLECTIVES_PDL=1 $B/mscclpp-perf allreduce --procs -b 2M -e 256M -f 4 -d bf16 -n 20 --graph --check --timeout 30 2>&1 | grep -vE "^#  |^ *$" | tail -8
      echo quit | nvidia-cuda-mps-control 2>/dev/null ;;
    exec)
      OUT=$L/exec RUN_BUDGET=$share bash gpu-bundle-exec/run.sh 2>&1 | tail -80 ;;
    eth)
      # The Ethernet-with-GPU-memory tests and proxy-load rows (scripts/gpu-bundle-eth.sh builds
      # gpu-bundle-eth/, optionally with an earlier build's rows: PERF_BEFORE); carry it too.
      if [ -x gpu-bundle-eth/run.sh ]; then OUT=$L/eth RUN_BUDGET=$share bash gpu-bundle-eth/run.sh 2>&1 | tail -60
      else echo "eth: no gpu-bundle-eth/ (build it with scripts/gpu-bundle-eth.sh and carry it)"; fi ;;
    nccl)
      OUT=$L/nccl RUN_BUDGET=$share TORCHRUN_RANKS="${TORCHRUN_RANKS:-2 4}" bash scripts/gpu-nccl.sh 2>&1 | tail -50 ;;
    p2p)
      # Ethernet over loopback (host memory, no GPU): the 8-byte round trip and 64 MiB one way
      # against the same run's raw TCP baseline (issue 25, item 6).
      tar xJf gpu-bundle-exec/bin.tar.xz -C /tmp bin/mscclpp-perf 2>/dev/null
      for k in $(seq 14); do timeout 20 /tmp/bin/mscclpp-perf p2p -b 8 -e 8 | tail -1; done
      for k in $(seq 5); do timeout 30 /tmp/bin/mscclpp-perf p2p -b 64M -e 64M | tail -1; done ;;
    device)
      # mscclpp-perf device: FIFO, proxy throughput, PortChannel ping-pong and where a hop's
      # time goes (instrumented proxies, issue 25 item 2), bandwidth, the proxy under load.
      tar xJf gpu-bundle-exec/bin.tar.xz -C /tmp bin/mscclpp-perf 2>/dev/null
      t0=$SECONDS
      # DEVICE_PARTS (mscclpp-perf's --parts, e.g. "fifo,channels") picks parts; default all.
      timeout "$share" /tmp/bin/mscclpp-perf device --timeout 20 ${DEVICE_PARTS:+--parts "$DEVICE_PARTS"} 2>&1 \
        | tee "$L/perf-device.txt" | grep -v "^ *$"
      # Again with signals paid after every batch (ProxyConfig::signal_coalesce 0), budget allowing.
      if [ -z "${DEVICE_PARTS:-}" ] && [ $((share - (SECONDS - t0))) -gt $((SECONDS - t0 + 10)) ]; then
        echo "-- with --signal-coalesce 0"
        timeout $((share - (SECONDS - t0))) /tmp/bin/mscclpp-perf device --timeout 20 --signal-coalesce 0 2>&1 \
          | tee "$L/perf-device-nocoalesce.txt" | grep -E "proxy load|signal" | grep -v "^ *$"
      fi ;;
    twonode)
      # Issue 28: the two-node plan with ranks as threads, RUNS times per setting (mscclpp-perf's
      # own CUDA_DEVICE_MAX_CONNECTIONS=32, then the driver's 8 for comparison).
      OUT=$L/twonode RUNS=${TWONODE_RUNS:-6} CAP=30 SETTINGS="${TWONODE_SETTINGS:-per-plan:default interpreter:default per-plan:8}" \
        timeout "$share" bash scripts/gpu-two-node.sh 2>&1 | tee "$L/twonode.txt" ;;
    exectests)
      # Every executor GPU test once, per-plan kernel (the default), without run.sh's per-test caps.
      tar xJf gpu-bundle-exec/bin.tar.xz -C gpu-bundle-exec 2>/dev/null
      timeout "$share" gpu-bundle-exec/bin/exec-gpu --ignored --test-threads=1 > "$L/exec-tests.txt" 2>&1
      echo "exec-gpu rc=$?"; grep -E "^test |test result" "$L/exec-tests.txt" | tail -40 ;;
    *) echo "unknown part $part" ;;
  esac
done
# The device tool returns only so many files from $OUT: pack the parts' log folders into one
# tarball (files directly in $OUT, such as a tee of this script's output, stay; KEEP_LOGS=1
# leaves everything as it is).
dirs=$(cd "$L" && ls -d */ 2>/dev/null || true)
if [ "${KEEP_LOGS:-0}" != 1 ] && [ -n "$dirs" ]; then
  (cd "$L" && tar czf logs.tgz $dirs && rm -rf $dirs) && echo "== logs packed into \$OUT/logs.tgz: $dirs"
fi
RUN
chmod +x gpu-bundle-coll/all.sh
du -sh gpu-bundle-coll gpu-bundle-exec gpu-bundle-nccl
