#!/usr/bin/env bash
# Happy path of the container deployment (deploy/docker-compose.yml), for real:
#
#   1. builds the images (deploy/build-images.sh; skips what is up to date)
#   2. `docker compose -p converge-hp-<unique> up -d`: NATS with JetStream and accounts
#      (deploy/nats/compose-secrets.sh: one user per role, random passwords, in a temporary
#      directory), the allocator, three agents with 2 fake GPUs each, NATS published on a
#      free port of 127.0.0.1; the host-side CLI connects as user `cli`
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
# the containers' state, their log tails and the worker logs' tails first (all of this
# is tests/compose/lib.sh, shared by every compose test). Exit status 0
# only if every check passed. Needs docker with compose (v2 `docker compose` or v1
# `docker-compose`), python3, and what deploy/build-images.sh needs (root for the first
# build of the base image).
set -euo pipefail

# --timeout is this test's own option; the others are tests/compose/lib.sh's.
timeout=600
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --timeout) timeout="${2:?--timeout needs seconds}"; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
            printf '%s\n' "Options:" "  --skip-build        use the images as they are (deploy/build-images.sh not run)" \
                "  --timeout SECONDS   longest wait for all jobs to complete (default 600)" \
                "  --keep              leave the cluster running (prints how to reach and remove it)"
            exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
[[ "$timeout" =~ ^[0-9]+$ ]] || { echo "happy-path.sh: --timeout takes whole seconds" >&2; exit 2; }

# Project converge-hp-<pid>-<time>, secured NATS (one user per role, random passwords) on a
# free port of 127.0.0.1, the CLI as `cli`, 2 fake GPUs per agent (so that one job must span
# agents), the local cluster's short scheduling interval and restart cost; teardown on exit.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init hp "${args[@]}"
jobs_dir="$cv_root/tests/compose/jobs"

cv_build
cli_in_container=0
log "docker compose up -d (project $project, NATS published on 127.0.0.1:$nats_port)"
t_up=$(now)
cv_up
up_s=$(since "$t_up")
log "containers up and three agents reporting in ${up_s} s; CLI: ${cli[0]} on the host as user cli, $CONVERGE_NATS_URL"
# The server is secured: no credentials, or a wrong password, is refused.
for creds in "" "cli:wrong-password"; do
    if out=$(env -u CONVERGE_NATS_USER -u CONVERGE_NATS_PASSWORD_FILE ${creds:+CONVERGE_NATS_USER=${creds%%:*} CONVERGE_NATS_PASSWORD=${creds#*:}} \
            "${cli[0]}" --nats-connect-timeout 5s hosts 2>&1); then
        fail "NATS accepted the CLI ${creds:+as ${creds%%:*} with a wrong password}${creds:-without credentials}"
    fi
    grep -qi 'authoriz' <<<"$out" || fail "the CLI ${creds:+with a wrong password}${creds:-without credentials} failed, but not for authorization: $out"
done
log "NATS refuses the CLI without credentials and with a wrong password"
# The server's monitoring port (no password: connections, users, subscriptions) is on the
# NATS container's loopback only: an agent's container, where the workers run, cannot
# open it, while the client port answers.
agent_c=$(cv_container agent-1)
docker exec "$agent_c" bash -c 'exec 3<>/dev/tcp/nats/4222' 2>/dev/null \
    || fail "agent-1 cannot reach nats:4222 (the check of the monitoring port means nothing)"
if docker exec "$agent_c" bash -c 'exec 3<>/dev/tcp/nats/8222' 2>/dev/null; then
    fail "agent-1 (and so any worker) reaches the NATS monitoring port nats:8222"
fi
log "NATS monitoring (8222) is unreachable from an agent's container; its client port answers"

# Everything after `up` is measured and checked by one Python program that polls the CLI's
# JSON; it writes the figures to $results and exits non-zero with a message on failure.
results=$(mktemp -t converge-hp.XXXXXX)
cv_tmpfiles+=("$results")
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

all_done=$(awk '$1 == "all_done" { print $2 }' "$results")
cv_pass "-" "all jobs completed $all_done s after up (secured NATS), up ${up_s} s, stop ${stop_s} s"
