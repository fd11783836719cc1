#!/usr/bin/env bash
# Stopping and starting every agent container in the middle of a job (deploy/docker-compose.yml):
#
#   1. `up -d` (2 fake GPUs per agent), submits examples/jobs/mnist-mlp.toml (1-6 workers)
#      and waits until it runs on two agents or more and has made progress
#   2. `compose stop agent-1 agent-2 agent-3`: each agent must stop its own workers (log
#      "shutting down: stopping all workers", every worker "stopped (exit code 143)", i.e.
#      checkpointed) and exit 0
#   3. `compose start` the agents: the containers usually get new IPs; since they advertise
#      their service names, the job's ranks find each other again, resume from the
#      checkpoint on the shared volume and the job completes
#
#   tests/compose/agent-restart.sh [--skip-build] [--keep]
#
# Prints the stop time, the time from `start` to the first new progress and the JCT. Tears
# everything down on exit (unless --keep). Needs what happy-path.sh needs.
set -euo pipefail

skip_build=0
keep=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-build) skip_build=1; shift ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "agent-restart.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
compose_file="$root/deploy/docker-compose.yml"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"
if docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose); else compose_cmd=(docker-compose); fi
project="converge-ar-$$-$(date +%s)"
compose() { "${compose_cmd[@]}" -p "$project" -f "$compose_file" "$@"; }
log() { printf '==> %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

nats_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export CONVERGE_NATS_PORT="$nats_port" CONVERGE_FAKE_GPUS=2 CONVERGE_EPOCH=5s \
    CONVERGE_RESTART_COST=10s CONVERGE_STOP_GRACE=10s
export CONVERGE_NATS_URL="nats://127.0.0.1:$nats_port"

failure=""
started_up=0
passed=0
fail() { failure="$*"; exit 1; }
cleanup() {
    local rc=$?
    set +e  # tear down whatever fails on the way (even writing to a closed output)
    trap '' PIPE
    trap - EXIT INT TERM
    if [[ $passed -eq 0 ]]; then
        echo "FAILED: ${failure:-exit status $rc}" >&2
        if [[ $started_up -eq 1 ]]; then
            compose ps || true
            compose logs --no-color --tail 30 || true
        fi
        [[ $rc -eq 0 ]] && rc=1
    fi
    if [[ $started_up -eq 1 ]]; then
        if [[ $keep -eq 1 ]]; then
            echo "kept: ${compose_cmd[*]} -p $project -f $compose_file down -v"
        else
            compose down -v --remove-orphans >/dev/null 2>&1 || true
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'failure=interrupted; exit 130' INT TERM
# A closed output pipe (| head) or terminal: tear down quietly rather than die untidied.
trap 'failure="output closed"; exec >/dev/null 2>&1; exit 141' PIPE HUP

if [[ $skip_build -eq 0 ]]; then
    "$root/deploy/build-images.sh" || fail "deploy/build-images.sh failed"
fi
[[ -x "$target_dir/release/converge" ]] || fail "$target_dir/release/converge is missing (cargo build --release -p converge-cli)"
cli=("$target_dir/release/converge" --nats-connect-timeout 10s)

# job_state FIELD...: prints the fields of mnist-mlp's status (python3 over --json jobs -a).
job_state() {
    "${cli[@]}" --json jobs --all 2>/dev/null | python3 -c '
import json, sys
fields = sys.argv[1:]
for j in json.load(sys.stdin):
    s = j.get("status") or {}
    if s.get("job") == "mnist-mlp":
        hosts = len({p["host"] for p in s.get("placement", [])})
        vals = {"hosts": hosts, **s}
        print(" ".join(str(vals.get(f)) for f in fields))
' "$@"
}
wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
    local limit="$1" what="$2"; shift 2
    local deadline=$(( $(date +%s) + limit ))
    until "$@"; do
        (( $(date +%s) < deadline )) || fail "$what not within $limit s"
        sleep 1
    done
}

log "up -d (project $project)"
started_up=1
compose up -d >/dev/null 2>&1 || fail "compose up failed"
hosts_up() { [[ $("${cli[@]}" --json hosts 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0) -ge 3 ]]; }
wait_for 60 "three agents reporting" hosts_up
"${cli[@]}" submit "$root/examples/jobs/mnist-mlp.toml" >/dev/null || fail "submit failed"
spans_and_runs() { read -r phase hosts step < <(job_state phase hosts step) && [[ "$phase" == running && "$hosts" -ge 2 && "$step" -ge 50 ]]; }
wait_for 90 "mnist-mlp running on two agents with progress" spans_and_runs
read -r step_before workers gen < <(job_state step world_size generation)
log "mnist-mlp runs: generation $gen, $workers workers on several agents, step $step_before"

ips() { local a; for a in agent-1 agent-2 agent-3; do docker inspect -f "$a={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}" "$(compose ps -a -q "$a")"; done | tr '\n' ' '; }
ips_before=$(ips)
log "stopping the three agents"
t=$(now)
compose stop agent-1 agent-2 agent-3 >/dev/null 2>&1 || fail "compose stop failed"
stop_s=$(since "$t")
for a in agent-1 agent-2 agent-3; do
    id=$(compose ps -a -q "$a")
    code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
    [[ "$code" == 0 ]] || fail "$a exited with status $code"
    logs=$(docker logs "$id" 2>&1)
    started=$(grep -c 'worker started' <<<"$logs" || true)
    stopped=$(grep -c 'worker stopped (exit code 143)' <<<"$logs" || true)
    grep -q 'shutting down: stopping all workers' <<<"$logs" \
        || fail "$a exited without stopping its workers (no 'shutting down: stopping all workers' in its log; $started worker(s) had started)"
    [[ "$stopped" -ge 1 ]] || fail "$a: no worker stopped with exit code 143 (checkpointed)"
    echo "    $a: $stopped worker(s) checkpointed and exited 143; agent exited 0"
done
log "stop took $stop_s s"

log "starting the agents again"
t=$(now)
compose start agent-1 agent-2 agent-3 >/dev/null 2>&1 || fail "compose start failed"
echo "    container IPs before: $ips_before"
echo "    container IPs after:  $(ips)"
progressed() { read -r step < <(job_state step) && [[ "$step" -gt "$step_before" ]]; }
wait_for 90 "new progress after the restart" progressed
resume_s=$(since "$t")
compose exec -T agent-1 sh -c 'grep -h "resumed from checkpoint" /var/lib/converge/logs/mnist-mlp/*.log | tail -n 1' \
    | grep -q resumed || fail "no rank logged 'resumed from checkpoint'"
log "progress again $resume_s s after start ($(compose exec -T agent-1 sh -c 'grep -h "resumed from checkpoint" /var/lib/converge/logs/mnist-mlp/*.log | tail -n 1'))"

completed() { read -r phase < <(job_state phase) && [[ "$phase" == completed ]] || { [[ "$phase" == failed || "$phase" == cancelled ]] && fail "mnist-mlp $phase"; false; }; }
wait_for 600 "mnist-mlp completed" completed
read -r jct gens < <(job_state finished_at submitted_at generation | awk '{ printf "%.1f %s\n", $1 - $2, $3 }')
passed=1
echo
echo "PASS  stop $stop_s s, progress again $resume_s s after start, mnist-mlp JCT $jct s in $gens generation(s)"
