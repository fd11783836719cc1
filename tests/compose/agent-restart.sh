#!/usr/bin/env bash
# Stopping and starting every agent container in the middle of a job (deploy/docker-compose.yml):
#
#   1. `up -d` (2 fake GPUs per agent), submits tests/compose/fault-jobs/ft-span.toml (3
#      workers, so its ring spans two agents; about 1,000 steps whose 50 ms of simulated
#      accelerator time sleep, so the test costs little CPU) and waits until it runs on two
#      agents and has made progress
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
# everything down on exit (unless --keep). Cluster set-up and teardown: tests/compose/lib.sh
# (secured NATS, CLI as user cli). Needs what happy-path.sh needs.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init ar "$@"
cv_build
root=$cv_root

# job_state FIELD...: prints the fields of ft-span's status (python3 over --json jobs -a).
job_state() {
    "${cli[@]}" --json jobs --all 2>/dev/null | python3 -c '
import json, sys
fields = sys.argv[1:]
for j in json.load(sys.stdin):
    s = j.get("status") or {}
    if s.get("job") == "ft-span":
        hosts = len({p["host"] for p in s.get("placement", [])})
        vals = {"hosts": hosts, **s}
        print(" ".join(str(vals.get(f)) for f in fields))
' "$@"
}
cv_up
cv_submit "$root/tests/compose/fault-jobs/ft-span.toml"
spans_and_runs() { read -r phase hosts step < <(job_state phase hosts step) && [[ "$phase" == running && "$hosts" -ge 2 && "$step" -ge 50 ]]; }
wait_for 90 "ft-span running on two agents with progress" spans_and_runs
read -r step_before workers gen < <(job_state step world_size generation)
log "ft-span runs: generation $gen, $workers workers on several agents, step $step_before"

ips() { local a; for a in agent-1 agent-2 agent-3; do docker inspect -f "$a={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}" "$(compose ps -a -q "$a")"; done | tr '\n' ' '; }
ips_before=$(ips)
log "stopping the three agents"
t=$(now)
compose stop agent-1 agent-2 agent-3 >/dev/null 2>&1 || fail "compose stop failed"
stop_s=$(since "$t")
with_workers=0
for a in agent-1 agent-2 agent-3; do
    id=$(compose ps -a -q "$a")
    code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
    [[ "$code" == 0 ]] || fail "$a exited with status $code"
    logs=$(docker logs "$id" 2>&1)
    started=$(grep -c 'worker started' <<<"$logs" || true)
    stopped=$(grep -c 'worker stopped (exit code 143)' <<<"$logs" || true)
    grep -q 'shutting down: stopping all workers' <<<"$logs" \
        || fail "$a exited without stopping its workers (no 'shutting down: stopping all workers' in its log; $started worker(s) had started)"
    [[ "$stopped" -ge "$(( started > 0 ? 1 : 0 ))" ]] || fail "$a: $started worker(s) started but none stopped with exit code 143 (checkpointed)"
    [[ "$stopped" -eq 0 ]] || with_workers=$((with_workers + 1))
    echo "    $a: $stopped worker(s) checkpointed and exited 143; agent exited 0"
done
[[ $with_workers -ge 2 ]] || fail "workers checkpointed and exited 143 on $with_workers agent(s), not the two the job spans"
log "stop took $stop_s s"

log "starting the agents again"
t=$(now)
compose start agent-1 agent-2 agent-3 >/dev/null 2>&1 || fail "compose start failed"
echo "    container IPs before: $ips_before"
echo "    container IPs after:  $(ips)"
progressed() { read -r step < <(job_state step) && [[ "$step" -gt "$step_before" ]]; }
wait_for 90 "new progress after the restart" progressed
resume_s=$(since "$t")
# Worker logs are per agent: look on every agent, for a few seconds (the line may land
# just after the first progress report).
resumed_line() {
    local a
    for a in agent-1 agent-2 agent-3; do
        compose exec -T "$a" sh -c 'grep -h "resumed from checkpoint" /var/lib/converge/logs/ft-span/*.log 2>/dev/null | tail -n 1'
    done | grep resumed | tail -n 1
}
resumed="" deadline=$(( $(date +%s) + 15 ))
while [[ -z "$resumed" && $(date +%s) -lt $deadline ]]; do
    resumed=$(resumed_line || true)
    [[ -n "$resumed" ]] || sleep 1
done
[[ -n "$resumed" ]] || fail "no rank logged 'resumed from checkpoint'"
log "progress again $resume_s s after start ($resumed)"

completed() { read -r phase < <(job_state phase) && [[ "$phase" == completed ]] || { [[ "$phase" == failed || "$phase" == cancelled ]] && fail "ft-span $phase"; false; }; }
wait_for 300 "ft-span completed" completed
read -r jct gens < <(job_state finished_at submitted_at generation | awk '{ printf "%.1f %s\n", $1 - $2, $3 }')
cv_pass "$resume_s s" "stop $stop_s s, progress again $resume_s s after start, ft-span JCT $jct s in $gens generation(s)"
