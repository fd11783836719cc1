#!/usr/bin/env bash
# A flooding agent on a three-server NATS cluster (docs/load.md, "A flooding agent"):
#
#   1. three nats-servers on 127.0.0.1, routed to each other, JetStream on each;
#   2. the allocator with --bus-replicas 3 (buckets and the progress stream on all three);
#   3. converge-loadgen: honest simulated agents writing heartbeats, jobs placed on them and
#      their progress reports, while --flood-hosts compromised agents publish --flood-bytes
#      reports on their own subjects, --flood-in-flight unacknowledged at all times, for
#      --duration;
#      it reports failed heartbeats, failed plan and status writes, the honest reports the
#      allocator applied, and the progress stream's largest size against its bound;
#   4. the allocator is stopped (SIGTERM) and started again: the time from its start to
#      its first decision (`converge_allocator_step_seconds_count` > 0), after it replayed
#      the flooded stream.
#
#   ./deploy/flood-bench.sh [--out DIR] [--duration 60s] [--flood-hosts 1] [--agents 200]
#                           [--jobs 100] [--reports-per-s 1000] [--flood-bytes 60000]
#                           [--flood-in-flight 4096] [--max-buffered-size SIZE] [--debug]
#
# Each flooding agent has its own NATS connection, as a real one has; the honest agents
# share another and publish their reports as converge-agent does (--retry-like-agent). --max-buffered-size sets the servers' `jetstream { max_buffered_size }`
# (a stream's inbound queue, 128 MiB by default; e.g. 16MB) to try what it changes.
#
# Builds the release binaries (--debug: the debug ones), fetches the pinned nats-server
# (deploy/get-nats-server.sh). Writes OUT/summary.json (the load generator's), OUT/restart.txt
# and the servers' and allocators' logs; prints a table. About 2 minutes with the defaults.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

out="" duration=60s flood_hosts=1 agents=200 jobs=100 rate=1000 flood_bytes=60000 flood_in_flight=4096 profile=release
max_buffered_size=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out=${2:?--out needs a value}; shift 2 ;;
        --duration) duration=${2:?--duration needs a value}; shift 2 ;;
        --flood-hosts) flood_hosts=${2:?--flood-hosts needs a value}; shift 2 ;;
        --agents) agents=${2:?--agents needs a value}; shift 2 ;;
        --jobs) jobs=${2:?--jobs needs a value}; shift 2 ;;
        --reports-per-s) rate=${2:?--reports-per-s needs a value}; shift 2 ;;
        --flood-bytes) flood_bytes=${2:?--flood-bytes needs a value}; shift 2 ;;
        --flood-in-flight) flood_in_flight=${2:?--flood-in-flight needs a value}; shift 2 ;;
        --max-buffered-size) max_buffered_size=${2:?--max-buffered-size needs a value}; shift 2 ;;
        --debug) profile=debug; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "flood-bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
out=${out:-$(mktemp -d /tmp/converge-flood.XXXXXX)}
mkdir -p "$out"

nats=$(deploy/get-nats-server.sh)
if [[ $profile == release ]]; then
    cargo build --release --locked -q -p converge-allocator -p converge-loadgen
else
    cargo build --locked -q -p converge-allocator -p converge-loadgen
fi
bin="target/$profile"

# Nine free ports (client, route, monitoring per server) and one for the allocator's metrics.
read -r -a ports < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(10)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)
client=("${ports[@]:0:3}") route=("${ports[@]:3:3}") monitor=("${ports[@]:6:3}") metrics=${ports[9]}
routes="nats://127.0.0.1:${route[0]},nats://127.0.0.1:${route[1]},nats://127.0.0.1:${route[2]}"
url="nats://127.0.0.1:${client[0]},nats://127.0.0.1:${client[1]},nats://127.0.0.1:${client[2]}"

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$out/js"
}
trap cleanup EXIT
for i in 0 1 2; do
    conf=()
    if [[ -n $max_buffered_size ]]; then
        printf 'jetstream {\n  max_buffered_size: %s\n}\n' "$max_buffered_size" >"$out/s$i.conf"
        conf=(-c "$out/s$i.conf")
    fi
    "$nats" "${conf[@]}" -a 127.0.0.1 -p "${client[$i]}" -m "${monitor[$i]}" --server_name "s$i" \
        -js -sd "$out/js/s$i" --cluster_name converge-flood \
        --cluster "nats://127.0.0.1:${route[$i]}" --routes "$routes" >"$out/s$i.log" 2>&1 &
    pids+=($!)
done

# Waits until `$1` (a URL) answers, or says what did not start.
wait_http() {
    python3 - "$1" "$2" <<'EOF'
import sys, time, urllib.request
url, what = sys.argv[1], sys.argv[2]
deadline = time.time() + 90
while time.time() < deadline:
    try:
        urllib.request.urlopen(url, timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit("%s did not answer at %s in 90 s" % (what, url))
EOF
}
for i in 0 1 2; do wait_http "http://127.0.0.1:${monitor[$i]}/healthz" "nats-server s$i"; done

start_allocator() {
    "$bin/converge-allocator" --nats-url "$url" --bus-replicas 3 \
        --metrics-addr "127.0.0.1:$metrics" >"$out/allocator-$1.log" 2>&1 &
    alloc=$!
    pids+=("$alloc")
}
# Seconds until the allocator's metrics show a decision (its buckets and stream made, its
# lease taken, the stream replayed), polled every 0.1 s for at most 300 s.
first_decision() {
    python3 - "http://127.0.0.1:$metrics/metrics" <<'EOF'
import sys, time, urllib.request
url = sys.argv[1]
t0 = time.time()
while time.time() - t0 < 300:
    try:
        page = urllib.request.urlopen(url, timeout=2).read().decode()
        for line in page.splitlines():
            if line.startswith("converge_allocator_step_seconds_count") and float(line.split()[-1]) > 0:
                print("%.1f" % (time.time() - t0))
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.1)
print("none in 300")
EOF
}
start_allocator 1
echo "flood-bench: first allocator decided $(first_decision) s after its start" >&2

echo "flood-bench: three servers, allocator with 3 replicas; loading for $duration ($flood_hosts flooding host(s))" >&2
status=0
"$bin/converge-loadgen" --nats-url "$url" --bus-replicas 3 \
    --metrics-url "http://127.0.0.1:$metrics/metrics" --agents "$agents" --jobs "$jobs" \
    --reports-per-s "$rate" --duration "$duration" --scrape-every 10s \
    --flood-hosts "$flood_hosts" --flood-bytes "$flood_bytes" \
    --flood-in-flight "$flood_in_flight" --retry-like-agent --prefix flood \
    --summary "$out/summary.json" | tee "$out/loadgen.txt" || status=$?

# The restart: SIGTERM, then a new allocator; time to its first decision.
kill -TERM "$alloc"
wait "$alloc" 2>/dev/null || true
start_allocator 2
first=$(first_decision)
echo "restarted allocator: first decision ${first} s after its start" | tee "$out/restart.txt"
echo "flood-bench: results in $out" >&2
exit "$status"
