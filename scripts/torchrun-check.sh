#!/usr/bin/env bash
# A real torchrun starts mscclpp ranks (on the GPU machine, which has torch; CI cannot install
# torch: its PyPI wheel does not import without the CUDA wheels, several GB, and the CPU index
# download.pytorch.org is not reachable from CI). Run from the GPU bundle:
#
#   cd gpu-bundle && ./torchrun-check.sh        # prints PASS/FAIL lines, exits 1 on any FAIL
#
# torchrun's agent store listens on MASTER_PORT; our root listens on MASTER_PORT + 1
# (mscclpp::launcher). Checked in torchrun's three modes, a control run that forces the root onto
# MASTER_PORT (it must fail: the port is taken), and mscclpp-perf with 4 ranks.
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}
mkdir -p "$logs"
pass=0
fail=0
job=torchrun_shaped_launch_leaves_master_port_to_the_store   # the rank body in tests/launchers.rs
result() { # name ok detail
  if [ "$2" = 1 ]; then pass=$((pass + 1)); echo "PASS $1${3:+: $3}"; else fail=$((fail + 1)); echo "FAIL $1${3:+: $3} (log: $logs/torchrun-$1.log)"; fi
}
if ! python3 -c 'import torch.distributed.run' 2>/dev/null; then
  echo "FAIL torch: python3 cannot import torch.distributed.run here"
  exit 1
fi
echo "torch $(python3 -c 'import torch; print(torch.__version__)')"
port=$((29000 + RANDOM % 2000))
# The test job: 4 ranks, every pair exchanges 64 KiB over Ethernet and checks it.
check_job() { # name torchrun-args...
  local name=$1; shift
  MSCCLPP_LAUNCHED_TEST=$job timeout 120 torchrun "$@" --nproc-per-node=4 --no-python \
    ./bin/launchers --exact $job --nocapture --test-threads=1 >"$logs/torchrun-$name.log" 2>&1
  local rc=$? ok=1 r
  for r in 0 1 2 3; do
    grep -q "rank $r of 4: exchanged 65536 B with 3 peers, all exact (torchrun" "$logs/torchrun-$name.log" || ok=0
  done
  [ $rc = 0 ] || ok=0
  result "$name" $ok "exit $rc, $(grep -c 'all exact (torchrun' "$logs/torchrun-$name.log") of 4 ranks exchanged"
}
check_job static --master-addr=127.0.0.1 --master-port=$port
check_job standalone --standalone
check_job c10d --nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$((port + 10))
# Control: the root forced onto MASTER_PORT, where torchrun's store listens, cannot start.
MSCCLPP_ROOT_PORT=$((port + 20)) MSCCLPP_LAUNCHED_TEST=$job timeout 120 torchrun --master-addr=127.0.0.1 \
  --master-port=$((port + 20)) --nproc-per-node=2 --no-python ./bin/launchers --exact $job --nocapture \
  --test-threads=1 >"$logs/torchrun-control.log" 2>&1
rc=$?
if [ $rc != 0 ] && grep -qi "address already in use\|in use" "$logs/torchrun-control.log"; then
  result control 1 "the root on MASTER_PORT itself fails (the store holds it): exit $rc"
else
  result control 0 "expected 'Address already in use', exit $rc"
fi
# mscclpp-perf, 4 ranks, under torchrun --standalone.
timeout 180 torchrun --standalone --nproc-per-node=4 --no-python ./bin/mscclpp-perf --max-bytes 64K --iters 20 \
  --rounds 1 --timeout 60 >"$logs/torchrun-perf.log" 2>&1
rc=$?
ok=0
[ $rc = 0 ] && grep -q "4 ranks" "$logs/torchrun-perf.log" && ok=1
result perf $ok "mscclpp-perf with 4 ranks, exit $rc"
grep -E "^#|^ +[0-9]" "$logs/torchrun-perf.log" | head -20
echo "torchrun-check: $pass passed, $fail failed"
[ $fail = 0 ]
