#!/usr/bin/env bash
# A shaped multi-host Converge cluster on one machine. Each agent runs in its own network
# namespace (a "host") with its own veth link to a shared bridge, and every link is shaped
# with tc (HTB rate limit, plus netem delay where the kernel has sch_netem), so the workers
# of one job on different hosts really cross shaped links and each agent's NIC rates (sysinfo,
# the namespace's eth0) are that host's real traffic. NATS and the allocator run in a
# control namespace on the same bridge. Nothing is added to the machine's own network
# namespace: the bridge lives in a namespace of its own, and every address is inside the
# namespaces created here. Everything is torn down on exit, Ctrl-C or SIGTERM; a previous
# run's namespaces of the same --name are removed at start.
#
#   sudo ./deploy/netns-cluster.sh [--agents N] [--gpus N] [--rate RATE] [--latency DELAY]
#                                  [--subnet A.B.C] [--name NAME] [--up] [--env-file FILE]
#                                  [--jobs "SPEC..."] [--duration SECONDS] ... [--debug]
#
# Layout (defaults: --name cvnet, --subnet 10.213.47):
#   cvnet-net   the bridge br0, with one port per host (h1, h2, ...) and one for ctl
#   cvnet-ctl   eth0 10.213.47.1: nats-server (port 4222) and converge-allocator
#   cvnet-hI    eth0 10.213.47.(10+I): converge-agent --host-id node-I, its workers
# Each host's link is shaped in both directions (its eth0's egress, and the bridge port's
# egress toward it) to --rate, with --latency of delay each way on each link: between two
# hosts a packet crosses two links, so their round trip is 4 x --latency.
#
# Run commands in the cluster with `ip netns exec cvnet-ctl converge jobs` (the control
# namespace has CONVERGE_NATS_URL=nats://127.0.0.1:4222 as its server) or in a host's
# namespace with `ip netns exec cvnet-h1 ...`. Needs root (network namespaces, tc), iproute2,
# Rust (cargo) and python3 (to fetch the pinned nats-server). Where network namespaces cannot
# be created it says why and exits with status 77 (skipped).
set -euo pipefail

usage() {
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    cat <<'HELP'
Options:
  --agents N           hosts (network namespaces), one agent each (default 3)
  --gpus N             fake GPUs per agent (default 4)
  --rate RATE          each host link's rate in each direction, tc syntax with a bit unit:
                       1gbit, 500mbit, 100mbit (default 1gbit); agents report it as their
                       eth0's link speed (--link-speed), since a veth always says 10 Gbit/s
  --latency DELAY      delay added each way on each host link, tc syntax (default 0.2ms;
                       0 for none); needs the kernel's sch_netem, else the links are
                       rate-shaped only and a warning says so
  --subnet A.B.C       the private /24 used inside the namespaces (default 10.213.47)
  --name NAME          prefix of the namespaces (default cvnet): NAME-net, NAME-ctl,
                       NAME-h1...; two clusters with different names and subnets can coexist
  --up                 start the cluster and keep it up (no jobs, no monitor) until Ctrl-C,
                       SIGTERM or --duration; for tests and experiments that submit their own
  --env-file FILE      once the cluster is up, write shell variables describing it to FILE
                       (NETNS_NAME, NETNS_CTL, NETNS_HOSTS, NETNS_ADDRS, NATS_URL,
                       NETNS_WORK, NETNS_BIN, NETNS_LATENCY_EMULATED, ...)
  --placement KIND     allocator placement: bco (default) or first-fit
  --allocator-arg ARG  pass ARG to converge-allocator (repeatable)
  --agent-arg ARG      pass ARG to every converge-agent (repeatable)
  --jobs "SPEC..."     submit these job specs (space-separated paths, --spacing seconds
                       apart; default: the six examples of local-cluster.sh)
  --spacing SECONDS    seconds between submissions (default 15)
  --until-done N       stop once N jobs exist and all have finished (default: the number
                       of specs)
  --summary FILE       write the monitor's JSON summary of the run
  --duration SECONDS   stop after this long (default 300; with --up: 0, no limit)
  --scheduling-interval DURATION  allocator scheduling interval (default 5s)
  --restart-cost DUR   allocator restart cost (default 10s)
  --work DIR           working directory (logs, checkpoints, NATS store); default a new
                       temporary one, removed at the end unless --keep
  --keep               keep the working directory and print its path
  --debug              run debug binaries instead of release
  --no-build           do not run cargo build (the binaries must exist)
  --bin DIR            run the binaries in DIR instead of target/release (or target/debug);
                       implies --no-build
  --cleanup            only remove the namespaces of --name left by an earlier run, and exit
  -h, --help           this text
HELP
}

