#!/usr/bin/env bash
# Builds what one GPU-machine call needs to check the executor (issue #28), into the git-ignored
# folder gpu-bundle-exec/:
#   - the release test binary of mscclpp-executor's GPU tests (tests/gpu.rs), in bin.tar.xz;
#   - mscclpp-perf (release) and the generated plans (plans/), for `--plan` runs;
#   - run.sh: every GPU test in its own process under `timeout`, one PASS/FAIL line per test
#     (TIMEOUT when it ran past its cap), the failing messages after the summary; logs under $OUT;
#   - breakdown.sh (run.sh calls it last; also runs alone): the interpreter's cost breakdown,
#     crates/mscclpp-executor/bench/exec_breakdown.cu with its inputs regenerated here, compiled
#     by the GPU machine's nvcc and run for 1K-64K; prints its table (a failure fails no test).
# The GPU machine needs no Rust toolchain and no network (the kernel is compiled there by NVRTC
# from the driver's libnvrtc, as for the collectives).
# Both executor kernels run: the interpreter and the per-plan kernel (MSCCLPP_EXECUTOR_KERNEL).
# PERF_BEFORE=PATH adds a mscclpp-perf built at an earlier commit, whose one-hop plan rows run
# in the same call (e.g. a build of 25e5c59, session 19's kernels, against this one).
# Device call: carry ["gpu-bundle-exec"], command "bash gpu-bundle-exec/run.sh" (RUN_BUDGET,
# default 560 s).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-binary.sh
out=gpu-bundle-exec
rm -rf "$out" && mkdir -p "$out/bin"
test_binary mscclpp-executor gpu "$out/bin/exec-gpu"
test_binary mscclpp-executor selector_gpu "$out/bin/selector-gpu"
cargo build --release -q -p mscclpp-perf
cp target/release/mscclpp-perf "$out/bin/"
if [ -n "${PERF_BEFORE:-}" ]; then cp "$PERF_BEFORE" "$out/bin/mscclpp-perf-before"; fi
cargo run --release -q -p mscclpp-executor --example write_plans -- "$out/bin/plans" >/dev/null
(cd "$out" && tar cJf bin.tar.xz bin && rm -rf bin)
# The breakdown bench and what it includes, at their paths relative to each other.
bd="$out/breakdown/crates"
mkdir -p "$bd/mscclpp-executor/bench" "$bd/mscclpp-collectives/bench" "$bd/mscclpp/include/mscclpp_rs"
cp crates/mscclpp-executor/bench/exec_breakdown.cu "$bd/mscclpp-executor/bench/"
cargo run --release -q -p mscclpp-executor --example dump_breakdown_inputs -- "$bd/mscclpp-executor/bench/exec_breakdown_inputs.h" >/dev/null
cp crates/mscclpp-collectives/bench/graph_timing.cuh crates/mscclpp-collectives/bench/bench_pieces.cuh "$bd/mscclpp-collectives/bench/"
cp crates/mscclpp/include/mscclpp_rs/device.cuh "$bd/mscclpp/include/mscclpp_rs/"
cat > "$out/breakdown.sh" <<'BREAKDOWN'
#!/usr/bin/env bash
# The interpreter's cost breakdown: exec_breakdown.cu compiled with this machine's nvcc, run for
# every dumped size (its own bounded waits; the whole under BREAKDOWN_CAP seconds, default 180).
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}; mkdir -p "$logs"
cap=${BREAKDOWN_CAP:-180}
nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
[ -n "$nvcc" ] || { echo "exec-breakdown: no nvcc"; exit 1; }
dir=breakdown/crates/mscclpp-executor/bench
t0=$SECONDS
if ! timeout "$cap" "$nvcc" -O3 -arch=sm_90 -o "$dir/exec_breakdown" "$dir/exec_breakdown.cu" > "$logs/exec-breakdown-build.log" 2>&1; then
  echo "exec-breakdown: nvcc failed"; tail -30 "$logs/exec-breakdown-build.log"; exit 1
