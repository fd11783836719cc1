#!/usr/bin/env bash
# The shaped-cluster tier: starts deploy/netns-cluster.sh (two hosts of one GPU, links shaped
# to --rate) and checks, on the real links and processes:
#   1. a stale namespace of the same --name is removed at start;
#   2. bulk TCP between two hosts crosses the shaped link: measured rate <= the shaped rate
#      (and at least half of it), and with sch_netem the round trip shows the added latency
#      (4 x --latency: two links each way); without sch_netem that check says it is skipped;
#   3. a two-worker ring job (converge-trainer) placed across both hosts makes both agents
#      report non-zero eth0 rates in both directions, no more than the shaped rate, with
#      eth0's link speed the shaped rate;
#   4. SIGTERM to the script tears everything down: no namespace of the name left, none of
#      its processes alive.
#
#   tests/netns/run.sh [--release | --bin DIR] [--rate RATE] [--latency DELAY]
#
# Uses the debug binaries (run-tests.sh builds them; --release for target/release, --bin for
# another directory). Needs
# root and network namespaces: elsewhere it prints why it is skipped and exits 0, unless
# CONVERGE_REQUIRE_NETNS=1 (then it fails). About 10 s once the binaries are built.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

profile=debug
bin=""
rate=200mbit
latency=1ms
while [[ $# -gt 0 ]]; do
    case "$1" in
        --release) profile=release; shift ;;
        --bin) bin=$(realpath "$2"); shift 2 ;;
        --rate) rate="$2"; shift 2 ;;
        --latency) latency="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) echo "tests/netns/run.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

