#!/usr/bin/env python3
"""ShadowSync quality bench: held-out loss against samples for synchronous ring all-reduce and
the three ShadowSync algorithms (S-MA, S-BMUF, S-EASGD) of converge-trainer, and the
statistical-efficiency penalty of each (samples to reach a loss, relative to the ring).

Every run is W worker processes (plus one S-EASGD shard) on loopback, started as the node
agent would (RANK, WORLD_SIZE, MASTER_ADDR/PORT, CONVERGE_NUM_PS); rank 0's progress lines
give the curve. Only Python's standard library.

  cargo build --release --locked -p converge-trainer
  python3 trainer/bench/shadow_quality.py --workers 4 --seeds 1,2,3 > /tmp/shadow-quality.md

Definitions (per dataset, seed and algorithm, then the mean over seeds):
- loss at f = 25, 50, 100 % of the samples: the held-out loss of the job's final model when
  the job is run for f x the epochs (ring: read off its own curve, which is exact since all
  ranks hold the same model at known samples; shadow: a separate job of f x the epochs, whose
  final line evaluates the consensus of the final round at the exact sample count), so every
  point is a real model at a real sample count;
- vs ring: that loss relative to the ring's at the same samples;
- penalty at f (per seed): the statistical-efficiency penalty, samples the algorithm used to
  reach its loss divided by the samples the synchronous ring needed to reach the same loss
  (first crossing of the ring's interpolated held-out curve of the same seed): 1.10 means
  10 % more samples for the same loss; "<=1" when the ring never got that low in the run;
- penalty, normalized: the geometric mean over seeds and both points of the penalty divided
  by the ring's own ratio at that point (the ring's final loss is often reached earlier than
  at the end, on a plateau such as a9a's); points where the ring never got as low count as
  better and are left out ("<=1" when all are);
- rounds/step: the shadow thread's rounds per local step of rank 0 (sync frequency) in the
  full-length job, gap: the mean model_gap there.

The header line gives the range of the 1-minute load average at the end of the runs: regime A
(no --step-delay-ms) is CPU-bound, so other work on the machine lowers the sync frequency.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

ALGOS = ["ring", "ma", "bmuf", "easgd"]
FRACTIONS = [0.25, 0.5, 1.0]
ROWS = {"optdigits": 3823, "a9a": 32561, "mnist": 2000}
DEFAULT_EPOCHS = {"optdigits": 10.0, "a9a": 3.0, "mnist": 10.0}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_algo(spec):
    """`ring`, `ma`, `bmuf`, `easgd`, or `label=algo:options` for a variant."""
    if "=" not in spec:
        return spec, spec, []
    label, rest = spec.split("=", 1)
    algo, _, opts = rest.partition(":")
    return label, algo, opts.split()


def run(binary, data_dir, dataset, algo, workers, seed, epochs, batch, extra):
    algo, extra = algo[0], extra + algo[1]
    num_ps = 1 if algo == "easgd" else 0
    world = workers + num_ps
    port = free_port()
    steps = epochs * ROWS[dataset] / (workers * batch)
    every = max(1, int(steps / 24))
    args = [
        binary,
        "--data-dir", data_dir,
        "--dataset", dataset,
        "--epochs", str(epochs),
        "--seed", str(seed),
        "--batch-size", str(batch),
        "--log-every", str(every),
        "--eval-every", str(every),
        "--checkpoint-every", "3600",
    ] + extra
    if algo != "ring":
        args += ["--shadow", algo]
    procs = []
    started = time.time()
    for rank in reversed(range(world)):
        env = dict(os.environ)
        for k in ["CONVERGE_CHECKPOINT_DIR", "CONVERGE_BATCH_SIZE", "CONVERGE_NUM_PS"]:
            env.pop(k, None)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            CONVERGE_GENERATION="1",
            CONVERGE_NUM_PS=str(num_ps),
        )
        procs.append(
            (rank, subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True))
        )
    out = {}
    for rank, p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"{dataset} {algo} seed {seed}: rank {rank} exited {p.returncode}")
        out[rank] = stdout
    wall = time.time() - started
    lines = [json.loads(l.split(" ", 1)[1]) for l in out[0].splitlines()
             if l.startswith("CONVERGE_PROGRESS ")]
    return lines, wall, loadavg()


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def curve(lines):
    """(samples, eval_loss) points, the final line last."""
    pts = [(l["samples"], l["eval_loss"]) for l in lines if "eval_loss" in l]
    return pts


def loss_at(pts, s):
    """Held-out loss at sample count s, interpolated linearly."""
    if s <= pts[0][0]:
        return pts[0][1]
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if s0 <= s <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (s - s0) / (s1 - s0)
    return pts[-1][1]


def samples_to(pts, target):
    """First sample count at which the (interpolated) curve reaches target; None if never."""
    if pts[0][1] <= target:
        return pts[0][0]
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l1 <= target < l0:
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="target/release/converge-trainer")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--datasets", default="optdigits,a9a,mnist")
    ap.add_argument("--algos", default=",".join(ALGOS),
                    help="ring, ma, bmuf, easgd, or label=algo:options (a variant)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=None,
                    help="passes over the training set [default: per dataset]")
    ap.add_argument("--extra", default="", help="more trainer options for every run")
    ap.add_argument("--json", help="also write every run's curve (and wall time) here")
    ap.add_argument("--from-json", help="summarize the runs saved by --json instead of running")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    specs = {label: (algo, opts) for label, algo, opts in map(parse_algo, a.algos.split(","))}
    algos = list(specs)
    extra = a.extra.split()
    runs = {}
    if a.from_json:
        with open(a.from_json) as f:
            for k, v in json.load(f).items():
                d, al, sd, fr = k.split("/")
                if isinstance(v, list):  # saved without wall times
                    v = {"lines": v, "wall": None}
                runs[(d, al, int(sd), float(fr))] = (v["lines"], v["wall"], v.get("load"))
    for ds in a.datasets.split(",") if not a.from_json else []:
        epochs = a.epochs or DEFAULT_EPOCHS[ds]
        for seed in seeds:
            for algo in algos:
                for frac in FRACTIONS if specs[algo][0] != "ring" else [1.0]:
                    lines, wall, load = run(a.binary, a.data_dir, ds, specs[algo], a.workers,
                                            seed, epochs * frac, a.batch, extra)
                    runs[(ds, algo, seed, frac)] = (lines, wall, load)
                    print(f"# {ds} {algo} seed {seed} x{frac}: final {curve(lines)[-1]} "
                          f"in {wall:.1f} s, load {load:.1f}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{d}/{al}/{s}/{fr}": {"lines": r[0], "wall": r[1], "load": r[2]}
                       for (d, al, s, fr), r in runs.items()}, f)

    def point(ds, algo, seed, frac):
        """(samples, held-out loss) of the model after frac of the job."""
        if specs[algo][0] == "ring":
            pts = curve(runs[(ds, algo, seed, 1.0)][0])
            s = frac * pts[-1][0]
            return s, loss_at(pts, s)
        return curve(runs[(ds, algo, seed, frac)][0])[-1]

    mean = statistics.mean
    loads = [r[2] for r in runs.values() if r[2] is not None]
    load = f"; load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""
    print(f"W = {a.workers} workers, batch {a.batch} per worker, seeds {a.seeds}, "
          f"extra options {a.extra!r}; held-out loss, mean over seeds{load}\n")
    print("| dataset | algorithm | loss at 25 % | at 50 % | at 100 % | vs ring 25 / 50 / 100 % | "
          "penalty at 50 % (per seed) | at 100 % | penalty, normalized | rounds/step | gap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ds in a.datasets.split(","):
        if not any(k[0] == ds for k in runs):
            continue
        for algo in algos:
            losses = {f: [point(ds, algo, sd, f)[1] for sd in seeds] for f in FRACTIONS}
            ring = {f: [point(ds, "ring", sd, f)[1] for sd in seeds] for f in FRACTIONS} \
                if "ring" in specs else None
            rel = " / ".join(f"{100 * (mean(losses[f]) / mean(ring[f]) - 1):+.1f} %"
                             for f in FRACTIONS) if ring else "-"
            pens, norm = {}, []
            for f in (0.5, 1.0):
                ps = []
                for sd in seeds:
                    s, l = point(ds, algo, sd, f)
                    rpts = curve(runs[(ds, "ring", sd, 1.0)][0]) if ring else None
                    r = samples_to(rpts, l) if ring else None
                    ps.append(f"{s / r:.2f}" if r else "<=1")
                    if r:
                        # Against the ring's own ratio at that point (its curve's noise).
                        rs, rl = point(ds, "ring", sd, f)
                        norm.append((s / r) / (rs / samples_to(rpts, rl)))
                pens[f] = ", ".join(ps)
            rps, gaps = [], []
            for sd in seeds:
                lines, wall, _ = runs[(ds, algo, sd, 1.0)]
                r = [l["sync_rounds_per_s"] for l in lines if "sync_rounds_per_s" in l]
                g = [l["model_gap"] for l in lines if "model_gap" in l]
                if r and wall and lines[-1]["step"] > 0:
                    rps.append(mean(r) * wall / lines[-1]["step"])
                if g:
                    gaps.append(mean(g))
            print(f"| {ds} | {algo} | {mean(losses[0.25]):.4f} | {mean(losses[0.5]):.4f} | "
                  f"{mean(losses[1.0]):.4f} | {rel} | {pens[0.5]} | {pens[1.0]} | "
                  f"{f'{statistics.geometric_mean(norm):.2f}' if norm else '<=1'} | "
                  f"{f'{mean(rps):.2f}' if rps else '-'} | {f'{mean(gaps):.3f}' if gaps else '-'} |")


if __name__ == "__main__":
    main()
