#!/usr/bin/env bash
# Adaptive against fixed batch sizes in the local cluster. Runs the adaptive example jobs
# (examples/jobs/optdigits-softmax.toml and mnist-mlp.toml, both with a [batch] table)
# twice through deploy/local-cluster.sh: once as submitted (their batch follows their
# allocation), once with `--no-grad-stats` added to their command (no gradient statistics:
# each keeps its reference batch of 64 and is scheduled by throughput alone). Prints, per
# job, the loss at equal samples (the end of the same number of epochs) of both runs, their
# completion times and the batches the adaptive run got over time.
#
#   ./deploy/batch-demo.sh [--debug] [--out DIR] [--spacing SECONDS] [--duration SECONDS]
#
# The two run summaries (converge monitor --summary) and the table are written to --out
# (default: a new temporary directory).
set -euo pipefail

out=""
extra=()
spacing=10
duration=400
while [[ $# -gt 0 ]]; do
    case "$1" in
        --debug) extra+=(--debug); shift ;;
        --out) out="$2"; shift 2 ;;
        --spacing) spacing="$2"; shift 2 ;;
        --duration) duration="$2"; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "batch-demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -n "$out" ]] || out=$(mktemp -d -t converge-batch-demo.XXXXXX)
mkdir -p "$out/fixed-specs"
out=$(realpath "$out")

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
    "$root/deploy/local-cluster.sh" "${extra[@]}" --duration "$duration" --spacing "$spacing" \
        --summary "$out/$name.json" --jobs "$*" >"$out/$name.log" 2>&1 || true
    tail -n 3 "$out/$name.log"
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

def batches(j, t0):
    seq = []
    for b in j.get("batches_over_time", []):
        if b["total"] == 0:
            continue
        micro = f"{b['per_worker']}×{b['accum_steps'] + 1}" if b["accum_steps"] else f"{b['per_worker']}"
        mode = "" if b["adaptive"] else " (no stats)"
        seq.append(f"{b['total']} [{micro}/worker]{mode}@{b['t']:.0f}s")
    return " → ".join(seq) or "-"

print(f"adaptive run: {runs[0]['duration_s']:.0f} s ({runs[0]['ended_because']}); "
      f"fixed run: {runs[1]['duration_s']:.0f} s ({runs[1]['ended_because']})\n")
print("| job | run | samples | final train loss | final eval loss | eval loss vs fixed | JCT | generations | GPUs over time | batch over time (total [per worker × micro-batches]) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for job in sorted(jobs[0]):
    a, f = jobs[0][job], jobs[1].get(job)
    for name, j in (("adaptive", a), ("fixed", f)):
        if j is None:
            continue
        rel = None
        if name == "adaptive" and f and a["last_eval_loss"] and f["last_eval_loss"]:
            rel = 100.0 * (a["last_eval_loss"] / f["last_eval_loss"] - 1.0)
        gpus = " → ".join(f"{g['gpus']}@{g['t']:.0f}s" for g in j["gpus_over_time"])
        print(f"| `{job}` | {name} | {j['final_samples']:,} | {fmt(j['last_loss'])} | "
              f"{fmt(j['last_eval_loss'])} | {fmt(rel, '{:+.1f} %')} | {fmt(jct(j), '{:.0f} s')} | "
              f"{j['generations']} | {gpus} | {batches(j, 0)} |")
PY
echo "summaries and table in $out"
