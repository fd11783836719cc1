#!/usr/bin/env bash
# deploy/systemd/converge-agent.service under a real systemd, for real: systemd runs as
# PID 1 of a throw-away container (converge/base + Debian's systemd), the unit and its env
# file are installed as docs/deploy.md says (user converge, /usr/local/bin,
# /etc/converge/agent.env with 4 fake GPUs, /srv/converge/checkpoints), NATS and the
# allocator run beside it as transient units, and then:
#
#   1. `systemctl enable --now converge-agent` with every hardening option of the unit; the
#      agent reports and runs the 4 workers of examples/jobs/mnist-mlp.toml, which write
#      their logs and checkpoint through ProtectSystem=strict
#   2. `systemctl stop`: the unit's processes get SIGTERM (KillMode=control-group), the agent
#      stops its workers (exit 143 after checkpointing) and exits 0 well within
#      TimeoutStopSec
#   3. `systemctl start`: the workers resume from that checkpoint
#   4. SIGKILL to the agent alone: its workers' shims see their lifelines close and stop
#      them (systemd sends the leftovers SIGTERM too), systemd restarts the agent after
#      RestartSec (Restart=on-failure), and the agent starts its workers again
#   5. deploy/systemd/isolate-jobs.conf as a drop-in: the agent runs as root with a bounded
#      capability set, the job's workers restart from their checkpoint under one user id of
#      61000-61999, own their checkpoint directory (0700), have no CONVERGE_NATS_* in their
#      environment and cannot read the agent's env file or state
#
#   tests/compose/systemd-container.sh [--keep]
#
# Needs docker, the image converge/base:bookworm (deploy/build-images.sh base), the release
# binaries in $CARGO_TARGET_DIR/release (default target/release), deb.debian.org once (to
# add systemd to the test image) and a Docker that allows --cap-add SYS_ADMIN (systemd
# needs it for the unit's mount namespaces) and SYS_PTRACE (root on a host has it; step 5
# bounds the agent to it). Skips (exit 0) where that is refused.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
keep=0
[[ "${1:-}" == --keep ]] && keep=1

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
target_dir="${CARGO_TARGET_DIR:-$root/target}"
# Binaries of the profile the images were built from (CONVERGE_IMAGE_PROFILE, as
# deploy/build-images.sh): release by default, dev = target/debug.
case "${CONVERGE_IMAGE_PROFILE:-release}" in dev|debug) bin_profile_dir=debug ;; *) bin_profile_dir=release ;; esac
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"
image=converge-test/systemd:bookworm
name="converge-systemd-$$"

