#!/bin/bash
# Runs the IB transport for real: soft-RoCE (the kernel's rdma_rxe + rdma-core) in a qemu machine.
#
#   scripts/rxe-vm.sh            # build the VM once (cached), boot it, run the IB tests and a perf sweep
#
# Builds the release test binary of tests/ib_rdma.rs (the shared connection suite over IB0), the
# library's unit tests and mscclpp-perf, shares them with the VM, creates rxe0 there, runs them
# between processes inside it, and prints the results. The VM image (Debian 12 + rdma-core,
# ~200 MB) is built once by scripts/rxe-vm/build.sh into $W (default ~/.cache/mscclpp-rxe-vm,
# outside the repo); building needs root and network access to a Debian mirror.
#
# Environment: W (cache dir), SMP (VM CPUs, default 2), PERF_MAX (largest perf message, default 16M),
# VM_TIMEOUT (seconds for the whole VM run, default 2400), SKIP_BUILD=1 (reuse binaries in $W/share).
# Soft-RoCE is for correctness: its speed (emulated CPU, kernel copies) says nothing about a NIC.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export W=${W:-${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-rxe-vm}
PERF_MAX=${PERF_MAX:-16M}
VM_TIMEOUT=${VM_TIMEOUT:-2400}
say() { printf '=== rxe-vm: %s\n' "$*"; }

# 1. The VM image (once), with this repo's rxe-init as PID 1.
if [ ! -f "$W/rootfs.ext4" ] || [ ! -d "$W/rootfs" ]; then
  say "building the VM image in $W (once; needs root and a Debian mirror)"
  W="$W" bash "$HERE/rxe-vm/build.sh"
fi
if ! cmp -s "$HERE/rxe-vm/rxe-init" "$W/rootfs/sbin/rxe-init"; then
  say "refreshing rxe-init in the image"
  install -m 0755 "$HERE/rxe-vm/rxe-init" "$W/rootfs/sbin/rxe-init"
  mkfs.ext4 -q -F -L rxeroot -d "$W/rootfs" "$W/rootfs.ext4" 400M
fi
command -v qemu-system-x86_64 >/dev/null || {
  say "installing qemu"; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends qemu-system-x86 >/dev/null; }

# 2. Binaries (built here: the VM has the same glibc as a Debian 12 host).
S="$W/share"
mkdir -p "$S/bin"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  say "building release binaries"
  cd "$ROOT"
  exe_of() { # cargo's JSON messages -> the executable of the named test target
    python3 -c 'import json,sys
name=sys.argv[1]
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==name and m["profile"]["test"]:
        print(m["executable"])' "$1"
  }
  IBT=$(cargo test --release -p mscclpp --test ib_rdma --no-run --message-format=json 2>/dev/null | exe_of ib_rdma | tail -1)
  UNIT=$(cargo test --release -p mscclpp --lib --no-run --message-format=json 2>/dev/null | exe_of mscclpp | tail -1)
  cargo build --release -q -p mscclpp-perf
  [ -x "$IBT" ] && [ -x "$UNIT" ] || { echo "could not find the test binaries" >&2; exit 1; }
  cp "$IBT" "$S/bin/ib_rdma"; cp "$UNIT" "$S/bin/unit"; cp target/release/mscclpp-perf "$S/bin/"
fi

# 3. What runs inside (rxe-init calls every run-*.sh with "DEV GIDX").
rm -f "$S"/run-*.sh "$S/hooks.rc" "$S/results.txt" "$S/mscclpp.log"
cat > "$S/run-mscclpp.sh" <<EOF
#!/bin/sh
# Inside the VM: IB tests and perf over \$1 (rxe0).
DEV=\$1; GIDX=\$2; B=/mnt/share/bin; rc=0
export MSCCLPP_HCA_DEVICES=\$DEV RUST_BACKTRACE=1 PATH=\$PATH:/usr/bin
ulimit -l unlimited
cd /tmp
echo "### unit tests (verbs loading, devices)"
\$B/unit --test-threads=1 ib:: 2>&1 | tail -20 || rc=1
echo "### IB connection suite on \$DEV (processes)"
if \$B/ib_rdma --ignored --test-threads=1 --nocapture >/tmp/suite.log 2>&1; then
  grep -E '^test |^test result|^(write|flush|wait|after)' /tmp/suite.log
else
  rc=1; echo "suite FAILED"; tail -120 /tmp/suite.log
fi
echo "### mscclpp-perf --transport ib --ib-device \$DEV (two processes)"
\$B/mscclpp-perf --transport ib --ib-device \$DEV --max-bytes $PERF_MAX --rounds 1 --quiet 2>&1 || rc=1
echo "### the same in HostNoAtomic mode (MSCCLPP_IBV_MODE=host-no-atomic), up to 1 MiB"
MSCCLPP_IBV_MODE=host-no-atomic \$B/mscclpp-perf --transport ib --ib-device \$DEV --max-bytes 1M --rounds 1 --quiet 2>&1 || rc=1
echo "### raw verbs baseline on \$DEV: perftest ib_write_bw / ib_write_lat (RC WRITE, same device)"
for s in 8 4096 65536 1048576; do
  ib_write_bw -d \$DEV -x \$GIDX -s \$s -n 200 >/tmp/srv.log 2>&1 & sp=\$!; sleep 1
  timeout 60 ib_write_bw -d \$DEV -x \$GIDX -s \$s -n 200 127.0.0.1 2>&1 | grep -A1 '#bytes' | tail -1; wait \$sp
done
ib_write_lat -d \$DEV -x \$GIDX -s 8 -n 500 >/tmp/srv.log 2>&1 & sp=\$!; sleep 1
timeout 60 ib_write_lat -d \$DEV -x \$GIDX -s 8 -n 500 127.0.0.1 2>&1 | grep -A1 '#bytes' | tail -1; wait \$sp
exit \$rc
EOF
chmod +x "$S/run-mscclpp.sh"

# 4. Boot (TCG: this machine's /dev/kvm does not run stock guest kernels), bounded.
say "booting the VM (SMP=${SMP:-2}, limit ${VM_TIMEOUT}s)"
t0=$(date +%s)
APPEND="rxe_quick=1 rxe_hook_timeout=$((VM_TIMEOUT - 120))" timeout "$VM_TIMEOUT" bash "$HERE/rxe-vm/boot.sh" tcg \
  > "$S/console.log" 2>&1 || true
say "VM finished after $(( $(date +%s) - t0 )) s"
if [ ! -f "$S/results.txt" ]; then
  echo "no results from the VM; console tail:"; tail -40 "$S/console.log"; exit 1
fi
sed -n '/=== \/mnt\/share\/run-mscclpp.sh/,$p' "$S/results.txt"
rc=$(cat "$S/hooks.rc" 2>/dev/null || echo 1)
say "exit status of the runs in the VM: $rc"
exit "$rc"
