#!/usr/bin/env bash
# Issue 25 item 1 (the proxy under load), in one GPU-machine call: builds mscclpp-perf and the
# `proxy_load` GPU test (release) into the git-ignored gpu-bundle-proxy/ with a runner that runs
#   1. `mscclpp-perf device` (all its rows; the proxy load rows come last: put / putWithSignal /
#      signal to 1, 4, 8 in-process peers over CUDA IPC and Ethernet, 1 to 132 x 256 producers,
#      each beside one host thread issuing the same calls), about 2 minutes;
#   2. the ignored test million_puts_from_many_producers_land_once (1,013,760 puts from
#      132 x 256 producers to 4 CUDA IPC peers, every slot checked, FIFO wraps printed; fails
#      with TIMEOUT after 60 s instead of hanging).
#
#   scripts/gpu-bundle-proxy.sh      # here
#   device run: carry ["gpu-bundle-proxy"], command "bash gpu-bundle-proxy/run.sh" (timeout_s 600)
#
# Logs under $OUT (or ./logs): perf-device.txt, proxy-load-test.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-binary.sh
out=gpu-bundle-proxy
grep -qx '/gpu-bundle-proxy/' .git/info/exclude 2>/dev/null || echo '/gpu-bundle-proxy/' >> "$(git rev-parse --git-path info/exclude)"
rm -rf "$out" && mkdir -p "$out/bin"
cargo build --release -p mscclpp-perf
cp target/release/mscclpp-perf "$out/bin/"
test_binary mscclpp proxy_load "$out/bin/proxy_load"
echo "bundled $out/bin/proxy_load"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
set -u -o pipefail
cd "$(dirname "$0")"
logs=${OUT:-logs}
mkdir -p "$logs"
rc=0
nvidia-smi -L 2>&1 | tee "$logs/gpus.txt"
echo "== GPU test: million_puts_from_many_producers_land_once"
timeout 90 ./bin/proxy_load --ignored --test-threads=1 --nocapture > "$logs/proxy-load-test.txt" 2>&1
code=$?
grep -E "^test |RESULT|TIMEOUT|panicked|test result" "$logs/proxy-load-test.txt"
[ "$code" = 0 ] || { rc=1; echo "-- FAILED: proxy_load test (exit $code)"; tail -30 "$logs/proxy-load-test.txt"; }
echo "== mscclpp-perf device (proxy load rows last)"
timeout ${PERF_CAP:-330} ./bin/mscclpp-perf device --max-bytes 1G --timeout 30 > "$logs/perf-device.txt" 2>&1
code=$?
cat "$logs/perf-device.txt"
[ "$code" = 0 ] || { rc=1; echo "-- FAILED: mscclpp-perf device (exit $code)"; }
echo "== exit $rc"
exit $rc
RUN
chmod +x "$out/run.sh"
du -sh "$out"
