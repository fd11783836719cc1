#!/usr/bin/env bash
# Every container-deployment test, one after the other (or N at a time), with one image build:
#
#   1. deploy/build-images.sh (once; skips what is up to date)
#   2. with --skip-build each: happy-path.sh, agent-restart.sh, nats-restart.sh,
#      nats-cluster.sh (three NATS servers, deploy/docker-compose.cluster.yml),
#      kill-allocator.sh, partition.sh, two-allocators.sh, monitoring.sh (compose, secured
#      NATS, each its own project), systemd-verify.sh, systemd-container.sh
#      (--no-systemd-container leaves it out)
#   3. a summary table: each test's result (PASS, FAIL, SKIP), recovery time and figures,
#      then one line: "run-all.sh: all passed (10 tests)"; with skips "run-all.sh: 8
#      passed, 2 skipped (TEST: reason; ...)"; with failures "run-all.sh: FAIL: TEST, ...
#      failed; 7 passed" and exit status 1
#
#   tests/compose/run-all.sh [--skip-build] [--no-systemd-container] [--logs DIR]
#                            [--parallel N] [TEST...]
#
# --parallel N (or CONVERGE_COMPOSE_PARALLEL=N): N tests at a time (default 1), each its own
# compose project; ./run-tests.sh runs 2 (the tests mostly wait on jobs whose steps sleep).
# TEST: names without .sh (e.g. partition kill-allocator) to run only those. Each test's
# output goes to DIR/<test>.log (default: a temporary directory, printed; kept).
#
# Without docker (or without compose) it skips with a message and exit status 0, unless
# CONVERGE_REQUIRE_DOCKER=1 (CI sets it): then it fails. A test skips when its log has a
# line starting with SKIP (systemd-verify.sh without systemd-analyze, systemd-container.sh
# where Docker refuses a systemd container); with CONVERGE_REQUIRE_DOCKER=1 that is a
# failure of the test, naming what was missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

skip_build=0 systemd_container=1 logs="" only=() parallel="${CONVERGE_COMPOSE_PARALLEL:-1}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-build) skip_build=1; shift ;;
        --no-systemd-container) systemd_container=0; shift ;;
        --logs) logs="${2:?--logs needs a directory}"; shift 2 ;;
        --parallel) parallel="${2:?--parallel needs a number}"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "run-all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) only+=("${1%.sh}"); shift ;;
    esac
done

[[ "$parallel" =~ ^[1-9][0-9]*$ ]] || { echo "run-all.sh: --parallel takes a number of tests, 1 or more" >&2; exit 2; }
require_docker="${CONVERGE_REQUIRE_DOCKER:-0}"
no_docker() {
    if [[ "$require_docker" == 1 ]]; then
        echo "run-all.sh: FAIL: $* (CONVERGE_REQUIRE_DOCKER=1: the compose tests must run)" >&2
        exit 1
    fi
    echo "run-all.sh: SKIP: $* (set CONVERGE_REQUIRE_DOCKER=1 to make this a failure)"
    exit 0
}
command -v docker >/dev/null || no_docker "docker is not installed"
docker info >/dev/null 2>&1 || no_docker "the docker daemon is not reachable (docker info failed)"
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null \
    || no_docker "neither 'docker compose' nor 'docker-compose' is available"
command -v python3 >/dev/null || { echo "run-all.sh: python3 is required" >&2; exit 1; }

