#!/usr/bin/env bash
# Network partition of one agent (deploy/docker-compose.yml, secured NATS):
#
#   1. up (tests/compose/lib.sh), submits tests/compose/fault-jobs/ft-span.toml (3 fixed
#      workers over two of the three agents, 2 fake GPUs each); waits for progress
#   2. `docker network disconnect` one agent that runs ft-span workers (the one with the
#      fewest of its ranks)
#   3. checks: the cut-off agent self-fences after --fence-after (10 s: its log says so and
#      its workers stop) before the new generation starts; the allocator declares it lost
#      after --host-timeout (15 s) and places ft-span in a new generation on the two other
#      agents, resumed from its checkpoint
#   4. `docker network connect` it back: it heartbeats again, follows its current plan (no
#      ft-span worker of the old generation comes back), the old generation's worker logs
#      get no line after the new generation started (nothing trains twice); ft-span completes
#
#   tests/compose/partition.sh [--skip-build] [--keep]
#
# Prints the time from the cut to the agent's fence, to the new generation's first worker
# start and to its first progress, and the progress lost (last step of the old generation
# minus the step the new one resumed at; target: at most one checkpoint interval, 10 steps).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init partition "$@"
cv_build
cv_up
jobs_dir="$cv_root/tests/compose/fault-jobs"
cv_submit "$jobs_dir/ft-span.toml"

spans() { read -r p h s < <(cv_job ft-span phase hosts step) && [[ "$p" == running && "$h" -ge 2 && "$s" -ge 50 ]]; }
wait_for 90 "ft-span running on two agents with progress" spans
read -r gen step_cut placed < <(cv_job ft-span generation step placed)
# The agent with the fewest ranks of ft-span.
victim=$(tr ',' '\n' <<<"$placed" | cut -d: -f1 | sort | uniq -c | sort -n | head -n1 | awk '{ print $2 }')
vid=$(cv_container "$victim")
net="${project}_converge"
log "ft-span generation $gen, step $step_cut, on $placed: cutting $victim off ($net)"
t_cut=$(now)
docker network disconnect "$net" "$vid" || fail "docker network disconnect failed"

new_gen_runs() { read -r p g < <(cv_job ft-span phase generation) && [[ "$g" -gt "$gen" && "$p" == running ]]; }
wait_for 60 "ft-span in a new generation after the partition" new_gen_runs
t_newgen_seen=$(now)
read -r gen2 placed2 < <(cv_job ft-span generation placed)
log "ft-span generation $gen2 on $placed2, seen $(since "$t_cut" "$t_newgen_seen") s after the cut"
grep -q "$victim" <<<"$placed2" && fail "the new generation is placed on the cut-off agent $victim"
progress_again() { read -r g s < <(cv_job ft-span generation step) && [[ "$g" == "$gen2" && "$s" -gt "$step_cut" ]]; }
wait_for 60 "progress of generation $gen2" progress_again
progress_s=$(since "$t_cut")

# The cut-off agent's fence and its workers' stop, against the new generation's start (log times).
vlogs=$(docker logs -t "$vid" 2>&1)
t_fence=$(python3 "$cv_tool" logtimes 'no heartbeat reached NATS for --fence-after' <<<"$vlogs" | head -n1)
[[ -n "$t_fence" ]] || fail "$victim did not log a self-fence ('no heartbeat reached NATS for --fence-after')"
t_vstop=$(python3 "$cv_tool" logtimes "worker stopped.*worker=ft-span/gen$gen/|worker=ft-span/gen$gen/.*worker stopped" <<<"$vlogs" | tail -n1)
[[ -n "$t_vstop" ]] || fail "$victim logged no stop of its ft-span generation $gen workers"
t_start2=$(for a in agent-1 agent-2 agent-3; do docker logs -t "$(cv_container "$a")" 2>&1; done \
    | python3 "$cv_tool" logtimes "worker started.*worker=ft-span/gen$gen2/|worker=ft-span/gen$gen2/.*worker started" | sort -n | head -n1)
[[ -n "$t_start2" ]] || fail "no agent logged the start of a generation $gen2 worker"
fence_s=$(since "$t_cut" "$t_fence")
vstop_s=$(since "$t_cut" "$t_vstop")
resched_s=$(since "$t_cut" "$t_start2")
log "after the cut: $victim fenced at $fence_s s, its workers stopped at $vstop_s s; generation $gen2 started at $resched_s s; progress again at $progress_s s"
awk -v a="$t_vstop" -v b="$t_start2" 'BEGIN { exit !(a < b) }' \
    || fail "$victim's generation $gen workers stopped ($vstop_s s) after generation $gen2 started ($resched_s s): the job trained twice"

log "reconnecting $victim"
logs_dir=$(cv_volume worker-logs)
docker network connect "$net" "$vid" || fail "docker network connect failed"
t_conn=$(now)
victim_back() { grep -qw "$victim" <<<"$(cv_fresh_hosts 2)"; }
wait_for 60 "$victim heartbeating again" victim_back
back_s=$(since "$t_conn")
follows_plan() { docker logs "$vid" 2>&1 | grep -q 'NATS is back: following the current plan again'; }
wait_for 60 "$victim logging 'NATS is back: following the current plan again'" follows_plan
follow_s=$(since "$t_conn")
stale=$(cv_pids ft-span | awk -v g="$gen" '$2 == g')
[[ -z "$stale" ]] || fail "workers of the old generation $gen run again after the reconnect: $stale"
log "$victim heartbeats again $back_s s after the reconnect and follows its plan again at $follow_s s; no generation-$gen worker anywhere"

cv_wait_done ft-span
# Nothing trained twice: no old-generation log line after the new generation started.
while read -r g ranks first last resumed mtime; do
    if [[ "$g" -lt "$gen2" ]] && awk -v m="$mtime" -v s="$t_start2" 'BEGIN { exit !(m > s + 0.5) }'; then
        fail "a generation-$g worker log of ft-span was written $(since "$t_start2" "$mtime") s after generation $gen2 started"
    fi
done < <(python3 "$cv_tool" gens "$logs_dir" ft-span)
read -r last resumed lost < <(python3 "$cv_tool" lost "$logs_dir" ft-span "$gen2")
[[ "$lost" != - ]] || fail "no resume step found in generation $gen2's rank-0 log"
[[ "$lost" -le 10 ]] || fail "ft-span lost $lost steps (last step $last before the cut, resumed at $resumed): more than one checkpoint interval (10)"
read -r g jct < <(cv_job ft-span generation finished_at submitted_at | awk '{ printf "%s %.1f\n", $1, $2 - $3 }')
log "ft-span completed in generation $g, JCT $jct s; old generation's last step $last, resumed at $resumed"
cv_pass "$resched_s s" "fence $fence_s s, workers stopped $vstop_s s, new generation $resched_s s, progress $progress_s s after the cut; lost $lost steps (last $last, resumed $resumed); heartbeat $back_s s and plan followed $follow_s s after the reconnect"
