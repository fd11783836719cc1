#!/usr/bin/env bash
# One NATS server of three killed (kill -9) and brought back, twice, under load
# (deploy/docker-compose.yml + deploy/docker-compose.cluster.yml: servers nats, nats-2,
# nats-3, secured as the single server, every bucket and the progress stream with 3
# replicas, every client given the three URLs):
#
#   1. up (tests/compose/lib.sh with cv_cluster=1); every Converge stream (the buckets and
#      CONVERGE_PROGRESS) has 3 replicas, all current (the servers' /jsz)
#   2. submits tests/compose/fault-jobs/ft-span-long.toml (3 workers over two agents, 2-3
#      min) and ft-small.toml (1 worker); waits until both make progress; reads every
#      worker's PID from the agents' telemetry
#   3. round 1: `docker kill -s KILL` of the JetStream meta leader; round 2: of the server
#      with the most Converge clients (ties: the progress stream's leader). Each round
#      prints the streams the victim led, and measures
#        - every Converge client that was on the victim: reconnected to a surviving server
#          (the server's accept time in /connz minus the kill), at most 5 s
#        - the agents' heartbeats: the longest time any host's stored heartbeat was old
#          (`converge --json hosts`), below the agents' --fence-after (10 s)
#        - the allocator writing a status and both jobs' steps advancing again
#      then, once the survivors have a meta leader and a leader for every stream, starts
#      the server again (`docker start`, same volume) and waits until every stream again
#      has 3 current replicas
#   4. checks: the same worker PIDs and generations (no worker restarted), no agent fenced
#      ('no heartbeat reached NATS for --fence-after' in no agent's log), no agent lost a
#      report ('progress report lost' in none); both jobs complete; every valid progress
#      line the workers printed is in the progress stream, on each of the three servers
#      (lost = printed - stored, must be 0; duplicates from retried publishes are counted)
#
#   tests/compose/nats-cluster.sh [--skip-build] [--keep]
#
# Prints each round's figures and the PASS line with the slowest reconnect, the longest
# heartbeat gap and the reports printed/stored.
set -euo pipefail
if [[ $(id -u) -ne 0 ]]; then
    # The servers' monitoring listens on their containers' loopback only (nsenter needs root).
    echo "SKIP: nats-cluster.sh reads the NATS servers' monitoring through nsenter, which needs root"
    exit 0
fi
cv_cluster=1
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init nats-cluster "$@"
cv_build
cv_up
servers=(nats nats-2 nats-3)

# mon SERVICE PATH: a NATS server's monitoring endpoint. It listens on the container's
# loopback only (deploy/nats/compose-secrets.sh), so the host's python3 reads it from
# inside the container's network namespace (nsenter; root).
mon() {
    local pid; pid=$(docker inspect -f '{{.State.Pid}}' "$(cv_container "$1")" 2>/dev/null) || return 1
    [[ -n "$pid" && "$pid" != 0 ]] || return 1
    nsenter -t "$pid" -n python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' \
        "http://127.0.0.1:8222$2" 2>/dev/null
}
jsz() { mon "$1" '/jsz?accounts=true&streams=true&config=true' | python3 "$cv_tool" jsz; }
alive() { [[ "$(docker inspect -f '{{.State.Running}}' "$(cv_container "$1")" 2>/dev/null)" == true ]]; }
# first_alive: a running server's /jsz.
jsz_any() { local s; for s in "${servers[@]}"; do alive "$s" && jsz "$s" && return 0; done; return 1; }
# streams_led: 'stream NAME REPLICAS LEADER CURRENT MESSAGES' of every stream, as its
# leader reports it (only a leader knows whether the other replicas are current).
streams_led() {
    local s
    for s in "${servers[@]}"; do
        alive "$s" || continue
        jsz "$s" | awk -v s="$s" '$1 == "stream" && $4 == s'
    done
}
# all_replicated: every stream has 3 replicas, all current, and every server is up.
all_replicated() {
    local s out
    for s in "${servers[@]}"; do mon "$s" /healthz >/dev/null || return 1; done
    out=$(streams_led) || return 1
    awk '$1 == "stream" { n++; if ($3 != 3 || $5 != 3) bad++ } END { exit !(n >= 5 && bad == 0) }' <<<"$out"
}

log "waiting until every stream has 3 current replicas"
wait_for 90 "every stream with 3 current replicas" all_replicated
jsz_any | awk '$1 == "meta"' | sed 's/^/    /'
streams_led | sed 's/^/    /'

cv_run_with_small ft-span-long 120 50 20
read -r gen_long placed < <(cv_job ft-span-long generation placed)
read -r gen_small < <(cv_job ft-small generation)
pids_before=$( { cv_pids ft-span-long; cv_pids ft-small; } )
[[ $(wc -l <<<"$pids_before") -eq 4 ]] || fail "expected 4 live workers in the telemetry, got: $pids_before"
log "ft-span-long generation $gen_long on $placed; ft-small generation $gen_small"
echo "$pids_before" | sed 's/^/    worker (host gen rank pid): /'