tests=(happy-path agent-restart nats-restart nats-cluster kill-allocator partition two-allocators monitoring systemd-verify)
[[ $systemd_container -eq 0 ]] || tests+=(systemd-container)
if [[ ${#only[@]} -gt 0 ]]; then
    for t in "${only[@]}"; do [[ -x "$here/$t.sh" ]] || { echo "run-all.sh: no test $t" >&2; exit 2; }; done
    tests=("${only[@]}")
fi
[[ -n "$logs" ]] || logs=$(mktemp -d -t converge-compose-tests.XXXXXX)
mkdir -p "$logs"
summary="$logs/summary.tsv"
: >"$summary"

t_all=$(date +%s)
if [[ $skip_build -eq 0 ]]; then
    echo "==> deploy/build-images.sh (log: $logs/build-images.log)"
    t=$(date +%s)
    if ! "$root/deploy/build-images.sh" >"$logs/build-images.log" 2>&1; then
        tail -n 30 "$logs/build-images.log"
        echo "run-all.sh: FAIL: deploy/build-images.sh failed" >&2
        exit 1
    fi
    echo "    images ready in $(( $(date +%s) - t )) s"
fi

declare -A result=() took=() recovery=() detail=() skip_reason=()
failed=0
# run_one TEST: runs it (its output in $logs/TEST.log), then writes "STATUS SECONDS" to
# $logs/TEST.status.
run_one() {
    local t="$1" args=() start rc
    case "$t" in systemd-*) ;; *) args=(--skip-build) ;; esac
    start=$(date +%s)
    set +e
    CV_SUMMARY_FILE="$summary" "$here/$t.sh" "${args[@]}" >"$logs/$t.log" 2>&1
    rc=$?
    set -e
    # Written whole, then renamed: the loop below never reads a half-written status.
    echo "$rc $(( $(date +%s) - start ))" >"$logs/$t.status.tmp"
    mv "$logs/$t.status.tmp" "$logs/$t.status"
}
# judge TEST: its result, time, recovery and figures, from its status, log and summary line.
judge() {
    local t="$1" rc line skip_line reason
    read -r rc took[$t] <"$logs/$t.status"
    [[ "$rc" =~ ^[0-9]+$ ]] || rc=1
    line=$(awk -F'\t' -v n="$t" '$1 == n' "$summary" | tail -n 1)
    case "$t" in happy-path) line=$(awk -F'\t' '$1 == "hp"' "$summary" | tail -n 1) ;; agent-restart) line=$(awk -F'\t' '$1 == "ar"' "$summary" | tail -n 1) ;; esac
    recovery[$t]=$(cut -f3 <<<"$line"); detail[$t]=$(cut -f4- <<<"$line")
    [[ -n "${recovery[$t]}" ]] || recovery[$t]=-
    if [[ -z "${detail[$t]}" ]]; then
        detail[$t]=$({ grep -E '^(PASS|FAIL|FAILED|SKIP|systemd checks)' "$logs/$t.log" || true; } | tail -n 1 | cut -c1-150)
    fi
    if [[ $rc -ne 0 ]]; then
        result[$t]=FAIL; failed=1
    elif skip_line=$(grep -m1 '^SKIP' "$logs/$t.log" 2>/dev/null); then
        reason=$(sed -E 's/^SKIP[:[:space:]]*//' <<<"$skip_line")
        skip_reason[$t]=${reason:-no reason given}
        if [[ "$require_docker" == 1 ]]; then
            result[$t]=FAIL; failed=1
            detail[$t]="skipped, which CONVERGE_REQUIRE_DOCKER=1 makes a failure: ${skip_reason[$t]}"
        else
            result[$t]=SKIP
        fi
    else
        result[$t]=PASS
    fi
    echo "    $t: ${result[$t]} in ${took[$t]} s: ${detail[$t]}"
    [[ ${result[$t]} != FAIL ]] || { echo "    --- last lines of $logs/$t.log ---"; { grep -E 'FAIL|SKIP|==>' "$logs/$t.log" || true; } | tail -n 8 | sed 's/^/    /'; }
}
# Up to $parallel tests at a time, each its own compose project (own containers, network,
# volumes and published ports), in the order listed; results in the order they finish.
# Each runs in a process group of its own (job control on for the fork only, so that
# this script's foreground commands keep the terminal and Ctrl-C reaches this script;
# stdin from /dev/null, which a background job no longer gets by itself): Ctrl-C or
# SIGTERM here sends SIGTERM to every running test, whose trap tears its cluster down, and
# waits (2 min at most) until their process groups are gone.
declare -A pid_of=()
stop_tests() {
    local p deadline=$(( $(date +%s) + 120 ))
    trap - INT TERM
    echo "run-all.sh: interrupted: stopping the running tests (each tears its cluster down)" >&2
    for p in "${pid_of[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
    for p in "${pid_of[@]}"; do
        while kill -0 -- "-$p" 2>/dev/null && (( $(date +%s) < deadline )); do sleep 0.5; done
    done
    exit 130
}
trap stop_tests INT TERM
pending=("${tests[@]}") running=()
while [[ ${#pending[@]} -gt 0 || ${#running[@]} -gt 0 ]]; do
    while [[ ${#pending[@]} -gt 0 && ${#running[@]} -lt $parallel ]]; do
        t=${pending[0]}; pending=("${pending[@]:1}")
        rm -f "$logs/$t.status"
        echo "==> $t (log: $logs/$t.log)"
        set -m
        run_one "$t" </dev/null &
        pid_of[$t]=$!
        set +m
        running+=("$t")
    done
    sleep 1
    still=()
    for t in "${running[@]}"; do
        # A runner gone without a status (killed, or its shell failed) is a failure.
        if [[ ! -f "$logs/$t.status" ]] && ! kill -0 "${pid_of[$t]}" 2>/dev/null && [[ ! -f "$logs/$t.status" ]]; then
            echo "1 0" >"$logs/$t.status"
            echo "run-all.sh: the runner of $t ended without writing its status" >>"$logs/$t.log"
        fi
        if [[ -f "$logs/$t.status" ]]; then
            judge "$t"
            unset "pid_of[$t]"
        else
            still+=("$t")
        fi
    done
    running=("${still[@]}")
done
wait

echo
printf '%-18s %-6s %6s  %-10s %s\n' test result time recovery details
for t in "${tests[@]}"; do
    printf '%-18s %-6s %5ss  %-10s %s\n' "$t" "${result[$t]}" "${took[$t]}" "${recovery[$t]}" "${detail[$t]}"
done
echo
echo "total $(( $(date +%s) - t_all )) s; logs in $logs"
join() { local sep=$1 out=$2 x; shift 2; for x in "$@"; do out+="$sep$x"; done; printf '%s' "$out"; }
passed=0 failures=() skips=()
for t in "${tests[@]}"; do
    case ${result[$t]} in
        PASS) passed=$((passed + 1)) ;;
        FAIL) failures+=("$t${skip_reason[$t]:+ (skipped under CONVERGE_REQUIRE_DOCKER=1: ${skip_reason[$t]})}") ;;
        SKIP) skips+=("$t: ${skip_reason[$t]}") ;;
    esac
done
counts="$passed passed"
[[ ${#skips[@]} -eq 0 ]] || counts+=", ${#skips[@]} skipped ($(join '; ' "${skips[@]}"))"
if [[ $failed -ne 0 ]]; then
    echo "run-all.sh: FAIL: $(join ', ' "${failures[@]}") failed; $counts" >&2
    exit 1
fi
if [[ ${#skips[@]} -gt 0 ]]; then
    echo "run-all.sh: $counts"
else
    echo "run-all.sh: all passed ($passed test$([[ $passed -eq 1 ]] || echo s))"
fi