log() { printf '==> %s\n' "$*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

for b in converge-agent converge-trainer converge converge-allocator; do
    [[ -x "$target_dir/$bin_profile_dir/$b" ]] || fail "$target_dir/$bin_profile_dir/$b is missing (cargo build --release)"
done
docker image inspect converge/base:bookworm >/dev/null 2>&1 \
    || fail "converge/base:bookworm is missing (deploy/build-images.sh base)"
nats_bin=$("$root/deploy/get-nats-server.sh")

if ! docker image inspect "$image" >/dev/null 2>&1; then
    log "building $image (converge/base + systemd from deb.debian.org)"
    ctx=$(mktemp -d)
    printf '%s\n' 'FROM converge/base:bookworm' \
        'RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd systemd-sysv dbus && rm -rf /var/lib/apt/lists/*' \
        'CMD ["/sbin/init"]' >"$ctx/Dockerfile"
    docker build -q -t "$image" "$ctx" >/dev/null || { rm -rf "$ctx"; fail "cannot build $image"; }
    rm -rf "$ctx"
fi

cleanup() {
    local rc=$?
    set +e  # tear down whatever fails on the way (even writing to a closed output)
    trap '' PIPE
    trap - EXIT
    if [[ $rc -ne 0 ]] && docker inspect "$name" >/dev/null 2>&1; then
        echo "---- journal of converge-agent (last 40 lines) ----"
        docker exec "$name" journalctl -u converge-agent --no-pager -n 40 2>/dev/null || true
    fi
    if [[ $keep -eq 1 ]]; then
        echo "container kept: docker exec -it $name bash; remove with docker rm -f $name"
    else
        docker rm -f "$name" >/dev/null 2>&1 || true
    fi
    exit "$rc"
}
trap cleanup EXIT

log "starting systemd in container $name"
if ! docker run -d --name "$name" --cap-add SYS_ADMIN --cap-add SYS_PTRACE \
        --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
        --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro \
        "$image" >/dev/null 2>"/tmp/$name.err"; then
    cat "/tmp/$name.err" >&2
    why=$(grep -m1 . "/tmp/$name.err" | cut -c1-160 || true); rm -f "/tmp/$name.err"
    echo "SKIP: this Docker refuses a systemd container (--cap-add SYS_ADMIN SYS_PTRACE, seccomp and apparmor unconfined): ${why:-docker run failed}"
    exit 0
fi
rm -f "/tmp/$name.err"
for _ in $(seq 50); do
    state=$(docker exec "$name" systemctl is-system-running 2>/dev/null || true)
    [[ "$state" == running || "$state" == degraded ]] && break
    sleep 0.2
done
[[ "$state" == running || "$state" == degraded ]] || fail "systemd did not come up (state: ${state:-none})"

inside() { docker exec "$name" bash -c "$1"; }

log "installing the agent as docs/deploy.md says"
for b in converge-agent converge-trainer converge converge-allocator; do
    docker cp "$target_dir/$bin_profile_dir/$b" "$name:/usr/local/bin/$b"
done
docker cp "$nats_bin" "$name:/usr/local/bin/nats-server"
inside 'mkdir -p /etc/converge /usr/local/share/converge /root/jobs'
docker cp "$root/deploy/systemd/converge-agent.service" "$name:/etc/systemd/system/converge-agent.service"
docker cp "$root/deploy/systemd/converge-agent.env" "$name:/etc/converge/agent.env"
docker cp "$root/data" "$name:/usr/local/share/converge/data"
docker cp "$root/examples/jobs/mnist-mlp.toml" "$name:/root/jobs/mnist-mlp.toml"
inside '
set -e
useradd --system --uid 10001 --user-group --home-dir /var/lib/converge --shell /usr/sbin/nologin converge 2>/dev/null
install -d -o converge -g converge /srv/converge/checkpoints
chgrp converge /etc/converge/agent.env && chmod 0640 /etc/converge/agent.env
sed -i -e "s#^CONVERGE_NATS_URL=.*#CONVERGE_NATS_URL=nats://127.0.0.1:4222#" \
       -e "s/^#CONVERGE_FAKE_GPUS=.*/CONVERGE_FAKE_GPUS=4/" \
       -e "s/^#CONVERGE_HOST_ID=.*/CONVERGE_HOST_ID=sd-node-1/" /etc/converge/agent.env
systemd-run -q --unit nats -p DynamicUser=yes -p StateDirectory=nats \
    /usr/local/bin/nats-server -a 127.0.0.1 -js -sd /var/lib/nats
systemd-run -q --unit allocator -E NO_COLOR=1 -E CONVERGE_SCHEDULING_INTERVAL=5s -E CONVERGE_RESTART_COST=10s \
    /usr/local/bin/converge-allocator
systemctl daemon-reload
'

log "1. systemctl enable --now converge-agent"
inside 'systemctl enable -q --now converge-agent'
inside 'for i in $(seq 100); do converge --json hosts 2>/dev/null | grep -q "\"sd-node-1\"" && exit 0; sleep 0.2; done; exit 1' \
    || fail "the agent did not report within 20 s"
inside 'converge submit /root/jobs/mnist-mlp.toml >/dev/null'
# 60 s: the first generation may be replaced within seconds (a better batch once its first
# gradient statistics arrive), and a loaded CI machine is slow to start the next.
inside 'for i in $(seq 120); do
        n=$(grep -l CONVERGE_PROGRESS /var/log/converge/mnist-mlp/gen*-rank0.log 2>/dev/null | wc -l)
        [ -s /srv/converge/checkpoints/mnist-mlp/checkpoint.json ] && [ "$n" -gt 0 ] && exit 0; sleep 0.5
    done; exit 1' || fail "no progress and checkpoint under /var/log/converge and /srv/converge within 60 s"
# A worker may be between generations at this instant (the allocator restarts the job for
# a better batch once its first gradient statistics arrive): wait up to 30 s for one.
workers=$(inside 'for i in $(seq 60); do
        n=$(pgrep -c -u converge converge-traine || true)
        [ "$n" -ge 1 ] && { echo "$n"; exit 0; }; sleep 0.5
    done; echo 0')
echo "    agent running under the hardened unit with $workers workers; logs and checkpoint written"
[[ "$workers" -ge 1 ]] || fail "no worker process runs"

log "2. systemctl stop converge-agent"
stop_s=$(inside 't=$(date +%s.%N); systemctl stop converge-agent; awk -v a="$t" -v b="$(date +%s.%N)" "BEGIN { print b - a }"')
inside 'journalctl -u converge-agent --no-pager -o cat' >"/tmp/$name.journal"
grep -q 'worker stopped (exit code 143)' "/tmp/$name.journal" || fail "no worker stopped with exit code 143 (checkpointed) on stop"
grep -q 'agent stopped' "/tmp/$name.journal" || fail "the agent did not log 'agent stopped'"
grep -q 'Killing process' "/tmp/$name.journal" && fail "systemd had to SIGKILL processes on a clean stop"
result=$(inside 'systemctl show -p Result --value converge-agent')
[[ "$result" == success ]] || fail "the unit's stop result is $result"
rm -f "/tmp/$name.journal"
# Rank 0 checkpoints on SIGTERM. Written unbuffered (a system call per JSON token), its 2 MB
# checkpoint took 11.6 s on this container's fuse-overlayfs and the stop 12 to 13 s; with
# the trainer's 64 KiB buffer the stop takes well under a second.
awk -v s="$stop_s" 'BEGIN { exit !(s + 0 > 0 && s + 0 < 10) }' \
    || fail "systemctl stop took $stop_s s (over 10 s): a worker was slow to checkpoint and exit"
printf '    stopped cleanly in %.1f s (TimeoutStopSec=90s): workers exited 143, agent exited 0\n' "$stop_s"

log "3. systemctl start converge-agent: the workers resume from the checkpoint"
inside 'systemctl start converge-agent'
inside 'for i in $(seq 60); do grep -q "resumed from checkpoint" /var/log/converge/mnist-mlp/gen*-rank0.log && exit 0; sleep 0.5; done; exit 1' \
    || fail "rank 0 did not resume from its checkpoint within 30 s"
echo "    $(inside 'grep -h "resumed from checkpoint" /var/log/converge/mnist-mlp/gen*-rank0.log | tail -n1')"

log "4. SIGKILL to the agent alone: its workers stop, systemd restarts it"
old_pid=$(inside 'systemctl show -p MainPID --value converge-agent')
resumes_before_kill=$(inside 'cat /var/log/converge/mnist-mlp/gen*-rank0.log | grep -c "resumed from checkpoint" || true')
old_workers=$(inside 'pgrep -d " " -u converge converge-traine || true')
inside 'systemctl kill -s SIGKILL --kill-whom=main converge-agent'
# 60 s: systemd restarts the agent (RestartSec=5s) once the unit's other processes, the
# workers it sends SIGTERM, have exited (rank 0 after its checkpoint).
inside "for i in \$(seq 300); do p=\$(systemctl show -p MainPID --value converge-agent); [ \"\$p\" != 0 ] && [ \"\$p\" != $old_pid ] && exit 0; sleep 0.2; done; exit 1" \
    || fail "the agent was not restarted within 60 s"
inside "for p in $old_workers; do [ -d /proc/\$p ] && exit 1; done; exit 0" \
    || fail "workers of the dead agent outlived it"
inside 'grep -q "the agent is gone" /var/log/converge/mnist-mlp/gen*-rank*.log' \
    || fail "no worker shim saw its agent die"
inside 'for i in $(seq 50); do [ "$(pgrep -c -u converge converge-traine)" -ge 1 ] && exit 0; sleep 0.2; done; exit 1' \
    || fail "the restarted agent did not start its workers again"
inside "for i in \$(seq 60); do
        n=\$(cat /var/log/converge/mnist-mlp/gen*-rank0.log | grep -c 'resumed from checkpoint')
        [ \"\$n\" -gt $resumes_before_kill ] && exit 0; sleep 0.5
    done; exit 1" || fail "rank 0 did not resume from its checkpoint under the restarted agent within 30 s"
echo "    leftover workers stopped, agent restarted (pid $old_pid -> $(inside 'systemctl show -p MainPID --value converge-agent')), workers running again"

log "5. deploy/systemd/isolate-jobs.conf: the job's workers under a user id of their own"
# "resumed from checkpoint" lines so far (step 4's included): the restart below must add
# one.
resumes=$(inside 'cat /var/log/converge/mnist-mlp/gen*-rank0.log | grep -c "resumed from checkpoint" || true')
inside 'mkdir -p /etc/systemd/system/converge-agent.service.d' || fail "mkdir of the drop-in directory failed"
docker cp "$root/deploy/systemd/isolate-jobs.conf" "$name:/etc/systemd/system/converge-agent.service.d/isolate-jobs.conf" \
    || fail "docker cp of isolate-jobs.conf failed"
inside 'systemctl daemon-reload && systemctl restart converge-agent' || fail "systemctl restart converge-agent failed under isolate-jobs.conf"
# The workers stop with the old agent and start again under one id of 61000-61999 (60 s).
uid=$(inside 'for i in $(seq 120); do
        u=$(ps -C converge-traine -o uid= | sort -un | xargs)
        [ -n "$u" ] && [ "$u" -ge 61000 ] 2>/dev/null && [ "$u" -le 61999 ] && { echo "$u"; exit 0; }
        sleep 0.5
    done; echo "${u:-none}"; exit 1') || fail "the workers did not run under one id of 61000-61999 within 60 s (ids: $uid)"
agent_pid=$(inside 'systemctl show -p MainPID --value converge-agent') || fail "no MainPID of converge-agent"
[[ "$(inside "ps -o uid= -p $agent_pid | xargs" || true)" == 0 ]] \
    || fail "the agent does not run as root under isolate-jobs.conf"
# The bounding set of the drop-in: CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETGID, SETUID,
# SYS_PTRACE (capability bits 0 1 3 5 6 7 19), within what this container has (it runs
# with SYS_PTRACE added, as root on a host has it).
capbnd=$(inside "sed -n 's/^CapBnd:[[:space:]]*//p' /proc/$agent_pid/status" || true)
container_capbnd=$(inside "sed -n 's/^CapBnd:[[:space:]]*//p' /proc/1/status" || true)
[[ "$container_capbnd" =~ ^[0-9a-f]{16}$ ]] || fail "no capability bounding set of the container's init: '$container_capbnd'"
(( 0x$container_capbnd & 0x80000 )) || fail "the container has no SYS_PTRACE to bound the agent with (docker run --cap-add SYS_PTRACE)"
want_capbnd=$(printf '%016x' $(( 0x800eb & 0x$container_capbnd )))
[[ "$capbnd" == "$want_capbnd" ]] || fail "the agent's capability bounding set is '$capbnd', not $want_capbnd (isolate-jobs.conf's within the container's $container_capbnd)"
owner=$(inside 'stat -c "%u %a" /srv/converge/checkpoints/mnist-mlp' || true)
[[ "$owner" == "$uid 700" ]] || fail "the job's checkpoint directory is '$owner' (owner, mode), not '$uid 700'"
# The agent's NATS settings are in its environment and not in its workers'. A worker's
# environment is read as the worker's own id (what the worker itself can read); every
# worker's must read and be a worker's.
inside "tr '\0' '\n' </proc/$agent_pid/environ | grep -q '^CONVERGE_NATS_URL='" \
    || fail "the agent's environment has no CONVERGE_NATS_URL (the next check would prove nothing)"
read_envs=0
for p in $(inside 'pgrep converge-traine | xargs' || true); do
    env_of=$(docker exec -u "$uid:$uid" "$name" cat "/proc/$p/environ" | tr '\0' '\n') || continue  # gone meanwhile
    [[ -n "$env_of" ]] || continue  # exiting (a zombie's environment reads empty)
    grep -q '^CONVERGE_JOB_ID=mnist-mlp$' <<<"$env_of" || fail "worker $p's environment (read as uid $uid) has no CONVERGE_JOB_ID=mnist-mlp"
    leaked=$(grep -c '^CONVERGE_NATS_' <<<"$env_of" || true)
    [[ "$leaked" == 0 ]] || fail "worker $p has $leaked CONVERGE_NATS_* variable(s) in its environment"
    read_envs=$((read_envs + 1))
done
[[ $read_envs -ge 1 ]] || fail "no worker's environment could be read as uid $uid"
# What the worker's id may not read: the agent's env file and its state directory.
as_worker() { inside "setpriv --reuid=$uid --regid=$uid --clear-groups $1 >/dev/null 2>&1"; }
as_worker 'cat /usr/local/share/converge/data/README.md' \
    || fail "uid $uid cannot read the data set's README (the checks below would prove nothing)"
! as_worker 'cat /etc/converge/agent.env' || fail "uid $uid (a job's workers) can read /etc/converge/agent.env"
! as_worker 'ls /var/lib/converge/state' || fail "uid $uid (a job's workers) can list the agent's state directory"
inside "for i in \$(seq 60); do
        n=\$(cat /var/log/converge/mnist-mlp/gen*-rank0.log | grep -c 'resumed from checkpoint')
        [ \"\$n\" -gt $resumes ] && exit 0; sleep 0.5
    done; exit 1" || fail "rank 0 did not resume from its checkpoint under its new id within 30 s"
echo "    agent as root (bounding set $capbnd), workers as uid $uid, checkpoint directory theirs (0700), no CONVERGE_NATS_* in $read_envs worker environment(s), agent env file and state unreadable to them, rank 0 resumed from the checkpoint"

inside 'converge cancel mnist-mlp >/dev/null 2>&1 || true; systemctl stop converge-agent'
echo
echo "PASS  converge-agent.service under systemd $(inside 'systemctl --version | head -n1 | cut -d" " -f2')"
