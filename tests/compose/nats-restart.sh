#!/usr/bin/env bash
# NATS restart under load (deploy/docker-compose.yml, secured NATS):
#
#   1. up (tests/compose/lib.sh), submits tests/compose/fault-jobs/ft-span.toml (3 workers:
#      spans two agents) and ft-small.toml (1 worker); waits until both make progress
#   2. reads every worker's PID from the agents' telemetry (`converge --json hosts`)
#   3. `docker restart` of the NATS container (JetStream on its volume)
#   4. checks: the three agents heartbeat again, the allocator writes statuses again, both
#      jobs progress again, with the same worker PIDs (no worker restarted, no agent fenced:
#      the outage is shorter than the agents' --fence-after 10 s) and no new generation;
#      both jobs complete, still in their first generation
#
#   tests/compose/nats-restart.sh [--skip-build] [--keep]
#
# Prints the outage (restart command to NATS accepting the CLI again), the recovery time
# (restart command to all agents reporting, a status written and both jobs progressing) and
# the progress lost (0 when no generation changed). Measured: agents are back within
# 1.5 s, but the allocator's progress consumer (an async-nats ordered pull consumer) only
# notices that the restarted server lost it after missing idle heartbeats (15 s), so job
# statuses stand still for about 16-18 s; the workers train on meanwhile.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init nats-restart "$@"
cv_build
cv_up
cv_run_with_small ft-span 90 50 20
read -r gen_span step_span placed < <(cv_job ft-span generation step placed)
read -r gen_small step_small < <(cv_job ft-small generation step)
pids_before=$( { cv_pids ft-span; cv_pids ft-small; } )
[[ $(wc -l <<<"$pids_before") -eq 4 ]] || fail "expected 4 live workers in the telemetry, got: $pids_before"
log "ft-span generation $gen_span step $step_span on $placed; ft-small generation $gen_small step $step_small"
echo "$pids_before" | sed 's/^/    worker (host gen rank pid): /'

log "docker restart of the NATS container"
t0=$(now)
docker restart "$(cv_container nats)" >/dev/null || fail "docker restart nats failed"
restart_cmd_s=$(since "$t0")
nats_back() { "${cli[@]}" --json hosts >/dev/null 2>&1; }
wait_for 60 "NATS answering the CLI again" nats_back
outage_s=$(since "$t0")
t_back=$(date +%s.%N)
read -r step_span < <(cv_job ft-span step)
read -r step_small < <(cv_job ft-small step)
reports_back=$(cv_metric allocator converge_allocator_progress_reports_total)
log "docker restart returned after $restart_cmd_s s; the CLI reaches NATS again $outage_s s after the restart"

# Each part of the recovery, timed on its own (polled every 0.5 s).
t_agents="" t_status="" t_progress="" t_ingest=""
deadline=$(( $(date +%s) + 60 ))
while [[ -z "$t_agents" || -z "$t_status" || -z "$t_progress" ]]; do
    (( $(date +%s) < deadline )) || fail "not recovered within 60 s of the NATS restart: agents ${t_agents:-no}, status write ${t_status:-no}, progress ${t_progress:-no} (ft-span $(cv_job ft-span phase step updated_at), ft-small $(cv_job ft-small phase step updated_at))"
    t=$(now)
    [[ -z "$t_ingest" && "$(cv_metric allocator converge_allocator_progress_reports_total)" != "$reports_back" ]] && t_ingest=$(since "$t0" "$t")
    [[ -z "$t_agents" && $(cv_fresh_hosts 2 | wc -w) -ge 3 ]] && t_agents=$(since "$t0" "$t")
    if read -r u1 s1 < <(cv_job ft-span updated_at step) && read -r u2 s2 p2 < <(cv_job ft-small updated_at step phase); then
        [[ -z "$t_status" ]] && awk -v u="$u1" -v t="$t_back" 'BEGIN { exit !(u > t) }' && t_status=$(since "$t0" "$t")
        [[ -z "$t_progress" && "$s1" -gt "$step_span" && ( "$s2" -gt "$step_small" || "$p2" == completed ) ]] && t_progress=$(since "$t0" "$t")
    fi
    sleep 0.5
done
recovery_s=$(printf '%s\n' "$t_agents" "$t_status" "$t_progress" | sort -g | tail -n1)
log "after the restart: agents heartbeat at $t_agents s; the allocator ingests progress again at ${t_ingest:-?} s (converge_allocator_progress_reports_total), writes a status at $t_status s, both jobs' steps advance at $t_progress s"

pids_after=$( { cv_pids ft-span; cv_pids ft-small; } )
if [[ "$pids_after" != "$pids_before" ]]; then
    echo "    before: $pids_before"; echo "    after:  $pids_after"
    fail "worker PIDs changed across the NATS restart (workers were restarted)"
fi
log "same 4 worker PIDs after the restart (workers kept running)"
for a in agent-1 agent-2 agent-3; do
    if docker logs "$(cv_container "$a")" 2>&1 | grep -q 'no heartbeat reached NATS for --fence-after'; then
        fail "$a fenced its workers during a NATS restart of $outage_s s"
    fi
done

cv_wait_done ft-span ft-small
read -r gen_span_end step_span_end < <(cv_job ft-span generation step)
read -r gen_small_end < <(cv_job ft-small generation)
[[ "$gen_span_end" == "$gen_span" && "$gen_small_end" == "$gen_small" ]] \
    || fail "a new generation started: ft-span $gen_span -> $gen_span_end, ft-small $gen_small -> $gen_small_end"
for j in ft-span ft-small; do
    read -r jct < <(cv_job "$j" finished_at submitted_at | awk '{ printf "%.1f\n", $1 - $2 }')
    log "$j completed in generation $(cv_job "$j" generation), JCT $jct s"
done
cv_pass "$recovery_s s" "NATS outage $outage_s s, lost 0 steps (same PIDs, same generation)"
