#!/usr/bin/env python3
"""Measures ring all-reduce jobs of converge-trainer on the shaped netns cluster, placement by
placement: each configuration starts `contention` identical jobs whose ranks are spread over
the hosts as the placement says (the Pollux placement code: one digit per host, the ranks on
it, e.g. "211" = 2 ranks on host 1, 1 on host 2, 1 on host 3), all at once, so that with
contention 2 every host link carries two rings. Ranks are started directly in the hosts'
namespaces with the worker contract's environment (no scheduler involved), rank 0's progress
lines are timed as they arrive, and the steady-state seconds per step and rank 0's mean sync
time per step are written as CSV:

  placement,contention,local_bsz,step_time,sync_time

Usage (inside a cluster started by deploy/netns-cluster.sh --up --env-file ENV):
  ring_grid.py --env ENV --out FILE [--hidden 512] [--batch 4] [--delay-ms 40]
               [--steps 120] [--grid "2:1 11:1 ..."]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_common import read_env, start_rank  # noqa: E402

DEFAULT_GRID = "2:1 11:1 4:1 22:1 211:1 1111:1 3:1 21:1 111:1 11:2 22:2 1111:2"


def run_config(cfg, placement, contention, args, port_base):
    hosts = cfg["NETNS_HOSTS"].split()
    digits = [int(d) for d in placement]
    if len(digits) > len(hosts):
        raise SystemExit(f"placement {placement} needs {len(digits)} hosts, the cluster has {len(hosts)}")
    world = sum(digits)
    procs, lines = [], {}
    for job in range(contention):
        rank = 0
        lines[job] = []
        for host_index, count in enumerate(digits):
            for _ in range(count):
                procs.append(start_rank(
                    cfg, hosts[host_index], rank, world, port_base + job,
                    f"grid-{placement}-{contention}-{job}", args, lines[job],
                ))
                rank += 1
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"placement {placement} x{contention}: a rank failed ({[p.returncode for p in procs]})")
    time.sleep(0.2)
    rows = []
    for job, points in lines.items():
        # Steady state: from the report after the first third of the steps to the last.
        steady = [pt for pt in points if pt[1]["step"] >= args.steps // 3]
        if len(steady) < 3:
            raise SystemExit(f"placement {placement}: too few progress lines ({len(points)})")
        (t0, p0), (t1, p1) = steady[0], steady[-1]
        step_time = (t1 - t0) / (p1["step"] - p0["step"])
        syncs = [pt[1].get("sync_s", 0.0) for pt in steady[1:]]
        rows.append((step_time, statistics.mean(syncs)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="the --env-file of netns-cluster.sh")
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--delay-ms", type=int, default=40)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--grid", default=DEFAULT_GRID, help="placement:contention pairs")
    args = ap.parse_args()
    cfg = read_env(args.env)
    out = open(args.out, "w")
    out.write("placement,contention,local_bsz,step_time,sync_time\n")
    port = 29600
    for item in args.grid.split():
        placement, _, contention = item.partition(":")
        contention = int(contention or 1)
        started = time.monotonic()
        rows = run_config(cfg, placement, contention, args, port)
        port += contention
        for step_time, sync_time in rows:
            out.write(f"{placement},{contention},{args.batch},{step_time:.6f},{sync_time:.6f}\n")
            out.flush()
        steps = ", ".join(f"{s * 1000:.1f} ms (sync {y * 1000:.1f})" for s, y in rows)
        print(f"{placement:>5} x{contention}: {steps}  [{time.monotonic() - started:.0f} s]", flush=True)


if __name__ == "__main__":
    sys.exit(main())
