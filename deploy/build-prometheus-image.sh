#!/usr/bin/env bash
# Builds converge/prometheus:<version> offline, for the compose cluster's optional
# `monitoring` profile: the `prometheus` package of the Debian mirror (apt-get download, no
# registry), its two binaries on the local converge/base:bookworm (deploy/build-images.sh
# base builds it). Not part of build-images.sh or CI: the default compose tests do not use
# it.
#
#   deploy/build-images.sh base             # once, if converge/base:bookworm is missing
#   deploy/build-prometheus-image.sh        # --rebuild to remake an existing image
#   docker compose -f deploy/docker-compose.yml --profile monitoring up -d
#   # Prometheus at http://127.0.0.1:9090 (CONVERGE_PROMETHEUS_BIND / _PORT)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rebuild=0
case "${1:-}" in
    --rebuild) rebuild=1 ;;
    -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
    "") ;;
    *) echo "build-prometheus-image.sh: unknown option $1" >&2; exit 2 ;;
esac

die() { printf 'build-prometheus-image.sh: %s\n' "$*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed"
command -v apt-get >/dev/null || die "apt-get is needed to fetch Debian's prometheus package"
docker image inspect converge/base:bookworm >/dev/null 2>&1 \
    || die "converge/base:bookworm is missing: run deploy/build-images.sh base first"

work=$(mktemp -d)
chmod 0755 "$work"
trap 'rm -rf "$work"' EXIT
# apt-get download writes as the _apt user where it can; a world-writable folder avoids
# its "unsandboxed" warning.
mkdir -m 0777 "$work/deb"
# Stale or missing package lists (a fresh CI machine): refresh them once, as root.
(cd "$work/deb" && apt-get download prometheus >/dev/null 2>&1) \
    || { [[ $EUID -eq 0 ]] && apt-get update -qq >/dev/null \
        && (cd "$work/deb" && apt-get download prometheus >/dev/null); } \
    || die "apt-get download prometheus failed (apt-get update first?)"
deb=$(ls "$work"/deb/prometheus_*.deb)
version=$(dpkg-deb -f "$deb" Version)          # e.g. 2.42.0+ds-5+deb12u1
tag="converge/prometheus:${version%%+*}"       # converge/prometheus:2.42.0
if docker image inspect "$tag" >/dev/null 2>&1 && [[ $rebuild -eq 0 ]]; then
    echo "==> $tag exists (--rebuild to remake it)" >&2
    echo "$tag"
    exit 0
fi
dpkg-deb -x "$deb" "$work/x"
ctx="$work/ctx"
mkdir -p "$ctx"
install -m 0755 "$work/x/usr/bin/prometheus" "$work/x/usr/bin/promtool" "$ctx/"
"$ctx/promtool" check config "$root/deploy/prometheus/prometheus.yml" >&2
install -m 0644 "$root/deploy/prometheus/prometheus.yml" "$ctx/prometheus.yml"
echo "==> building $tag from Debian's prometheus $version" >&2
docker build -q -t "$tag" -f "$root/deploy/images/prometheus.Dockerfile" "$ctx" >&2
echo "==> $tag built" >&2
echo "$tag"
