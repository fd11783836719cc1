#!/usr/bin/env bash
# Regenerates data/curves/sweep/: a hyperparameter sweep (learning rate x batch size) of real
# single-rank converge-trainer runs, for simulating exploratory jobs from real loss curves.
# See data/curves/sweep/README.md.
#
# Usage: data/curves/sweep/record.sh   (from anywhere; honours CARGO_TARGET_DIR)
#   SWEEP_OUT=DIR   write the files to DIR instead of data/curves/sweep (e.g. to compare two
#                   recordings: everything but index.csv's wall_s column is deterministic)
#   SWEEP_ONLY=RE   only the runs whose file name matches the Python regex RE (index.csv then
#                   lists only those)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$root"
cargo build --release -p converge-trainer
built="${CARGO_TARGET_DIR:-$root/target}/release/converge-trainer"
# Run a private copy, so that a concurrent build in the same target folder cannot swap the
# binary in the middle of the sweep.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp "$built" "$tmp/converge-trainer"
echo "trainer: $("$tmp/converge-trainer" --version), sha256 $(sha256sum "$tmp/converge-trainer" | cut -d' ' -f1)"

TRAINER="$tmp/converge-trainer" DATA="$root/data" OUT="${SWEEP_OUT:-$root/data/curves/sweep}" \
  ONLY="${SWEEP_ONLY:-}" python3 - <<'PY'
import csv, json, math, os, re, subprocess, sys, time

trainer, data, out, only = (os.environ[k] for k in ("TRAINER", "DATA", "OUT", "ONLY"))
os.makedirs(out, exist_ok=True)

# name dataset model epochs default-lr (converge-trainer --help; the same pairs and epochs as
# data/curves/record.sh)
pairs = [
    ("a9a-logreg", "a9a", "logreg", 5, 0.05),
    ("millionsong-linreg", "millionsong", "linreg", 10, 0.01),
    ("optdigits-softmax", "optdigits", "softmax", 10, 0.05),
    ("optdigits-mlp", "optdigits", "mlp", 10, 0.02),
    ("mnist-mlp", "mnist", "mlp", 20, 0.02),
]
multipliers = [("0.25", 0.25), ("1", 1.0), ("4", 4.0)]  # powers of two: lr values are exact
batches = [16, 64]
seed = 1
# One progress line (and one held-out evaluation) per 320 samples, the resolution of
# data/curves/*.csv (batch 32 x 10 steps): every 20 steps at batch 16, every 5 at batch 64.
SAMPLES_PER_LINE = 320

# Only the command line decides the run: drop every variable that would change it.
env = {k: v for k, v in os.environ.items()
       if k not in ("WORLD_SIZE", "RANK", "CONVERGE_CHECKPOINT_DIR", "CONVERGE_NUM_PS",
                    "CONVERGE_BATCH_SIZE", "CONVERGE_ACCUM_STEPS", "CONVERGE_TOTAL_BATCH",
                    "CONVERGE_REFERENCE_BATCH", "CONVERGE_DATA_DIR")}

def fmt(v):
    """A JSON value as the trainer printed it (numbers are kept as text, see parse_*). The
    trainer prints null for a non-finite number: it becomes "nan" (an absent field, such as
    eval_loss on a row without evaluation, stays empty)."""
    return "nan" if v is None else str(v)

index = []
for name, dataset, model, epochs, base_lr in pairs:
    for mult_label, mult in multipliers:
        lr = base_lr * mult
        for batch in batches:
            file = f"{name}-lrx{mult_label}-b{batch}.csv"
            if only and not re.search(only, file):
                continue
            log_every = SAMPLES_PER_LINE // batch
            cmd = [trainer, "--data-dir", data, "--dataset", dataset, "--model", model,
                   "--seed", str(seed), "--epochs", str(epochs), "--batch-size", str(batch),
                   "--lr", repr(lr), "--log-every", str(log_every),
                   "--eval-every", str(log_every)]
            start = time.monotonic()
            p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
            wall = time.monotonic() - start
            rows, bad = [], False
            for line in p.stdout.splitlines():
                if not line.startswith("CONVERGE_PROGRESS "):
                    continue
                # Keep numbers exactly as printed.
                rec = json.loads(line[len("CONVERGE_PROGRESS "):], parse_float=str,
                                 parse_int=str,
                                 parse_constant=lambda c: {"NaN": "nan"}.get(c, c.lower()))
                row = [fmt(rec[k]) if k in rec else ""
                       for k in ("step", "samples", "loss", "eval_loss", "epoch")]
                rows.append(row)
                try:
                    if not math.isfinite(float(row[2])):
                        bad = True
                except ValueError:
                    bad = True
            with open(os.path.join(out, file), "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(["step", "samples", "loss", "eval_loss", "epoch"])
                w.writerows(rows)
            if p.returncode == 0 and not bad:
                status = "ok"
            elif bad or "diverged" in p.stderr:
                status = "diverged"
            else:
                status = "failed"
            m = re.search(r"(\d+) training and \d+ held-out rows", p.stderr)
            finite = [r[2] for r in rows if r[2] != "" and math.isfinite(float(r[2]))]
            evals = [r[3] for r in rows if r[3] != ""]  # last evaluation, even "nan"
            index.append({
                "file": file, "pair": name, "dataset": dataset, "model": model,
                "lr": repr(lr), "lr_multiplier": mult_label, "batch_size": batch,
                "epochs": epochs, "train_rows": m.group(1) if m else "",
                "points": len(rows),
                "first_loss": rows[0][2] if rows else "",
                "last_loss": rows[-1][2] if rows else "",
                "min_loss": min(finite, key=float) if finite else "",
                "final_eval_loss": evals[-1] if evals else "",
                "wall_s": f"{wall:.2f}", "status": status, "log_every": log_every,
            })
            msg = f"{file}: {len(rows)} points, {wall:.2f} s, {status}"
            if status != "ok":
                last = [l for l in p.stderr.splitlines() if l.strip()]
                msg += f" (exit {p.returncode}: {last[-1] if last else 'no stderr'})"
            print(msg, flush=True)

fields = ["file", "pair", "dataset", "model", "lr", "lr_multiplier", "batch_size", "epochs",
          "train_rows", "points", "first_loss", "last_loss", "min_loss", "final_eval_loss",
          "wall_s", "status", "log_every"]
with open(os.path.join(out, "index.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(index)
print(f"{out}/index.csv: {len(index)} runs, "
      f"{sum(r['status'] != 'ok' for r in index)} not ok", flush=True)
PY
