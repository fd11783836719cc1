"""``CONVERGE_PROGRESS`` lines, in the format the agent parses (``WorkerProgressLine``)."""

import json
import math
import operator
import sys
from typing import Any, Dict, Optional, TextIO

__all__ = ["PREFIX", "ProgressError", "format_progress", "report_progress"]

#: What a progress line starts with, followed by one JSON object on the same line.
PREFIX = "CONVERGE_PROGRESS "

#: The agent skips (and counts as malformed) longer lines.
MAX_LINE_BYTES = 64 * 1024


class ProgressError(ValueError):
    """A progress figure the agent would refuse or ignore; the message names it."""


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ProgressError("%s must be a whole number, not a bool" % name)
    try:
        n = operator.index(value)
    except TypeError:
        raise ProgressError("%s must be a whole number, got %r" % (name, value)) from None
    if n < 0:
        raise ProgressError("%s must be >= 0, got %d" % (name, n))
    if n >= 2**64:
        raise ProgressError("%s must fit in 64 bits, got %d" % (name, n))
    return n


def _real(name: str, value: Any, non_negative: bool = False) -> float:
    if isinstance(value, bool):
        raise ProgressError("%s must be a number, not a bool" % name)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ProgressError("%s must be a number, got %r" % (name, value)) from None
    if not math.isfinite(x):
        raise ProgressError("%s must be finite, got %r" % (name, x))
    if non_negative and x < 0:
        raise ProgressError("%s must be >= 0, got %r" % (name, x))
    return x


def format_progress(
    step: int,
    samples: int,
    loss: float,
    *,
    epoch: Optional[float] = None,
    eval_loss: Optional[float] = None,
    sync_s: Optional[float] = None,
    model_bytes: Optional[int] = None,
    grad_sqr: Optional[float] = None,
    grad_var: Optional[float] = None,
    sync_rounds_per_s: Optional[float] = None,
    model_gap: Optional[float] = None,
) -> str:
    """One progress line (no newline), after checking every figure.

    - ``step``: optimizer steps since the job began (continues across generations).
    - ``samples``: training samples since the job began (continues across generations).
    - ``loss``: training loss, mean over the steps since the previous line; finite.
    - ``epoch``: samples / training-set size; finite, >= 0.
    - ``eval_loss``: held-out loss, when evaluated at this step; finite.
    - ``sync_s``: seconds per optimizer step spent synchronizing gradients or parameters,
      mean since the previous line; finite, >= 0 (0 for a single worker).
    - ``model_bytes``: bytes of the parameters the job synchronizes (count x element size).
    - ``grad_sqr``, ``grad_var``: gradient statistics (both or neither): the squared norm of
      the mean per-sample gradient and the variance (trace of the covariance) of one
      sample's gradient, unbiased estimates over the steps since the previous line; finite,
      >= 0 and not both 0.
    - ``sync_rounds_per_s``: ShadowSync workers (``arch = "shadow"``, ``CONVERGE_SYNC=shadow``):
      background synchronization rounds completed per second since the previous line;
      finite, >= 0.
    - ``model_gap``: ShadowSync workers: mean relative distance
      ``||local - synchronized|| / max(||local||, ||synchronized||)`` between the worker's
      model and the synchronized one over those rounds (0 to 2); finite, >= 0.

    Counts accept anything with ``__index__`` (numpy integers), reals anything ``float()``
    accepts (numpy floats, 0-d tensors). Raises :class:`ProgressError` naming the figure.
    """
    line: Dict[str, Any] = {
        "step": _count("step", step),
        "samples": _count("samples", samples),
        "loss": _real("loss", loss),
    }
    if epoch is not None:
        line["epoch"] = _real("epoch", epoch, non_negative=True)
    if eval_loss is not None:
        line["eval_loss"] = _real("eval_loss", eval_loss)
    if sync_s is not None:
        line["sync_s"] = _real("sync_s", sync_s, non_negative=True)
    if model_bytes is not None:
        line["model_bytes"] = _count("model_bytes", model_bytes)
    if (grad_sqr is None) != (grad_var is None):
        raise ProgressError(
            "grad_sqr and grad_var go together: got only %s"
            % ("grad_sqr" if grad_var is None else "grad_var")
        )
    if grad_sqr is not None:
        sqr = _real("grad_sqr", grad_sqr, non_negative=True)
        var = _real("grad_var", grad_var, non_negative=True)
        if sqr == 0 and var == 0:
            raise ProgressError("grad_sqr and grad_var are both 0: leave them out instead")
        line["grad_sqr"] = sqr
        line["grad_var"] = var
    if sync_rounds_per_s is not None:
        line["sync_rounds_per_s"] = _real("sync_rounds_per_s", sync_rounds_per_s, non_negative=True)
    if model_gap is not None:
        line["model_gap"] = _real("model_gap", model_gap, non_negative=True)
    return PREFIX + json.dumps(line, separators=(",", ":"), allow_nan=False)


def report_progress(
    step: int,
    samples: int,
    loss: float,
    *,
    file: Optional[TextIO] = None,
    **optional: Any
) -> str:
    """Prints :func:`format_progress`'s line to ``file`` (default ``sys.stdout``, read
    when called) and flushes it, so the agent sees it at once; returns the line."""
    text = format_progress(step, samples, loss, **optional)
    out = sys.stdout if file is None else file
    out.write(text + "\n")
    out.flush()
    return text
