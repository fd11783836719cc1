#!/usr/bin/env python3
"""DistributedDataParallel on the repository's MNIST subset as a Converge worker, through
the converge-worker kit (python/): the contract from the environment, the planned batch,
progress lines, fenced atomic checkpoints and SIGTERM.

One process per rank, as the agent starts them (torchrun's RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): NCCL on the GPU CUDA_VISIBLE_DEVICES gives it when CUDA is available, gloo on
the CPU otherwise. The model is a 784-256-10 MLP trained by SGD with momentum. The data
order depends only on the samples consumed, not on the world size: micro-batch j of rank r
reads positions [samples + j*W*b + r*b, ... + b) of an endless stream of seeded per-epoch
permutations, so a job resumes from its checkpoint at any world size. With a [batch] table
the allocator's batch replaces --batch-size (with gradient accumulation when it plans
extra micro-batches). Goodput through converge_worker.torch.AdaptiveBatch: rank 0's progress
lines carry the gradient statistics measured from each rank's gradient before the
all-reduce (and from the micro-batches), and the learning rate follows AdaScale's gain
(--lr-rule, default adascale; sqrt, linear or none). The data order is the kit's
ElasticSampler: after a resize no sample of the epoch is read twice or skipped.

`run(args, load, model_fn, name)` is the whole worker; ddp_resnet.py reuses it with a
convolutional network.

Every step the ranks agree on stopping (a SIGTERM seen by any rank stops all of them after
the same step), so no rank is left waiting in a collective: rank 0 checkpoints the last
completed step and every rank exits 143. Exit 0 when the epochs are done; 1 on a failure
(fenced, a peer lost: collectives time out after --timeout-s); 2 on bad options,
environment or checkpoint.
"""

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from converge_worker import (
    EXIT_STOPPED,
    LR_RULES,
    CheckpointError,
    CheckpointFenced,
    Contract,
    ContractError,
    ElasticSampler,
    install_stop_handler,
    load_checkpoint,
    report_progress,
    save_checkpoint,
)
from converge_worker.torch import AdaptiveBatch

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


NAME = "ddp_mnist"


def log(*args):
    print("%s:" % NAME, *args, file=sys.stderr, flush=True)


def read_mnist(path):
    """(images as floats in [0, 1], labels) from the subset's CSV: label, 784 pixels, an
    empty trailing field, CRLF line ends (data/README.md)."""
    labels, pixels = [], []
    with open(path) as f:
        for line in f:
            fields = line.strip().rstrip(",").split(",")
            if len(fields) != 785:
                raise ValueError("%s: a row with %d fields, not 785" % (path, len(fields)))
            labels.append(int(fields[0]))
            pixels.append([float(v) for v in fields[1:]])
    return torch.tensor(pixels) / 255.0, torch.tensor(labels)


