#!/usr/bin/env bash
# Happy path of the container deployment (deploy/docker-compose.yml), for real:
#
#   1. builds the images (deploy/build-images.sh; skips what is up to date)
#   2. `docker compose -p converge-hp-<unique> up -d`: NATS, the allocator, three agents
#      with 2 fake GPUs each, NATS published on a free port of 127.0.0.1
#   3. waits until the three agents report (heartbeats in KV), each advertising its name
#   4. submits the jobs in tests/compose/jobs/ (hp-optdigits-span needs 3 workers, more
#      than one agent's 2 GPUs, so its ring spans agents)
#   5. waits until every job has completed (any failed or cancelled job fails the test)
#   6. checks the spanning job ran on two agents or more and that its checkpoint is on
#      the shared volume as every agent sees it
#   7. stops the cluster (every agent must exit 0 after stopping its workers) and prints
#      each job's JCT and the time from `up` to the first job running
#
#   tests/compose/happy-path.sh [--skip-build] [--timeout SECONDS] [--keep]
#
# Always tears the cluster down (`down -v`) on exit, unless --keep; on failure it prints
# the containers' state, their log tails and the worker logs' tails first. Exit status 0
# only if every check passed. Needs docker with compose (v2 `docker compose` or v1
# `docker-compose`), python3, and what deploy/build-images.sh needs (root for the first
# build of the base image).
set -euo pipefail

usage() {
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'HELP'
Options:
  --skip-build        use the images as they are (deploy/build-images.sh not run)
  --timeout SECONDS   longest wait for all jobs to complete (default 600)
  --keep              leave the cluster running (prints how to reach and remove it)
  -h, --help          this text
HELP
}

