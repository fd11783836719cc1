#!/usr/bin/env bash
# The compose cluster's `monitoring` profile, for real: Prometheus (its image built offline
# from Debian's package by deploy/build-prometheus-image.sh) with deploy/prometheus/
# prometheus.yml scrapes the allocator and the three agents.
#
#   1. builds the images, and the Prometheus image
#   2. `docker compose --profile monitoring up -d` (secured NATS, three agents with 2 fake
#      GPUs each), Prometheus published on a free port of 127.0.0.1
#   3. waits until Prometheus reports the allocator's and the three agents' targets up
#   4. checks through Prometheus's query API: one DCGM_FI_DEV_GPU_UTIL series per fake GPU
#      (6) with each agent's Hostname, DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE equal to
#      the GPUs' memory, node_network_receive_bytes_total from every agent
#   5. submits a job and waits for its converge_job_workers series, then for the job to
#      complete and the series to go
#
#   tests/compose/monitoring.sh [--skip-build] [--keep]
#
# Tears the cluster down on exit (unless --keep). Needs what happy-path.sh needs, and
# apt-get (Debian's prometheus package is downloaded, not installed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cv_init monitoring "$@"
cv_build
log "building the Prometheus image (deploy/build-prometheus-image.sh)"
tag=$("$cv_root/deploy/build-prometheus-image.sh") || fail "deploy/build-prometheus-image.sh failed"
prom_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export CONVERGE_PROMETHEUS_BIND=127.0.0.1 CONVERGE_PROMETHEUS_PORT="$prom_port"
export CONVERGE_PROMETHEUS_TAG="${tag##*:}"
cv_profiles=(monitoring)
cv_up
prom="http://127.0.0.1:$prom_port"

# promq EXPR: the query's result vector as 'labels<TAB>value' lines.
promq() {
    python3 - "$prom" "$1" <<'PY'
import json, sys, urllib.parse, urllib.request
url = sys.argv[1] + "/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[2]})
data = json.load(urllib.request.urlopen(url, timeout=3))
for r in data["data"]["result"]:
    print(json.dumps(r["metric"], sort_keys=True) + "\t" + r["value"][1])
PY
}
# targets_up: the allocator and the three agents scraped (allocator-2 exists only under
# the `ha` profile: its target stays down here).
targets_up() {
    python3 - "$prom" <<'PY'
import json, sys, urllib.request
t = json.load(urllib.request.urlopen(sys.argv[1] + "/api/v1/targets", timeout=3))["data"]["activeTargets"]
up = [x["labels"] for x in t if x["health"] == "up"]
agents = sum(1 for l in up if l["job"] == "converge-agent")
allocator = any(l["job"] == "converge-allocator" and l["instance"] == "allocator:9464" for l in up)
sys.exit(0 if agents == 3 and allocator else 1)
PY
}
count() { promq "$1" 2>/dev/null | wc -l; }

t0=$(now)
wait_for 90 "Prometheus scraping the allocator and the three agents" targets_up
targets_s=$(since "$t0")
log "every target up $targets_s s after the cluster"
wait_for 60 "one GPU utilization series per fake GPU" eval '[[ $(count DCGM_FI_DEV_GPU_UTIL) -eq 6 ]]'
hostnames=$(promq 'count by (Hostname) (DCGM_FI_DEV_GPU_UTIL)' | wc -l)
[[ $hostnames -eq 3 ]] || fail "DCGM_FI_DEV_GPU_UTIL from $hostnames Hostnames, expected 3"
# Fake GPUs have 16 GiB: used + free = 16384 MiB on each.
bad=$(promq 'DCGM_FI_DEV_FB_USED + on(gpu, Hostname) DCGM_FI_DEV_FB_FREE != 16384' | wc -l)
[[ $bad -eq 0 ]] || fail "$bad GPUs whose FB_USED + FB_FREE is not 16384 MiB"
nic_hosts=$(promq 'count by (instance) (node_network_receive_bytes_total)' | wc -l)
[[ $nic_hosts -eq 3 ]] || fail "node_network_receive_bytes_total from $nic_hosts agents, expected 3"

cv_submit "$cv_root/tests/compose/jobs/hp-a9a-logreg.toml"
wait_for 120 "the job's converge_job_workers series" \
    eval '[[ $(promq "converge_job_workers{job_id=\"hp-a9a-logreg\"} > 0" 2>/dev/null | wc -l) -eq 1 ]]'
cv_wait_done hp-a9a-logreg
# A finished job's series go at the allocator's next step; Prometheus marks them stale at
# its next scrape (15 s).
wait_for 60 "the finished job's series gone" \
    eval '[[ $(count "converge_job_workers{job_id=\"hp-a9a-logreg\"}") -eq 0 ]]'
cv_pass - "Prometheus $tag: 4 targets up ${targets_s} s after up; 6 GPU series from 3 hosts, FB used + free = 16384 MiB; NIC counters from 3 agents; a job's series came and went"
