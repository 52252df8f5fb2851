#!/usr/bin/env bash
# Checks libmscclpp_nccl.so on the GPU machine (one GPU, torch, torchrun; no Rust, no network).
# Build the bundle here first: bash scripts/gpu-bundle-nccl.sh; then from the repository root on
# the GPU machine: bash scripts/gpu-nccl.sh
#
# Starts MPS (the ranks share GPU 0 and their kernels must be resident together), runs every
# step under `timeout`, prints PASS/FAIL per step with the failing lines, stops MPS, exits 1 on
# any failure. Logs in $OUT (default gpu-bundle-nccl/logs). Everything runs within RUN_BUDGET
# seconds (default 300): each step's limit (P2P_TIMEOUT, PYNCCL_TIMEOUT, TORCHRUN_TIMEOUT,
# OVERHEAD_TIMEOUT) is cut to what is left. TORCHRUN_RANKS ("2 3 4") shortens a run; STEPS
# (default "p2p pynccl torchrun fallback overhead") picks the steps.
# Steps: the device point-to-point GPU tests (Rust, ranks as threads), the PyNCCL pytest,
# torchrun 2/3/4 ranks under LD_PRELOAD, torchrun through the NCCL fallback (when the bundle
# carries a real NCCL), the C API overhead table (nccl_overhead).
set -u
cd "$(dirname "$0")/.."
b=gpu-bundle-nccl
logs=${OUT:-$b/logs}
mkdir -p "$logs"
so=$PWD/$b/libmscclpp_nccl.so
if ! [ -f "$so" ]; then echo "FAIL setup: no $so (run scripts/gpu-bundle-nccl.sh on the build machine)"; exit 1; fi
pass=0; fail=0
want() { case " ${STEPS:-p2p pynccl torchrun fallback overhead} " in *" $1 "*) return 0;; *) return 1;; esac; }
deadline=$((SECONDS + ${RUN_BUDGET:-300}))
limit() { # a step's own limit, cut to what is left of the budget (at least 5 s)
  local left=$((deadline - SECONDS)); [ "$left" -lt 5 ] && left=5
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
result() { # name rc log
  if [ "$2" = 0 ]; then pass=$((pass + 1)); echo "PASS $1"
  else
    fail=$((fail + 1)); echo "FAIL $1 (exit $2, log $3)"
    grep -E "FAIL|Error|error|assert|Traceback|failed" "$3" | grep -v "^PASS" | head -20 | sed 's/^/    /'
    echo "    last lines:"; tail -15 "$3" | sed 's/^/    | /'
    # A client killed (timeout) or crashed under MPS can leave the server refusing new clients
    # ("CUDA-capable device(s) is/are busy or unavailable" in every later step): restart it.
    restart_mps
  fi
}
# MPS: own pipe and log folders so nothing else on the machine is touched.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mscclpp-nccl-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mscclpp-nccl-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
mps=0
if command -v nvidia-cuda-mps-control >/dev/null && timeout 20 nvidia-cuda-mps-control -d; then
  mps=1; echo "MPS started"
else
  echo "MPS not started (ranks' kernels may not run together: expect hangs above 1 rank per SM budget)"
fi
stop_mps() { if [ "$mps" = 1 ]; then echo quit | timeout 20 nvidia-cuda-mps-control || true; echo "MPS stopped"; fi; }
restart_mps() {
  if [ "$mps" = 1 ]; then
    echo quit | timeout 20 nvidia-cuda-mps-control || true
    sleep 2
    if timeout 20 nvidia-cuda-mps-control -d; then echo "    MPS restarted"; else mps=0; echo "    MPS did not restart"; fi
  fi
}
trap stop_mps EXIT
export PYTHONUNBUFFERED=1 MSCCLPP_LOG_LEVEL=${MSCCLPP_LOG_LEVEL:-INFO} MSCCLPP_NCCL_TIMEOUT_S=${MSCCLPP_NCCL_TIMEOUT_S:-60}
# The native paths must not need a real NCCL (torch's 2.28.9 refuses two ranks on one GPU).
unset MSCCLPP_ENABLE_NCCL_FALLBACK MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
[ -f "$b/bin.tar.xz" ] && tar xJf "$b/bin.tar.xz" -C "$b"
# 0. The device point-to-point path on its own (ring 2-4 ranks, all-to-all, graph replay, errors).
if ! want p2p; then
  echo "SKIP gpu_p2p (STEPS)"
elif [ -x "$b/bin/gpu_p2p" ]; then
  log=$logs/gpu_p2p.log
  timeout "$(limit "${P2P_TIMEOUT:-60}")" "$b/bin/gpu_p2p" --ignored --test-threads=1 > "$log" 2>&1
  result "gpu_p2p ($(grep -c ' ok$' "$log") tests passed)" $? "$log"
else
  echo "SKIP gpu_p2p: no $b/bin.tar.xz"
fi
# 1. PyNCCL-style ctypes client (pytest), 2 and 3 ranks.
if want pynccl; then
  log=$logs/pynccl.log
  MSCCLPP_NCCL_SO=$so timeout "$(limit "${PYNCCL_TIMEOUT:-60}")" python3 -m pytest -q -rs -p no:cacheprovider "$b/test_pynccl.py" > "$log" 2>&1
  result "pynccl pytest" $? "$log"
fi
# 2. torch.distributed under LD_PRELOAD with torchrun, 2, 3 and 4 processes.
want torchrun || TORCHRUN_RANKS=none
for n in ${TORCHRUN_RANKS:-2 3 4}; do
  [ "$n" = none ] && continue
  log=$logs/torchrun-$n.log
  port=$((29500 + RANDOM % 1000))
  LD_PRELOAD=$so timeout "$(limit "${TORCHRUN_TIMEOUT:-75}")" torchrun --nproc-per-node="$n" --master-port="$port" "$b/torch_nccl.py" > "$log" 2>&1
  rc=$?
  # The log must say which calls ran natively (the library logs each route once per process).
  native=$(grep -c -- "-> native" "$log")
  [ "$rc" = 0 ] && [ "$native" = 0 ] && rc=1
  result "torchrun $n ranks ($(grep -c '^PASS' "$log") checks passed, $native native routes logged)" $rc "$log"
  grep -E "mscclpp::nccl.*->" "$log" | sed -E 's/.*mscclpp::nccl: //' | sort -u | head -24 | sed 's/^/    route: /'
done
# 2b. The NCCL fallback with a real NCCL (>= 2.30, several ranks on one GPU): torchrun with every
# operation forced to NCCL (MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION=all), the same checks against
# a CPU reference; the log must show the calls routed to the fallback. Runs when the bundle
# carries nccl/libnccl.so.2.xz (scripts/gpu-bundle-nccl.sh copies nccl-ignored/, made by
# shared/tools/nccl-sm90.py) or FALLBACK_NCCL names a library.
real=${FALLBACK_NCCL:-}
if want fallback && [ -z "$real" ] && [ -f "$b/nccl/libnccl.so.2.xz" ]; then
  python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$b/nccl/libnccl.so.2.xz'), open('/tmp/libnccl-fallback.so.2','wb'))" \
    && real=/tmp/libnccl-fallback.so.2
fi
if ! want fallback; then
  echo "SKIP the NCCL fallback (STEPS)"
elif [ -n "$real" ]; then
  for n in ${FALLBACK_RANKS:-2}; do
    log=$logs/torchrun-fallback-$n.log
    port=$((29500 + RANDOM % 1000))
    LD_PRELOAD=$so MSCCLPP_ENABLE_NCCL_FALLBACK=1 MSCCLPP_NCCL_LIB_PATH=$real MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION=all \
      NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0 \
      timeout "$(limit "${TORCHRUN_TIMEOUT:-75}")" torchrun --nproc-per-node="$n" --master-port="$port" "$b/torch_nccl.py" > "$log" 2>&1
    rc=$?
    routed=$(grep -c -- "-> NCCL fallback" "$log")
    # Every check passed and calls really went to the real NCCL.
    [ "$rc" = 0 ] && [ "$routed" -gt 0 ] || { [ "$rc" = 0 ] && rc=1; }
    result "torchrun $n ranks through the NCCL fallback ($(grep -c '^PASS' "$log") checks passed, $routed routes to NCCL)" $rc "$log"
    grep -E "loaded the NCCL fallback|-> NCCL fallback" "$log" | sed -E 's/.*mscclpp::nccl: //' | sort -u | head -12 | sed 's/^/    route: /'
  done
else
  echo "SKIP the NCCL fallback: no real NCCL (bundle nccl-ignored/libnccl.so.2.xz, or FALLBACK_NCCL=path)"
fi
# 3. What the C API adds per AllReduce call (host) and inside a CUDA graph (GPU), 2 ranks.
if want overhead && [ -x "$b/bin/nccl_overhead" ]; then
  log=$logs/overhead.log
  timeout "$(limit "${OVERHEAD_TIMEOUT:-45}")" "$b/bin/nccl_overhead" --ranks 2 > "$log" 2>&1
  result "nccl_overhead" $? "$log"
  grep -A12 "^AllReduce" "$log" | sed 's/^/    /'
fi
echo "$pass passed, $fail failed in ${SECONDS}s"
[ "$fail" = 0 ]