skip_build=0
timeout=600
keep=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-build) skip_build=1; shift ;;
        --timeout) timeout="${2:?--timeout needs seconds}"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "happy-path.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$timeout" =~ ^[0-9]+$ ]] || { echo "happy-path.sh: --timeout takes whole seconds" >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
compose_file="$root/deploy/docker-compose.yml"
jobs_dir="$root/tests/compose/jobs"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"

log() { printf '==> %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="${2:-$(date +%s.%N)}" 'BEGIN { printf "%.1f", b - a }'; }

if docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose_cmd=(docker-compose)
else
    echo "happy-path.sh: neither 'docker compose' nor 'docker-compose' is available" >&2
    exit 1
fi
project="converge-hp-$$-$(date +%s)"
compose() { "${compose_cmd[@]}" -p "$project" -f "$compose_file" "$@"; }

# The cluster's settings: small fake GPUs so that one job must span agents, the local
# cluster's short scheduling epoch and restart cost, NATS on a free port of 127.0.0.1.
nats_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export CONVERGE_NATS_BIND=127.0.0.1 CONVERGE_NATS_PORT="$nats_port" CONVERGE_FAKE_GPUS=2 \
    CONVERGE_EPOCH=5s CONVERGE_RESTART_COST=10s CONVERGE_HORIZON=60s CONVERGE_STOP_GRACE=10s
export CONVERGE_NATS_URL="nats://127.0.0.1:$nats_port"

started_up=0
passed=0
results=""
failure=""
fail() { failure="$*"; exit 1; }

dump_diagnostics() {
    echo
    echo "---- containers ----"
    compose ps || true
    echo "---- container logs (last 40 lines each) ----"
    compose logs --no-color --tail 40 || true
    echo "---- worker logs (last 8 lines each, from agent-1's view of the shared volume) ----"
    compose exec -T agent-1 sh -c 'for f in /var/lib/converge/logs/*/*.log; do [ -f "$f" ] && { echo "## $f"; tail -n 8 "$f"; }; done' 2>/dev/null || true
}

cleanup() {
    local rc=$?
    set +e  # tear down whatever fails on the way (even writing to a closed output)
    trap '' PIPE
    trap - EXIT INT TERM
    if [[ $rc -ne 0 || $passed -eq 0 ]]; then
        echo
        echo "FAILED: ${failure:-exit status $rc}" >&2
        [[ $started_up -eq 1 ]] && dump_diagnostics
        [[ $rc -eq 0 ]] && rc=1
    fi
    [[ -n "${results:-}" ]] && rm -f "$results"
    if [[ $started_up -eq 1 ]]; then
        if [[ $keep -eq 1 ]]; then
            echo "cluster kept: project $project, NATS at $CONVERGE_NATS_URL"
            echo "remove it with: ${compose_cmd[*]} -p $project -f $compose_file down -v"
        else
            log "tearing down ($project, down -v)"
            compose down -v --remove-orphans >/dev/null 2>&1 || compose down -v >/dev/null 2>&1 || true
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'failure="interrupted"; exit 130' INT TERM
# A closed output pipe (| head) or terminal: tear down quietly rather than die untidied.
trap 'failure="output closed"; exec >/dev/null 2>&1; exit 141' PIPE HUP

t_total=$(now)
if [[ $skip_build -eq 0 ]]; then
    log "building images (deploy/build-images.sh)"
    t=$(now)
    "$root/deploy/build-images.sh" || fail "deploy/build-images.sh failed"
    build_s="$(since "$t") s"
    log "images ready in ${build_s}"
else
    build_s="skipped"
fi

# The CLI: the host binary against the published port when it is built, else the one in
# the allocator image through `compose exec`.
if [[ -x "$target_dir/release/converge" ]]; then
    cli=("$target_dir/release/converge" --nats-connect-timeout 10s)
    cli_in_container=0
    cli_desc="$target_dir/release/converge on the host, $CONVERGE_NATS_URL"
else
    cli=("${compose_cmd[@]}" -p "$project" -f "$compose_file" exec -T allocator converge --nats-connect-timeout 10s)
    cli_desc="converge in the allocator container"
    cli_in_container=1
fi

log "docker compose up -d (project $project, NATS published on 127.0.0.1:$nats_port)"
t_up=$(now)
started_up=1
compose up -d >/dev/null 2>&1 || { compose up -d || true; fail "compose up failed"; }
up_s=$(since "$t_up")
log "containers started in ${up_s} s; CLI: $cli_desc"

# Everything after `up` is measured and checked by one Python program that polls the CLI's
# JSON; it writes the figures to $results and exits non-zero with a message on failure.
results=$(mktemp -t converge-hp.XXXXXX)
CLI_JSON="$(printf '%s\n' "${cli[@]}")" CLI_IN_CONTAINER="$cli_in_container" python3 - "$t_up" "$timeout" "$jobs_dir" "$results" <<'PY' || fail "$(tail -n 1 "$results" 2>/dev/null || echo 'the job checks failed')"
import json, os, subprocess, sys, time, glob

t_up, timeout, jobs_dir, results = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
cli = os.environ["CLI_JSON"].splitlines()
in_container = os.environ.get("CLI_IN_CONTAINER") == "1"
out = open(results, "w")

def say(msg):
    print(msg, flush=True)

def die(msg):
    out.write(msg + "\n"); out.flush()
    say("FAIL: " + msg)
    sys.exit(1)

def run(*args, check=True, stdin=None):
    p = subprocess.run(cli + list(args), capture_output=True, text=True, timeout=60, input=stdin)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
    return p.stdout

def get_json(*args):
    return json.loads(run("--json", *args))

def excepthook(kind, value, tb):
    import traceback
    traceback.print_exception(kind, value, tb)
    die(f"unexpected error: {value}")
sys.excepthook = excepthook

# 1. Three agents report, each with its fake GPUs and its own name as address.
deadline = time.time() + 120
hosts = []
while time.time() < deadline:
    try:
        hosts = get_json("hosts")
    except Exception as e:  # NATS or the buckets may not be there yet
        hosts = []
    fresh = [h for h in hosts if time.time() - h["time"] < 10]
    if len(fresh) >= 3:
        break
    time.sleep(0.5)
else:
    die(f"only {len(hosts)} agent(s) reported within 120 s after up: {[h['host'] for h in hosts]}")
t_agents = time.time()
say(f"    3 agents reported {t_agents - t_up:.1f} s after up: " +
    ", ".join(f"{h['host']} ({len(h['gpus'])} {h['gpu_source']} GPUs, addr {h['addr']})" for h in sorted(hosts, key=lambda h: h["host"])))
for h in hosts:
    if h["addr"] != h["host"]:
        die(f"agent {h['host']} advertises {h['addr']}, expected its service name")

# 2. Submit: the spanning job first.
specs = sorted(glob.glob(os.path.join(jobs_dir, "*.toml")), key=lambda p: (0 if "span" in p else 1, p))
if not specs:
    die(f"no job specs in {jobs_dir}")
submitted = {}
t_first_submit = time.time()
for spec in specs:
    if in_container:  # the CLI in the allocator container cannot read host paths
        msg = run("submit", "/dev/stdin", stdin=open(spec).read()).strip()
    else:
        msg = run("submit", spec).strip()
    say(f"    {msg}")
    jid = os.path.basename(spec)[:-5]
    submitted[jid] = time.time()
t_submit = time.time()

# 3. Poll until every job completed.
seen_hosts = {j: set() for j in submitted}
first_running = None      # first poll showing a job with a step > 0
first_started_at = None   # earliest started_at the allocator recorded
last_phases, last_print, line = None, 0.0, ""
deadline = time.time() + timeout
statuses = {}
while True:
    try:
        jobs = get_json("jobs", "--all")
    except Exception as e:
        say(f"    (jobs not readable: {e})")
        jobs = []
    statuses = {j["status"]["job"]: j["status"] for j in jobs if j.get("status")}
    for jid, st in statuses.items():
        if jid in seen_hosts:
            seen_hosts[jid].update(p["host"] for p in st.get("placement", []))
        if st.get("step", 0) > 0 and first_running is None:
            first_running = time.time()
        if st.get("started_at") and (first_started_at is None or st["started_at"] < first_started_at):
            first_started_at = st["started_at"]
    bad = {j: s for j, s in statuses.items() if s["phase"] in ("failed", "cancelled")}
    if bad:
        die("job(s) " + ", ".join(f"{j} {s['phase']}: {s.get('message')}" for j, s in bad.items()))
    line = "  ".join(f"{j}={statuses[j]['phase']}@{statuses[j].get('step', 0)}" if j in statuses else f"{j}=?" for j in sorted(submitted))
    phases = [statuses.get(j, {}).get("phase") for j in sorted(submitted)]
    if phases != last_phases or time.time() - last_print >= 10:
        say(f"    [{time.time() - t_up:6.1f} s] {line}")
        last_phases, last_print = phases, time.time()
    if len(statuses) >= len(submitted) and all(statuses.get(j, {}).get("phase") == "completed" for j in submitted):
        break
    if time.time() > deadline:
        die(f"jobs not completed within {timeout:.0f} s: {line}")
    time.sleep(1)
t_done = time.time()

# 4. Checks and figures.
span = [j for j in submitted if "span" in j]
for j in span:
    if len(seen_hosts[j]) < 2:
        die(f"{j} never ran on two agents (hosts seen: {sorted(seen_hosts[j])})")
say("")
say(f"{'job':<22} {'JCT s':>7} {'gens':>5} {'steps':>6} {'samples':>8} {'loss first -> last':>20}  agents")
for j in sorted(submitted):
    s = statuses[j]
    jct = s["finished_at"] - s["submitted_at"]
    loss = f"{s['first_loss']:.3f} -> {s['loss']:.3f}" if s.get("first_loss") is not None and s.get("loss") is not None else "-"
    say(f"{j:<22} {jct:7.1f} {s['generation']:5d} {s['step']:6d} {s['samples']:8d} {loss:>20}  {','.join(sorted(seen_hosts[j]))}")
    out.write(f"jct {j} {jct:.1f}\n")
say("")
first = first_started_at - t_up if first_started_at else float("nan")
say(f"up -> 3 agents reporting:            {t_agents - t_up:6.1f} s")
say(f"up -> first job running (allocator): {first:6.1f} s   (submissions {t_first_submit - t_up:.1f}-{t_submit - t_up:.1f} s after up)")
if first_running:
    say(f"up -> first progress report seen:    {first_running - t_up:6.1f} s")
say(f"up -> all jobs completed:            {t_done - t_up:6.1f} s")
out.write(f"agents {t_agents - t_up:.1f}\nfirst_running {first:.1f}\nall_done {t_done - t_up:.1f}\n")
out.write("ok\n")
PY

# The spanning job's checkpoint, as every agent sees the shared volume.
for a in agent-1 agent-2 agent-3; do
    compose exec -T "$a" test -s /var/lib/converge/checkpoints/hp-optdigits-span/checkpoint.json \
        || fail "$a does not see /var/lib/converge/checkpoints/hp-optdigits-span/checkpoint.json on the shared volume"
done
log "the spanning job's checkpoint is on the shared volume, seen by all three agents"

# A clean stop: the agents and the allocator exit 0 within their grace periods.
t=$(now)
compose stop >/dev/null 2>&1 || fail "compose stop failed"
stop_s=$(since "$t")
for svc in allocator agent-1 agent-2 agent-3; do
    id=$(compose ps -a -q "$svc")
    code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
    [[ "$code" == 0 ]] || fail "$svc exited with status $code on stop"
done
log "compose stop took ${stop_s} s; allocator and agents exited 0"

passed=1
echo
echo "PASS  build ${build_s}, up ${up_s} s, stop ${stop_s} s, total $(since "$t_total") s"