name=cvtest
subnet=10.213.48
tmp=$(mktemp -d -t converge-netns-test.XXXXXX)
cluster_pid=""
server_pid=""
pass() { echo "netns: ok: $*"; }
fail() { echo "netns: FAIL: $*" >&2; [[ -d "${NETNS_WORK:-}" ]] && tail -n 20 "$NETNS_WORK"/*.log >&2 || true; exit 1; }

finish() {
    local status=$?
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null || true
    if [[ -n "$cluster_pid" ]] && kill -0 "$cluster_pid" 2>/dev/null; then
        kill -TERM "$cluster_pid" 2>/dev/null || true
        wait "$cluster_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
    exit "$status"
}
trap finish EXIT

skip() {
    if [[ "${CONVERGE_REQUIRE_NETNS:-0}" == 1 ]]; then
        echo "netns: FAIL (CONVERGE_REQUIRE_NETNS=1): $*" >&2
        exit 1
    fi
    echo "netns: tier skipped: $*"
    exit 0
}
[[ $EUID == 0 ]] || skip "needs root (network namespaces, tc)"
command -v ip >/dev/null && command -v tc >/dev/null || skip "needs iproute2 (ip, tc)"
bin=${bin:-$root/target/$profile}
for b in converge converge-agent converge-allocator converge-trainer; do
    [[ -x "$bin/$b" ]] || fail "no $bin/$b (cargo build first)"
done

# 1. A stale namespace of the cluster's name (as a killed earlier run would leave).
ip netns add "$name-h7" 2>/dev/null || skip "cannot create a network namespace here"

flags=(--name "$name" --subnet "$subnet" --agents 2 --gpus 1 --rate "$rate" --latency "$latency"
    --bin "$bin" --up --env-file "$tmp/env" --scheduling-interval 1s --restart-cost 0s)
deploy/netns-cluster.sh "${flags[@]}" >"$tmp/cluster.out" 2>&1 &
cluster_pid=$!
for _ in $(seq 600); do
    [[ -f "$tmp/env" ]] && break
    if ! kill -0 "$cluster_pid" 2>/dev/null; then
        wait "$cluster_pid" && code=0 || code=$?
        cat "$tmp/cluster.out" >&2
        [[ "$code" == 77 ]] && skip "$(grep -m1 skipped "$tmp/cluster.out")"
        fail "netns-cluster.sh exited with $code before the cluster was up"
    fi
    sleep 0.1
done
[[ -f "$tmp/env" ]] || { cat "$tmp/cluster.out" >&2; fail "the cluster did not come up in 60 s"; }
# shellcheck disable=SC1091
source "$tmp/env"
ip netns list | awk '{print $1}' | grep -qx "$name-h7" && fail "the stale namespace $name-h7 is still there"
pass "stale namespace $name-h7 removed at start"
read -r ns1 ns2 <<<"$NETNS_HOSTS"
read -r addr1 addr2 <<<"$NETNS_ADDRS"
rate_bps=$(( NETNS_RATE_MBIT * 1000000 ))

# 2. Bulk TCP and round trips from host 1 to host 2.
ip netns exec "$ns2" python3 tests/netns/netprobe.py serve --port 5201 >"$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 50); do
    ip netns exec "$ns1" bash -c ": </dev/tcp/$addr2/5201" 2>/dev/null && break
    sleep 0.1
done
bulk=$(ip netns exec "$ns1" python3 tests/netns/netprobe.py bulk --to "$addr2:5201" --seconds 3)
measured=$(python3 -c 'import json,sys; print(int(json.loads(sys.argv[1])["bits_per_s"]))' "$bulk")
echo "netns: bulk $ns1 -> $ns2: $((measured / 1000000)) Mbit/s over a link shaped to $rate"
(( measured <= rate_bps * 103 / 100 )) || fail "measured $measured bit/s exceeds the shaped $rate_bps bit/s"
(( measured >= rate_bps / 2 )) || fail "measured $measured bit/s, less than half the shaped $rate_bps bit/s"
pass "bulk transfer between hosts is limited by the shaped link ($measured <= $rate_bps bit/s)"
rtt=$(ip netns exec "$ns1" python3 tests/netns/netprobe.py rtt --to "$addr2:5201" --count 100)
median_us=$(python3 -c 'import json,sys; print(int(1000*json.loads(sys.argv[1])["median_ms"]))' "$rtt")
echo "netns: round trip $ns1 -> $ns2: median $median_us us"
if [[ "$NETNS_LATENCY_EMULATED" == 1 ]]; then
    want_us=$(python3 -c 'import sys; v=sys.argv[1]; f={"us":1,"ms":1000,"s":1000000}; u=next(k for k in ("us","ms","s") if v.endswith(k)); print(int(4*float(v[:-len(u)])*f[u]))' "$NETNS_LATENCY")
    (( median_us >= want_us * 95 / 100 )) || fail "round trip $median_us us, below the 4 x $NETNS_LATENCY = $want_us us the links add"
    (( median_us <= want_us + 20000 )) || fail "round trip $median_us us, far above the $want_us us the links add"
    pass "round trip shows the links' latency ($median_us us >= $want_us us)"
else
    echo "netns: skipped: latency check (this kernel has no sch_netem; the links are rate-shaped only)"
fi
kill "$server_pid" 2>/dev/null || true
wait "$server_pid" 2>/dev/null || true
server_pid=""

# 3. A two-worker ring job across both hosts; both agents see its traffic on eth0.
ctl() { ip netns exec "$NETNS_CTL" env CONVERGE_NATS_URL=nats://127.0.0.1:4222 PATH="$bin:$PATH" "$@"; }
ctl converge submit tests/netns/ring-2.toml >/dev/null
python3 - "$NETNS_CTL" "$rate_bps" "$bin/converge" <<'PY' || fail "the agents did not report the ring job's traffic"
import json, subprocess, sys, time
ctl, rate_bps, converge_bin = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def converge(*args):
    out = subprocess.run(["ip", "netns", "exec", ctl, "env", "CONVERGE_NATS_URL=nats://127.0.0.1:4222",
                          converge_bin, "--json", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)
deadline = time.time() + 90
seen = None
while time.time() < deadline:
    jobs = {j["spec"]["id"]: j["status"] for j in converge("jobs")}
    job = jobs.get("netns-ring-2")
    hosts = {h["host"]: h for h in converge("hosts")}
    eth0 = {h: next((n for n in t["nics"] if n["name"] == "eth0"), None) for h, t in hosts.items()}
    placed = sorted({p["host"] for p in (job or {}).get("placement", [])})
    # The job spans both hosts; both eth0 move >= 50 kB/s each way, below the shaped rate.
    if job and job.get("phase") == "running" and placed == ["node-1", "node-2"] and all(
        n and n["rx_bytes_per_s"] > 50e3 and n["tx_bytes_per_s"] > 50e3 for n in eth0.values()
    ):
        seen = eth0
        break
    time.sleep(1)
if seen is None:
    print(f"netns: last view: job={job and {k: job.get(k) for k in ('phase', 'placement', 'step', 'message')}} eth0={eth0}", file=sys.stderr)
    sys.exit(1)
for host, n in sorted(seen.items()):
    print(f"netns: {host} eth0 rx {n['rx_bytes_per_s']*8/1e6:.1f} Mbit/s, tx {n['tx_bytes_per_s']*8/1e6:.1f} Mbit/s, link {n['link_speed_bps']}")
    assert n["link_speed_bps"] == rate_bps, f"{host}: eth0 link speed {n['link_speed_bps']}, not the shaped {rate_bps}"
    # One telemetry interval's average; 10 % for sampling jitter.
    for d in ("rx", "tx"):
        assert n[f"{d}_bytes_per_s"] * 8 <= rate_bps * 1.1, f"{host} {d} above the shaped rate"
PY
pass "both agents report the ring job's eth0 traffic (non-zero, within the shaped rate, link speed $NETNS_RATE)"
ctl converge cancel netns-ring-2 >/dev/null || true

# 4. Teardown on SIGTERM.
work=$NETNS_WORK
pids=$(for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-"); do ip netns pids "$ns"; done | sort -u | tr '\n' ' ')
kill -TERM "$cluster_pid"
wait "$cluster_pid" || true
cluster_pid=""
left=$(ip netns list | awk '{print $1}' | grep -E "^$name-" || true)
[[ -z "$left" ]] || fail "namespaces left after SIGTERM: $left"
for pid in $pids; do
    kill -0 "$pid" 2>/dev/null && fail "process $pid of the cluster still alive after SIGTERM: $(tr '\0' ' ' </proc/"$pid"/cmdline)"
done
[[ -e "$work" ]] && fail "working directory $work left behind"
pass "SIGTERM removed every namespace ($name-*), process and the working directory"
echo "netns: all checks passed"
