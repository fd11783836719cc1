#!/usr/bin/env bash
# GPU check for a real GPU host (NVIDIA driver, nvidia-smi, python3 with a CUDA torch).
#
# Uses PREBUILT RELEASE BINARIES ONLY: target/release/{converge-agent,converge-allocator,
# converge} (cargo build --release --locked -p converge-agent -p converge-allocator
# -p converge-cli, on a machine with crates.io, then copy the repository over) and the
# nats-server of deploy/get-nats-server.sh (.tools/nats-server-*/nats-server, or
# $NATS_SERVER_BIN). It builds and downloads nothing: GPU hosts often have no registry
# access. python3 must already have torch (CUDA) and the converge-worker kit
# (pip install ./python) for examples/pytorch/ddp_mnist.toml.
#
# What it checks, and writes to OUT/summary.md (OUT: --out DIR, else $OUT, else
# ./gpu-check-<time>), in about 7 minutes on one GPU:
#   a) NVML through the agent, idle and under load (a PyTorch matmul loop on every GPU,
#      --load-seconds, 20 s): `converge-agent --probe` AND the running agent's /metrics
#      (DCGM_FI_DEV_*) each against
#      `nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,power.draw,clocks.sm`,
#      within tolerances (below);
#   d) the kit's adaptive batch on the GPU, outside the cluster: examples/pytorch/ddp_resnet.py
#      (ResNet-18) for --epochs-compare epochs (4) at the reference batch (64) and at 2x and
#      4x it with AdaScale, three seeds each: held-out loss at equal samples (median of 3) and step
#      time; and the statistics' overhead (the 4x run again with --no-grad-stats);
#   b) a one-agent cluster (nats-server, converge-allocator, converge-agent on NVML, all
#      with --metrics-addr) running examples/pytorch/ddp_resnet.toml and ddp_mnist.toml to
#      completion (--job-timeout, 420 s): every job's batch and generation every 5 s (batch
#      changes, restarts, held-out loss), and the agent's /metrics compared with nvidia-smi
#      while a job runs, with the job_id and rank labels of the GPU's holder;
#   c) the agent's CPU (% of one core) and RSS over that run, from /proc every 5 s.
# Exit status 0 only when every check of a) and b) passed; d)'s figures are reported, with
# whether they meet the targets (docs/gpu-check.md). --skip-jobs runs a) only.
#
# The converge-worker kit is taken from python/ (PYTHONPATH) when python3 lacks it.
#
# Tolerances (readings are taken within about a second of each other, and utilization is
# averaged over different windows by the two tools): uuid, name and GPU count equal;
# memory.total within 2 %; memory.used within max(256 MiB, 10 %); utilization within
# 25 points (and at least 50 % on both under load); power within max(15 W, 15 %); SM clock
# within max(150 MHz, 20 %).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out="${OUT:-}"
load_s=20
job_timeout=420
compare_epochs=4
skip_jobs=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --load-seconds) load_s="$2"; shift 2 ;;
        --job-timeout) job_timeout="$2"; shift 2 ;;
        --epochs-compare) compare_epochs="$2"; shift 2 ;;
        --skip-jobs) skip_jobs=1; shift ;;
        -h | --help) sed -n '2,41p' "$0"; exit 0 ;;
        *) echo "tests/gpu/run.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
[[ -n "$out" ]] || out="$PWD/gpu-check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
out=$(cd "$out" && pwd)

fail() { echo "tests/gpu/run.sh: $*" >&2; echo "**FAILED**: $*" >>"$out/summary.md"; exit 1; }
log() { printf '==> %s\n' "$*" >&2; }

: >"$out/summary.md"
{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname))"
    echo
    echo "Prebuilt release binaries from \`target/release\` (commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown))."
    echo
} >>"$out/summary.md"