# converge_clients SERVICE: 'name start' of the allocator's and the agents' connections.
converge_clients() { mon "$1" '/connz?limit=1024' | python3 "$cv_tool" connz | grep -E '^converge-(allocator|agent/)' || true; }

worst_reconnect=0 worst_gap=0 rounds=""
# kill_round LABEL VICTIM
kill_round() {
    local label=$1 victim=$2 s
    local led; led=$(jsz "$victim" | awk -v v="$victim" '$1 == "stream" && $4 == v { printf "%s ", $2 } $1 == "meta" && $2 == v { printf "(meta leader) " }')
    local moved; moved=$(converge_clients "$victim" | awk '{ print $1 }' | sort)
    log "round $label: kill -9 of $victim, leader of: ${led:-nothing}; its Converge clients: $(echo $moved)"
    local step_long step_small
    read -r step_long < <(cv_job ft-span-long step)
    read -r step_small < <(cv_job ft-small step)
    local t0; t0=$(now)
    docker kill -s KILL "$(cv_container "$victim")" >/dev/null || fail "docker kill $victim failed"

    # Poll every 0.25 s: where the moved clients are now, how old each heartbeat is, the
    # allocator's statuses and the jobs' steps.
    declare -A back=() gap=()
    local t_status="" t_progress="" deadline; deadline=$(awk -v t="$t0" 'BEGIN { printf "%.3f", t + 60 }')
    while :; do
        local t; t=$(now)
        awk -v n="$t" -v d="$deadline" 'BEGIN { exit !(n < d) }' \
            || fail "round $label: not recovered within 60 s: reconnected: ${!back[*]}; status ${t_status:-no}, progress ${t_progress:-no}"
        for s in "${servers[@]}"; do
            [[ "$s" == "$victim" ]] && continue
            while read -r name start; do
                [[ -n "$name" && -z "${back[$name]:-}" ]] || continue
                grep -qx -- "$name" <<<"$moved" || continue
                awk -v a="$start" -v b="$t0" 'BEGIN { exit !(a > b) }' && back[$name]=$(since "$t0" "$start")
            done < <(converge_clients "$s")
        done
        local host age
        while read -r host age; do
            [[ -n "$host" ]] || continue
            awk -v a="$age" -v g="${gap[$host]:-0}" 'BEGIN { exit !(a > g) }' && gap[$host]=$age
        done < <("${cli[@]}" --json hosts 2>/dev/null | python3 "$cv_tool" ages 2>/dev/null || true)
        if read -r u1 s1 < <(cv_job ft-span-long updated_at step) && read -r s2 p2 < <(cv_job ft-small step phase); then
            [[ -z "$t_status" ]] && awk -v u="$u1" -v t="$t0" 'BEGIN { exit !(u > t + 1) }' && t_status=$(since "$t0")
            [[ -z "$t_progress" && "$s1" -gt "$step_long" && ( "$s2" -gt "$step_small" || "$p2" == completed ) ]] && t_progress=$(since "$t0")
        fi
        local all_back=1 m
        for m in $moved; do [[ -n "${back[$m]:-}" ]] || all_back=0; done
        # Done when every moved client is back, the statuses and steps move, and every
        # host's heartbeat is fresh again (its gap measured to the end).
        if [[ $all_back -eq 1 && -n "$t_status" && -n "$t_progress" ]] && [[ $(cv_fresh_hosts 1.5 | wc -w) -ge 3 ]]; then
            break
        fi
        sleep 0.25
    done
    local line="" m
    for m in $moved; do
        line+="$m ${back[$m]} s, "
        awk -v a="${back[$m]}" -v w="$worst_reconnect" 'BEGIN { exit !(a > w) }' && worst_reconnect=${back[$m]}
    done
    local gaps="" h
    for h in $(printf '%s\n' "${!gap[@]}" | sort); do
        gaps+="$h ${gap[$h]} s, "
        awk -v a="${gap[$h]}" -v w="$worst_gap" 'BEGIN { exit !(a > w) }' && worst_gap=${gap[$h]}
    done
    log "round $label: reconnected: ${line:-no Converge client was on $victim, }longest heartbeat age: ${gaps%, }; a status written at $t_status s, both jobs' steps advance at $t_progress s"
    for m in $moved; do
        awk -v a="${back[$m]}" 'BEGIN { exit !(a <= 5) }' || fail "round $label: $m reconnected ${back[$m]} s after the kill (target: 5 s)"
    done
    rounds+="$label: $victim ${led:+[$(echo $led)]} clients ${line%, } heartbeat max ${gaps%, }; "

    # Bring it back once the survivors have settled (a meta leader and every stream's leader
    # among them), as a crashed server would come back: restarted 2 s after its kill, while
    # the others were still electing a meta leader, a server came back with the streams
    # created last restored as standalone streams outside their raft groups (leader: itself,
    # no replicas), never current again (nats-server 2.11.11).
    wait_for 60 "a meta leader and every stream's leader among the survivors" survivors_settled "$victim"
    log "round $label: docker start $victim (same volume), $(since "$t0") s after its kill"
    local t1; t1=$(now)
    docker start "$(cv_container "$victim")" >/dev/null || fail "docker start $victim failed"
    wait_for 90 "$victim back with every stream's 3 replicas current" all_replicated
    log "round $label: $victim back, every stream with 3 current replicas, $(since "$t1") s after docker start"
    # A restarted server checks its streams against the cluster's assignments 30 s after it
    # starts (and drops those it thinks orphaned): the next round only after that, and with
    # every replica still current.
    while awk -v t="$t1" -v n="$(now)" 'BEGIN { exit !(n < t + 35) }'; do sleep 1; done
    if docker logs "$(cv_container "$victim")" 2>&1 | grep -q 'orphaned stream'; then
        docker logs "$(cv_container "$victim")" 2>&1 | grep 'orphaned stream' | sed 's/^/    /'
        fail "round $label: the restarted $victim dropped stream replicas as orphaned (nats-server's check 30 s after start)"
    fi
    all_replicated || { streams_led | sed 's/^/    /'; fail "round $label: 35 s after $victim's restart, a stream lacks a current replica"; }
    log "round $label: 35 s after the restart every stream still has 3 current replicas"
}

