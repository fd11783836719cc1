#!/usr/bin/env python3
"""A Converge worker in numpy: softmax regression, data parallel, on the repository's
optdigits (default) or MNIST subset, through the converge-worker kit (python/).

Every rank computes the gradient of its share of each step's batch; the gradients are
averaged by a star all-reduce over TCP (rank 0 listens on MASTER_PORT, the others connect
to MASTER_ADDR:MASTER_PORT). Rank 0 prints the progress lines (loss, eval loss, epoch,
sync time, model size and gradient statistics) and writes the checkpoint; every rank
reads it on start, so a job resumes at any world size. The data order is a function of
the samples consumed (an endless stream of seeded per-epoch permutations), not of the
world size: micro-batch j of worker r reads positions
[samples + j*W*b + r*b, samples + j*W*b + (r+1)*b). With a [batch] table the allocator's
batch (CONVERGE_BATCH_SIZE and its siblings) replaces --batch-size and the learning rate
follows the square-root rule from the reference batch.

Exit codes: 0 finished, 1 failure (a peer was lost, fenced), 2 bad options or
environment, 143 stopped by SIGTERM after checkpointing the last completed step.

    CONVERGE_PROGRESS lines on stdout (rank 0); everything else on stderr.
"""

import argparse
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np

from converge_worker import (
    EXIT_STOPPED,
    CheckpointError,
    CheckpointFenced,
    Contract,
    ContractError,
    install_stop_handler,
    load_checkpoint,
    report_progress,
    save_checkpoint,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
IO_TIMEOUT_S = 60.0


def log(*args):
    print("numpy-worker:", *args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Data


def load_dataset(name, data_dir):
    """(x_train, y_train, x_test, y_test): features scaled to [0, 1], integer labels."""
    if name == "optdigits":
        def read(path):
            # One header row (data/README.md), then 64 features 0..16 and the class.
            rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
            return rows[:, :64] / 16.0, rows[:, 64].astype(np.int64)

        x, y = read(data_dir / "optdigits" / "optdigits.tra")
        xt, yt = read(data_dir / "optdigits" / "optdigits.tes")
    elif name == "mnist":
        def read(path):
            # Label, 784 pixels 0..255, then one empty trailing field; no header.
            rows = np.loadtxt(path, delimiter=",", usecols=range(785), dtype=np.float64)
            return rows[:, 1:] / 255.0, rows[:, 0].astype(np.int64)

        x, y = read(data_dir / "mnist_subset" / "mnist_train.csv")
        xt, yt = read(data_dir / "mnist_subset" / "mnist_test.csv")
    else:
        raise ValueError("unknown dataset %r" % name)
    return x, y, xt, yt


def positions(start, count, n, seed):
    """Indices of stream positions [start, start + count): epoch e of the stream is the
    permutation of range(n) seeded by (seed, e)."""
    out = np.empty(count, dtype=np.int64)
    done = 0
    while done < count:
        p = start + done
        epoch, offset = divmod(p, n)
        take = min(count - done, n - offset)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out[done:done + take] = perm[offset:offset + take]
        done += take
    return out


# --------------------------------------------------------------------------------------
# Model: softmax regression, parameters as one flat vector [W (d x k), b (k)]


class Softmax:
    def __init__(self, d, k):
        self.d, self.k = d, k
        self.size = d * k + k

    def split(self, params):
        return params[: self.d * self.k].reshape(self.d, self.k), params[self.d * self.k:]

    def probs(self, params, x):
        w, b = self.split(params)
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def loss(self, params, x, y):
        p = self.probs(params, x)
        return float(-np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None)).mean())

    def grad(self, params, x, y):
        """(sum of per-sample losses, sum of per-sample gradients, sum of their squared
        norms) over the rows of x."""
        p = self.probs(params, x)
        n = len(y)
        loss_sum = float(-np.log(np.clip(p[np.arange(n), y], 1e-12, None)).sum())
        delta = p
        delta[np.arange(n), y] -= 1.0
        gw = x.T @ delta
        gb = delta.sum(axis=0)
        # One sample's gradient is delta_i (x) [x_i, 1]: its squared norm factorizes.
        sq = float(((delta ** 2).sum(axis=1) * ((x ** 2).sum(axis=1) + 1.0)).sum())
        return loss_sum, np.concatenate([gw.ravel(), gb]), sq


# --------------------------------------------------------------------------------------
# Star all-reduce over TCP


def recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


class StarAllReduce:
    """Averages a float64 vector over the workers: the others send theirs to rank 0, which
    answers with the mean."""

    HELLO = struct.Struct("!IQ")  # rank, generation

    def __init__(self, contract, size):
        self.rank, self.world = contract.rank, contract.workers
        self.nbytes = size * 8
        self.peers = []
        self.sock = None
        if self.world == 1:
            return
        if self.rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("0.0.0.0", contract.master_port))
            server.listen(self.world)
            server.settimeout(IO_TIMEOUT_S)
            peers = {}
            while len(peers) < self.world - 1:
                conn, _ = server.accept()
                conn.settimeout(IO_TIMEOUT_S)
                rank, generation = self.HELLO.unpack(recv_exact(conn, self.HELLO.size))
                if generation != contract.generation or not 0 < rank < self.world or rank in peers:
                    log("refused a peer: rank %d of generation %d" % (rank, generation))
                    conn.close()
                    continue
                peers[rank] = conn
            server.close()
            self.peers = [peers[r] for r in sorted(peers)]
        else:
            deadline = time.monotonic() + IO_TIMEOUT_S
            while True:
                try:
                    self.sock = socket.create_connection(
                        (contract.master_addr, contract.master_port), timeout=IO_TIMEOUT_S
                    )
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise ConnectionError("cannot reach rank 0 at %s:%d: %s" % (
                            contract.master_addr, contract.master_port, e)) from None
                    time.sleep(0.2)
            self.sock.sendall(self.HELLO.pack(self.rank, contract.generation))

    def mean(self, vec):
        if self.world == 1:
            return vec
        if self.rank == 0:
            total = vec.copy()
            for peer in self.peers:
                total += np.frombuffer(recv_exact(peer, self.nbytes), dtype=np.float64)
            total /= self.world
            data = total.tobytes()
            for peer in self.peers:
                peer.sendall(data)
            return total
        self.sock.sendall(np.ascontiguousarray(vec, dtype=np.float64).tobytes())
        return np.frombuffer(recv_exact(self.sock, self.nbytes), dtype=np.float64).copy()

    def close(self):
        for s in self.peers + ([self.sock] if self.sock else []):
            s.close()


# --------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["optdigits", "mnist"], default="optdigits")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per worker per step when the job has no [batch] table")
    p.add_argument("--lr", type=float, default=0.5,
                   help="learning rate at the reference batch (64 without a [batch] table)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--eval-every", type=int, default=50, help="steps between eval losses")
    p.add_argument("--checkpoint-every", type=float, default=5.0, help="seconds")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="emulated accelerator time per step")
    a = p.parse_args(argv)
    for name in ["epochs", "lr", "checkpoint_every", "step_delay_ms"]:
        if not getattr(a, name) >= 0:
            p.error("--%s must be >= 0" % name.replace("_", "-"))
    if a.batch_size < 1 or a.log_every < 1 or a.eval_every < 1:
        p.error("--batch-size, --log-every and --eval-every must be at least 1")
    return a