# --- Prerequisites: say exactly what is missing. ---
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this check needs an NVIDIA GPU host with the driver installed"
nvidia-smi -L >"$out/nvidia-smi-L.txt" 2>&1 || fail "nvidia-smi -L failed (no GPU or driver not loaded): $(head -n 3 "$out/nvidia-smi-L.txt")"
ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1' \
    || [[ -e /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 ]] \
    || log "warning: libnvidia-ml.so.1 not in the linker cache; the agent may not load NVML"
for b in converge-agent converge-allocator converge; do
    [[ -x "$root/target/release/$b" ]] \
        || fail "target/release/$b missing: build it elsewhere (cargo build --release --locked -p converge-agent -p converge-allocator -p converge-cli) and copy it here"
done
agent_bin="$root/target/release/converge-agent"
allocator_bin="$root/target/release/converge-allocator"
cli_bin="$root/target/release/converge"
nats_bin="${NATS_SERVER_BIN:-$(ls "$root"/.tools/nats-server-*/nats-server 2>/dev/null | head -n1 || true)}"
command -v python3 >/dev/null || fail "python3 not found"
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>"$out/torch.err" \
    || fail "python3 has no CUDA torch ($(tail -n1 "$out/torch.err")): needed for the load and the jobs"
log "GPUs: $(nvidia-smi -L | wc -l); torch $(python3 -c 'import torch; print(torch.__version__)')"

smi_query() {
    nvidia-smi --query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,power.draw,clocks.sm \
        --format=csv,noheader,nounits
}

# Compares one probe JSON (HostTelemetry) or one /metrics page with one nvidia-smi CSV.
# Args: kind (probe|metrics) file smi-file phase (idle|load|jobs). Appends a table to the
# summary; exits 1 on a reading out of tolerance.
compare() {
    python3 - "$@" >>"$out/summary.md" <<'PY'
import json, re, sys
kind, path, smi_path, phase = sys.argv[1:5]
MIB = 1024 * 1024
def num(v):
    v = v.strip()
    try:
        return float(v)
    except ValueError:
        return None  # [N/A], [Not Supported]
smi = {}
for line in open(smi_path):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 8:
        continue
    smi[int(f[0])] = dict(uuid=f[1], name=f[2], util=num(f[3]), used=num(f[4]),
                          total=num(f[5]), power=num(f[6]), clock=num(f[7]))
agent = {}
if kind == "probe":
    t = json.load(open(path))
    if t.get("gpu_source") != "nvml":
        print(f"\n**FAILED**: the agent's GPU source is {t.get('gpu_source')!r}, not nvml")
        sys.exit(1)
    # The GPU type (generation) the agent reports: the normalized model name, which the
    # allocator groups hosts by (docs/heterogeneous.md); it must name nvidia-smi's model.
    gpu_type = t.get("labels", {}).get("gpu.type")
    smi_name = next(iter(smi.values()), {}).get("name", "")
    squashed = re.sub(r"[^a-z0-9]", "", smi_name.lower())
    print(f"\nGPU type reported ({phase}): `{gpu_type}` (gpu.model `{t.get('labels', {}).get('gpu.model')}`, "
          f"nvidia-smi `{smi_name}`)")
    if not gpu_type or gpu_type.replace("-", "") not in squashed:
        print(f"\n**FAILED**: the reported GPU type {gpu_type!r} does not name {smi_name!r}")
        sys.exit(1)
    for g in t["gpus"]:
        agent[g["index"]] = dict(uuid=g["uuid"], name=g["name"], util=g["utilization_pct"],
                                 used=g["memory_used_bytes"] / MIB, total=g["memory_total_bytes"] / MIB,
                                 power=None if g.get("power_mw") is None else g["power_mw"] / 1000,
                                 clock=g.get("sm_clock_mhz"))
else:
    pat = re.compile(r'^(DCGM_FI_DEV_\w+)\{([^}]*)\} (\S+)$')
    for line in open(path):
        m = pat.match(line.strip())
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        g = agent.setdefault(int(labels["gpu"]), dict(uuid=labels["UUID"], name=labels["modelName"],
                                                      util=None, used=None, total=None, power=None, clock=None))
        v = float(m.group(3))
        if m.group(1) == "DCGM_FI_DEV_GPU_UTIL": g["util"] = v
        if m.group(1) == "DCGM_FI_DEV_FB_USED": g["used"] = v; g["total"] = (g["total"] or 0) + v
        if m.group(1) == "DCGM_FI_DEV_FB_FREE": g["total"] = (g["total"] or 0) + v
        if m.group(1) == "DCGM_FI_DEV_POWER_USAGE": g["power"] = v
        if m.group(1) == "DCGM_FI_DEV_SM_CLOCK": g["clock"] = v
bad = []
if sorted(agent) != sorted(smi):
    bad.append(f"GPU indices differ: agent {sorted(agent)}, nvidia-smi {sorted(smi)}")
print(f"\n### {kind} vs nvidia-smi, {phase}\n")
print("| gpu | reading | agent | nvidia-smi | tolerance | ok |\n|---|---|---|---|---|---|")
def check(i, what, a, s, tol):
    if a is None and s is None:
        ok = True
    elif a is None or s is None:
        ok = False  # one tool has a reading the other lacks
    else:
        ok = abs(a - s) <= tol
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    print(f"| {i} | {what} | {fmt(a)} | {fmt(s)} | ±{tol:.0f} | {'yes' if ok else '**no**'} |")
    if not ok:
        bad.append(f"gpu {i} {what}: agent {a}, nvidia-smi {s}, tolerance {tol:.0f}")
for i in sorted(set(agent) & set(smi)):
    a, s = agent[i], smi[i]
    if a["uuid"] != s["uuid"]: bad.append(f"gpu {i} uuid: {a['uuid']} vs {s['uuid']}")
    if a["name"] != s["name"]: bad.append(f"gpu {i} name: {a['name']} vs {s['name']}")
    check(i, "memory total (MiB)", a["total"], s["total"], 0.02 * (s["total"] or 0))
    check(i, "memory used (MiB)", a["used"], s["used"], max(256, 0.10 * (s["used"] or 0)))
    check(i, "utilization (%)", a["util"], s["util"], 25)
    check(i, "power (W)", a["power"], s["power"], max(15, 0.15 * (s["power"] or 0)))
    check(i, "SM clock (MHz)", a["clock"], s["clock"], max(150, 0.20 * (s["clock"] or 0)))
    if phase == "load" and not ((a["util"] or 0) >= 50 and (s["util"] or 0) >= 50):
        bad.append(f"gpu {i} under load: utilization agent {a['util']}, nvidia-smi {s['util']} (expected >= 50)")
if bad:
    print("\n**FAILED**:\n" + "\n".join(f"- {b}" for b in bad))
    sys.exit(1)
print("\nAll within tolerance.")
PY
}

