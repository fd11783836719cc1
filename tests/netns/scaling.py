#!/usr/bin/env python3
"""Throughput scaling of converge-trainer's sync architectures on the shaped netns cluster
(docs/communication.md, "Throughput scaling on shaped links"; issue 15, part 5).

For every mode (ring all-reduce, parameter server, S-MA, S-BMUF, S-EASGD) and world size W
(workers), W workers are started one per host (hosts 1..W) directly in the hosts' namespaces
with the worker contract's environment (as ring_grid.py does; no scheduler involved). The
parameter-server and S-EASGD jobs add CONVERGE_NUM_PS shards, the last ranks, on the hosts
after the workers' (host W+1, ...), so every worker's sync crosses its own link and the
shards'. Rank 0's CONVERGE_PROGRESS lines are timed as they arrive; over the steady state
(the lines after the first third of the --seconds each point runs) the job's throughput is
d(samples)/dt (`samples` counts the whole job's samples in every mode), and for the shadow
modes the mean `sync_rounds_per_s` and `model_gap` of those lines. The CPU load (1-minute
load average, sampled at the end of each point) is recorded too.

Writes CSV:
  mode,workers,samples_per_s,step_s,speedup,efficiency,sync_s,sync_rounds_per_s,rounds_per_step,model_gap,loadavg,
  exact_samples_per_s (from the first measured line to the final line's exact count, when
  the job printed one after SIGTERM; its time includes the job's end: a shadow job's final
  consensus round), end_s (from SIGTERM to that final line: the end's cost, paid once per
  generation like the rendezvous) and exact_to_stop_samples_per_s (the same exact count over
  the time to SIGTERM only: the training threads stop at SIGTERM, so it counts what was
  trained by then, at most one step per worker more)
where speedup = samples_per_s / (one plain worker's samples_per_s: ring mode, W = 1, no sync)
and efficiency = speedup / W; and a markdown table to --md.

Usage (inside a cluster started by deploy/netns-cluster.sh --up --env-file ENV, with at
least max(workers) + shards hosts):
  scaling.py --env ENV --out FILE.csv [--md FILE.md] [--svg FILE.svg] [--modes ring,ps,ma,bmuf,easgd]
             [--workers 1,2,4,8] [--hidden 256] [--batch 4] [--delay-ms 40] [--seconds 15]
             [--ps 1]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_common import read_env, start_rank  # noqa: E402

MODES = {
    # name: (label, extra trainer args, shards)
    "ring": ("ring all-reduce", [], False),
    "ps": ("parameter server", [], True),
    "ma": ("S-MA", ["--shadow", "ma"], False),
    "bmuf": ("S-BMUF", ["--shadow", "bmuf"], False),
    "easgd": ("S-EASGD", ["--shadow", "easgd"], True),
}


def run_point(cfg, mode, workers, args, port):
    hosts = cfg["NETNS_HOSTS"].split()
    _, extra, sharded = MODES[mode]
    shards = args.ps if sharded else 0
    world = workers + shards
    if world > len(hosts):
        raise SystemExit(f"{mode} x{workers}: needs {world} hosts, the cluster has {len(hosts)}")
    procs, lines = [], []
    for rank in range(world):
        extra_env = {"CONVERGE_NUM_PS": str(shards)} if shards else None
        procs.append(start_rank(
            cfg, hosts[rank], rank, world, port, f"scaling-{mode}-{workers}", args, lines,
            extra_env=extra_env, extra_args=extra,
        ))
    # Each point runs --seconds from rank 0's first progress line (or to --steps), then
    # every rank gets SIGTERM (a shadow job then ends with its consensus round).
    deadline = time.monotonic() + args.timeout
    while not lines and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.05)
    stop_at = time.monotonic() + args.seconds
    while time.monotonic() < stop_at and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    stopped = time.monotonic()
    measured = [pt for pt in lines if pt[0] < stopped]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"{mode} x{workers}: did not stop")
    if any(p.returncode not in (0, 143, -15) for p in procs):
        raise SystemExit(f"{mode} x{workers}: a rank failed ({[p.returncode for p in procs]})")
    load = float(open("/proc/loadavg").read().split()[0])
    time.sleep(0.3)
    # A cross-check that does not rest on rank 0's estimate of the others' samples: the last
    # line of a job stopped by SIGTERM counts the samples exactly (a shadow job's comes after
    # its consensus round, whose time it includes, so this figure errs low).
    exact = end_s = exact_to_stop = None
    if lines and lines[-1][0] >= stopped and measured:
        (te, pe), (ts, ps_) = lines[-1], measured[0]
        if te > ts and pe["samples"] > ps_["samples"]:
            exact = (pe["samples"] - ps_["samples"]) / (te - ts)
            exact_to_stop = (pe["samples"] - ps_["samples"]) / (stopped - ts)
            end_s = te - stopped
    # Steady state: the lines after the first third of the measured time, without a final
    # line written after the last step (a shadow job's comes after its consensus round).
    measured = [pt for pt in measured if pt[1]["step"] < args.steps]
    if len(measured) < 4:
        raise SystemExit(f"{mode} x{workers}: too few progress lines ({len(lines)})")
    t_first, t_last = measured[0][0], measured[-1][0]
    steady = [pt for pt in measured if pt[0] >= t_first + (t_last - t_first) / 3]
    if len(steady) < 3:
        steady = measured[-3:]
    (t0, p0), (t1, p1) = steady[0], steady[-1]
    dt = t1 - t0
    samples_per_s = (p1["samples"] - p0["samples"]) / dt
    step_s = dt / (p1["step"] - p0["step"])
    rest = [pt[1] for pt in steady[1:]]
    sync_s = statistics.mean(pt.get("sync_s", 0.0) for pt in rest)
    rounds = [pt["sync_rounds_per_s"] for pt in rest if pt.get("sync_rounds_per_s") is not None]
    gaps = [pt["model_gap"] for pt in rest if pt.get("model_gap") is not None]
    rps = statistics.mean(rounds) if rounds else None
    return {
        "mode": mode, "workers": workers, "samples_per_s": samples_per_s, "step_s": step_s,
        "sync_s": sync_s, "sync_rounds_per_s": rps,
        "rounds_per_step": rps * step_s if rps is not None else None,
        "model_gap": statistics.mean(gaps) if gaps else None, "loadavg": load,
        "exact_samples_per_s": exact, "end_s": end_s,
        "exact_to_stop_samples_per_s": exact_to_stop,
    }


def fmt(v, spec):
    return "" if v is None else format(v, spec)


def write_md(rows, args, cfg, path):
    out = []
    out.append(f"{cfg.get('NETNS_RATE', '?')} links, MLP hidden {args.hidden} "
               f"({args.model_bytes / 1e6:.2f} MB of f64 parameters), batch {args.batch} per worker, "
               f"{args.delay_ms} ms emulated compute per step, {args.seconds:g} s per point; "
               f"one worker per host; shards: {args.ps} (own host)")
    out.append("")
    out.append("| mode | workers | samples/s | step | speedup | efficiency | sync per step | "
               "sync rounds/s | rounds per step | model gap | load avg | "
               "exact: efficiency to the final line | end | exact: to SIGTERM |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        out.append(
            f"| {MODES[r['mode']][0]} | {r['workers']} | {r['samples_per_s']:.1f} | "
            f"{r['step_s'] * 1000:.1f} ms | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
            f"{fmt(r['sync_s'] * 1000 if r['sync_s'] else None, '.1f') + (' ms' if r['sync_s'] else '-')} | "
            f"{fmt(r['sync_rounds_per_s'], '.1f') or '-'} | {fmt(r['rounds_per_step'], '.2f') or '-'} | "
            f"{fmt(r['model_gap'], '.4f') or '-'} | {r['loadavg']:.1f} | "
            f"{fmt(r['exact_eff'], '.2f') or '-'} | {fmt(r['end_s'], '.2f') + ' s' if r['end_s'] is not None else '-'} | "
            f"{fmt(r['exact_to_stop_eff'], '.2f') or '-'} |")
    open(path, "w").write("\n".join(out) + "\n")
    return "\n".join(out)


def write_svg(rows, workers, path):
    w, h, m = 480, 360, 50
    xmax, ymax = max(workers), max(max(workers), max(r["speedup"] for r in rows))
    sx = lambda x: m + (x / xmax) * (w - 2 * m)  # noqa: E731
    sy = lambda y: h - m - (y / ymax) * (h - 2 * m)  # noqa: E731
    colors = {"ring": "#d62728", "ps": "#ff7f0e", "ma": "#1f77b4", "bmuf": "#2ca02c", "easgd": "#9467bd"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(xmax)}" y2="{sy(0)}" stroke="black"/>',
             f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(0)}" y2="{sy(ymax)}" stroke="black"/>',
             f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(xmax)}" y2="{sy(xmax)}" stroke="#999" stroke-dasharray="4"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">workers</text>',
             f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">speedup over one worker</text>']
    for x in workers:
        parts.append(f'<text x="{sx(x)}" y="{sy(0) + 14}" text-anchor="middle">{x}</text>')
    for y in range(0, int(ymax) + 1, 2):
        parts.append(f'<text x="{sx(0) - 6}" y="{sy(y) + 4}" text-anchor="end">{y}</text>')
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        pts = sorted((r["workers"], r["speedup"]) for r in rows if r["mode"] == mode)
        c = colors.get(mode, "black")
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                     + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts) + '"/>')
        parts.append(f'<text x="{m + 10}" y="{m - 20 + 14 * i}" fill="{c}">{MODES[mode][0]}</text>')
    parts.append("</svg>")
    open(path, "w").write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="the --env-file of netns-cluster.sh")
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--md", help="markdown table to write")
    ap.add_argument("--svg", help="SVG plot of speedup against workers to write")
    ap.add_argument("--modes", default="ring,ps,ma,bmuf,easgd")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--delay-ms", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1000, help="at most this many steps per point")
    ap.add_argument("--seconds", type=float, default=15, help="seconds per point from the first progress line")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ps", type=int, default=1, help="shards of the ps and easgd jobs")
    ap.add_argument("--timeout", type=float, default=180)
    args = ap.parse_args()
    args.model_bytes = 8 * (784 * args.hidden + args.hidden + args.hidden * 10 + 10)
    cfg = read_env(args.env)
    workers = [int(w) for w in args.workers.split(",")]
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode} (one of {', '.join(MODES)})")
    port = 29700
    rows = []
    base = None
    points = [("ring", 1)] + [(m, w) for m in modes for w in workers if (m, w) != ("ring", 1)]
    for mode, w in points:
        started = time.monotonic()
        r = run_point(cfg, mode, w, args, port)
        port += 1
        if base is None:
            base = r["samples_per_s"]
        r["speedup"] = r["samples_per_s"] / base
        r["efficiency"] = r["speedup"] / w
        for k in ("exact", "exact_to_stop"):
            v = r[f"{k}_samples_per_s"]
            r[f"{k}_eff"] = v / base / w if v is not None else None
        rows.append(r)
        print(f"{mode:>5} x{w}: {r['samples_per_s']:.1f} samples/s, step {r['step_s'] * 1000:.1f} ms, "
              f"efficiency {r['efficiency']:.2f}, rounds/s {fmt(r['sync_rounds_per_s'], '.1f') or '-'}, "
              f"gap {fmt(r['model_gap'], '.4f') or '-'}, load {r['loadavg']:.1f}, "
              f"to the final line {fmt(r['exact_samples_per_s'], '.1f') or '-'} samples/s "
              f"(efficiency {fmt(r['exact_eff'], '.2f') or '-'}, end {fmt(r['end_s'], '.2f') or '-'} s, "
              f"to SIGTERM {fmt(r['exact_to_stop_eff'], '.2f') or '-'}) "
              f"[{time.monotonic() - started:.0f} s]", flush=True)
    order = {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (order[r["mode"]], r["workers"]))
    cols = ["mode", "workers", "samples_per_s", "step_s", "speedup", "efficiency", "sync_s",
            "sync_rounds_per_s", "rounds_per_step", "model_gap", "loadavg", "exact_samples_per_s",
            "end_s", "exact_to_stop_samples_per_s"]
    with open(args.out, "w") as f:
        f.write(",".join(cols) + "\n")
        for r in rows:
            f.write(",".join("" if r[c] is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]))
                             for c in cols) + "\n")
    if args.md:
        print(write_md(rows, args, cfg, args.md))
    if args.svg:
        write_svg(rows, workers, args.svg)


if __name__ == "__main__":
    sys.exit(main())
