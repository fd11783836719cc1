#!/usr/bin/env bash
# Writes the NATS configuration and the passwords deploy/docker-compose.yml mounts: runs
# deploy/nats/gen-config.sh for the compose cluster's users (allocator, cli,
# agent-agent-1..3; passwords random per cluster, an existing password file is kept) with
# the JetStream store in /data and monitoring on port 8222 of the container's loopback only
# (nothing on the compose network, where the agents' workers run, can read it; as root on
# the Docker host: nsenter -t "$(docker inspect -f '{{.State.Pid}}' CONTAINER)" -n
# curl http://127.0.0.1:8222/varz), then makes the files readable
# by the containers' uid 10001 (Compose without Swarm bind-mounts secrets as they are).
#
#   deploy/nats/compose-secrets.sh [--cluster] [DIR]     DIR: default deploy/nats/secrets
#
# --cluster: the configuration of deploy/docker-compose.cluster.yml's three servers (nats,
# nats-2, nats-3; each started with its own --server_name): also a cluster `converge`
# routed on port 6222, the routes authenticated as `route` (credentials/route.password).
#
# Then `docker compose -f deploy/docker-compose.yml up -d` (with CONVERGE_SECRETS_DIR=DIR
# when DIR is not the default) and, for the CLI on the host:
#   export CONVERGE_NATS_USER=cli CONVERGE_NATS_PASSWORD_FILE=DIR/credentials/cli.password
#
# As root the files are chowned to 10001 and stay 0600 (0640 for the configuration); as
# another user (a member of the docker group) they are made world-readable in a 0700
# directory, so that only that user and the containers read them.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ "${1:-}" != -h && "${1:-}" != --help ]] || { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0; }
cluster=()
if [[ "${1:-}" == --cluster ]]; then
    cluster=(--cluster-name converge --routes nats://nats:6222,nats://nats-2:6222,nats://nats-3:6222)
    shift
fi
out="${1:-$here/secrets}"
uid=10001

"$here/gen-config.sh" --hosts agent-1,agent-2,agent-3 --out "$out" --store-dir /data \
    --http 127.0.0.1:8222 --server-name converge-nats "${cluster[@]}"
chmod 700 "$out"
if [[ $(id -u) -eq 0 ]]; then
    chown "$uid:$uid" "$out/nats-server.conf" "$out"/credentials/*.password
    chmod 640 "$out/nats-server.conf"
    chmod 600 "$out"/credentials/*.password
    chmod 755 "$out/credentials"   # the host-side CLI of other users still cannot read the files
else
    chmod 644 "$out/nats-server.conf" "$out"/credentials/*.password
    chmod 755 "$out/credentials"
fi
echo "compose secrets in $out (CONVERGE_SECRETS_DIR); CLI: CONVERGE_NATS_USER=cli CONVERGE_NATS_PASSWORD_FILE=$out/credentials/cli.password" >&2
