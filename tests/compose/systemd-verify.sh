#!/usr/bin/env bash
# Static checks of deploy/systemd/converge-agent.service and converge-agent.env:
#
#   1. `systemd-analyze verify` on a copy of the unit whose ExecStart= points at a binary
#      that exists here (the release converge-agent if built, else /bin/true): verify
#      refuses a unit whose command is missing, and the real path is /usr/local/bin.
#      Any warning about the unit fails the check, not only errors.
#   2. TimeoutStopSec= of the unit exceeds CONVERGE_STOP_GRACE of the env file by 15 s or
#      more (the agent needs the grace to stop its workers, then flushes for up to 5 s).
#   3. The env file is KEY=value lines only, and, when the release converge-agent is
#      built, the binary accepts every value in it (`converge-agent --probe` with fake
#      GPUs parses the whole environment and connects to nothing).
#   4. `systemd-analyze security --offline=true` prints the unit's exposure (information).
#
#   tests/compose/systemd-verify.sh
#
# Skips (exit 0, with a message) where systemd-analyze is not installed. Nothing is
# installed or started; a running systemd is not needed.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
unit="$root/deploy/systemd/converge-agent.service"
envfile="$root/deploy/systemd/converge-agent.env"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
# Binaries of the profile the images were built from (CONVERGE_IMAGE_PROFILE, as
# deploy/build-images.sh): release by default, dev = target/debug.
case "${CONVERGE_IMAGE_PROFILE:-release}" in dev|debug) bin_profile_dir=debug ;; *) bin_profile_dir=release ;; esac
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"
agent_bin="$target_dir/$bin_profile_dir/converge-agent"

if ! command -v systemd-analyze >/dev/null; then
    echo "SKIP: systemd-analyze is not installed (Debian: apt-get install systemd)"
    exit 0
fi

tmp=$(mktemp -d -t converge-systemd.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=1; }

# 1. systemd-analyze verify
exec_path=/bin/true
[[ -x "$agent_bin" ]] && exec_path="$agent_bin"
sed "s#^ExecStart=/usr/local/bin/converge-agent\$#ExecStart=$exec_path#" "$unit" >"$tmp/converge-agent.service"
grep -q "^ExecStart=$exec_path\$" "$tmp/converge-agent.service" \
    || fail "the unit's ExecStart= is not /usr/local/bin/converge-agent"
out=$(systemd-analyze verify --man=no "$tmp/converge-agent.service" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 || -n "$out" ]]; then
    printf '%s\n' "$out"
    fail "systemd-analyze verify (exit $rc) complained about the unit"
else
    echo "ok: systemd-analyze verify $(systemd-analyze --version | head -n1 | cut -d' ' -f1-2): no warnings (ExecStart=$exec_path in the copy)"
fi

# 2. stop timeout vs. stop grace
to_seconds() { # 90s, 2min, 1m30s, 1h, 500ms -> whole seconds (rounded up)
    python3 - "$1" <<'PY'
import math, re, sys
s = sys.argv[1].strip().replace(" ", "")
units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "": 1}
total, pos = 0.0, 0
for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|sec|min|s|m|h|)", s):
    if m.start() != pos:
        sys.exit(f"cannot parse duration {sys.argv[1]!r}")
    total += float(m.group(1)) * units[m.group(2)]
    pos = m.end()
if pos != len(s) or not s:
    sys.exit(f"cannot parse duration {sys.argv[1]!r}")
print(math.ceil(total))
PY
}
timeout_stop=$(sed -n 's/^TimeoutStopSec=//p' "$unit" | tail -n1)
stop_grace=$(sed -n 's/^CONVERGE_STOP_GRACE=//p' "$envfile" | tail -n1)
stop_grace=${stop_grace:-10s}
if [[ -z "$timeout_stop" ]]; then
    fail "the unit sets no TimeoutStopSec="
else
    ts=$(to_seconds "$timeout_stop"); gs=$(to_seconds "$stop_grace")
    if (( ts >= gs + 15 )); then
        echo "ok: TimeoutStopSec=$timeout_stop >= CONVERGE_STOP_GRACE=$stop_grace + 15 s"
    else
        fail "TimeoutStopSec=$timeout_stop is under CONVERGE_STOP_GRACE=$stop_grace + 15 s"
    fi
fi
grep -q '^KillMode=control-group$' "$unit" \
    || fail "the unit must use KillMode=control-group (leftover workers of a dead agent get SIGTERM, not an immediate SIGKILL)"

# 3. env file
bad=$(grep -vnE '^[[:space:]]*(#.*)?$|^[A-Z_][A-Z0-9_]*=' "$envfile" || true)
[[ -z "$bad" ]] && echo "ok: $(basename "$envfile") holds only KEY=value lines and comments" \
    || fail "lines of $(basename "$envfile") that are not KEY=value: $bad"
if [[ -x "$agent_bin" ]]; then
    mapfile -t vars < <(grep -E '^[A-Z_][A-Z0-9_]*=' "$envfile")
    if probe=$(env -i PATH=/usr/bin:/bin "${vars[@]}" CONVERGE_FAKE_GPUS=1 "$agent_bin" --probe 2>&1); then
        echo "ok: converge-agent --probe accepts every value of the env file"
    else
        printf '%s\n' "$probe" | tail -n 5
        fail "converge-agent refuses the env file's values"
    fi
else
    echo "note: $agent_bin not built; the env file's values were not checked against the binary"
fi

# 4. exposure (information only; the unit cannot use PrivateDevices= and friends, see it)
if systemd-analyze security --offline=true "$tmp/converge-agent.service" >"$tmp/security" 2>&1; then
    echo "info: $(grep 'Overall exposure level' "$tmp/security" | sed 's/^→ *//')"
else
    echo "info: systemd-analyze security --offline=true is not available here"
fi

if [[ $failed -ne 0 ]]; then
    echo "systemd checks FAILED"
    exit 1
fi
echo "systemd checks passed"
