#!/usr/bin/env bash
# SIGKILL of the allocator mid-run (deploy/docker-compose.yml, secured NATS):
#
#   1. up (tests/compose/lib.sh), submits tests/compose/fault-jobs/ft-span.toml (3 fixed
#      workers over two agents) and ft-small.toml (1 fixed worker); waits until both run
#   2. `docker kill -s KILL` the allocator, 2 s without it, then starts it again (unless
#      Docker's restart policy already did)
#   3. checks, on the restarted allocator's /metrics: it leads again
#      (converge_allocator_leader 1) and makes its first policy decision
#      (converge_allocator_step_seconds_count{policy="true"} >= 1) within one scheduling interval (5 s)
#      of its start;
#      converge_allocator_plan_writes_total stays 0 for two scheduling intervals while both jobs keep their
#      allocation (nothing to rewrite); no job gets a new generation; both complete
#
#   tests/compose/kill-allocator.sh [--skip-build] [--keep]
#
# Prints the time from the restart (the container's StartedAt) to the first decision and
# to the first status write, and the progress lost (0 when no generation changed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init kill-allocator "$@"
cv_build
cv_up
interval_s=${CONVERGE_SCHEDULING_INTERVAL%s}
cv_run_with_small ft-span 90 50 20
read -r gen_span step_span < <(cv_job ft-span generation step)
read -r gen_small < <(cv_job ft-small generation)
[[ "$(cv_metric allocator converge_allocator_leader)" == 1 ]] || fail "the allocator does not report converge_allocator_leader 1 before the kill"
log "ft-span generation $gen_span step $step_span, ft-small generation $gen_small; plan writes so far: $(cv_metric allocator converge_allocator_plan_writes_total)"

alloc=$(cv_container allocator)
log "docker kill -s KILL allocator"
docker kill -s KILL "$alloc" >/dev/null || fail "docker kill failed"
sleep 2
if [[ "$(docker inspect -f '{{.State.Running}}' "$alloc")" == true ]]; then
    how="restarted by Docker's restart policy"
else
    compose start allocator >/dev/null 2>&1 || fail "compose start allocator failed"
    how="started with compose start"
fi
started_at=$(docker inspect -f '{{.State.StartedAt}}' "$alloc" | python3 -c 'import sys, datetime; s = sys.stdin.read().strip(); d, f = (s.rstrip("Z") + ".0").split(".")[:2]; print("%.3f" % (datetime.datetime.strptime(d, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc).timestamp() + float("0." + f)))')
log "allocator $how (StartedAt $started_at)"

# The first decision and status write of the new process, polled every 0.2 s.
t_decision="" t_status=""
deadline=$(awk -v s="$started_at" 'BEGIN { printf "%d", s + 40 }')
while [[ -z "$t_decision" || -z "$t_status" ]]; do
    (( $(date +%s) < deadline )) || fail "no decision (step) and status write of the restarted allocator within 40 s (steps $(cv_metric allocator converge_allocator_step_seconds_count), status writes $(cv_metric allocator converge_allocator_status_writes_total), leader $(cv_metric allocator converge_allocator_leader))"
    m=$(cv_metrics allocator || true)
    t=$(now)
    steps=$(python3 "$cv_tool" metric converge_allocator_step_seconds_count 'policy="true"' <<<"$m")
    writes=$(python3 "$cv_tool" metric converge_allocator_status_writes_total <<<"$m")
    [[ -z "$t_decision" && "$steps" != - && "$steps" != 0 ]] && t_decision=$t
    [[ -z "$t_status" && "$writes" != - && "$writes" != 0 ]] && t_status=$t
    sleep 0.2
done
decision_s=$(since "$started_at" "$t_decision")
status_s=$(since "$started_at" "$t_status")
log "restarted allocator: first decision $decision_s s, first status write $status_s s after its start (scheduling interval ${interval_s} s)"
awk -v d="$decision_s" -v e="$interval_s" 'BEGIN { exit !(d <= e) }' \
    || fail "the restarted allocator's first decision came $decision_s s after its start, more than one scheduling interval ($interval_s s)"
[[ "$(cv_metric allocator converge_allocator_leader)" == 1 ]] || fail "the restarted allocator does not lead (converge_allocator_leader != 1)"

# Two scheduling intervals with nothing to change: no plan written.
sleep $(( 2 * interval_s ))
read -r p1 g1 < <(cv_job ft-span phase generation)
read -r p2 g2 < <(cv_job ft-small phase generation)
writes=$(cv_metric allocator converge_allocator_plan_writes_total)
steps=$( { cv_metrics allocator || true; } | python3 "$cv_tool" metric converge_allocator_step_seconds_count 'policy="true"')
# A counter with labels has no sample before its first increment: absent = 0 when the
# endpoint answered (the step counter is there).
[[ "$steps" != - ]] || fail "the restarted allocator's /metrics did not answer"
[[ "$writes" != - ]] || writes=0
if [[ "$p1" == running && "$p2" == running ]]; then
    [[ "$writes" == 0 ]] || fail "the restarted allocator wrote $writes plan(s) while both jobs kept their allocation"
    log "$(since "$started_at") s after the restart: $steps policy decisions, 0 plan writes, generations $g1/$g2"
else
    log "a job finished within two scheduling intervals ($p1/$p2): plan writes ($writes) not checked"
fi
[[ "$g1" == "$gen_span" && "$g2" == "$gen_small" ]] || fail "a new generation started: ft-span $gen_span -> $g1, ft-small $gen_small -> $g2"

cv_wait_done ft-span ft-small
for j in ft-span ft-small; do
    read -r g jct < <(cv_job "$j" generation finished_at submitted_at | awk '{ printf "%s %.1f\n", $1, $2 - $3 }')
    want=$gen_span; [[ $j == ft-small ]] && want=$gen_small
    [[ "$g" == "$want" ]] || fail "$j completed in generation $g, not $want (restarted)"
    log "$j completed in generation $g, JCT $jct s"
done
cv_pass "$decision_s s" "first decision $decision_s s and first status write $status_s s after the restart (scheduling interval $interval_s s), 0 plan writes, lost 0 steps (same generation)"
