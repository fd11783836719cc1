# Shared part of the compose tests (tests/compose/*.sh), sourced, never run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#   cv_init fault-x "$@"        # options (--skip-build, --keep, --help), project name, traps
#   cv_build                    # deploy/build-images.sh unless --skip-build
#   cv_up                       # secrets, `up -d`, waits until the three agents report
#   ...                         # the test; fail "why" on failure
#   cv_pass RECOVERY "figures"  # the PASS line (and the run-all summary)
#
# What it sets up: a unique compose project (converge-<name>-<pid>-<time>), NATS published
# on a free port of 127.0.0.1, a secured NATS (deploy/nats/compose-secrets.sh writes the
# configuration and random passwords into a temporary directory, CONVERGE_SECRETS_DIR), the
# host-side CLI authenticating as `cli`, 2 fake GPUs per agent, a 5 s scheduling interval, a 10 s restart
# cost, allocator metrics on :9464 (reached at the container's IP). On exit (also on
# failure or Ctrl-C) it prints the failure, the containers, their log tails and the worker
# log tails, then removes everything (`down -v`) and the secrets, unless --keep.
#
# A test that sets cv_cluster=1 before cv_init runs deploy/docker-compose.cluster.yml on
# top: three NATS servers (nats, nats-2, nats-3), each published on its own free port, the
# CLI given all three URLs (CONVERGE_NATS_URL), 3 replicas.
#
# Environment: CV_SUMMARY_FILE (set by run-all.sh): cv_pass/failures append one line to it.

