#!/usr/bin/env bash
# The test command of the README and of CI: builds every binary (the end-to-end tests run
# the real `converge`, `converge-trainer` and `nats-server` processes), then runs all tiers:
# unit and property tests, integration tests against a real nats-server on a dynamic port,
# end-to-end and fault tests on loopback, then the container tests (below). Fetches the
# pinned nats-server on first use.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$root"
NATS_SERVER_BIN=$("$root/deploy/get-nats-server.sh")
export NATS_SERVER_BIN
"$NATS_SERVER_BIN" --version
# Headless Chromium for the dashboard's browser tests (tests/tests/dashboard.rs): Debian's
# `chromium`, installed when missing (as root, as in CI). Without it those tests are
# skipped, unless CONVERGE_REQUIRE_BROWSER=1 (CI), which makes them fail.
if [[ -z "${CONVERGE_CHROMIUM:-}" ]]; then
    if ! command -v chromium >/dev/null && [[ $EUID == 0 ]] && command -v apt-get >/dev/null; then
        { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends chromium; }; } >/dev/null ||
            echo "run-tests.sh: cannot install chromium; the browser tests are skipped" >&2
    fi
    CONVERGE_CHROMIUM=$(command -v chromium || true)
    export CONVERGE_CHROMIUM
fi
# The Python worker kit (python/) and the numpy example worker: a virtualenv in target/py
# with the kit and a pinned numpy, reused until python/ changes; its unit tests run here,
# tests/tests/python_worker.rs runs the worker through CONVERGE_PYTHON. Without python3 or
# PyPI the Python tests are skipped, unless CONVERGE_REQUIRE_PYTHON=1 (then they fail).
if [[ -z "${CONVERGE_PYTHON:-}" ]]; then
    py="$root/target/py"
    stamp="numpy==2.2.6 $(cat python/pyproject.toml python/converge_worker/*.py | sha256sum | cut -c1-16)"
    if [[ "$(cat "$py/.converge-stamp" 2>/dev/null)" != "$stamp" ]]; then
        rm -rf "$py"
        if python3 -m venv "$py" && "$py/bin/pip" install -q --disable-pip-version-check \
            ./python "numpy==2.2.6"; then
            echo "$stamp" >"$py/.converge-stamp"
        else
            echo "run-tests.sh: no Python test environment in $py; Python worker tests skipped" >&2
            rm -rf "$py"
        fi
    fi
    if [[ -x "$py/bin/python" ]]; then
        export CONVERGE_PYTHON="$py/bin/python"
    fi
fi
if [[ -n "${CONVERGE_PYTHON:-}" ]]; then
    "$CONVERGE_PYTHON" -m unittest discover -s python/tests
    # The PyTorch examples where CONVERGE_TORCH_PYTHON (or CONVERGE_PYTHON) has torch;
    # otherwise they print why they are skipped.
    "$CONVERGE_PYTHON" -m unittest -v examples/pytorch/test_examples.py
fi
cargo build --workspace --bins --locked
# The decision core stays pure: no async runtime, NATS client, logging, CSV or plotting crate
# anywhere in converge-sched's dependency tree (ARCHITECTURE.md).
if impure=$(cargo tree -p converge-sched -e normal --prefix none --locked |
    grep -E '^(tokio|async-nats|tracing|csv|plotters|plotters-svg|futures)[ -]'); then
    echo "converge-sched must stay pure; its dependency tree has:" >&2
    echo "$impure" >&2
    exit 1
fi
cargo test --workspace --locked "$@"

# Shaped-cluster tier (tests/netns/run.sh, about a minute): agents in network namespaces
# on tc-shaped veth links (deploy/netns-cluster.sh): traffic between hosts is held to the
# shaped rate, the agents report a ring job's NIC traffic, teardown leaves nothing. Needs
# root; skipped without it or without network namespaces unless CONVERGE_REQUIRE_NETNS=1;
# skipped when a test filter is given or CONVERGE_SKIP_NETNS=1.
if [[ $# -eq 0 && "${CONVERGE_SKIP_NETNS:-0}" != 1 ]]; then
    "$root/tests/netns/run.sh"
fi

# Container tier (tests/compose/run-all.sh): images built offline from the debug binaries
# just built, then the compose cluster with secured NATS and its fault tests (happy path,
# agent restart, NATS restart, allocator kill -9, two allocators, an agent cut off the
# network) and the systemd unit. Skipped without Docker unless CONVERGE_REQUIRE_DOCKER=1
# (CI sets it); skipped when a test filter is given or CONVERGE_SKIP_CONTAINERS=1.
if [[ $# -eq 0 && "${CONVERGE_SKIP_CONTAINERS:-0}" != 1 ]]; then
    CONVERGE_IMAGE_PROFILE="${CONVERGE_IMAGE_PROFILE:-dev}" "$root/tests/compose/run-all.sh"
fi