agents=3
gpus=4
rate=1gbit
latency=0.2ms
subnet=10.213.47
name=cvnet
up=0
env_file=""
placement=""
allocator_args=()
agent_args=()
job_list=""
spacing=15
until_done=""
summary=""
duration=""
interval=5s
restart_cost=10s
work=""
keep=0
profile=release
build=1
bin_dir=""
cleanup_only=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --agents) agents="$2"; shift 2 ;;
        --gpus) gpus="$2"; shift 2 ;;
        --rate) rate="$2"; shift 2 ;;
        --latency) latency="$2"; shift 2 ;;
        --subnet) subnet="$2"; shift 2 ;;
        --name) name="$2"; shift 2 ;;
        --up) up=1; shift ;;
        --env-file) env_file="$2"; shift 2 ;;
        --placement) placement="$2"; shift 2 ;;
        --allocator-arg) allocator_args+=("$2"); shift 2 ;;
        --agent-arg) agent_args+=("$2"); shift 2 ;;
        --jobs) job_list="$2"; shift 2 ;;
        --spacing) spacing="$2"; shift 2 ;;
        --until-done) until_done="$2"; shift 2 ;;
        --summary) summary="$2"; shift 2 ;;
        --duration) duration="$2"; shift 2 ;;
        --scheduling-interval|--epoch) interval="$2"; shift 2 ;;
        --restart-cost) restart_cost="$2"; shift 2 ;;
        --work) work="$2"; shift 2 ;;
        --keep) keep=1; shift ;;
        --debug) profile=debug; shift ;;
        --no-build) build=0; shift ;;
        --bin) bin_dir="$2"; build=0; shift 2 ;;
        --cleanup) cleanup_only=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "netns-cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

die() { echo "netns-cluster.sh: $*" >&2; exit 2; }
[[ "$agents" =~ ^[1-9][0-9]*$ && "$agents" -le 200 ]] || die "--agents takes a count from 1 to 200"
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "--gpus takes a positive count"
[[ "$spacing" =~ ^[0-9]+$ ]] || die "--spacing takes whole seconds"
[[ -z "$duration" || "$duration" =~ ^[0-9]+$ ]] || die "--duration takes whole seconds"
[[ -z "$until_done" || "$until_done" =~ ^[1-9][0-9]*$ ]] || die "--until-done takes a positive count"
# Namespace names end up in interface-free places only, but keep them short and plain.
[[ "$name" =~ ^[a-z][a-z0-9]{0,9}$ ]] || die "--name takes 1-10 lowercase letters and digits, starting with a letter"
[[ "$subnet" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || die "--subnet takes the first three octets of a /24, e.g. 10.213.47"
for octet in "${BASH_REMATCH[@]:1}"; do (( octet <= 255 )) || die "--subnet $subnet: octet $octet above 255"; done
# The rate in Mbit/s, for the agents' --link-speed (tc itself parses $rate).
if [[ "$rate" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]]; then
    case "${BASH_REMATCH[2]}" in
        kbit) rate_mbit=$(( BASH_REMATCH[1] / 1000 )) ;;
        mbit) rate_mbit=${BASH_REMATCH[1]} ;;
        gbit) rate_mbit=$(( BASH_REMATCH[1] * 1000 )) ;;
    esac
    (( rate_mbit >= 1 )) || die "--rate $rate is below 1mbit"
