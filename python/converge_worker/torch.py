"""Goodput for PyTorch programs: gradient statistics, the planned batch with gradient
accumulation, and an adaptive learning rate (``pip install ./python[torch]``; the rest of
the kit needs nothing).

:class:`AdaptiveBatch` wraps a model (plain or ``DistributedDataParallel``) and its
optimizer for one generation of a job::

    c = Contract.from_env()
    batch = c.batch_or(32, reference=64)
    sampler = ElasticSampler(len(train_set), seed=1)
    ddp = DDP(model)
    ab = AdaptiveBatch(ddp, opt, batch, lr=0.1)         # lr tuned at the reference batch
    ab.load_state_dict(ckpt["adaptive"])                # when resuming
    while samples < target:
        for micro in ab.micro_batches(sampler, samples, rank=c.rank):
            xb, yb = x[micro.indices], y[micro.indices]
            with micro.sync():                          # DDP's no_sync() but on the last
                (loss_fn(ddp(xb), yb) * micro.weight).backward()
            ab.after_backward()
        ab.step()                                       # learning rate, optimizer step
        samples += batch.total
        if c.is_rank0 and step % 10 == 0:
            report_progress(step, samples, loss, **(ab.take_stats() or {}))

What it measures (docs/protocol.md, "Worker contract"; :mod:`converge_worker.gradstats`):
every step has ``count = workers x passes`` gradients of ``samples_per_gradient`` samples
each. A pass's own gradient is what it added to ``.grad``: for every pass but the last, the
difference from the previous pass's ``.grad`` (a copy is kept only when a worker makes more
than one pass); for the last pass of a ``DistributedDataParallel`` model with more than one
rank, a communication hook reads each bucket's local gradient before the all-reduce (no
second backward pass, no extra copy without accumulation). ``|mean gradient|^2`` is read
after the all-reduce and the ranks' sums of squared local norms are added by one
all-reduce of one number per step. A worker alone with one micro-batch splits it into two
halves (``split_single=True``, as converge-trainer does), so that every step has at least
two gradients; otherwise a lone worker would never report statistics and its batch would
never adapt.

Learning-rate rules (:func:`~converge_worker.gradstats.scaled_lr`): ``adascale`` (the
default: AdaScale's gain from the smoothed statistics, falling back to ``sqrt`` until the
first estimate), ``sqrt``, ``linear``, ``none``. The smoothed statistics go in the
checkpoint (:meth:`AdaptiveBatch.state_dict`), with the optimizer's state, so the next
generation's learning rate starts where this one's ended.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .contract import Batch, ContractError
from .gradstats import LR_RULES, SmoothedStats, StatsWindow, scaled_lr, step_estimate
from .sampler import ElasticSampler

__all__ = ["AdaptiveBatch", "MicroBatch"]


@dataclass
class MicroBatch:
    """One forward/backward pass of this worker within an optimizer step."""

    #: Pass index within the step (0-based) and the number of passes.
    index: int
    passes: int
    #: Dataset indices this pass reads (from the :class:`ElasticSampler`).
    indices: List[int]
    #: Multiply the pass's mean loss by this, so that the passes' gradients add up to the
    #: gradient of this worker's mean loss over the step (``len(indices) / per-worker
    #: samples of the step``).
    weight: float
    #: ``sync()`` is the context to run the backward pass in: ``no_sync()`` of a
    #: ``DistributedDataParallel`` model on every pass but the last, else a no-op.
    sync: Callable[[], ContextManager[Any]]

    @property
    def last(self) -> bool:
        return self.index == self.passes - 1


def _sqr_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``sum |t|^2`` as a float32/64 tensor on the tensors' device."""
    norms = torch._foreach_norm(tensors) if hasattr(torch, "_foreach_norm") else [t.norm() for t in tensors]
    return torch.stack([n.float() for n in norms]).pow(2).sum()


