"""Gradient statistics and the learning-rate rules that use them, in pure Python.

The figures are the ``grad_sqr`` and ``grad_var`` of docs/protocol.md ("Worker contract"),
estimated as AdaptDL does (Qiao et al., "Pollux", OSDI'21, section 3.1; adaptdl's
``GradientNoiseScale``) from ``m >= 2`` gradients ``g_1 .. g_m`` of the same step, each the
mean over ``b`` samples (one replica's local gradient before the all-reduce, or one
micro-batch's when a worker accumulates):

- ``local_sqr = (1/m) * sum |g_i|^2`` and ``total_sqr = |mean g|^2``;
- ``grad_sqr = (m * total_sqr - local_sqr) / (m - 1)``: unbiased estimate of ``|G|^2``, the
  squared L2 norm of the true gradient of the mean per-sample loss;
- ``grad_var = (local_sqr - total_sqr) * b * m / (m - 1)``: unbiased estimate of the
  variance (trace of the covariance) of ONE sample's gradient, so that a gradient averaged
  over ``B`` samples has variance ``grad_var / B`` and ``grad_var / grad_sqr`` is the
  gradient noise scale in samples.

converge-trainer (trainer/src/batch.rs, ``step_estimate``) computes the same figures; the
worker reports the mean of the per-step estimates since its previous progress line, each
clamped at 0 (:class:`StatsWindow`), and steers its learning rate by smoothed ones
(:class:`SmoothedStats`, :func:`adascale_gain`).

No dependency: the torch half of the kit (:mod:`converge_worker.torch`) feeds it floats.
"""

import math
from typing import Dict, Optional, Tuple

__all__ = [
    "LR_RULES",
    "SmoothedStats",
    "StatsWindow",
    "adascale_gain",
    "scaled_lr",
    "step_estimate",
]

#: The learning-rate rules a job may choose (:func:`scaled_lr`).
LR_RULES = ("adascale", "sqrt", "linear", "none")


def step_estimate(
    total_sqr: float, local_sqr: float, count: int, samples_per_gradient: float
) -> Optional[Tuple[float, float]]:
    """``(grad_sqr, grad_var)`` of one step from ``count`` gradients of
    ``samples_per_gradient`` samples each (module docs), unclamped (either may come out
    negative on a noisy step; the mean over steps is what is unbiased).

    ``None`` with fewer than 2 gradients, a non-positive sample count, or a non-finite
    input or result: such a step tells nothing.
    """
    if count < 2 or not samples_per_gradient > 0:
        return None
    if not (math.isfinite(total_sqr) and math.isfinite(local_sqr)):
        return None
    sqr = (count * total_sqr - local_sqr) / (count - 1)
    var = (local_sqr - total_sqr) * samples_per_gradient * count / (count - 1)
    if not (math.isfinite(sqr) and math.isfinite(var)):
        return None
    return sqr, var


class StatsWindow:
    """The mean of the per-step estimates since the previous progress line, each clamped at
    0, as converge-trainer reports them."""

    def __init__(self) -> None:
        self._sqr = 0.0
        self._var = 0.0
        self._steps = 0

    def add(self, estimate: Optional[Tuple[float, float]]) -> None:
        """Adds one step's :func:`step_estimate` (``None`` is skipped)."""
        if estimate is None:
            return
        self._sqr += max(estimate[0], 0.0)
        self._var += max(estimate[1], 0.0)
        self._steps += 1

    @property
    def steps(self) -> int:
        """Steps with an estimate since the last :meth:`take`."""
        return self._steps

    def take(self) -> Optional[Dict[str, float]]:
        """``{"grad_sqr": .., "grad_var": ..}`` for :func:`~converge_worker.report_progress`
        and an empty window; ``None`` when no step had an estimate or both means are 0 (the
        agent would ignore the pair)."""
        steps, sqr, var = self._steps, self._sqr, self._var
        self._sqr = self._var = 0.0
        self._steps = 0
        if steps == 0 or (sqr == 0 and var == 0):
            return None
        return {"grad_sqr": sqr / steps, "grad_var": var / steps}