# survivors_settled VICTIM: every running server sees a meta leader and a leader for every
# stream, none of them VICTIM.
survivors_settled() {
    local s out
    for s in "${servers[@]}"; do
        [[ "$s" == "$1" ]] && continue
        alive "$s" || continue
        out=$(jsz "$s") || return 1
        awk -v v="$1" '$1 == "meta" { m = ($2 != "-" && $2 != v) } $1 == "stream" { n++; if ($4 == "-" || $4 == v) bad++ }
            END { exit !(m && n >= 5 && !bad) }' <<<"$out" || return 1
    done
}

# Round 1: the JetStream meta leader (stream and consumer creation go through it).
read -r _ meta _ < <(jsz_any | awk '$1 == "meta"')
[[ " ${servers[*]} " == *" $meta "* ]] || fail "no JetStream meta leader among ${servers[*]} (got '$meta')"
kill_round 1 "$meta"

# Round 2: the server most Converge clients are on (ties: the progress stream's leader).
read -r _ _ _ progress_leader _ < <(streams_led | awk '$2 == "CONVERGE_PROGRESS"')
victim2="" most=-1
for s in "$progress_leader" "${servers[@]}"; do
    n=$(converge_clients "$s" | wc -l)
    (( n > most )) && { most=$n; victim2=$s; }
done
kill_round 2 "$victim2"

pids_after=$( { cv_pids ft-span-long; cv_pids ft-small; } )
# ft-small may have completed meanwhile: compare what still runs.
while read -r h g r p; do
    [[ -z "$h" ]] && continue
    grep -qx "$h $g $r $p" <<<"$pids_before" || { echo "    before: $pids_before"; echo "    after:  $pids_after"; fail "a worker was restarted across the kills ($h gen $g rank $r pid $p is new)"; }
done <<<"$pids_after"
log "no worker restarted (PIDs as before the kills)"
for a in agent-1 agent-2 agent-3; do
    alog=$(docker logs "$(cv_container "$a")" 2>&1)
    grep -q 'no heartbeat reached NATS for --fence-after' <<<"$alog" && fail "$a fenced its workers"
    grep -q 'progress report lost' <<<"$alog" && fail "$a lost a progress report: $(grep 'progress report lost' <<<"$alog" | head -n 2)"
done
log "no agent fenced, no agent gave up on a report"

cv_wait_done ft-span-long ft-small
read -r gen_long_end < <(cv_job ft-span-long generation)
read -r gen_small_end < <(cv_job ft-small generation)
[[ "$gen_long_end" == "$gen_long" && "$gen_small_end" == "$gen_small" ]] \
    || fail "a new generation started: ft-span-long $gen_long -> $gen_long_end, ft-small $gen_small -> $gen_small_end"

# Every printed progress line in the stream, on every server.
logs_dir=$(cv_volume worker-logs) || fail "no worker-logs volume"
printed=$(python3 "$cv_tool" progress-lines "$logs_dir" ft-span-long ft-small)
stored_all() {
    local s out
    stored_line=""
    for s in "${servers[@]}"; do
        out=$(jsz "$s" | awk '$1 == "stream" && $2 == "CONVERGE_PROGRESS" { print $6 }') || return 1
        [[ -n "$out" ]] || return 1
        stored_line+="$s $out, "
        [[ "$out" -ge "$printed" ]] || return 1
    done
}
stored_line=""
for _ in $(seq 60); do stored_all && break; sleep 0.5; done
stored=$(jsz nats | awk '$1 == "stream" && $2 == "CONVERGE_PROGRESS" { print $6 }')
lost=$(( printed > stored ? printed - stored : 0 ))
dups=$(( stored > printed ? stored - printed : 0 ))
log "progress lines printed by the workers: $printed; in CONVERGE_PROGRESS: ${stored_line%, } (lost $lost, duplicates $dups)"
[[ $lost -eq 0 ]] || fail "$lost progress reports lost"
cv_pass "$worst_reconnect s" "reconnect max $worst_reconnect s, heartbeat age max $worst_gap s (fence at 10 s), reports printed $printed stored $stored lost 0 dup $dups; ${rounds%; }"