class AdaptiveBatch:
    """Runs one generation's optimizer steps at the planned ``batch``, measures the
    gradient statistics and sets the learning rate (module docs).

    ``lr`` is the learning rate tuned at ``batch.reference`` samples per step; ``rule`` one
    of :data:`~converge_worker.gradstats.LR_RULES`; ``smoothing`` the statistics' moving
    average per reference-sized step. ``measure=False`` measures nothing (no hook, no
    split, no copies: for timing the statistics' overhead; ``adascale`` then stays at its
    ``sqrt`` fallback unless a checkpoint brought statistics). ``measure_every``: measure
    one step in that many (default: every step when the statistics cost only a norm per
    DDP bucket; every 10th when they cost extra work, that is the split of a lone worker's
    batch or the gradient copies of accumulation, which on a GPU took 30 % of a ResNet-18
    step when done every step). Unmeasured steps run exactly as without the kit. Raises :class:`~converge_worker.ContractError` when
    ``batch`` does not fit the process group (``total != workers x per_worker x
    micro-batches``) and ``ValueError`` on a bad rule, ``lr`` or smoothing: before any step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Batch,
        *,
        lr: float,
        rule: str = "adascale",
        smoothing: float = 0.99,
        split_single: bool = True,
        measure: bool = True,
        measure_every: Optional[int] = None,
    ) -> None:
        if rule not in LR_RULES:
            raise ValueError("unknown learning-rate rule %r: one of %s" % (rule, ", ".join(LR_RULES)))
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError("lr must be a positive number, not %r" % (lr,))
        self.model = model
        self.optimizer = optimizer
        self.batch = batch
        self.base_lr = lr
        self.rule = rule
        self.ddp = isinstance(model, DistributedDataParallel)
        self.workers = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if batch.total != self.workers * batch.per_worker * batch.micro_batches:
            raise ContractError(
                "the planned batch (total %d = workers x CONVERGE_BATCH_SIZE=%d x %d micro-batches) "
                "does not fit a process group of %d workers"
                % (batch.total, batch.per_worker, batch.micro_batches, self.workers)
            )
        self.measure = measure
        self.split = measure and split_single and self.workers == 1 and batch.micro_batches == 1 and batch.per_worker >= 2
        #: Passes of a measured step (unmeasured steps make ``batch.micro_batches``).
        self.passes = 2 if self.split else batch.micro_batches
        cheap = not self.split and self.passes == 1
        if measure_every is None:
            measure_every = 1 if cheap else 10
        if isinstance(measure_every, bool) or not isinstance(measure_every, int) or measure_every < 1:
            raise ValueError("measure_every must be a whole number >= 1, not %r" % (measure_every,))
        self.measure_every = measure_every
        self._steps = 0
        self._measuring = False
        self._passes_now = self.passes
        self.stats = SmoothedStats(smoothing)
        self.window = StatsWindow()
        #: The last step's unclamped ``(grad_sqr, grad_var)`` estimate, or ``None``.
        self.last_estimate: Optional[Tuple[float, float]] = None
        self.applied_rule = ""
        self.lr = self._lr()
        self._params = [p for p in model.parameters() if p.requires_grad]
        # Each parameter's .grad after the previous pass, by id(parameter).
        self._prev: Optional[Dict[int, torch.Tensor]] = None
        self._local: Optional[torch.Tensor] = None
        self._pass = 0
        self._weights: List[float] = []
        self._hook_weight = 1.0
        self._hooked = measure and self.ddp and self.workers > 1
        if self._hooked:
            model.register_comm_hook(self, AdaptiveBatch._comm_hook)

    # --- the step -------------------------------------------------------------------------

    def micro_batches(self, sampler: ElasticSampler, samples: int, rank: int) -> Iterator[MicroBatch]:
        """This worker's passes of the optimizer step that starts at ``samples``: the planned
        micro-batches, or the one micro-batch's two halves when it is split (module docs)."""
        self._begin()
        self._measuring = self.measure and self._steps % self.measure_every == 0
        per_step = self.batch.per_worker * self.batch.micro_batches
        if self.split and self._measuring:
            idx = sampler.micro_batch(samples, self.batch, rank, 0)
            half = len(idx) // 2
            parts = [idx[:half], idx[half:]]
        else:
            parts = [sampler.micro_batch(samples, self.batch, rank, j)
                     for j in range(self.batch.micro_batches)]
        self._passes_now = len(parts)
        for j, part in enumerate(parts):
            last = j == len(parts) - 1
            weight = len(part) / per_step
            self._weights.append(weight)
            self._hook_weight = weight
            sync = (lambda: contextlib.nullcontext()) if (last or not self.ddp) else self.model.no_sync
            yield MicroBatch(j, len(parts), part, weight, sync)

    def after_backward(self) -> None:
        """Call after each pass's ``backward()``: records the pass's own gradient norm."""
        j = self._pass
        self._pass += 1
        last = self._pass == self._passes_now
        if not self._measuring or (last and self._hooked):
            return  # the communication hook read it before the all-reduce
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        w = self._weights[j] if j < len(self._weights) else 1.0
        if self._prev is None:
            sq = _sqr_norm(grads)
        else:
            sq = _sqr_norm([self._own(p, p.grad) for p in self._params if p.grad is not None])
        self._add_local(sq / (w * w))
        if not last:
            self._prev = {id(p): p.grad.detach().clone() for p in self._params if p.grad is not None}

    def step(self) -> float:
        """Finishes the step: the statistics of its gradients, the learning rate, then
        ``optimizer.step()``. Returns the learning rate used."""
        if self._pass != self._passes_now:
            raise RuntimeError(
                "AdaptiveBatch.step() after %d of %d passes: call after_backward() after "
                "every pass of micro_batches()" % (self._pass, self._passes_now)
            )
        grads = [p.grad for p in self._params if p.grad is not None]
        estimate: Optional[Tuple[float, float]] = None
        if self._measuring and grads and self._local is not None:
            total_sqr = _sqr_norm(grads)
            local = self._local.reshape(1).to(total_sqr.dtype)
            if self.workers > 1:
                dist.all_reduce(local)
            count = self.passes * self.workers
            per_gradient = self.batch.total / count
            estimate = step_estimate(float(total_sqr), float(local) / count, count, per_gradient)
        self.last_estimate = estimate
        self.window.add(estimate)
        self.stats.update(estimate, self.batch.total / self.batch.reference)
        self.lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self._steps += 1
        self._begin()
        return self.lr

    def take_stats(self) -> Optional[Dict[str, float]]:
        """``grad_sqr``/``grad_var`` since the previous call, for ``report_progress(**...)``;
        ``None`` when there is nothing to report."""
        return self.window.take()

    def describe(self) -> str:
        """One line for the worker's log: batch, passes, rule and learning rate."""
        b = self.batch
        if not self.measure:
            how = ", no gradient statistics"
        else:
            how = ", gradient statistics every %s%s" % (
                "step" if self.measure_every == 1 else "%d steps" % self.measure_every,
                " (the batch split in two halves)" if self.split else "")
        return "batch %d = %d workers x %d x %d micro-batches%s, lr %.4g (%s)" % (
            b.total, self.workers, b.per_worker, b.micro_batches, how, self.lr, self.applied_rule)

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"stats": self.stats.state_dict(), "rule": self.rule}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the smoothed statistics of an earlier generation (whatever its world
        size or batch); raises ``ValueError`` on a malformed state."""
        if not isinstance(state, dict) or "stats" not in state:
            raise ValueError("malformed AdaptiveBatch state: %r" % (state,))
        self.stats.load_state_dict(state["stats"])
        self.lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    # --- internals ------------------------------------------------------------------------

    def _lr(self) -> float:
        lr, self.applied_rule = scaled_lr(
            self.base_lr, self.batch.total, self.batch.reference, self.rule, self.stats.value()
        )
        return lr

    def _begin(self) -> None:
        self._prev = None
        self._local = None
        self._pass = 0
        self._weights = []

    def _own(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """What the current pass added to ``param``'s gradient."""
        prev = None if self._prev is None else self._prev.get(id(param))
        return grad if prev is None else grad - prev

    def _add_local(self, sq: torch.Tensor) -> None:
        self._local = sq if self._local is None else self._local + sq

    def _comm_hook(self, bucket):  # no annotations: DDP checks them against its own types
        # This rank's gradient in the bucket, before it is averaged over the ranks.
        if not self._measuring:
            pass
        elif self._prev is None:
            sq = bucket.buffer().float().pow(2).sum()
        else:
            own = [self._own(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())]
            sq = _sqr_norm(own)
        if self._measuring:
            w = self._hook_weight
            self._add_local(sq / (w * w))
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
