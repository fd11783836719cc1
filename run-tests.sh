#!/usr/bin/env bash
# The test command of the README and of CI: builds every binary (the end-to-end tests run
# the real `converge`, `converge-trainer` and `nats-server` processes), then runs all tiers:
# unit and property tests, integration tests against a real nats-server on a dynamic port,
# and end-to-end tests on loopback. Fetches the pinned nats-server on first use.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$root"
NATS_SERVER_BIN=$("$root/deploy/get-nats-server.sh")
export NATS_SERVER_BIN
"$NATS_SERVER_BIN" --version
cargo build --workspace --bins --locked
cargo test --workspace --locked "$@"