# One paired reading: the probe sleeps 1 s between its two samples; nvidia-smi runs meanwhile.
probe_pair() {
    local tag="$1"
    "$agent_bin" --probe --nats-url nats://127.0.0.1:1 >"$out/probe-$tag.json" 2>"$out/probe-$tag.err" &
    local p=$!
    sleep 0.6
    smi_query >"$out/smi-$tag.csv"
    wait "$p" || fail "converge-agent --probe failed (NVML not loadable?): $(tail -n 3 "$out/probe-$tag.err")"
}

# The kit (python/) for the PyTorch examples, from the tree when python3 lacks it.
python3 -c 'import converge_worker.torch' 2>/dev/null \
    || export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import converge_worker.torch' 2>"$out/kit.err" \
    || fail "the converge-worker kit does not import ($(tail -n1 "$out/kit.err"))"
for spec in examples/pytorch/ddp_resnet.toml examples/pytorch/ddp_mnist.toml; do
    [[ -f "$root/$spec" ]] || fail "$spec missing"
done

# --- the one-agent cluster (its /metrics is compared in a), its jobs run in b)) ---
[[ -n "$nats_bin" && -x "$nats_bin" ]] \
    || fail "no nats-server: run deploy/get-nats-server.sh on a machine with PyPI and copy .tools/ here, or set NATS_SERVER_BIN"
