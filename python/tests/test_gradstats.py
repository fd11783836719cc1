"""The gradient statistics and learning-rate rules of converge_worker.gradstats, against
reference computations from per-sample gradients (pure Python: a least-squares model whose
per-sample gradients are written out by hand)."""

import math
import random
import unittest

import _kit  # noqa: F401  (the kit from the source tree when not installed)

from converge_worker.gradstats import (
    LR_RULES,
    SmoothedStats,
    StatsWindow,
    adascale_gain,
    scaled_lr,
    step_estimate,
)


def per_sample_gradients(n, dim, seed):
    """Gradients of 0.5 * (w.x - y)^2 at a fixed w, one per sample."""
    rng = random.Random(seed)
    w = [rng.gauss(0, 1) for _ in range(dim)]
    true = [rng.gauss(0, 1) for _ in range(dim)]
    out = []
    for _ in range(n):
        x = [rng.gauss(0, 1) for _ in range(dim)]
        y = sum(t * v for t, v in zip(true, x)) + rng.gauss(0, 0.5)
        r = sum(a * v for a, v in zip(w, x)) - y
        out.append([r * v for v in x])
    return out


def mean(vectors):
    n = len(vectors)
    return [sum(col) / n for col in zip(*vectors)]


def sqr(v):
    return sum(x * x for x in v)


def reference(grads):
    """|G|^2 and the unbiased trace of the covariance of one sample's gradient."""
    g = mean(grads)
    var = sum(sqr([a - b for a, b in zip(x, g)]) for x in grads) / (len(grads) - 1)
    return sqr(g), var


def estimate_from_partition(grads, b, rng):
    """step_estimate from one random partition of the samples into gradients of b."""
    order = list(range(len(grads)))
    rng.shuffle(order)
    parts = [mean([grads[i] for i in order[k:k + b]]) for k in range(0, len(order), b)]
    m = len(parts)
    local = sum(sqr(p) for p in parts) / m
    total = sqr(mean(parts))
    return step_estimate(total, local, m, b)


class Estimates(unittest.TestCase):
    def test_unbiased_against_per_sample_gradients(self):
        # 1,024 samples in 64 gradients of 16: over 40 random partitions the mean estimate
        # is within 5 % of the per-sample reference (grad_var exactly unbiased for a full
        # partition; grad_sqr biased by grad_var / n, 0.1 % here).
        grads = per_sample_gradients(1024, 6, seed=3)
        ref_sqr, ref_var = reference(grads)
        rng = random.Random(7)
        window = StatsWindow()
        for _ in range(40):
            window.add(estimate_from_partition(grads, 16, rng))
        got = window.take()
        self.assertLess(abs(got["grad_sqr"] / ref_sqr - 1), 0.05, (got, ref_sqr))
        self.assertLess(abs(got["grad_var"] / ref_var - 1), 0.05, (got, ref_var))

    def test_exact_formulas(self):
        # Two gradients of 4 samples: g1 = (1, 0), g2 = (0, 1).
        total = sqr([0.5, 0.5])  # 0.5
        local = (1 + 1) / 2  # 1
        s, v = step_estimate(total, local, 2, 4)
        self.assertAlmostEqual(s, (2 * 0.5 - 1) / 1)
        self.assertAlmostEqual(v, (1 - 0.5) * 4 * 2 / 1)

    def test_degenerate_inputs_tell_nothing(self):
        self.assertIsNone(step_estimate(1.0, 1.0, 1, 8))  # one gradient
        self.assertIsNone(step_estimate(1.0, 1.0, 2, 0))
        self.assertIsNone(step_estimate(float("nan"), 1.0, 2, 8))
        self.assertIsNone(step_estimate(1.0, float("inf"), 4, 8))


class Window(unittest.TestCase):
    def test_mean_of_clamped_estimates(self):
        w = StatsWindow()
        w.add((1.0, 4.0))
        w.add((-1.0, 2.0))  # a noisy step: grad_sqr counts as 0
        w.add(None)  # skipped
        self.assertEqual(w.steps, 2)
        self.assertEqual(w.take(), {"grad_sqr": 0.5, "grad_var": 3.0})
        self.assertIsNone(w.take())  # emptied

    def test_nothing_to_report_when_all_zero(self):
        w = StatsWindow()
        w.add((-1.0, -2.0))
        self.assertIsNone(w.take())


