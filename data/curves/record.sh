#!/usr/bin/env bash
# Regenerates data/curves/*.csv: loss curves of real single-rank converge-trainer runs, used
# by `converge-sim predict-bench` (docs/prediction.md). See data/curves/README.md.
#
# Usage: data/curves/record.sh   (from anywhere; honours CARGO_TARGET_DIR)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
cargo build --release -p converge-trainer
trainer="${CARGO_TARGET_DIR:-$root/target}/release/converge-trainer"
out="$root/data/curves"

# name dataset model epochs
runs=(
  "a9a-logreg a9a logreg 5"
  "millionsong-linreg millionsong linreg 10"
  "optdigits-softmax optdigits softmax 10"
  "optdigits-mlp optdigits mlp 10"
  "mnist-mlp mnist mlp 20"
)
seeds=(1 2 3)

for run in "${runs[@]}"; do
  read -r name dataset model epochs <<<"$run"
  for seed in "${seeds[@]}"; do
    file="$out/$name-s$seed.csv"
    # Single rank: no WORLD_SIZE, no checkpointing; every other option at its default
    # (batch size 32, momentum 0.9, the model's default learning rate).
    lines="$(env -u WORLD_SIZE -u RANK -u CONVERGE_CHECKPOINT_DIR "$trainer" \
      --data-dir "$root/data" --dataset "$dataset" --model "$model" --seed "$seed" \
      --epochs "$epochs" --log-every 10 --eval-every 10 2>/dev/null | grep '^CONVERGE_PROGRESS ')"
    {
      echo "step,samples,loss,eval_loss"
      # Fields come in a fixed order: step, samples, loss, epoch, then eval_loss if evaluated.
      sed -n \
        -e 's/^CONVERGE_PROGRESS {"step":\([0-9]*\),"samples":\([0-9]*\),"loss":\([^,]*\),"epoch":[^,}]*,"eval_loss":\([^,}]*\)}$/\1,\2,\3,\4/p' \
        -e 's/^CONVERGE_PROGRESS {"step":\([0-9]*\),"samples":\([0-9]*\),"loss":\([^,]*\),"epoch":[^,}]*}$/\1,\2,\3,/p' \
        <<<"$lines"
    } >"$file"
    want="$(grep -c . <<<"$lines")"
    got="$(($(wc -l <"$file") - 1))"
    if [[ "$want" != "$got" ]]; then
      echo "record.sh: $file: converted $got of $want progress lines" >&2
      exit 1
    fi
    echo "$file: $got points"
  done
done
