#!/usr/bin/env bash
# Load sweep on generated workloads: `quality` (work declared, and target loss only) against
# the `pollux` baseline at 0.5/1.0/1.5/2.0x the Pollux job load (80/160/240/320 jobs over
# 8 hours sampled from the Philly trace, seeds 101..108), 16 nodes x 4 GPUs, first fit.
# Prints a markdown table (docs/scheduling.md, "Load sweep"); mean JCT is the mean over the
# eight workloads of each one's mean JCT.
#
# Usage: sim/scripts/load-sweep.sh [OUT_DIR]   (needs `cargo build --release -p converge-sim`)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
sim=target/release/converge-sim
[[ -x $sim ]] || { echo "load-sweep.sh: build it first: cargo build --release -p converge-sim" >&2; exit 1; }
out=${1:-$(mktemp -d -t converge-load-sweep.XXXXXX)}
mkdir -p "$out"
run() { # load policy work
    local load=$1 policy=$2 work=$3 files=()
    for s in 101 102 103 104 105 106 107 108; do files+=("$out/w-$load-$s.csv"); done
    "$sim" simulate --workload "${files[@]}" --policy "$policy" --work "$work" \
        --out "$out/$policy-$work-$load" >/dev/null
}
for load in 0.5 1.0 1.5 2.0; do
    jobs=$(python3 -c "print(int(160 * $load))")
    for s in 101 102 103 104 105 106 107 108; do
        "$sim" workload --jobs "$jobs" --hours 8 --seed "$s" --out "$out/w-$load-$s.csv" >/dev/null
    done
    run "$load" quality declared &
    run "$load" quality target-loss
    wait
    run "$load" pollux declared
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def stats(name):
    d = json.load(open(f"{out}/{name}/summary.json"))
    means = [sum(j.values()) / len(j) for j in d["jcts"].values()]
    return sum(means) / len(means), d["mean_restarts_per_job"]
print("| load | `quality`, declared | `quality`, target loss only | `pollux` | ratios (declared / target loss) | restarts/job (declared / target loss / `pollux`) |")
print("|---|---|---|---|---|---|")
for load in ["0.5", "1.0", "1.5", "2.0"]:
    (qd, rd), (qt, rt), (p, rp) = (stats(f"quality-declared-{load}"),
                                   stats(f"quality-target-loss-{load}"),
                                   stats(f"pollux-declared-{load}"))
    print(f"| {load}× | {qd:,.0f} s | {qt:,.0f} s | {p:,.0f} s | {qd/p:.2f} / {qt/p:.2f} | {rd:.2f} / {rt:.2f} / {rp:.2f} |")
PY