cv_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cv_compose_file="$cv_root/deploy/docker-compose.yml"
cv_target_dir="${CARGO_TARGET_DIR:-$cv_root/target}"
# Binaries of the profile the images were built from (CONVERGE_IMAGE_PROFILE, as
# deploy/build-images.sh): release by default, dev = target/debug.
case "${CONVERGE_IMAGE_PROFILE:-release}" in dev|debug) bin_profile_dir=debug ;; *) bin_profile_dir=release ;; esac
[[ "$cv_target_dir" == /* ]] || cv_target_dir="$cv_root/$cv_target_dir"
cv_tool="$cv_root/tests/compose/cvtool.py"

log() { printf '==> %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="${2:-$(date +%s.%N)}" 'BEGIN { printf "%.1f", b - a }'; }

cv_name="" skip_build=0 keep=0 started_up=0 passed=0 failure="" cv_secrets="" cv_profiles=() cv_tmpfiles=()
cv_cluster="${cv_cluster:-0}" cv_compose_files=(-f "$cv_compose_file")
fail() { failure="$*"; exit 1; }

cv_usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<'HELP'
Options:
  --skip-build   use the images as they are (deploy/build-images.sh not run)
  --keep         leave the cluster running (prints how to remove it)
  -h, --help     this text
HELP
}

# cv_init NAME ARGS...: options, project, environment, traps.
cv_init() {
    cv_name="$1"; shift
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --skip-build) skip_build=1; shift ;;
            --keep) keep=1; shift ;;
            -h|--help) cv_usage; exit 0 ;;
            *) echo "$cv_name: unknown option $1 (see --help)" >&2; exit 2 ;;
        esac
    done
    if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
        echo "$cv_name: docker is not available" >&2; exit 1
    fi
    if docker compose version >/dev/null 2>&1; then
        cv_compose_cmd=(docker compose)
    elif command -v docker-compose >/dev/null; then
        cv_compose_cmd=(docker-compose)
    else
        echo "$cv_name: neither 'docker compose' nor 'docker-compose' is available" >&2; exit 1
    fi
    project="converge-$cv_name-$$-$(date +%s)"
    local free_port='import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
    nats_port=$(python3 -c "$free_port")
    cv_secrets=$(mktemp -d -t converge-secrets.XXXXXX)
    export CONVERGE_NATS_BIND=127.0.0.1 CONVERGE_NATS_PORT="$nats_port" CONVERGE_FAKE_GPUS=2 \
        CONVERGE_SCHEDULING_INTERVAL="${CONVERGE_SCHEDULING_INTERVAL:-5s}" CONVERGE_RESTART_COST=10s CONVERGE_HORIZON=60s \
        CONVERGE_STOP_GRACE=10s CONVERGE_METRICS_ADDR=0.0.0.0:9464 \
        CONVERGE_SECRETS_DIR="$cv_secrets"
    export CONVERGE_NATS_URL="nats://127.0.0.1:$nats_port"
    if [[ $cv_cluster -eq 1 ]]; then
        cv_compose_files+=(-f "$cv_root/deploy/docker-compose.cluster.yml")
        CONVERGE_NATS_PORT_2=$(python3 -c "$free_port")
        CONVERGE_NATS_PORT_3=$(python3 -c "$free_port")
        while [[ $CONVERGE_NATS_PORT_3 == "$CONVERGE_NATS_PORT_2" || $CONVERGE_NATS_PORT_2 == "$nats_port" || $CONVERGE_NATS_PORT_3 == "$nats_port" ]]; do
            CONVERGE_NATS_PORT_3=$(python3 -c "$free_port")
            CONVERGE_NATS_PORT_2=$(python3 -c "$free_port")
        done
        export CONVERGE_NATS_PORT_2 CONVERGE_NATS_PORT_3 CONVERGE_BUS_REPLICAS=3
        export CONVERGE_NATS_URL="nats://127.0.0.1:$nats_port,nats://127.0.0.1:$CONVERGE_NATS_PORT_2,nats://127.0.0.1:$CONVERGE_NATS_PORT_3"
    fi
    # The host-side CLI is the `cli` user.
    export CONVERGE_NATS_USER=cli CONVERGE_NATS_PASSWORD_FILE="$cv_secrets/credentials/cli.password"
    unset CONVERGE_NATS_PASSWORD CONVERGE_NATS_NKEY CONVERGE_NATS_CREDS
    trap cv_cleanup EXIT
    trap 'failure="interrupted"; exit 130' INT TERM
    # A closed output pipe (| head) or terminal: tear down quietly rather than die untidied.
    trap 'failure="output closed"; exec >/dev/null 2>&1; exit 141' PIPE HUP
    cv_t_total=$(now)
}

compose() {
    local p=()
    for x in "${cv_profiles[@]}"; do p+=(--profile "$x"); done
    "${cv_compose_cmd[@]}" -p "$project" "${cv_compose_files[@]}" "${p[@]}" "$@"
}

cv_summary() { [[ -z "${CV_SUMMARY_FILE:-}" ]] || printf '%s\t%s\n' "$cv_name" "$*" >>"$CV_SUMMARY_FILE"; }

cv_dump() {
    echo
    echo "---- containers ----"
    compose ps || true
    echo "---- container logs (last 40 lines each) ----"
    compose logs --no-color --tail 40 || true
    echo "---- worker logs (last 8 lines each) ----"
    local d; d=$(cv_volume worker-logs 2>/dev/null) || d=""
    if [[ -n "$d" && -d "$d" ]]; then
        for f in "$d"/*/*.log; do [[ -f "$f" ]] && { echo "## ${f#$d/}"; tail -n 8 "$f"; }; done
    fi
}

cv_cleanup() {
    local rc=$?
    set +e  # tear down whatever fails on the way (even writing to a closed output)
    trap '' PIPE
    trap - EXIT INT TERM
    if [[ $rc -ne 0 || $passed -eq 0 ]]; then
        echo
        echo "FAILED: ${failure:-exit status $rc}" >&2
        cv_summary "FAIL	-	${failure:-exit status $rc}"
        [[ $started_up -eq 1 ]] && cv_dump
        [[ $rc -eq 0 ]] && rc=1
    fi
    if [[ $started_up -eq 1 ]]; then
        if [[ $keep -eq 1 ]]; then
            echo "cluster kept: project $project, NATS at $CONVERGE_NATS_URL (user cli, password file $CONVERGE_NATS_PASSWORD_FILE)"
            echo "remove it with: CONVERGE_SECRETS_DIR=$cv_secrets ${cv_compose_cmd[*]} -p $project ${cv_compose_files[*]} --profile ha down -v; rm -rf $cv_secrets"
        else
            log "tearing down ($project, down -v)"
            compose down -v --remove-orphans >/dev/null 2>&1 || compose down -v >/dev/null 2>&1 || true
        fi
    fi
    [[ $keep -eq 1 || -z "$cv_secrets" ]] || rm -rf "$cv_secrets"
    [[ ${#cv_tmpfiles[@]} -eq 0 ]] || rm -f "${cv_tmpfiles[@]}"
    exit "$rc"
}

cv_build() {
    if [[ $skip_build -eq 0 ]]; then
        log "building images (deploy/build-images.sh)"
        local t; t=$(now)
        "$cv_root/deploy/build-images.sh" || fail "deploy/build-images.sh failed"
        cv_build_s="$(since "$t") s"
    else
        cv_build_s="skipped"
    fi
    [[ -x "$cv_target_dir/$bin_profile_dir/converge" ]] || fail "$cv_target_dir/$bin_profile_dir/converge is missing (cargo build --release -p converge-cli)"
    cli=("$cv_target_dir/$bin_profile_dir/converge" --nats-connect-timeout 10s)
}

# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.5 s.
wait_for() {
    local limit="$1" what="$2"; shift 2
    local deadline; deadline=$(awk -v n="$(now)" -v l="$limit" 'BEGIN { printf "%.3f", n + l }')
    until "$@"; do
        awk -v n="$(now)" -v d="$deadline" 'BEGIN { exit !(n < d) }' || fail "$what not within $limit s"
        sleep 0.5
    done
}

cv_fresh_hosts() { "${cli[@]}" --json hosts 2>/dev/null | python3 "$cv_tool" fresh-hosts "${1:-5}" 2>/dev/null; }
cv_three_agents() { [[ $(cv_fresh_hosts 5 | wc -w) -ge 3 ]]; }

# cv_up [SERVICE...]: secrets, `up -d`, three agents reporting.
cv_up() {
    local cluster_arg=()
    [[ $cv_cluster -eq 0 ]] || cluster_arg=(--cluster)
    log "NATS configuration and passwords (deploy/nats/compose-secrets.sh ${cluster_arg[*]} $cv_secrets)"
    "$cv_root/deploy/nats/compose-secrets.sh" "${cluster_arg[@]}" "$cv_secrets" 2>/dev/null || fail "compose-secrets.sh failed"
    log "up -d (project $project, NATS on $CONVERGE_NATS_URL, user cli)"
    cv_t_up=$(now)
    started_up=1
    compose up -d "$@" >/dev/null 2>&1 || { compose up -d "$@" || true; fail "compose up failed"; }
    wait_for 90 "three agents reporting" cv_three_agents
    log "three agents report $(since "$cv_t_up") s after up: $(cv_fresh_hosts 5)"
}

cv_jobs_json() { "${cli[@]}" --json jobs --all 2>/dev/null; }
# cv_job JOB FIELD...: fields of JOB's status (see cvtool.py job).
cv_job() { local j="$1"; shift; cv_jobs_json | python3 "$cv_tool" job "$j" "$@" 2>/dev/null; }
cv_submit() { "${cli[@]}" submit "$1" >/dev/null || fail "submit $1 failed"; }
# cv_pids JOB: 'host gen rank pid' of JOB's live workers, from the agents' telemetry.
cv_pids() { "${cli[@]}" --json hosts 2>/dev/null | python3 "$cv_tool" pids "$1"; }
# cv_run_with_small SPAN SECONDS SPAN_STEPS SMALL_STEPS: submits fault-jobs/SPAN.toml and
# ft-small.toml and waits (SECONDS at most) until SPAN runs on two agents past SPAN_STEPS
# steps and ft-small runs past SMALL_STEPS.
cv_run_with_small() {
    local span="$1" limit="$2"; shift 2
    cv_submit "$cv_root/tests/compose/fault-jobs/$span.toml"
    cv_submit "$cv_root/tests/compose/fault-jobs/ft-small.toml"
    wait_for "$limit" "$span running on two agents and ft-small running, both with progress" \
        cv_both_run "$span" "$@"
}
cv_both_run() {
    local p1 h1 s1 p2 s2
    read -r p1 h1 s1 < <(cv_job "$1" phase hosts step) && read -r p2 s2 < <(cv_job ft-small phase step) &&
        [[ "$p1" == running && "$h1" -ge 2 && "$s1" -ge "$2" && "$p2" == running && "$s2" -ge "$3" ]]
}
cv_container() { compose ps -a -q "$1"; }
cv_ip() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$(cv_container "$1")"; }
cv_volume() { docker volume inspect -f "{{.Mountpoint}}" "${project}_$1"; }
# cv_metrics SERVICE: the allocator's /metrics (from the host, at the container's IP).
cv_metrics() {
    local ip; ip=$(cv_ip "$1") || return 1
    [[ -n "$ip" ]] || return 1
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' "http://$ip:9464/metrics" 2>/dev/null
}
# cv_metric SERVICE NAME: the sum of NAME's samples, '-' when absent or unreachable.
cv_metric() { { cv_metrics "$1" || true; } | python3 "$cv_tool" metric "$2"; }

# cv_wait_done JOB... : every job completed (failed/cancelled fails the test), 300 s.
cv_all_done() {
    local js; js=$(cv_jobs_json | python3 "$cv_tool" phases 2>/dev/null) || return 1
    local j ph
    for j in "$@"; do
        ph=$(awk -v j="$j" '$1 == j { print $2 }' <<<"$js")
        [[ "$ph" == failed || "$ph" == cancelled ]] && fail "$j $ph: $(cv_job "$j" message)"
        [[ "$ph" == completed ]] || return 1
    done
}
cv_wait_done() { wait_for "${CV_DONE_TIMEOUT:-300}" "jobs $* completed" cv_all_done "$@"; }

# cv_pass RECOVERY DETAILS: RECOVERY is the test's recovery time (or '-').
cv_pass() {
    passed=1
    cv_summary "PASS	$1	$2 (total $(since "$cv_t_total") s)"
    echo
    echo "PASS  recovery $1; $2  (build $cv_build_s, total $(since "$cv_t_total") s)"
}
