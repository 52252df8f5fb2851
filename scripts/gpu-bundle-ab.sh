#!/usr/bin/env bash
# A same-machine A/B of mscclpp-perf in one GPU-machine call: builds gpu-ab/ (git-ignored) with
#   perf-base   mscclpp-perf of BASE (a revision, built in a worktree under target/gpu-ab-base),
#   perf-new    mscclpp-perf of the working tree,
#   cuda-new, device-new, proxy_load-new   the GPU test binaries of the working tree,
#   run.sh      the runner, and steps.txt, the steps it runs (edit it before the call).
#
#   scripts/gpu-bundle-ab.sh BASE     # here, e.g. BASE=main~3
#   device run: carry ["gpu-ab"], command "bash gpu-ab/run.sh" (timeout_s at most 600)
#
# Each line of steps.txt is `NAME SECONDS COMMAND...`, run from gpu-ab/ under `timeout SECONDS`,
# its output in NAME.txt. The default steps run the Ethernet proxy load rows base first, then
# new with session 33's backlog hold on and off, the GPU tests over Ethernet and of the proxy,
# then base and new again (run the base first: in session 32 the order of two builds in one
# call was a confound). The device tool brings back at most 8 files, so after every step the
# logs (and timeline.txt, each step's end and exit code) are packed into $OUT/logs.tgz: a call
# cut short still returns every finished step.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-binary.sh
base=${1:?usage: scripts/gpu-bundle-ab.sh BASE-REVISION}
out=gpu-ab
grep -qx '/gpu-ab/' .git/info/exclude 2>/dev/null || echo '/gpu-ab/' >> "$(git rev-parse --git-path info/exclude)"
rm -rf "$out" && mkdir -p "$out"

wt=target/gpu-ab-base
if [ -d "$wt" ]; then git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"; fi
git worktree prune
git worktree add --detach "$wt" "$base" >/dev/null
(cd "$wt" && CARGO_TARGET_DIR="$PWD/../gpu-ab-base-target" cargo build --release -p mscclpp-perf)
cp target/gpu-ab-base-target/release/mscclpp-perf "$out/perf-base"
git worktree remove --force "$wt"

cargo build --release -p mscclpp-perf
cp target/release/mscclpp-perf "$out/perf-new"
for t in cuda device proxy_load; do test_binary mscclpp "$t" "$out/$t-new"; done
echo "bundled $(ls "$out" | tr '\n' ' ')(base $(git rev-parse --short "$base"), new $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + changes'))"

cat > "$out/steps.txt" <<'STEPS'
eth-base-1 90 ./perf-base device --parts load-eth --timeout 20
eth-hold-1 90 ./perf-new device --parts load-eth --timeout 20 --signal-backlog-hold 5000
eth-new-1 90 ./perf-new device --parts load-eth --timeout 20
t-cuda 50 ./cuda-new --ignored --test-threads=1 ethernet_tokens_behind ethernet_small_gpu_writes
t-device 60 ./device-new --ignored --test-threads=1 ethernet exclusive
t-proxyload 60 ./proxy_load-new --ignored --test-threads=1
eth-base-2 90 ./perf-base device --parts load-eth --timeout 20
eth-hold-2 90 ./perf-new device --parts load-eth --timeout 20 --signal-backlog-hold 5000
STEPS

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs steps.txt (see scripts/gpu-bundle-ab.sh); logs packed into $OUT/logs.tgz after each step.
set -u
cd "$(dirname "$0")"
O=${OUT:-/tmp/gpu-ab-out}; L=/tmp/gpu-ab-logs
mkdir -p "$O" "$L"
nvidia-smi -L > "$L/gpus.txt" 2>&1
t0=$(date +%s)
mark() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$L/timeline.txt"; tar czf "$O/logs.tgz" -C "$L" .; }
mark start
while read -r name secs cmd; do
  [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
  timeout "$secs" bash -c "$cmd" > "$L/$name.txt" 2>&1
  mark "$name rc=$?"
done < steps.txt
mark end
RUN
chmod +x "$out/run.sh"