def main(argv=None):
    args = parse_args(argv)
    try:
        c = Contract.from_env()
    except ContractError as e:
        log("bad worker environment:", e)
        return 2
    if c.num_ps:
        log("parameter-server jobs are not supported (CONVERGE_NUM_PS=%d)" % c.num_ps)
        return 2
    # The environment as this worker saw it (its log file keeps it).
    extra = ["ROLE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LOCAL_WORLD_SIZE"]
    print("CONVERGE_WORKER_ENV " + json.dumps(
        {"contract": c.to_dict(), "env": {k: os.environ.get(k) for k in extra}},
        sort_keys=True), flush=True)
    stop = install_stop_handler()

    x, y, xt, yt = load_dataset(args.dataset, args.data_dir)
    n = len(y)
    model = Softmax(x.shape[1], 10)
    batch = c.batch_or(args.batch_size, reference=64)
    lr = batch.scaled_lr(args.lr)
    target = int(args.epochs * n)

    params = np.zeros(model.size)
    momentum = np.zeros(model.size)
    step = samples = 0
    try:
        ckpt = load_checkpoint(c.checkpoint_dir, generation=c.generation)
    except CheckpointFenced as e:
        log(e)
        return 1
    except CheckpointError as e:
        log("unusable checkpoint:", e)
        return 2
    if ckpt is not None:
        s = ckpt.state
        if s.get("dataset") != args.dataset or len(s["params"]) != model.size:
            log("the checkpoint is for --dataset %s, not %s" % (s.get("dataset"), args.dataset))
            return 2
        params, momentum = np.asarray(s["params"]), np.asarray(s["momentum"])
        step, samples = int(s["step"]), int(s["samples"])
        log("resumed at step %d (%d samples) from generation %d" % (step, samples, ckpt.generation))
    log("rank %d of %d, generation %d, batch %d per worker x %d micro-batches = %d, lr %.4g"
        % (c.rank, c.workers, c.generation, batch.per_worker, batch.micro_batches, batch.total, lr))

    def checkpoint():
        if c.rank != 0 or c.checkpoint_dir is None:
            return
        state = {"dataset": args.dataset, "params": params, "momentum": momentum,
                 "step": step, "samples": samples, "seed": args.seed}
        save_checkpoint(state, c.checkpoint_dir, generation=c.generation,
                        metadata={"step": step, "samples": samples, "world_size": c.workers})

    def line(loss, **extra):
        if c.rank == 0:
            report_progress(step, samples, loss, epoch=samples / n,
                            model_bytes=model.size * 8, **extra)

    if samples >= target:
        # Already complete (a restart after the end): report and finish.
        line(model.loss(params, x, y), eval_loss=model.loss(params, xt, yt))
        return 0

    try:
        comm = StarAllReduce(c, model.size + 1)
    except OSError as e:
        if stop.requested:
            return EXIT_STOPPED
        log("rendezvous failed:", e)
        return 1

    losses, sync_total, stats, stats_n = [], 0.0, np.zeros(2), 0
    last_ckpt = time.monotonic()
    status = 0
    try:
        while samples < target:
            if stop.requested:
                status = EXIT_STOPPED
                break
            started = time.monotonic()
            loss_sum, grad, sq_sum, count = 0.0, np.zeros(model.size), 0.0, 0
            per_step = batch.per_worker * c.workers
            for j in range(batch.micro_batches):
                first = samples + j * per_step + c.rank * batch.per_worker
                idx = positions(first, batch.per_worker, n, args.seed)
                l, g, sq = model.grad(params, x[idx], y[idx])
                loss_sum, grad, sq_sum, count = loss_sum + l, grad + g, sq_sum + sq, count + len(idx)
            local_mean = grad / count
            if count >= 2:
                # Unbiased estimates from this worker's per-sample gradients (AdaptDL's
                # grad_sqr and grad_var, the latter for one sample).
                g2 = float(local_mean @ local_mean)
                var = (sq_sum / count - g2) * count / (count - 1)
                stats += (g2 - var / count, var)
                stats_n += 1
            t0 = time.monotonic()
            reduced = comm.mean(np.append(local_mean, loss_sum / count))
            if c.workers > 1:  # a single worker synchronizes nothing: 0
                sync_total += time.monotonic() - t0
            momentum = args.momentum * momentum + reduced[:-1]
            params = params - lr * momentum
            losses.append(reduced[-1])
            step += 1
            samples += batch.total
            if args.step_delay_ms:
                stop.wait(max(0.0, args.step_delay_ms / 1000 - (time.monotonic() - started)))
            if step % args.log_every == 0 or samples >= target:
                extra = {"sync_s": sync_total / len(losses)}
                if step % args.eval_every == 0 or samples >= target:
                    extra["eval_loss"] = model.loss(params, xt, yt)
                if stats_n:
                    sqr, var = np.maximum(stats / stats_n, 0.0)
                    if sqr + var > 0:
                        extra.update(grad_sqr=float(sqr), grad_var=float(var))
                line(float(np.mean(losses)), **extra)
                losses, sync_total, stats, stats_n = [], 0.0, np.zeros(2), 0
            if time.monotonic() - last_ckpt >= args.checkpoint_every:
                checkpoint()
                last_ckpt = time.monotonic()
        checkpoint()
    except CheckpointFenced as e:
        log(e)
        return 1
    except OSError as e:
        # A peer left: after a stop that is the stop (rank 0 keeps the last completed step).
        if stop.requested:
            checkpoint()
            return EXIT_STOPPED
        log("lost a peer:", e)
        return 1
    finally:
        comm.close()
    if status == EXIT_STOPPED:
        log("stopped by signal %s at step %d; checkpointed" % (stop.signal, step))
    return status


if __name__ == "__main__":
    sys.exit(main())
