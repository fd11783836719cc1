#!/usr/bin/env bash
# A live sweep on the local cluster, once as a user gets it (the allocator's default policy,
# the sweep's default early stopping, `predicted`) and once under fair share without early
# stopping (`--policy fair`, the sweep file with `early_stop = "none"`):
# examples/sweeps/optdigits.toml (12 real converge-trainer trials with a plateau rule and a
# deadline) on --agents hosts of 4 fake GPUs (default 2: 8 GPUs for 12 trials, so trials
# compete). Prints SLAQ's measures of both runs side by side (docs/local-cluster.md, "A live sweep"):
# average normalized loss over time, time to 80/90/95 % loss reduction, GPU-hours of the
# sweep, its best trial (by held-out loss where every trial reported one) with its held-out
# and training loss, and how the trials ended.
#
#   ./deploy/sweep-demo.sh [--out DIR] [--agents N] [--duration SECONDS] [--debug]
#
# The run summaries (converge monitor --summary), logs and the table go to --out (default: a
# new temporary directory). About twice --duration at most (default 900 s per run).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=deploy/demo-common.sh
source "$root/deploy/demo-common.sh"
agents=2 duration=900
demo_args sweep-demo.sh agents agents "$@"
sweep="$root/examples/sweeps/optdigits.toml"
trials=12

# The same sweep without early stopping, for the fair-share run.
no_stop="$out/optdigits-no-early-stop.toml"
sed 's/^early_stop = "predicted"$/early_stop = "none"/' "$sweep" > "$no_stop"
grep -q '^early_stop = "none"$' "$no_stop" || { echo "sweep-demo: cannot turn early stopping off in $no_stop" >&2; exit 1; }

run() {
    local name="$1" file="$2"; shift 2
    echo "==> $name run ($agents agents x 4 GPUs, $trials trials)"
    local args=()
    for a in "$@"; do args+=(--allocator-arg "$a"); done
    demo_run_cluster "$name" --agents "$agents" --until-done "$trials" --jobs "$file" ${args[@]+"${args[@]}"}
}
run default "$sweep"
run fair "$no_stop" --policy fair

python3 - "$out/default.json" "$out/fair.json" <<'PY' | tee "$out/table.md"
import json, sys

names = ["default, predicted stop", "fair, no early stop"]
runs = [json.load(open(p)) for p in sys.argv[1:3]]

def smoothed(points, k=5):
    """(t, loss) with each loss the mean of the last k reports (minibatch noise)."""
    out = []
    for i, p in enumerate(points):
        window = points[max(0, i - k + 1): i + 1]
        out.append((p["t"], sum(q["loss"] for q in window) / len(window)))
    return out

# Per trial, the loss it starts from and the lowest (smoothed) loss either run reached:
# SLAQ's normalization, 1 at the start, 0 at the best known.
curves = [{j["id"]: smoothed(j["loss_over_samples"]) for j in r["jobs"]} for r in runs]
ids = sorted(set(curves[0]) & set(curves[1]))
if len(ids) < 2:
    sys.exit(f"sweep-demo: only {len(ids)} trials reported in both runs; see the logs in the output folder")
start = {i: max(c[i][0][1] for c in curves if c[i]) for i in ids}
floor = {i: min(l for c in curves for _, l in c[i]) for i in ids}

