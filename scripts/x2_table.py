"""Issue 16's table from one two-GPU run: `mscclpp-perf device --procs --json A` and
`nccl_sendrecv.py --json B` (run-x2.sh writes both), side by side per size, with the goals:

    python3 x2_table.py device-procs.json nccl.json

Bandwidths in GB/s (per direction for bidirectional), times in us. Either file may be missing
(its columns then read '-').
"""
import json, sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"# {path}: {e}")
        return None


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main():
    dev = load(sys.argv[1]) if len(sys.argv) > 1 else None
    nccl = load(sys.argv[2]) if len(sys.argv) > 2 else None
    recs = {}
    for r in (dev or {}).get("records", []):
        recs[(r["name"], r["size"])] = r
    nc = {r["size"]: r for r in (nccl or [])}

    def ours(name, size):
        r = recs.get((name, size))
        return r["ours"]["median"] if r else None

    def base(name, size):
        r = recs.get((name, size))
        return r["baseline"]["median"] if r else None

    def f(x, w=8, p=2):
        return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"

    sizes = sorted({s for (n, s) in recs if n.startswith("memchan_")} | {s for s in nc if s >= 1024})
    print("# issue 16: GB/s per direction; CE = cuMemcpyDtoDAsync on the IPC-mapped peer pointer (same run)")
    print(f"{'size':>8} | {'put':>8} {'CE':>8} {'NCCL':>8} | {'get':>8} | {'put bi':>8} {'CE bi':>8} {'NCCL bi':>8} | {'Port':>8} {'CE':>8} | ahead of NCCL")
    behind = []
    for s in sizes:
        pu, pub = ours("memchan_put_uni_gbps", s), base("memchan_put_uni_gbps", s)
        gu = ours("memchan_get_uni_gbps", s)
        pb, pbb = ours("memchan_put_bidir_gbps", s), base("memchan_put_bidir_gbps", s)
        po, pob = ours("portchannel_put_with_signal_gbps", s), base("portchannel_put_with_signal_gbps", s)
        n = nc.get(s, {})
        nu, nb = n.get("uni_gbps"), n.get("bidir_gbps")
        marks = []
        for label, a, b in (("put", pu, nu), ("put bi", pb, nb), ("Port", po, nu)):
            if a is not None and b is not None:
                marks.append(label if a > b else f"{label} BEHIND")
                if a <= b:
                    behind.append(f"{label} at {human(s)}")
        print(f"{human(s):>8} | {f(pu)} {f(pub)} {f(nu)} | {f(gu)} | {f(pb)} {f(pbb)} {f(nb)} | {f(po)} {f(pob)} | {', '.join(marks)}")
    n1k = nc.get(1024, {}).get("rtt_us")
    sem, raw = ours("semaphore_pingpong_us", 8), base("semaphore_pingpong_us", 8)
    ll16, ll8 = ours("ll16_oneway_us", 1024), ours("ll8_oneway_us", 1024)
    port1k = ours("portchannel_pingpong_us", 1024)
    print(f"# latency (us): semaphore ping-pong {f(sem, 0, 2)} (raw flag {f(raw, 0, 2)}); LL16 1 KiB one way {f(ll16, 0, 2)}, LL8 {f(ll8, 0, 2)}; "
          f"PortChannel 1 KiB ping-pong {f(port1k, 0, 2)}; NCCL 1 KiB send/recv round trip {f(n1k, 0, 1)}")
    print(f"# LL16 1 MiB {f(ours('ll16_gbps', 1 << 20), 0, 1)} GB/s, LL8 1 MiB {f(ours('ll8_gbps', 1 << 20), 0, 1)} GB/s")
    goals = []
    big = [(s, recs[("memchan_put_uni_gbps", s)]["ratio"]) for s in sizes if s >= 64 << 20 and ("memchan_put_uni_gbps", s) in recs]
    if big:
        worst = min(big, key=lambda t: t[1])
        goals.append(f"MemoryChannel put >= 0.95 of the copy engine from 64 MiB: {'MET' if worst[1] >= 0.95 else 'NOT MET'} (lowest {worst[1]:.3f} at {human(worst[0])})")
    if sem is not None:
        goals.append(f"semaphore ping-pong <= 2.4 us: {'MET' if sem <= 2.4 else 'NOT MET'} ({sem:.2f})")
    r128 = recs.get(("portchannel_put_with_signal_gbps", 128 << 20))
    if r128:
        goals.append(f"PortChannel at 128 MiB >= 0.95 of the copy engine: {'MET' if r128['ratio'] >= 0.95 else 'NOT MET'} ({r128['ratio']:.3f}, {r128['ours']['median']:.1f} GB/s; MSCCL++ 367)")
    if sizes and nc:
        goals.append("ahead of NCCL send/recv at every size: " + ("MET" if not behind else "NOT MET: " + ", ".join(behind)))
    for g in goals:
        print("# goal: " + g)


if __name__ == "__main__":
    main()