fi
echo "exec-breakdown: built in $((SECONDS - t0)) s with $("$nvcc" --version | tail -1)"
l=$((cap - (SECONDS - t0))); [ "$l" -gt 20 ] || l=20
timeout "$l" "$dir/exec_breakdown" "$@" 2>&1 | tee "$logs/exec-breakdown.log"
exit "${PIPESTATUS[0]}"
BREAKDOWN
chmod +x "$out/breakdown.sh"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
set -u
cd "$(dirname "$0")"
logs=${OUT:-logs}; mkdir -p "$logs"
tar xJf bin.tar.xz
budget=${RUN_BUDGET:-560}
sum="$logs/summary.txt"; : > "$sum"
fails="$logs/failures.txt"; : > "$fails"
# Caps: longer than the tests' own bounds (20 s kernel timeouts, 60 s synchronize, 70 s
# bootstrap waits) where a failure can stack them, so a test reports before it is killed.
cap_for() { case "$1" in *proxy*|*large*|*4_ranks*) echo 90;; *) echo 45;; esac; }
# Every GPU test under one executor kernel (MSCCLPP_EXECUTOR_KERNEL=$1); names get "@$1".
run_tests() {
  export MSCCLPP_EXECUTOR_KERNEL=$1
  for t in $(./bin/exec-gpu --list --ignored 2>/dev/null | sed -n 's/: test$//p') $(./bin/selector-gpu --list --ignored 2>/dev/null | sed -n 's/: test$/@selector/p'); do
    bin=./bin/exec-gpu; case "$t" in *@selector) t=${t%@selector}; bin=./bin/selector-gpu;; esac
    cap=$(cap_for "$t"); l=$((budget - SECONDS - 5)); [ "$l" -lt "$cap" ] || l=$cap
    if [ "$l" -le 5 ]; then echo "SKIPPED (deadline) $t@$1" | tee -a "$sum"; continue; fi
    log="$logs/$t@$1.log"; t0=$SECONDS
    timeout "$l" $bin --ignored --exact --nocapture --test-threads=1 "$t" > "$log" 2>&1
    rc=$?; r=PASS
    [ "$rc" = 0 ] || r="FAIL rc=$rc"; [ "$rc" = 124 ] && r="TIMEOUT after ${l}s"
    echo "$r $t@$1 ($((SECONDS - t0))s)" | tee -a "$sum"
    if [ "$r" != PASS ]; then
      { echo "=== $t@$1: $r"; grep -v '^\s*[0-9]*: \|^\s*at ' "$log" | tail -60; } >> "$fails"
    else
      grep -h "host cost\|reported after" "$log" >> "$sum" || true
    fi
  done
  unset MSCCLPP_EXECUTOR_KERNEL
}
# mscclpp-perf --plan: a plan timed like the built-in algorithms, with --check (memory channels
# with 2 ranks; port channels through the proxy over CUDA IPC with 4).
perf_run() {
  name=$1; shift; l=$((budget - SECONDS - 5)); [ "$l" -lt 45 ] || l=45
  if [ "$l" -le 5 ]; then echo "SKIPPED (deadline) perf $name" | tee -a "$sum"; return; fi
  log="$logs/perf-$name.log"; t0=$SECONDS
  timeout "$l" "${PERF_BIN:-./bin/mscclpp-perf}" "$@" > "$log" 2>&1
  rc=$?; r=PASS; [ "$rc" = 0 ] || r="FAIL rc=$rc"; [ "$rc" = 124 ] && r="TIMEOUT after ${l}s"
  echo "$r perf $name ($((SECONDS - t0))s)" | tee -a "$sum"
  if [ "$r" != PASS ]; then { echo "=== perf $name: $r"; tail -40 "$log"; } >> "$fails"; else grep -E "^ *[0-9]+ " "$log" >> "$sum"; fi
}
# Order: what decides the most first. The per-plan kernel (MSCCLPP_EXECUTOR_KERNEL=per-plan)
# checked, then timed beside the built-in kernel and the interpreter; then every GPU test under
# each kernel; then the rest.
P=bin/plans
MSCCLPP_EXECUTOR_KERNEL=per-plan perf_run onehop-2-check@per-plan allreduce --plan $P/onehop_allreduce_2_ll_4x256_oop.json --ranks 2 -b 1K -e 1M -d i32 --check --timeout 20
# The one-hop plans spell out the built-in allpair kernel (split over B blocks of T threads;
# allpair itself runs 1x128 at 1 KiB, 32x512 from 128 KiB): each beside `--algo allpair` in
# graph mode, for the 1.1x comparison.
perf_run builtin-allpair-2-graph allreduce --algo allpair --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20
for split in 1x128 4x256 32x512 1x256 2x256 8x512 16x512; do
  MSCCLPP_EXECUTOR_KERNEL=per-plan perf_run onehop-2-$split-graph@per-plan allreduce --plan $P/onehop_allreduce_2_ll_${split}_oop.json --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20
