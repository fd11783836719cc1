#!/usr/bin/env bash
# Runs a whole Converge cluster on this machine: NATS with JetStream, the allocator, three
# agents with 4 fake GPUs each, and six real training jobs (four datasets, one through a parameter server) submitted over
# time; serves the web dashboard (its URL is printed), shows a live view of the jobs in the
# terminal and stops everything cleanly on Ctrl-C, once every job has finished, or after
# --duration seconds (--stay: keeps the cluster and the dashboard up until Ctrl-C). Ends with
# a one-line verdict ("6/6 jobs completed in 154 s"). Without a terminal (a log, CI) it
# prints a line per change instead of redrawing the table.
#
#   ./deploy/local-cluster.sh [--duration SECONDS] [--summary FILE] [--jobs "SPEC..."] [--agents N]
#                             [--allocator-arg ARG]... [--until-done N] [--dashboard ADDR]
#                             [--stay] [--keep] [--debug]
#
# Needs: Rust (cargo) and python3 with pip (to fetch the pinned nats-server). Builds in
# release mode first (4 to 7.5 min cold on 2 cores, 0.7 GB in target/release). Logs and
# checkpoints live in a temporary directory, removed at the end unless --keep.
set -euo pipefail

usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'HELP'
Options:
  --duration SECONDS   stop after this long even if jobs are still running (default 300)
  --summary FILE       write a JSON summary of the run (per job: loss, steps, generations,
                       GPUs over time)
  --scheduling-interval DURATION  allocator scheduling interval (default 5s; --epoch is the old name)
  --restart-cost DUR   allocator restart cost knob (default 10s)
  --jobs "SPEC..."     submit these job specs instead of the six examples (space-separated
                       paths, --spacing seconds apart)
  --spacing SECONDS    seconds between submissions (default 15)
  --agents N           agents (hosts) with 4 fake GPUs each (default 3)
  --gpu-types LIST     mix GPU generations: agent i gets the i-th TYPE[:SPEED] of the
                       comma-separated LIST, cycling (e.g. t4:0.25,a100); SPEED in (0, 1]
                       stretches converge-trainer's step time (--fake-gpu-speed). Jobs may
                       then name gpu_types = ["a100"]; converge hosts shows the types
  --allocator-arg ARG  pass ARG to converge-allocator (repeatable), e.g.
                       --allocator-arg --policy --allocator-arg fair
  --until-done N       stop once N jobs exist and all have finished (default: the number of
                       specs; give the trial count when a spec is a sweep file)
  --dashboard ADDR     serve `converge dashboard` on ADDR (default 127.0.0.1:8080; a port
                       in use falls back to a free one; `off` for none)
  --stay               once the jobs have finished (or --duration ran out), keep NATS, the
                       allocator, the agents and the dashboard running until Ctrl-C, to look
                       around (the dashboard, `converge jobs -a`, `converge hosts`)
  --keep               keep the working directory (logs, checkpoints) and print its path
  --debug              build and run debug binaries instead of release
  -h, --help           this text
HELP
}

duration=300
summary=""
interval=5s
restart_cost=10s
keep=0
profile=release
job_list=""
spacing=15
agents=3
gpu_types=""
allocator_args=()
until_done=""
dashboard=127.0.0.1:8080
stay=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) duration="$2"; shift 2 ;;
        --summary) summary="$2"; shift 2 ;;
        --scheduling-interval|--epoch) interval="$2"; shift 2 ;;
        --restart-cost) restart_cost="$2"; shift 2 ;;
        --jobs) job_list="$2"; shift 2 ;;
        --spacing) spacing="$2"; shift 2 ;;
        --agents) agents="$2"; shift 2 ;;
        --gpu-types) gpu_types="$2"; shift 2 ;;
        --allocator-arg) allocator_args+=("$2"); shift 2 ;;
        --until-done) until_done="$2"; shift 2 ;;
        --dashboard) dashboard="$2"; shift 2 ;;
        --stay) stay=1; shift ;;
        --keep) keep=1; shift ;;
        --debug) profile=debug; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "local-cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$duration" =~ ^[0-9]+$ ]] || { echo "local-cluster.sh: --duration takes whole seconds" >&2; exit 2; }
