#!/usr/bin/env bash
# Contention-aware placement on the shaped cluster (docs/communication.md, "Contention-aware
# placement"). Two experiments on deploy/netns-cluster.sh, each on a fresh cluster:
#
#   grid  ring jobs of converge-trainer (an MLP whose all-reduce is a real share of a step on
#         the shaped links) started directly in the hosts' namespaces on placements of 1-4
#         hosts, alone and two at a time on the same hosts: measured seconds per step and
#         sync time per placement -> OUT/ring-steps.csv (tests/netns/ring_grid.py). The
#         contention model's predictions against it are a converge-sched test
#         (`cargo test -p converge-sched shaped_cluster -- --nocapture`, on the copy in
#         data/netns/ring-steps.csv).
#   jct   the same kind of jobs submitted to the allocator (FIFO, fixed sizes) once with
#         --placement first-fit and once with --placement bco: per job its placement, step
#         time and completion time -> OUT/jct-first-fit.json, OUT/jct-bco.json and a table.
#   scaling  (only with --only scaling; docs/communication.md, "Throughput scaling on shaped
#         links") ring, parameter-server, S-MA, S-BMUF and S-EASGD jobs of 1, 2, 4, 8 workers,
#         one per host, started directly in the hosts' namespaces (tests/netns/scaling.py) on
#         9 hosts (the shard of ps and S-EASGD on the ninth): samples/s, scaling efficiency,
#         sync rounds/s and model gap -> OUT/scaling.csv, OUT/scaling.md, OUT/scaling.svg.
#         --rate defaults to 200mbit there (the measured setting); SCALING_ARGS adds options of scaling.py.
#
#   sudo ./deploy/placement-bench.sh [--out DIR] [--rate RATE] [--only grid|jct|scaling]
#                                    [--bin DIR] [--debug] [--no-build]
#
# Needs root (network namespaces); about 8 minutes on two cores (grid and jct), about 6 for
# scaling.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

out=bench-out
rate=""
only=""
bin=""
profile=release
build=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --rate) rate="$2"; shift 2 ;;
        --only) only="$2"; shift 2 ;;
        --bin) bin=$(realpath "$2"); build=0; shift 2 ;;
        --debug) profile=debug; shift ;;
        --no-build) build=0; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) echo "placement-bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ -z "$only" || "$only" == grid || "$only" == jct || "$only" == scaling ]] || { echo "placement-bench.sh: --only takes grid, jct or scaling" >&2; exit 2; }
if [[ -z "$rate" ]]; then
    if [[ "$only" == scaling ]]; then rate=200mbit; else rate=1gbit; fi
fi
mkdir -p "$out"
out=$(realpath "$out")
if [[ "$build" == 1 ]]; then
    packages=(-p converge-cli -p converge-agent -p converge-allocator -p converge-trainer)
    if [[ "$profile" == release ]]; then cargo build --release --locked "${packages[@]}"; else cargo build --locked "${packages[@]}"; fi
fi
bin=${bin:-$root/target/$profile}

cluster_pid=""
stop_cluster() {
    if [[ -n "$cluster_pid" ]]; then
        kill -TERM "$cluster_pid" 2>/dev/null || true
        wait "$cluster_pid" 2>/dev/null || true
        cluster_pid=""
    fi
}
trap stop_cluster EXIT

# start_cluster LOG ARGS...: a cluster of the bench's name, up, its variables in $out/env.
start_cluster() {
    local log=$1
    shift
    rm -f "$out/env"
    deploy/netns-cluster.sh --name cvbench --subnet 10.213.49 --rate "$rate" --bin "$bin" \
        --up --env-file "$out/env" "$@" >"$log" 2>&1 &
    cluster_pid=$!
    for _ in $(seq 600); do
        [[ -f "$out/env" ]] && return 0
        kill -0 "$cluster_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.1
    done
    cat "$log" >&2
    exit 1
}

if [[ -z "$only" || "$only" == grid ]]; then
    echo "==> grid: ring jobs on 1-4 hosts, alone and two at a time ($rate links)"
    start_cluster "$out/grid-cluster.log" --agents 4 --gpus 4
    python3 tests/netns/ring_grid.py --env "$out/env" --out "$out/ring-steps.csv"
    stop_cluster
fi

if [[ "$only" == scaling ]]; then
    echo "==> scaling: ring, ps, S-MA, S-BMUF, S-EASGD on 1-8 workers ($rate links)"
    start_cluster "$out/scaling-cluster.log" --agents 9 --gpus 1
    # shellcheck disable=SC2086
    python3 tests/netns/scaling.py --env "$out/env" --out "$out/scaling.csv" --md "$out/scaling.md" \
        --svg "$out/scaling.svg" ${SCALING_ARGS:-}
    stop_cluster
fi

if [[ -z "$only" || "$only" == jct ]]; then
    specs=(tests/netns/bench-jobs/{a,b,c,d,e,f}.toml)
    for placement in first-fit bco; do
        echo "==> jct: ${#specs[@]} ring jobs, FIFO, placement $placement"
        start_cluster "$out/jct-$placement-cluster.log" --agents 4 --gpus 2 --placement "$placement" \
            --scheduling-interval 2s --restart-cost 30s --allocator-arg --policy --allocator-arg fifo
        python3 tests/netns/jct_run.py --env "$out/env" --out "$out/jct-$placement.json" --spacing 2 "${specs[@]}"
        stop_cluster
    done
    python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = {p: {r["job"]: r for r in json.load(open(f"{out}/jct-{p}.json"))} for p in ("first-fit", "bco")}
def where(r):
    return " ".join(f"{h.replace('node-', 'h')}x{n}" for h, n in sorted((r.get("placement") or {}).items()))
print("| job | first fit: hosts | step s | JCT s | BCO: hosts | step s | JCT s |")
print("|---|---|---|---|---|---|---|")
for job in runs["first-fit"]:
    f, b = runs["first-fit"][job], runs["bco"][job]
    print(f"| {job} | {where(f)} | {f['step_time_s']:.3f} | {f['jct_s']:.0f} | {where(b)} | {b['step_time_s']:.3f} | {b['jct_s']:.0f} |")
mean = {p: sum(r["jct_s"] for r in runs[p].values()) / len(runs[p]) for p in runs}
print(f"| mean | | | {mean['first-fit']:.0f} | | | {mean['bco']:.0f} |")
print(f"BCO mean JCT {100 * (mean['bco'] / mean['first-fit'] - 1):+.1f} % against first fit")
PY
fi
