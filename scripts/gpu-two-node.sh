#!/usr/bin/env bash
# Issue #28's intermittent two-node timeout: runs the two-node Simple plan (4 ranks as threads,
# port channels over CUDA IPC through the proxy) RUNS times per setting, each under `timeout`,
# and prints one line per run (PASS / FAIL with the ranks' errors). Settings: the executor
# kernel and CUDA_DEVICE_MAX_CONNECTIONS ("default": left unset, so mscclpp-perf sets 32 for its
# ranks as threads; 8 is the driver's own default), and optionally ":greatest" for
# MSCCLPP_CUDAIPC_STREAM_PRIORITY=greatest (the connection streams at the greatest priority:
# do they escape queues shared with the ranks' kernels?), e.g. per-plan:8:greatest.
# Needs gpu-bundle-exec (scripts/gpu-bundle-exec.sh). Device call: carry ["gpu-bundle-exec"],
# command "bash scripts/gpu-two-node.sh" (RUNS, SETTINGS, CAP to change the defaults; BUNDLE
# names another bundle folder built the same way, e.g. from a branch: gpu-bundle-exec-warmup;
# PERF_ARGS adds mscclpp-perf arguments, e.g. "--procs" (start the MPS daemon first) or "-w 1").
set -u
cd "$(dirname "$0")/../${BUNDLE:-gpu-bundle-exec}"
tar xJf bin.tar.xz
logs=${OUT:-/tmp/two-node}; mkdir -p "$logs"
runs=${RUNS:-4}; cap=${CAP:-30}
for setting in ${SETTINGS:-per-plan:default interpreter:default per-plan:8}; do
  IFS=: read -r k q prio <<< "$setting"
  for i in $(seq "$runs"); do
    env_q=(); [ "$q" = default ] || env_q=(CUDA_DEVICE_MAX_CONNECTIONS=$q)
    [ -n "${prio:-}" ] && env_q+=(MSCCLPP_CUDAIPC_STREAM_PRIORITY=$prio)
    t0=$SECONDS
    # The GPU subsystem's debug lines number every stream the process makes (and who made
    # it): with the stream-mapping rows of `mscclpp-perf device --parts queues`, they tell
    # which streams could share a hardware queue in a run that stalled.
    env "${env_q[@]}" MSCCLPP_LOG_LEVEL=DEBUG MSCCLPP_LOG_SUBSYS=GPU MSCCLPP_EXECUTOR_KERNEL=$k timeout "$cap" bin/mscclpp-perf allreduce \
      --plan bin/plans/two_node_allreduce_4_simple_ip.json --ranks 4 -b 64K -e 4M -d i32 --check --timeout 5 ${PERF_ARGS:-} \
      > "$logs/run.log" 2>&1
    rc=$?
    r=PASS; [ $rc = 0 ] || r="FAIL rc=$rc"; [ $rc = 124 ] && r="TIMEOUT (${cap}s)"
    echo "$r kernel=$k queues=$q${prio:+ priority=$prio} run $i ($((SECONDS - t0)) s)"
    [ $rc = 0 ] || grep -E "rank [0-9]|^ +[0-9]+ |no rank has moved on" "$logs/run.log" | grep -v "stream [0-9]* of this process\|diagnostics:" | sed "s/^/    /" | tail -24
    # Each rank's semaphore words and launches (Executor::diagnostics), for a failing run.
    [ $rc = 0 ] || grep "diagnostics:" "$logs/run.log" | sed "s/^mscclpp-perf: diagnostics: /    diag: /" | cut -c1-900
    # The streams made, in order (every failing run, and the first run of each setting); for a
    # failing run also the calls that serialize the context's streams made after the first
    # rank began launching, with their times and threads.
    if [ $rc != 0 ] || [ "$i" = 1 ]; then
      grep -oE "stream [0-9]+ of this process made on GPU[0-9]+ by [^ ]+" "$logs/run.log" | sed "s/ of this process made on GPU[0-9]* by/:/" | tr '\n' ';' | sed "s/^/    streams: /"; echo
    fi
    if [ $rc != 0 ]; then
      awk '/warmup launches begin/ {on=1} on && /serializes|warmup launches/' "$logs/run.log" | cut -c1-220 | head -20 | sed "s/^/    after the first launch: /"
    fi
    cat "$logs/run.log" >> "$logs/all-runs.log"
  done
done