[[ "$spacing" =~ ^[0-9]+$ ]] || { echo "local-cluster.sh: --spacing takes whole seconds" >&2; exit 2; }
[[ "$agents" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster.sh: --agents takes a positive count" >&2; exit 2; }
[[ -z "$until_done" || "$until_done" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster.sh: --until-done takes a positive count" >&2; exit 2; }
if [[ -n "$summary" ]]; then
    summary=$(realpath -m "$summary")
fi
if [[ -n "$job_list" ]]; then
    job_list=$(for spec in $job_list; do realpath -m "$spec"; done | tr '\n' ' ')
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=deploy/cluster-common.sh
source deploy/cluster-common.sh

echo "==> building ($profile)"
# Only the four binaries the cluster runs.
packages=(-p converge-cli -p converge-agent -p converge-allocator -p converge-trainer)
if [[ "$profile" == release ]]; then
    cargo build --release "${packages[@]}"
else
    # The selection ./run-tests.sh builds: after it, nothing is compiled again (a smaller
    # selection unifies crate features differently and rebuilds about 18 crates).
    cargo build --workspace --bins
fi
bin="$root/target/$profile"
export PATH="$bin:$PATH"
nats_server=$("$root/deploy/get-nats-server.sh")

work=$(mktemp -d -t converge-local.XXXXXX)
pids=()
submitter=""

cleanup() {
    trap - EXIT INT TERM
    echo
    echo "==> stopping"
    [[ -n "$submitter" ]] && kill "$submitter" 2>/dev/null || true
    [[ -n "${dashboard_pid:-}" ]] && { kill -TERM "$dashboard_pid" 2>/dev/null || true; wait "$dashboard_pid" 2>/dev/null || true; }
    # Agents first: they stop their workers (SIGTERM, checkpoint, exit).
    for pid in "${agent_pids[@]:-}"; do [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${agent_pids[@]:-}"; do [[ -n "$pid" ]] && wait "$pid" 2>/dev/null || true; done
    [[ -n "${allocator_pid:-}" ]] && { kill -TERM "$allocator_pid" 2>/dev/null || true; wait "$allocator_pid" 2>/dev/null || true; }
    [[ -n "${nats_pid:-}" ]] && { kill -TERM "$nats_pid" 2>/dev/null || true; wait "$nats_pid" 2>/dev/null || true; }
    [[ -n "${stay_pid:-}" ]] && kill "$stay_pid" 2>/dev/null || true
    local verdict=""
    [[ -s "$work/verdict" ]] && verdict=$(cat "$work/verdict")
    if [[ "$keep" == 1 ]]; then
        echo "logs and checkpoints kept in $work"
    else
        rm -rf "$work"
    fi
    # The run's outcome, last.
    [[ -z "$verdict" ]] || echo "$verdict"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "==> starting NATS (JetStream in $work/nats)"
mkdir -p "$work/nats/ports"
setsid "$nats_server" -a 127.0.0.1 -p -1 -js -sd "$work/nats/js" --ports_file_dir "$work/nats/ports" \
    >"$work/nats.log" 2>&1 &
nats_pid=$!
for _ in $(seq 100); do
    ports=$(ls "$work"/nats/ports/*.ports 2>/dev/null | head -n1 || true)
    [[ -n "$ports" ]] && break
    sleep 0.1
done
[[ -n "$ports" ]] || { echo "nats-server did not start; see $work/nats.log" >&2; exit 1; }
CONVERGE_NATS_URL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["nats"][0])' "$ports")
export CONVERGE_NATS_URL
echo "    $CONVERGE_NATS_URL"

echo "==> starting the allocator (scheduling interval $interval, restart cost $restart_cost)"
setsid converge-allocator --scheduling-interval "$interval" --restart-cost "$restart_cost" --horizon 60s \
    "${allocator_args[@]}" >"$work/allocator.log" 2>&1 &
allocator_pid=$!

IFS=, read -r -a type_list <<<"$gpu_types"
agent_pids=()
for i in $(seq "$agents"); do
    type_args=()
    if [[ ${#type_list[@]} -gt 0 ]]; then
        entry=${type_list[$(( (i - 1) % ${#type_list[@]} ))]}
        type_args=(--fake-gpu-type "${entry%%:*}")
        [[ "$entry" != *:* ]] || type_args+=(--fake-gpu-speed "${entry#*:}")
    fi
    setsid converge-agent --host-id "node-$i" --fake-gpus 4 "${type_args[@]}" --advertise-addr 127.0.0.1 \
        --log-dir "$work/logs" --checkpoint-root "$work/checkpoints" --state-dir "$work/state" \
        --stop-grace 10s \
        >"$work/agent-$i.log" 2>&1 &
    agent_pids+=("$!")
done
echo "==> $agents agents x 4 fake GPUs${gpu_types:+ of types $gpu_types}; worker logs in $work/logs"

# The dashboard: on the address asked for, else (port in use) on a free one.
start_dashboard() {
    setsid converge dashboard --listen "$1" >"$work/dashboard.out" 2>"$work/dashboard.log" &
    dashboard_pid=$!
    for _ in $(seq 50); do
        url=$(sed -n 's/^dashboard: //p' "$work/dashboard.out")
        [[ -n "$url" ]] && return 0
        kill -0 "$dashboard_pid" 2>/dev/null || break
        sleep 0.1
    done
    dashboard_pid=""
    return 1
}
if [[ "$dashboard" != off ]]; then
    if start_dashboard "$dashboard" || start_dashboard 127.0.0.1:0; then
        echo "==> dashboard: $url"
    else
        echo "==> the dashboard did not start; see $work/dashboard.log" >&2
    fi
fi

# Jobs arrive over time: (seconds after the previous submission, spec).
schedule_jobs || { echo "local-cluster.sh: no job spec $missing_spec" >&2; exit 2; }
submit_jobs_in_background converge

monitor_args=(monitor --interval 2s --duration "${duration}s" --until-done "${until_done:-${#jobs[@]}}"
    --verdict-file "$work/verdict")
[[ -n "$summary" ]] && monitor_args+=(--summary "$summary")
[[ -t 1 ]] || monitor_args+=(--no-clear)
converge "${monitor_args[@]}" || true
if [[ "$stay" == 1 ]]; then
    echo "==> --stay: the cluster stays up until Ctrl-C"
    [[ -n "${dashboard_pid:-}" ]] && echo "    dashboard: $url"
    echo "    from another shell: CONVERGE_NATS_URL=$CONVERGE_NATS_URL $bin/converge jobs -a"
    sleep infinity &
    stay_pid=$!
    wait "$stay_pid" || true
fi
