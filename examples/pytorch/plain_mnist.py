#!/usr/bin/env python3
"""A plain PyTorch worker that follows Converge's worker contract by hand, without the
converge-worker kit: it reads the agent's variables, prints CONVERGE_PROGRESS lines,
checkpoints atomically with the generation (fencing) and checkpoints and exits on SIGTERM.
Any program can do the same (docs/protocol.md, "Worker contract").

One worker (the job spec has max_workers = 1; WORLD_SIZE above 1 is refused): a 784-256-10
MLP by SGD with momentum on the repository's MNIST subset, on the GPU the agent gives it
(CUDA_VISIBLE_DEVICES) or the CPU.

Exit codes: 0 done, 1 fenced, 2 bad options or environment, 143 stopped by SIGTERM after
checkpointing.
"""

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
CHECKPOINT_NAME = "plain_mnist.pt"


def log(*args):
    print("plain_mnist:", *args, file=sys.stderr, flush=True)


# --- The contract, by hand ------------------------------------------------------------

def env_int(name, default):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError("%s=%r is not a whole number" % (name, value))
    return int(value)


def progress(step, samples, loss, **optional):
    """One line: the prefix, then a JSON object on the same line; flushed at once."""
    fields = {"step": step, "samples": samples, "loss": loss}
    fields.update({k: v for k, v in optional.items() if v is not None})
    if not all(math.isfinite(v) for v in fields.values() if isinstance(v, float)):
        log("not reporting non-finite figures:", fields)
        return
    print("CONVERGE_PROGRESS " + json.dumps(fields, separators=(",", ":")), flush=True)


def save_atomic(state, directory, generation):
    """torch.save to a temporary file in the same directory, fsync, rename over the
    checkpoint, fsync the directory; refuses to overwrite a newer generation's."""
    path = directory / CHECKPOINT_NAME
    if generation > 0 and path.exists():
        old = torch.load(path, map_location="cpu", weights_only=True)
        if old["generation"] > generation:
            raise RuntimeError("fenced: %s is from generation %d, newer than %d"
                               % (path, old["generation"], generation))
    tmp = directory / (".%s.tmp.%d" % (CHECKPOINT_NAME, os.getpid()))
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state, generation=generation), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STOP = []


def on_sigterm(signum, frame):
    STOP.append(signum)  # the loop checkpoints and exits; nothing else here


# --------------------------------------------------------------------------------------

def read_mnist(path):
    labels, pixels = [], []
    with open(path) as f:
        for line in f:
            fields = line.strip().rstrip(",").split(",")
            if len(fields) != 785:
                raise ValueError("%s: a row with %d fields, not 785" % (path, len(fields)))
            labels.append(int(fields[0]))
            pixels.append([float(v) for v in fields[1:]])
    return torch.tensor(pixels) / 255.0, torch.tensor(labels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--epochs", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=float, default=10.0, help="seconds")
    p.add_argument("--step-delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.log_every < 1:
        p.error("--batch-size and --log-every must be at least 1")

    try:
        world_size = env_int("WORLD_SIZE", 1)
        generation = env_int("CONVERGE_GENERATION", 0)
        # The planned batch of a [batch] job, if any: this script keeps its own batch
        # when there is none, and then reports no gradient statistics (docs/protocol.md).
        batch_size = env_int("CONVERGE_BATCH_SIZE", args.batch_size)
        accum = env_int("CONVERGE_ACCUM_STEPS", 0)
    except ValueError as e:
        log("bad worker environment:", e)
        return 2
    if world_size != 1 or accum:
        log("this plain example runs one worker without accumulation (WORLD_SIZE=%d, "
            "CONVERGE_ACCUM_STEPS=%d); use ddp_mnist.py for more" % (world_size, accum))
        return 2
    ckpt_dir = os.environ.get("CONVERGE_CHECKPOINT_DIR") or None
    ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
    signal.signal(signal.SIGTERM, on_sigterm)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    x, y = read_mnist(args.data_dir / "mnist_subset" / "mnist_train.csv")
    xt, yt = read_mnist(args.data_dir / "mnist_subset" / "mnist_test.csv")
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    n = len(y)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = samples = 0
    if ckpt_dir is not None and (ckpt_dir / CHECKPOINT_NAME).exists():
        state = torch.load(ckpt_dir / CHECKPOINT_NAME, map_location=device, weights_only=True)
        if generation > 0 and state["generation"] > generation:
            log("fenced: the checkpoint is from generation %d, newer than %d"
                % (state["generation"], generation))
            return 1
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, samples = state["step"], state["samples"]
        log("resumed at step %d" % step)

    def checkpoint():
        if ckpt_dir is not None:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "step": step, "samples": samples}, ckpt_dir, generation)

    target = int(args.epochs * n)
    losses, last_ckpt = [], time.monotonic()
    try:
        while samples < target:
            if STOP:
                checkpoint()
                log("stopped by SIGTERM at step %d; checkpointed" % step)
                return 128 + signal.SIGTERM
            started = time.monotonic()
            epoch, offset = divmod(samples, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
            idx = perm[offset:offset + batch_size].to(device)  # the epoch's tail is short
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            samples += len(idx)
            losses.append(loss.item())
            if args.step_delay_ms:
                time.sleep(max(0.0, args.step_delay_ms / 1000 - (time.monotonic() - started)))
            if step % args.log_every == 0 or samples >= target:
                with torch.no_grad():
                    eval_loss = F.cross_entropy(model(xt), yt).item()
                progress(step, samples, sum(losses) / len(losses), epoch=samples / n,
                         eval_loss=eval_loss, sync_s=0.0,
                         model_bytes=sum(t.numel() * t.element_size() for t in model.parameters()))
                losses = []
            if time.monotonic() - last_ckpt >= args.checkpoint_every:
                checkpoint()
                last_ckpt = time.monotonic()
        checkpoint()
    except RuntimeError as e:
        if str(e).startswith("fenced"):
            log(e)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
