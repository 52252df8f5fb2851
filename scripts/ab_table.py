#!/usr/bin/env python3
"""Side-by-side table of `mscclpp-perf device` proxy load rows from several logs.

    python3 scripts/ab_table.py eth-base-1.txt eth-hold-1.txt eth-new-1.txt ...

One line per row (operation and size, peers, producers) and one column per log: the proxy's
M triggers/s, its ratio to the host thread of the same run in parentheses, and that host
thread's M/s after "b". Logs from `gpu-ab/run.sh` (scripts/gpu-bundle-ab.sh) come back packed in
logs.tgz: unpack it first (`tar xzf logs.tgz -C DIR`).
"""
import re
import sys

ROW = re.compile(
    r"proxy load, (?P<what>.+?) -> (?P<peers>\d+) peers, +(?P<who>.+?):\s+(?P<rate>[\d.]+) M triggers/s, "
    r"host direct\s+(?P<base>[\d.]+) M/s, ratio (?P<ratio>[\d.]+)"
)


def load(path):
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW.search(line)
            if m:
                key = (m["what"], int(m["peers"]), m["who"].strip())
                rows[key] = (float(m["rate"]), float(m["ratio"]), float(m["base"]))
    return rows


def main(paths):
    if not paths:
        print(__doc__.strip())
        return 2
    tables = [load(p) for p in paths]
    keys = []
    for t in tables:
        keys.extend(k for k in t if k not in keys)
    if not keys:
        print("no proxy load rows in " + ", ".join(paths))
        return 1
    print("row".ljust(64) + "".join(p.rsplit("/", 1)[-1][:20].rjust(24) for p in paths))
    for what, peers, who in keys:
        line = f"{what} ->{peers} {who}".ljust(64)
        for t in tables:
            v = t.get((what, peers, who))
            line += (f"{v[0]:7.3f} ({v[1]:.2f}) b{v[2]:.2f}" if v else "-").rjust(24)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
