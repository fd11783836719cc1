#!/usr/bin/env bash
# Adaptive against fixed batch sizes in the local cluster. Runs the adaptive example jobs
# (examples/jobs/optdigits-softmax.toml and mnist-mlp.toml, both with a [batch] table)
# twice through deploy/local-cluster.sh: once as submitted (their batch follows their
# allocation), once with `--no-grad-stats` added to their command (no gradient statistics:
# each keeps its reference batch of 64 and is scheduled by throughput alone). Prints, per
# job, the training loss of both runs at equal samples (25, 50, 75 and 100 % of the job's
# epochs) and the final held-out loss, their completion times, and the batches each run got
# over time.
#
#   ./deploy/batch-demo.sh [--debug] [--out DIR] [--spacing SECONDS] [--duration SECONDS]
#
# The two run summaries (converge monitor --summary) and the table are written to --out
# (default: a new temporary directory).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=deploy/demo-common.sh
source "$root/deploy/demo-common.sh"
spacing=10 duration=400
demo_args batch-demo.sh spacing spacing "$@"
mkdir -p "$out/fixed-specs"

specs=("$root/examples/jobs/optdigits-softmax.toml" "$root/examples/jobs/mnist-mlp.toml")
fixed=()
for spec in "${specs[@]}"; do
    f="$out/fixed-specs/$(basename "$spec")"
    sed 's/^command = \["converge-trainer", /command = ["converge-trainer", "--no-grad-stats", /' "$spec" >"$f"
    grep -q -- '--no-grad-stats' "$f" || { echo "batch-demo.sh: cannot rewrite the command of $spec" >&2; exit 1; }
    fixed+=("$f")
done

run() {
    local name="$1"; shift
    echo "==> $name run"
    demo_run_cluster "$name" --spacing "$spacing" --jobs "$*"
}
run adaptive "${specs[@]}"
run fixed "${fixed[@]}"

python3 - "$out/adaptive.json" "$out/fixed.json" <<'PY' | tee "$out/table.md"
import json, sys

runs = [json.load(open(p)) for p in sys.argv[1:3]]
jobs = [{j["id"]: j for j in r["jobs"]} for r in runs]

def fmt(x, spec="{:.4f}"):
    return "-" if x is None else spec.format(x)

def jct(j):
    return None if j.get("finished_at") is None else j["finished_at"] - j["submitted_at"]

def loss_at(j, samples, width):
    """Mean training loss reported in (samples - width, samples]: rank 0's loss (itself a
    mean over 10 steps) as the monitor saw it every 2 s."""
    pts = [p["loss"] for p in j.get("loss_over_samples", [])
           if samples - width < p["samples"] <= samples]
    return sum(pts) / len(pts) if pts else None

def batches(j):
    seq = []
    for b in j.get("batches_over_time", []):
        if b["total"] == 0:
            continue
        micro = f"{b['per_worker']}×{b['accum_steps'] + 1}" if b["accum_steps"] else f"{b['per_worker']}"
        mode = "" if b["adaptive"] else " (no stats)"
        seq.append(f"{b['total']} [{micro}/worker]{mode}@{b['t']:.0f}s")
    return " → ".join(seq) or "-"

def rel(a, f):
    return None if a is None or f is None or f == 0 else 100.0 * (a / f - 1.0)

print(f"adaptive run: {runs[0]['duration_s']:.0f} s ({runs[0]['ended_because']}); "
      f"fixed run: {runs[1]['duration_s']:.0f} s ({runs[1]['ended_because']})\n")
print("Training loss at equal samples (mean of the losses reported in the last 10 % of samples before each mark), adaptive / fixed (difference):\n")
print("| job | samples (adaptive / fixed) | 25 % | 50 % | 75 % | 100 % | final held-out loss |")
print("|---|---|---|---|---|---|---|")
for job in sorted(jobs[0]):
    a, f = jobs[0][job], jobs[1].get(job)
    if f is None:
        continue
    n = min(a["final_samples"], f["final_samples"])
    cells = []
    for frac in (0.25, 0.5, 0.75, 1.0):
        la, lf = loss_at(a, frac * n, 0.1 * n), loss_at(f, frac * n, 0.1 * n)
        cells.append(f"{fmt(la)} / {fmt(lf)} ({fmt(rel(la, lf), '{:+.1f} %')})")
    ea, ef = a["last_eval_loss"], f["last_eval_loss"]
    cells.append(f"{fmt(ea)} / {fmt(ef)} ({fmt(rel(ea, ef), '{:+.1f} %')})")
    print(f"| `{job}` | {a['final_samples']:,} / {f['final_samples']:,} | " + " | ".join(cells) + " |")
print()
print("| job | run | JCT | generations | GPUs over time | batch over time (total [per worker × micro-batches]) |")
print("|---|---|---|---|---|---|")
for job in sorted(jobs[0]):
    for name, j in (("adaptive", jobs[0][job]), ("fixed", jobs[1].get(job))):
        if j is None:
            continue
        gpus = " → ".join(f"{g['gpus']}@{g['t']:.0f}s" for g in j["gpus_over_time"])
        print(f"| `{job}` | {name} | {fmt(jct(j), '{:.0f} s')} | {j['generations']} | {gpus} | {batches(j)} |")
PY
echo "summaries and table in $out"