done
# The per-plan kernel of session 19 (no operation held in registers before the flag barrier,
# MSCCLPP_EXECUTOR_HELD_BUFFERS=0) on the splits that were best, for the same-run comparison.
for split in 4x256 2x256 32x512; do
  MSCCLPP_EXECUTOR_HELD_BUFFERS=0 MSCCLPP_EXECUTOR_KERNEL=per-plan perf_run onehop-2-$split-graph@per-plan-held0 allreduce --plan $P/onehop_allreduce_2_ll_${split}_oop.json --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20
done
# The earlier build's per-plan kernel (PERF_BEFORE), same splits.
if [ -x bin/mscclpp-perf-before ]; then
  for split in 4x256 2x256 32x512; do
    PERF_BIN=./bin/mscclpp-perf-before MSCCLPP_EXECUTOR_KERNEL=per-plan perf_run onehop-2-$split-graph@per-plan-before allreduce --plan $P/onehop_allreduce_2_ll_${split}_oop.json --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20
  done
fi
for split in 1x128 4x256 32x512; do
  MSCCLPP_EXECUTOR_KERNEL=interpreter perf_run onehop-2-$split-graph@interpreter allreduce --plan $P/onehop_allreduce_2_ll_${split}_oop.json --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20
done
run_tests per-plan
run_tests interpreter
for k in per-plan interpreter; do
  MSCCLPP_EXECUTOR_KERNEL=$k perf_run allpair-ll-2@$k allreduce --plan $P/allpair_allreduce_2_ll_oop.json --ranks 2 -b 4K -e 1M -d i32 --check --timeout 20
  MSCCLPP_EXECUTOR_KERNEL=$k perf_run two-node-simple-4@$k allreduce --plan $P/two_node_allreduce_4_simple_ip.json --ranks 4 -b 64K -e 4M -d i32 --check --timeout 20
done
# The two-node plan under 2 and 32 hardware queues. 2 is a control expected to FAIL (a proxy's
# copy on a connection stream queued behind a rank's launch; the library warns), 32 should pass
# (mscclpp-perf issues ranks' calls in lockstep rounds: docs/design.md, issue 28).
for q in 2 32; do
  for i in 1 2 3; do
    CUDA_DEVICE_MAX_CONNECTIONS=$q perf_run two-node-simple-4-q$q-$i allreduce --plan $P/two_node_allreduce_4_simple_ip.json --ranks 4 -b 64K -e 4M -d i32 --check --timeout 5
  done
done
# The interpreter's cost breakdown (breakdown.sh): reported, never fatal.
t0=$SECONDS
bash ./breakdown.sh > "$logs/exec-breakdown-run.txt" 2>&1
rc=$?; r=PASS; [ "$rc" = 0 ] || r="FAIL rc=$rc"; [ "$rc" = 124 ] && r="TIMEOUT"
echo "$r exec-breakdown ($((SECONDS - t0))s)" | tee -a "$sum"
if [ "$rc" = 0 ]; then sed -n '/^# exec breakdown/,$p' "$logs/exec-breakdown-run.txt" >> "$sum"; else { echo "=== exec-breakdown: $r"; tail -40 "$logs/exec-breakdown-run.txt"; } >> "$fails"; fi
echo; echo "== summary"; cat "$sum"
if [ -s "$fails" ]; then echo; echo "== failures"; cat "$fails"; fi
RUN
chmod +x "$out/run.sh"
echo "built $out ($(du -sh "$out" | cut -f1)); device call: carry [\"$out\"], command \"bash $out/run.sh\" (the breakdown alone: \"bash $out/breakdown.sh\")"