work="$out/cluster"
mkdir -p "$work/nats/ports"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
"$nats_bin" -a 127.0.0.1 -p -1 -js -sd "$work/nats/js" --ports_file_dir "$work/nats/ports" >"$work/nats.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do ls "$work"/nats/ports/*.ports >/dev/null 2>&1 && break; sleep 0.1; done
ports=$(ls "$work"/nats/ports/*.ports 2>/dev/null | head -n1) || true
[[ -n "$ports" ]] || fail "nats-server did not start (cluster/nats.log)"
export CONVERGE_NATS_URL
CONVERGE_NATS_URL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["nats"][0])' "$ports")
alloc_port=$(free_port)
agent_port=$(free_port)
"$allocator_bin" --scheduling-interval 10s --restart-cost 30s --metrics-addr "127.0.0.1:$alloc_port" \
    >"$work/allocator.log" 2>&1 &
pids+=($!)
# The jobs' commands are relative to the repository: the agent runs there.
(cd "$root" && exec "$agent_bin" --host-id gpu-check --advertise-addr 127.0.0.1 \
    --metrics-addr "127.0.0.1:$agent_port" --log-dir "$work/logs" \
    --checkpoint-root "$work/checkpoints" --state-dir "$work/state" --stop-grace 30s) \
    >"$work/agent.log" 2>&1 &
agent_pid=$!
pids+=("$agent_pid")
for _ in $(seq 100); do
    "$cli_bin" hosts 2>/dev/null | grep -q gpu-check && break
    kill -0 "$agent_pid" 2>/dev/null || fail "the agent exited: $(tail -n 5 "$work/agent.log")"
    sleep 0.2
done
log "cluster up (NATS $CONVERGE_NATS_URL, agent metrics :$agent_port, allocator metrics :$alloc_port)"

# The running agent's /metrics and nvidia-smi, read one right after the other.
metrics_pair() {
    local tag="$1"
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://127.0.0.1:$agent_port/metrics" >"$out/metrics-$tag.txt" || fail "the agent's /metrics did not answer"
    smi_query >"$out/smi-metrics-$tag.csv"
}

# --- a) idle and under load ---
log "a) NVML through the agent vs nvidia-smi, idle"
echo "## a) NVML readings (converge-agent --probe, and the running agent's /metrics) vs nvidia-smi" >>"$out/summary.md"
probe_pair idle
status=0
compare probe "$out/probe-idle.json" "$out/smi-idle.csv" idle || status=1
metrics_pair idle
compare metrics "$out/metrics-idle.txt" "$out/smi-metrics-idle.csv" idle || status=1

log "a) under load: matmul loop on every GPU for ${load_s} s"
python3 - "$load_s" >"$out/load.log" 2>&1 <<'PY' &
import sys, time, torch
end = time.time() + float(sys.argv[1])
devs = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
mats = [(torch.randn(8192, 8192, device=d), torch.randn(8192, 8192, device=d)) for d in devs]
n = 0
while time.time() < end:
    for a, b in mats:
        a @ b
    n += 1
    if n % 10 == 0:
        for d in devs:
            torch.cuda.synchronize(d)
print(f"{n} rounds of {len(devs)} 8192x8192 matmuls")
PY
load_pid=$!
sleep "$(( load_s / 2 > 5 ? load_s / 2 : 5 ))"
kill -0 "$load_pid" 2>/dev/null || fail "the load did not run: $(tail -n 5 "$out/load.log")"
probe_pair load
compare probe "$out/probe-load.json" "$out/smi-load.csv" load || status=1
metrics_pair load
compare metrics "$out/metrics-load.txt" "$out/smi-metrics-load.csv" load || status=1
wait "$load_pid" || fail "the load failed: $(tail -n 5 "$out/load.log")"

if [[ "$skip_jobs" == 1 ]]; then
    [[ $status == 0 ]] || fail "readings out of tolerance (tables above)"
    echo "PASSED (jobs skipped)" >>"$out/summary.md"
    log "passed; summary in $out/summary.md"
    exit 0
fi

# --- d) the adaptive batch outside the cluster: reference batch vs 4x with AdaScale ---
log "d) ddp_resnet.py: batch 64 vs 128 and 256 (AdaScale), ${compare_epochs} epochs, seeds 1-3; overhead of the statistics"
mkdir -p "$out/compare"
solo() {  # tag seed batch-per-worker extra-args...: one rank on GPU 0 under the contract
    local tag="$1" seed="$2" per="$3"
    shift 3
    (cd "$root" && env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT="$(free_port)" CUDA_VISIBLE_DEVICES=0 CONVERGE_JOB_ID="compare-$tag" \
        CONVERGE_GENERATION=1 CONVERGE_CHECKPOINT_DIR="$out/compare/ckpt-$tag" CONVERGE_NUM_PS=0 \
        CONVERGE_BATCH_SIZE="$per" CONVERGE_ACCUM_STEPS=0 CONVERGE_TOTAL_BATCH="$per" \
        CONVERGE_REFERENCE_BATCH=64 \
        timeout 150 python3 examples/pytorch/ddp_resnet.py --epochs "$compare_epochs" --seed "$seed" \
        --log-every 20 --eval-every 1000000 "$@") \
        >"$out/compare/$tag.out" 2>"$out/compare/$tag.err" \
        || fail "ddp_resnet.py ($tag) failed: $(grep -v Gloo "$out/compare/$tag.err" | tail -n 3)"
}
for seed in 1 2 3; do
    solo "fixed-64-s$seed" "$seed" 64
    solo "adaptive-128-s$seed" "$seed" 128
    solo "adaptive-256-s$seed" "$seed" 256
done
solo "adaptive-256-s1-nostats" 1 256 --no-grad-stats
python3 - "$out/compare" >>"$out/summary.md" <<'PY'
import json, re, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
def read(tag):
    lines = [json.loads(l[len("CONVERGE_PROGRESS "):]) for l in (d / f"{tag}.out").read_text().splitlines()
             if l.startswith("CONVERGE_PROGRESS ")]
    ev = [l for l in lines if "eval_loss" in l]
    m = re.search(r"([0-9.]+) ms per step", (d / f"{tag}.err").read_text())
    return dict(eval_loss=ev[-1]["eval_loss"] if ev else None, samples=lines[-1]["samples"],
                ms=float(m.group(1)) if m else None,
                noise=[l["grad_var"] / l["grad_sqr"] for l in lines if l.get("grad_sqr")])
fixed = [read(f"fixed-64-s{s}") for s in (1, 2, 3)]
adapt2 = [read(f"adaptive-128-s{s}") for s in (1, 2, 3)]
adapt = [read(f"adaptive-256-s{s}") for s in (1, 2, 3)]
nost = read("adaptive-256-s1-nostats")
f = lambda v, spec: "-" if v is None else format(v, spec)
print("\n## d) Adaptive batch on the GPU (examples/pytorch/ddp_resnet.py, ResNet-18, one GPU)\n")
print("| run | seed | samples | held-out loss | ms per step | gradient noise scale (last line) |")
print("|---|---|---|---|---|---|")
for name, runs in (("batch 64 (reference)", fixed), ("batch 128, AdaScale", adapt2), ("batch 256, AdaScale", adapt)):
    for s, r in zip((1, 2, 3), runs):
        ns = f(r["noise"][-1], ".0f") if r["noise"] else "-"
        print(f"| {name} | {s} | {r['samples']} | {f(r['eval_loss'], '.4f')} | {f(r['ms'], '.2f')} | {ns} |")
print(f"| batch 256, no statistics | 1 | {nost['samples']} | {f(nost['eval_loss'], '.4f')} | {f(nost['ms'], '.2f')} | - |")
print()
if all(r["eval_loss"] is not None for r in fixed + adapt + adapt2):
    mf = statistics.median(r["eval_loss"] for r in fixed)
    for b, runs in ((128, adapt2), (256, adapt)):
        ma = statistics.median(r["eval_loss"] for r in runs)
        rel = ma / mf - 1
        print(f"- Held-out loss at equal samples, median of 3: {ma:.4f} at {b} (AdaScale) vs {mf:.4f} at 64: "
              f"{100 * rel:+.1f} % (target within 1 %: {'met' if abs(rel) <= 0.01 else 'not met'})")
if adapt[0]["ms"] and fixed[0]["ms"] and nost["ms"]:
    over = adapt[0]["ms"] / nost["ms"] - 1
    print(f"- Samples per second: {256 / adapt[0]['ms'] * 1000:.0f} at 256 vs {64 / fixed[0]['ms'] * 1000:.0f} at 64 (seed 1)")
    print(f"- Overhead of the gradient statistics at 256 (one worker: the batch split in two halves, "
          f"norms, no extra all-reduce): {100 * over:+.1f} % of step time "
          f"({adapt[0]['ms']:.2f} vs {nost['ms']:.2f} ms; target <= 3 %: {'met' if over <= 0.03 else 'not met'})")
else:
    print("- (runs too short to time: fewer than 6 steps)")
PY

# --- b) the cluster runs the adaptive examples ---
log "b) submitting examples/pytorch/ddp_resnet.toml and ddp_mnist.toml"
for spec in examples/pytorch/ddp_resnet.toml examples/pytorch/ddp_mnist.toml; do
    "$cli_bin" submit "$root/$spec" >>"$work/submit.log" 2>&1 || fail "submit $spec failed: $(tail -n 3 "$work/submit.log")"
done

# c) the agent's CPU and RSS every 5 s, from /proc (clock ticks of utime + stime).
hz=$(getconf CLK_TCK)
echo "t_s,cpu_ticks,rss_kib" >"$work/agent-usage.csv"
echo "t_s,job,phase,generation,world_size,total,per_worker,accum_steps,adaptive,noise_scale,eval_loss,samples" >"$work/batches.csv"
started=$(date +%s)
compared=0
phase_of() {  # phase of job $1 from `converge --json jobs --all`
    "$cli_bin" --json jobs --all 2>/dev/null | python3 -c '
import json, sys
want = sys.argv[1]
def walk(v):
    if isinstance(v, dict):
        if want in (v.get("job"), v.get("id")) and "phase" in v:
            print(v["phase"]); sys.exit(0)
        for x in v.values(): walk(x)
    elif isinstance(v, list):
        for x in v: walk(x)
walk(json.load(sys.stdin))' "$1" || true
}
while :; do
    now=$(( $(date +%s) - started ))
    stat=$(cat "/proc/$agent_pid/stat" 2>/dev/null) || fail "the agent exited during the jobs: $(tail -n 5 "$work/agent.log")"
    ticks=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' <<<"$stat")
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$agent_pid/status")
    echo "$now,$ticks,$rss" >>"$work/agent-usage.csv"
    "$cli_bin" --json jobs --all >"$work/jobs-now.json" 2>/dev/null || true
    python3 - "$work/jobs-now.json" "$now" >>"$work/batches.csv" <<'PY' || true
import json, sys
def walk(v):
    if isinstance(v, dict):
        if "job" in v and "phase" in v:
            yield v
        else:
            for x in v.values(): yield from walk(x)
    elif isinstance(v, list):
        for x in v: yield from walk(x)
for j in walk(json.load(open(sys.argv[1]))):
    b = j.get("batch") or {}
    p = b.get("plan") or {}
    print(",".join(str(x) for x in (sys.argv[2], j["job"], j["phase"], j.get("generation"), j.get("world_size"),
          p.get("total", ""), p.get("per_worker", ""), p.get("accum_steps", ""), b.get("adaptive", ""),
          b.get("noise_scale", ""), j.get("eval_loss", ""), j.get("samples", ""))))
PY
    resnet=$(phase_of ddp-resnet); ddp=$(phase_of ddp-mnist)
    if [[ $compared == 0 && "$resnet" == running && $now -ge 20 ]]; then
        metrics_pair jobs
        echo "## b) the agent's /metrics vs nvidia-smi while ddp-resnet runs" >>"$out/summary.md"
        compare metrics "$out/metrics-jobs.txt" "$out/smi-metrics-jobs.csv" jobs || status=1
        if grep -q 'DCGM_FI_DEV_GPU_UTIL{.*job_id="ddp-resnet",rank="0"' "$out/metrics-jobs.txt"; then
            echo "- GPU 0's series carry job_id=\"ddp-resnet\", rank=\"0\" while it holds the GPU." >>"$out/summary.md"
        elif grep -q 'DCGM_FI_DEV_GPU_UTIL{.*job_id=' "$out/metrics-jobs.txt"; then
            echo "- GPU 0's series carry another job: $(grep -o 'job_id="[^"]*",rank="[^"]*"' "$out/metrics-jobs.txt" | head -n1)" >>"$out/summary.md"
        else
            echo "**FAILED**: no DCGM_FI_DEV_GPU_UTIL series with a job_id label while ddp-resnet runs" >>"$out/summary.md"
            status=1
        fi
        compared=1
    fi
    case "$resnet/$ddp" in
        completed/completed) break ;;
        failed/* | */failed | cancelled/* | */cancelled)
            "$cli_bin" jobs --all >"$work/jobs.txt" 2>&1 || true
            fail "a job did not complete (ddp-resnet: $resnet, ddp-mnist: $ddp); see $work/logs and cluster/jobs.txt" ;;
    esac
    [[ $now -lt $job_timeout ]] || { status=1; echo "**FAILED**: jobs not complete after ${job_timeout}s (ddp-resnet: $resnet, ddp-mnist: $ddp)" >>"$out/summary.md"; break; }
    sleep 5