def model_fn():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def load_mnist(args):
    """(train x, train y, held-out x, held-out y) of the repository's MNIST subset."""
    x, y = read_mnist(args.data_dir / "mnist_subset" / "mnist_train.csv")
    xt, yt = read_mnist(args.data_dir / "mnist_subset" / "mnist_test.csv")
    return x, y, xt, yt


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--epochs", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per rank per step when the job has no [batch] table")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate at 64 samples per step")
    p.add_argument("--lr-rule", choices=LR_RULES, default="adascale",
                   help="how the learning rate follows the planned batch (default adascale: "
                        "AdaScale's gain from the gradient statistics, sqrt until the first)")
    p.add_argument("--no-grad-stats", action="store_true",
                   help="measure no gradient statistics (to time their overhead)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=float, default=10.0, help="seconds")
    p.add_argument("--step-delay-ms", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    return p


def parse_args(p, argv):
    a = p.parse_args(argv)
    if a.batch_size < 1 or a.log_every < 1 or a.eval_every < 1:
        p.error("--batch-size, --log-every and --eval-every must be at least 1")
    if not (a.epochs >= 0 and a.lr > 0 and a.checkpoint_every >= 0 and a.timeout_s > 0):
        p.error("--epochs, --lr, --checkpoint-every and --timeout-s must be positive")
    return a


def run(args, load, model_fn, name):
    """One worker of the job: `load(args)` gives (x, y, held-out x, held-out y) tensors,
    `model_fn()` the network; `name` the checkpoint file's stem."""
    global NAME
    NAME = name
    checkpoint_name = name + ".pt"
    try:
        c = Contract.from_env()
    except ContractError as e:
        log("bad worker environment:", e)
        return 2
    if c.num_ps:
        log("parameter-server jobs are not supported (CONVERGE_NUM_PS=%d)" % c.num_ps)
        return 2
    stop = install_stop_handler()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # CUDA_VISIBLE_DEVICES holds this rank's GPU(s) only

    x, y, xt, yt = load(args)
    n = len(y)
    xt, yt = xt.to(device), yt.to(device)
    batch = c.batch_or(args.batch_size, reference=64)
    sampler = ElasticSampler(n, seed=args.seed)
    target = int(args.epochs * n)

    torch.manual_seed(args.seed)
    model = model_fn().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    step = samples = 0
    try:
        ckpt = load_checkpoint(
            c.checkpoint_dir, generation=c.generation, name=checkpoint_name,
            deserializer=lambda f: torch.load(f, map_location="cpu", weights_only=True),
        )
    except CheckpointFenced as e:
        log(e)
        return 1
    except (CheckpointError, RuntimeError) as e:
        log("unusable checkpoint:", e)
        return 2
    if ckpt is not None:
        model.load_state_dict(ckpt.state["model"])
        opt.load_state_dict(ckpt.state["optimizer"])  # AdaptiveBatch sets the learning rate
        step, samples = int(ckpt.state["step"]), int(ckpt.state["samples"])
        log("resumed at step %d (%d samples) from generation %d" % (step, samples, ckpt.generation))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, init_method="tcp://%s:%d" % (c.master_addr, c.master_port),
        rank=c.rank, world_size=c.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    ddp = DDP(model, device_ids=[0] if cuda else None)
    try:
        ab = AdaptiveBatch(ddp, opt, batch, lr=args.lr, rule=args.lr_rule,
                           measure=not args.no_grad_stats)
        if ckpt is not None and "adaptive" in ckpt.state:
            ab.load_state_dict(ckpt.state["adaptive"])
    except (ContractError, ValueError) as e:
        log("bad batch plan or checkpoint:", e)
        dist.destroy_process_group()
        return 2
    log("rank %d of %d (%s), generation %d, %s"
        % (c.rank, c.world_size, backend, c.generation, ab.describe()))

    def checkpoint():
        if c.rank == 0 and c.checkpoint_dir is not None:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "adaptive": ab.state_dict(), "step": step, "samples": samples}
            save_checkpoint(state, c.checkpoint_dir, generation=c.generation,
                            serializer=torch.save, name=checkpoint_name,
                            metadata={"step": step, "samples": samples})

    def eval_loss():
        with torch.no_grad():
            return float(F.cross_entropy(model(xt), yt))

    status, losses, last_ckpt = 0, [], time.monotonic()
    first_step, timed_steps, timed_s = step, 0, 0.0
    try:
        while samples < target:
            started = time.monotonic()
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            for micro in ab.micro_batches(sampler, samples, rank=c.rank):
                xb, yb = x[micro.indices].to(device), y[micro.indices].to(device)
                with micro.sync():  # gradients are all-reduced on the last micro-batch only
                    loss = F.cross_entropy(ddp(xb), yb) * micro.weight
                    loss.backward()
                ab.after_backward()
                loss_sum += loss.detach()
            # Mean loss over ranks, and whether any rank was asked to stop.
            agreed = torch.stack([loss_sum, torch.tensor(float(stop.requested), device=device)])
            dist.all_reduce(agreed)
            if agreed[1].item() > 0:
                status = EXIT_STOPPED
                break
            ab.step()  # gradient statistics, learning rate, optimizer step
            step += 1
            if cuda:
                torch.cuda.synchronize()
            if step - first_step > 5:  # the first steps warm up kernels and allocators
                timed_steps += 1
                timed_s += time.monotonic() - started
            samples += batch.total
            losses.append(agreed[0].item() / c.workers)
            if args.step_delay_ms:
                stop.wait(max(0.0, args.step_delay_ms / 1000 - (time.monotonic() - started)))
            if c.rank == 0 and (step % args.log_every == 0 or samples >= target):
                extra = {}
                if step % args.eval_every == 0 or samples >= target:
                    extra["eval_loss"] = eval_loss()
                extra.update(ab.take_stats() or {})
                report_progress(step, samples, sum(losses) / len(losses), epoch=samples / n,
                                model_bytes=model_bytes, **extra)
                losses = []
            if time.monotonic() - last_ckpt >= args.checkpoint_every:
                checkpoint()
                last_ckpt = time.monotonic()
        checkpoint()
        # Every rank leaves together: a rank that tears gloo down while rank 0 still writes
        # the checkpoint can abort it ("terminate called without an active exception").
        dist.barrier()
    except CheckpointFenced as e:
        log(e)
        return 1
    finally:
        dist.destroy_process_group()
    if timed_steps:
        log("%d steps in this generation, %.2f ms per step after the first 5 (batch %d, lr %.4g, %s)"
            % (step - first_step, 1000 * timed_s / timed_steps, batch.total, ab.lr, ab.applied_rule))
    if status == EXIT_STOPPED:
        log("stopped by signal %s at step %d%s" % (
            stop.signal, step, "; checkpointed" if c.rank == 0 and c.checkpoint_dir else ""))
    return status


def main(argv=None):
    args = parse_args(parser(__doc__.split("\n\n")[0]), argv)
    return run(args, load_mnist, model_fn, "ddp_mnist")


if __name__ == "__main__":
    sys.exit(main())