else
    die "--rate takes a whole number with kbit, mbit or gbit, e.g. 1gbit or 200mbit"
fi
[[ "$latency" == 0 || "$latency" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || die "--latency takes a delay such as 0.2ms, 50us or 0"
[[ -z "$placement" || "$placement" == bco || "$placement" == first-fit ]] || die "--placement takes bco or first-fit"
if [[ -z "$duration" ]]; then
    if [[ "$up" == 1 ]]; then duration=0; else duration=300; fi
fi
[[ -n "$summary" ]] && summary=$(realpath -m "$summary")
[[ -n "$env_file" ]] && env_file=$(realpath -m "$env_file")
if [[ -n "$job_list" ]]; then
    job_list=$(for spec in $job_list; do realpath -m "$spec"; done | tr '\n' ' ')
fi

net_ns="$name-net"
ctl_ns="$name-ctl"
host_ns() { echo "$name-h$1"; }
host_addr() { echo "$subnet.$((10 + $1))"; }
ctl_addr="$subnet.1"

# Every namespace of this --name that exists (an earlier run's included).
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$name-(net|ctl|h[0-9]+)$" || true
}

# Stops what still runs in a namespace of ours (workers an agent left, a process of an
# earlier run), then deletes it: its veth ends go with it, and their peers with them.
remove_namespace() {
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [[ -n "$pids" ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        for _ in $(seq 50); do
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -z "$pids" ]] && break
            sleep 0.1
        done
        # shellcheck disable=SC2086
        [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
}

remove_stale() {
    local stale
    stale=$(our_namespaces)
    if [[ -n "$stale" ]]; then
        echo "==> removing namespaces left by an earlier run: $(echo $stale)"
        for ns in $stale; do remove_namespace "$ns"; done
    fi
}

# Root and namespaces, or a clear skip.
if [[ $EUID != 0 ]]; then
    echo "netns-cluster.sh: skipped: needs root (network namespaces and tc); run it with sudo" >&2
    exit 77
fi
for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "netns-cluster.sh: skipped: no $tool (iproute2) on PATH" >&2; exit 77; }
done
if [[ "$cleanup_only" == 1 ]]; then
    remove_stale
    exit 0
fi
probe_ns="$name-probe$$"
if ! err=$(ip netns add "$probe_ns" 2>&1); then
    echo "netns-cluster.sh: skipped: cannot create a network namespace here ($err)" >&2
    exit 77
fi
if ! err=$(ip -n "$probe_ns" link add br0 type bridge 2>&1 &&
    ip -n "$probe_ns" link add eth0 type veth peer name p0 2>&1 &&
    ip -n "$probe_ns" link set eth0 up 2>&1 &&
    ip netns exec "$probe_ns" tc qdisc add dev eth0 root handle 1: htb default 1 2>&1 &&
    ip netns exec "$probe_ns" tc class add dev eth0 parent 1: classid 1:1 htb rate "$rate" ceil "$rate" quantum 65536 2>&1); then
    ip netns del "$probe_ns" 2>/dev/null || true
    echo "netns-cluster.sh: skipped: bridges, veth pairs or tc htb are not available in a namespace ($err)" >&2
    exit 77
fi
netem=0
if [[ "$latency" != 0 ]]; then
    if ip netns exec "$probe_ns" tc qdisc add dev eth0 parent 1:1 handle 10: netem delay "$latency" 2>/dev/null; then
        netem=1
    else
        echo "netns-cluster.sh: WARNING: this kernel has no sch_netem (tc netem): the links are shaped to $rate but no latency is added" >&2
    fi
fi
ip netns del "$probe_ns"

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=deploy/cluster-common.sh
source deploy/cluster-common.sh
remove_stale

if [[ "$build" == 1 ]]; then
    echo "==> building ($profile)"
    packages=(-p converge-cli -p converge-agent -p converge-allocator -p converge-trainer)
    if [[ "$profile" == release ]]; then
        cargo build --release "${packages[@]}"
    else
        cargo build "${packages[@]}"
    fi
fi
bin="$root/target/$profile"
[[ -n "$bin_dir" ]] && bin=$(realpath "$bin_dir")
for b in converge converge-agent converge-allocator converge-trainer; do
    [[ -x "$bin/$b" ]] || die "no $bin/$b: build the binaries first, or leave out --no-build"
done
export PATH="$bin:$PATH"
nats_server=$("$root/deploy/get-nats-server.sh")

if [[ -n "$work" ]]; then
    mkdir -p "$work"
    work=$(realpath "$work")
else
    work=$(mktemp -d -t converge-netns.XXXXXX)
fi
pids=()
agent_pids=()
submitter=""
sleeper=""
created=()

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    echo
    echo "==> stopping"
    [[ -n "$submitter" ]] && kill "$submitter" 2>/dev/null || true
    [[ -n "$sleeper" ]] && kill "$sleeper" 2>/dev/null || true
    # Agents first: they stop their workers (SIGTERM, checkpoint, exit).
    for pid in "${agent_pids[@]:-}"; do [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${agent_pids[@]:-}"; do [[ -n "$pid" ]] && wait "$pid" 2>/dev/null || true; done
    # Then the allocator and NATS, last started first.
    for (( i=${#pids[@]}-1; i>=0; i-- )); do kill -TERM "${pids[$i]}" 2>/dev/null || true; wait "${pids[$i]}" 2>/dev/null || true; done
    for ns in "${created[@]:-}"; do [[ -n "$ns" ]] && remove_namespace "$ns"; done
    [[ -n "$env_file" ]] && rm -f "$env_file"
    if [[ "$keep" == 1 ]]; then
        echo "logs, checkpoints and the NATS store kept in $work"
    else
        rm -rf "$work"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Shapes egress of $2 in namespace $1: HTB at --rate, netem delay under it when available.
shape() {
    local ns=$1 dev=$2
    ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: htb default 1
    # quantum: one full-size GSO packet per round (the default, rate/r2q, is too big at Gbit/s).
    ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" quantum 65536
    if [[ "$netem" == 1 ]]; then
        ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: netem delay "$latency" limit 100000
    fi
}

echo "==> network: bridge in $net_ns, $subnet.0/24, links of $agents host(s) shaped to $rate$([[ $netem == 1 ]] && echo ", $latency each way")"
ip netns add "$net_ns"; created+=("$net_ns")
ip -n "$net_ns" link set lo up
ip -n "$net_ns" link add br0 type bridge
ip -n "$net_ns" link set br0 up
ip netns add "$ctl_ns"; created+=("$ctl_ns")
ip -n "$ctl_ns" link set lo up
ip -n "$ctl_ns" link add eth0 type veth peer name ctl netns "$net_ns"
ip -n "$ctl_ns" addr add "$ctl_addr/24" dev eth0
ip -n "$ctl_ns" link set eth0 up
ip -n "$net_ns" link set ctl master br0 up
for i in $(seq "$agents"); do
    ns=$(host_ns "$i")
    ip netns add "$ns"; created+=("$ns")
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "h$i" netns "$net_ns"
    ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$net_ns" link set "h$i" master br0 up
    shape "$ns" eth0          # the host's uplink
    shape "$net_ns" "h$i"     # its downlink (the bridge port's egress)
done

echo "==> starting NATS in $ctl_ns ($ctl_addr:4222, JetStream in $work/nats)"
mkdir -p "$work/nats"
ip netns exec "$ctl_ns" setsid "$nats_server" -a 0.0.0.0 -p 4222 -js -sd "$work/nats/js" \
    >"$work/nats.log" 2>&1 &
pids+=("$!")
for _ in $(seq 100); do
    ip netns exec "$ctl_ns" bash -c ': </dev/tcp/127.0.0.1/4222' 2>/dev/null && break
    sleep 0.1
done
ip netns exec "$ctl_ns" bash -c ': </dev/tcp/127.0.0.1/4222' 2>/dev/null ||
    { echo "nats-server did not start; see $work/nats.log" >&2; exit 1; }
nats_url="nats://$ctl_addr:4222"

echo "==> starting the allocator in $ctl_ns (scheduling interval $interval, restart cost $restart_cost${placement:+, placement $placement})"
alloc=(converge-allocator --nats-url nats://127.0.0.1:4222 --scheduling-interval "$interval"
    --restart-cost "$restart_cost" --horizon 60s)
[[ -n "$placement" ]] && alloc+=(--placement "$placement")
ip netns exec "$ctl_ns" setsid "${alloc[@]}" "${allocator_args[@]}" >"$work/allocator.log" 2>&1 &
pids+=("$!")

hosts=()
addrs=()
for i in $(seq "$agents"); do
    ns=$(host_ns "$i")
    ip netns exec "$ns" setsid converge-agent --nats-url "$nats_url" --host-id "node-$i" \
        --fake-gpus "$gpus" --advertise-addr "$(host_addr "$i")" --link-speed "eth0=$rate_mbit" \
        --log-dir "$work/logs" --checkpoint-root "$work/checkpoints" --state-dir "$work/state" \
        --stop-grace 10s "${agent_args[@]}" >"$work/agent-$i.log" 2>&1 &
    agent_pids+=("$!")
    hosts+=("$ns")
    addrs+=("$(host_addr "$i")")
done
echo "==> $agents agents x $gpus fake GPUs (node-1..node-$agents at $(host_addr 1)..); logs in $work"

# The cluster is up once every agent's heartbeat is in KV.
ctl() { ip netns exec "$ctl_ns" env CONVERGE_NATS_URL=nats://127.0.0.1:4222 "$@"; }
for _ in $(seq 300); do
    live=$(ctl converge hosts --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
    [[ "$live" -ge "$agents" ]] && break
    for pid in "${agent_pids[@]}" "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "a cluster process exited early; see the logs in $work" >&2; keep=1; exit 1; }
    done
    sleep 0.2
done
[[ "$live" -ge "$agents" ]] || { echo "only $live of $agents agents reported; see $work/agent-*.log" >&2; keep=1; exit 1; }
echo "==> up: $live hosts; try: sudo ip netns exec $ctl_ns converge --nats-url nats://127.0.0.1:4222 hosts"

if [[ -n "$env_file" ]]; then
    {
        echo "NETNS_NAME=$name"
        echo "NETNS_NET=$net_ns"
        echo "NETNS_CTL=$ctl_ns"
        echo "NETNS_HOSTS=\"${hosts[*]}\""
        echo "NETNS_ADDRS=\"${addrs[*]}\""
        echo "NETNS_CTL_ADDR=$ctl_addr"
        echo "NETNS_RATE=$rate"
        echo "NETNS_RATE_MBIT=$rate_mbit"
        echo "NETNS_LATENCY=$latency"
        echo "NETNS_LATENCY_EMULATED=$netem"
        echo "NATS_URL=$nats_url"
        echo "NETNS_WORK=$work"
        echo "NETNS_BIN=$bin"
    } >"$env_file.tmp"
    mv "$env_file.tmp" "$env_file"
fi

if [[ "$up" == 1 ]]; then
    if [[ "$duration" -gt 0 ]]; then
        sleep "$duration" &
        sleeper=$!
        wait "$sleeper" || true
    else
        # Until a signal: `wait` returns to run the trap.
        while true; do
            sleep 3600 &
            sleeper=$!
            wait "$sleeper" || true
        done
    fi
    exit 0
fi

schedule_jobs || die "no job spec $missing_spec"
submit_jobs_in_background ctl converge

monitor_args=(monitor --interval 2s --duration "${duration}s" --until-done "${until_done:-${#jobs[@]}}")
[[ -n "$summary" ]] && monitor_args+=(--summary "$summary")
[[ -t 1 ]] || monitor_args+=(--no-clear)
ctl converge "${monitor_args[@]}" || true