done
"$cli_bin" jobs --all >"$work/jobs.txt" 2>&1 || true
[[ $compared == 1 ]] || echo "(the jobs ended before a /metrics comparison was due)" >>"$out/summary.md"
{
    echo
    echo "## b) jobs"
    echo
    echo '```'
    cat "$work/jobs.txt"
    echo '```'
    echo
    python3 - "$work/batches.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for job in sorted({r["job"] for r in rows}):
    seen, changes = [], 0
    for r in rows:
        if r["job"] != job or r["phase"] != "running":
            continue
        key = (r["generation"], r["world_size"], r["total"], r["per_worker"], r["accum_steps"])
        if not seen or seen[-1][0] != key:
            seen.append((key, r))
    last = [r for r in rows if r["job"] == job][-1]
    print(f"- {job}: generations (world size, batch total = per worker x (accum + 1)) in order: "
          + "; ".join(f"gen {k[0]}: {k[1]} x, batch {k[2] or '-'} = {k[3] or '-'} x ({k[4] or 0} + 1)" for k, _ in seen)
          + f". Batch changes: {sum(1 for a, b in zip(seen, seen[1:]) if a[0][2] != b[0][2])}; "
          f"adaptive {last['adaptive'] or '-'}; noise scale {last['noise_scale'] or '-'}; "
          f"held-out loss at the end {last['eval_loss'] or '-'} after {last['samples']} samples; phase {last['phase']}.")
PY
    echo
    echo "## c) the agent's footprint over the run (/proc every 5 s)"
    echo
    awk -F, -v hz="$hz" 'NR == 2 { t0 = $1; c0 = $2 } NR > 1 { t = $1; c = $2; if ($3 > max) max = $3; sum += $3; n++ }
        END { if (t > t0) printf "- CPU: %.2f %% of one core on average over %d s\n", 100 * (c - c0) / hz / (t - t0), t - t0;
              printf "- RSS: %.1f MiB at most, %.1f MiB on average (%d samples)\n", max / 1024, sum / n / 1024, n }' \
        "$work/agent-usage.csv"
    echo
} >>"$out/summary.md"
[[ $status == 0 ]] || fail "readings out of tolerance (tables above)"
echo "PASSED" >>"$out/summary.md"
log "passed; summary in $out/summary.md"