class SmoothedStats:
    """Exponential moving averages of the per-step estimates with start-up bias
    correction, as adaptdl's ``GradientNoiseScale`` keeps them: each step weighs
    ``theta = smoothing ** (total / reference)``, so a step of a larger batch counts for
    more. ``smoothing`` is per reference-sized step, in (0, 1) (adaptdl: 0.999 for long
    jobs; 0.99 here by default, for jobs of a few thousand steps).

    The state is plain floats (:meth:`state_dict`), carried in a job's checkpoint so that
    the next generation starts from what this one learned.
    """

    def __init__(self, smoothing: float = 0.99) -> None:
        if not 0.0 < smoothing < 1.0:
            raise ValueError("smoothing must be in (0, 1), not %r" % (smoothing,))
        self.smoothing = smoothing
        self._sqr = 0.0
        self._var = 0.0
        self._weight = 0.0

    def update(self, estimate: Optional[Tuple[float, float]], scale: float = 1.0) -> None:
        """Folds in one step's :func:`step_estimate` (``None`` is skipped) of a batch
        ``scale`` times the reference."""
        if estimate is None or not (scale > 0 and math.isfinite(scale)):
            return
        theta = self.smoothing ** scale
        self._sqr = theta * self._sqr + (1 - theta) * estimate[0]
        self._var = theta * self._var + (1 - theta) * estimate[1]
        self._weight = theta * self._weight + (1 - theta)

    @property
    def ready(self) -> bool:
        """Whether any estimate has been folded in."""
        return self._weight > 0

    def value(self) -> Optional[Tuple[float, float]]:
        """``(grad_sqr, grad_var)``, bias-corrected and clamped at 0; ``None`` before the
        first estimate."""
        if not self.ready:
            return None
        return max(self._sqr / self._weight, 0.0), max(self._var / self._weight, 0.0)

    def state_dict(self) -> Dict[str, float]:
        return {"sqr": self._sqr, "var": self._var, "weight": self._weight,
                "smoothing": self.smoothing}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restores :meth:`state_dict`'s values; raises ``ValueError`` on a malformed one
        (missing keys, non-finite numbers, a negative weight)."""
        try:
            sqr, var, weight = (float(state[k]) for k in ("sqr", "var", "weight"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError("malformed gradient-statistics state %r: %s" % (state, e)) from None
        if not all(math.isfinite(x) for x in (sqr, var, weight)) or weight < 0:
            raise ValueError("malformed gradient-statistics state %r" % (state,))
        self._sqr, self._var, self._weight = sqr, var, weight


def adascale_gain(grad_sqr: float, grad_var: float, total: int, reference: int) -> float:
    """AdaScale's gain (Johnson et al., "AdaScale SGD", ICML 2020; adaptdl's ``AdaScale``
    rule) for a step of ``total`` samples when the learning rate was tuned at ``reference``:
    ``(grad_var / reference + grad_sqr) / (grad_var / total + grad_sqr)``, the ratio of the
    expected squared gradient norms at the two batch sizes. It lies between 1 (no gradient
    noise: a larger batch buys nothing) and ``total / reference`` (pure noise: the linear
    rule). For ``total < reference`` it lies between ``total / reference`` and 1.
    Returns 1.0 when the statistics are all zero or not finite.
    """
    if total < 1 or reference < 1:
        raise ValueError("total and reference must be at least 1 (got %r, %r)" % (total, reference))
    if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)):
        return 1.0
    sqr, var = max(grad_sqr, 0.0), max(grad_var, 0.0)
    den = var / total + sqr
    if den <= 0:
        return 1.0
    return (var / reference + sqr) / den


def scaled_lr(
    lr: float,
    total: int,
    reference: int,
    rule: str = "adascale",
    stats: Optional[Tuple[float, float]] = None,
) -> Tuple[float, str]:
    """The learning rate for a step of ``total`` samples when ``lr`` was tuned at
    ``reference``, and the rule actually applied.

    ``rule``: ``"adascale"`` (``lr * adascale_gain``; with no ``stats`` yet it falls back to
    ``"sqrt"``, and says so in the second value), ``"sqrt"`` (``lr * sqrt(total /
    reference)``), ``"linear"`` (``lr * total / reference``) or ``"none"``.
    Raises ``ValueError`` on an unknown rule.
    """
    ratio = total / reference
    if rule == "adascale":
        if stats is None:
            return lr * math.sqrt(ratio), "sqrt (no gradient statistics yet)"
        return lr * adascale_gain(stats[0], stats[1], total, reference), "adascale"
    if rule == "sqrt":
        return lr * math.sqrt(ratio), rule
    if rule == "linear":
        return lr * ratio, rule
    if rule == "none":
        return lr, rule
    raise ValueError("unknown learning-rate rule %r: one of %s" % (rule, ", ".join(LR_RULES)))