def measures(run, curve):
    jobs = {j["id"]: j for j in run["jobs"]}
    t0 = run["started_at"]
    end_of_run = run["duration_s"]
    sub = {i: jobs[i]["submitted_at"] - t0 for i in ids}
    end = {i: (jobs[i]["finished_at"] - t0) if jobs[i]["finished_at"] else end_of_run for i in ids}
    def norm(i, l):
        span = start[i] - floor[i]
        return 1.0 if span <= 0 else min(1.0, max(0.0, (l - floor[i]) / span))
    # Average over time (2 s grid) of the mean normalized loss of submitted, unfinished trials.
    horizon = max(end.values())
    samples, t = [], min(sub.values())
    while t <= horizon:
        active = [i for i in ids if sub[i] <= t < end[i]]
        if active:
            vals = []
            for i in active:
                seen = [l for (ti, l) in curve[i] if ti <= t]
                vals.append(norm(i, seen[-1]) if seen else 1.0)
            samples.append(sum(vals) / len(vals))
        t += 2.0
    avg = sum(samples) / len(samples)
    times = []
    for level in (0.2, 0.1, 0.05):
        got = [next((ti - sub[i] for ti, l in curve[i] if norm(i, l) <= level), None) for i in ids]
        got = [g for g in got if g is not None]
        times.append((sum(got) / len(got) if got else None, len(got)))
    # GPU-hours held: the GPU count over time, integrated until the trial ended.
    gpu_h = 0.0
    for i in ids:
        g = jobs[i]["gpus_over_time"]
        for a, b in zip(g, g[1:] + [{"t": end[i], "gpus": 0}]):
            gpu_h += a["gpus"] * max(0.0, min(b["t"], end[i]) - a["t"]) / 3600.0
    final = {i: curve[i][-1][1] for i in ids if curve[i]}
    # The trial a user picks: the lowest held-out loss where every trial reported one.
    held_out = {i: jobs[i]["last_eval_loss"] for i in final}
    if all(v is not None for v in held_out.values()):
        best, ranked_by = min(held_out, key=held_out.get), "held-out loss"
    else:
        best, ranked_by = min(final, key=final.get), "training loss: a trial reported no held-out loss"
    ends = {}
    for i in ids:
        e = jobs[i].get("end")
        key = e["reason"] if e else jobs[i]["phase"]
        ends[key] = ends.get(key, 0) + 1
    return dict(avg=avg, times=times, gpu_h=gpu_h, best=best, best_loss=final[best], ranked_by=ranked_by,
                best_eval=jobs[best]["last_eval_loss"], makespan=max(end.values()) - min(sub.values()),
                ends=ends)

m = [measures(r, c) for r, c in zip(runs, curves)]
fmt = lambda v, d=0: "—" if v is None else f"{v:.{d}f}"
pct = lambda a, b: "—" if a is None or b in (None, 0) else f"{(a / b - 1) * 100:+.1f} %"
print(f"| measure ({len(ids)} trials) | {names[0]} | {names[1]} | change |")
print("|---|---|---|---|")
print(f"| average normalized loss | {m[0]['avg']:.3f} | {m[1]['avg']:.3f} | {pct(m[0]['avg'], m[1]['avg'])} |")
for k, level in enumerate((80, 90, 95)):
    a, b = m[0]["times"][k], m[1]["times"][k]
    print(f"| time to {level} % loss reduction, s (trials) | {fmt(a[0])} ({a[1]}) | {fmt(b[0])} ({b[1]}) | {pct(a[0], b[0])} |")
print(f"| GPU-hours of the sweep | {m[0]['gpu_h']:.3f} | {m[1]['gpu_h']:.3f} | {pct(m[0]['gpu_h'], m[1]['gpu_h'])} |")
print(f"| best trial | {m[0]['best']} (by {m[0]['ranked_by']}) | {m[1]['best']} (by {m[1]['ranked_by']}) | |")
print(f"| best trial's held-out loss | {fmt(m[0]['best_eval'], 4)} | {fmt(m[1]['best_eval'], 4)} | {pct(m[0]['best_eval'], m[1]['best_eval'])} |")
print(f"| best trial's final training loss | {m[0]['best_loss']:.4f} | {m[1]['best_loss']:.4f} | {pct(m[0]['best_loss'], m[1]['best_loss'])} |")
print(f"| sweep makespan, s | {m[0]['makespan']:.0f} | {m[1]['makespan']:.0f} | {pct(m[0]['makespan'], m[1]['makespan'])} |")
print(f"| how trials ended | {m[0]['ends']} | {m[1]['ends']} | |")
PY
echo "summaries, logs and table.md in $out"