class Smoothing(unittest.TestCase):
    def test_bias_corrected_from_the_first_step(self):
        s = SmoothedStats(0.9)
        self.assertFalse(s.ready)
        self.assertIsNone(s.value())
        s.update((2.0, 8.0))
        self.assertEqual(s.value(), (2.0, 8.0))
        s.update((4.0, 8.0), scale=1.0)
        sqr, var = s.value()
        self.assertAlmostEqual(sqr, (0.9 * 0.1 * 2 + 0.1 * 4) / (0.9 * 0.1 + 0.1))
        self.assertAlmostEqual(var, 8.0)

    def test_larger_batches_weigh_more(self):
        a, b = SmoothedStats(0.9), SmoothedStats(0.9)
        for s in (a, b):
            s.update((1.0, 1.0))
        a.update((3.0, 1.0), scale=1.0)
        b.update((3.0, 1.0), scale=4.0)
        self.assertGreater(b.value()[0], a.value()[0])

    def test_state_round_trip_and_refusals(self):
        s = SmoothedStats(0.95)
        s.update((1.5, 6.0))
        t = SmoothedStats(0.95)
        t.load_state_dict(s.state_dict())
        self.assertEqual(t.value(), s.value())
        for bad in ({}, {"sqr": 1, "var": "x", "weight": 1}, {"sqr": 1, "var": 1, "weight": -1},
                    {"sqr": float("nan"), "var": 1, "weight": 1}):
            with self.assertRaises(ValueError):
                t.load_state_dict(bad)
        with self.assertRaises(ValueError):
            SmoothedStats(1.0)


class Rules(unittest.TestCase):
    def test_adascale_gain_bounds(self):
        # No noise: a larger batch buys nothing. Pure noise: the linear rule.
        self.assertAlmostEqual(adascale_gain(1.0, 0.0, 256, 64), 1.0)
        self.assertAlmostEqual(adascale_gain(0.0, 1.0, 256, 64), 4.0)
        self.assertAlmostEqual(adascale_gain(1.0, 5.0, 64, 64), 1.0)
        g = adascale_gain(0.01, 2.0, 256, 64)  # noise scale 200 samples
        self.assertAlmostEqual(g, (2.0 / 64 + 0.01) / (2.0 / 256 + 0.01))
        self.assertTrue(1.0 < g < 4.0)
        # Below the reference the gain shrinks the step.
        self.assertTrue(0.5 <= adascale_gain(0.01, 2.0, 32, 64) < 1.0)
        self.assertEqual(adascale_gain(float("nan"), 1.0, 128, 64), 1.0)
        self.assertEqual(adascale_gain(0.0, 0.0, 128, 64), 1.0)
        with self.assertRaises(ValueError):
            adascale_gain(1.0, 1.0, 0, 64)

    def test_scaled_lr_rules(self):
        self.assertEqual(scaled_lr(0.1, 256, 64, "sqrt"), (0.1 * 2, "sqrt"))
        self.assertEqual(scaled_lr(0.1, 256, 64, "linear"), (0.1 * 4, "linear"))
        self.assertEqual(scaled_lr(0.1, 256, 64, "none"), (0.1, "none"))
        lr, how = scaled_lr(0.1, 256, 64, "adascale")
        self.assertEqual((lr, how), (0.1 * 2, "sqrt (no gradient statistics yet)"))
        lr, how = scaled_lr(0.1, 256, 64, "adascale", stats=(0.0, 1.0))
        self.assertAlmostEqual(lr, 0.4)
        self.assertEqual(how, "adascale")
        with self.assertRaises(ValueError):
            scaled_lr(0.1, 256, 64, "cosine")
        self.assertEqual(LR_RULES[0], "adascale")


if __name__ == "__main__":
    unittest.main()
