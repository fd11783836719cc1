"""ElasticSampler: after any resize every sample of an epoch is read once."""

import unittest

import _kit  # noqa: F401  (the kit from the source tree when not installed)

from converge_worker import Batch
from converge_worker.sampler import ElasticSampler


def step_indices(sampler, samples, batch):
    workers = batch.total // (batch.per_worker * batch.micro_batches)
    out = []  # in stream order: micro-batch j of every worker, then j + 1
    for j in range(batch.micro_batches):
        for r in range(workers):
            out.extend(sampler.micro_batch(samples, batch, r, j))
    return out


class Order(unittest.TestCase):
    def test_resizes_neither_repeat_nor_skip(self):
        n = 1000
        s = ElasticSampler(n, seed=5)
        plans = [Batch(16, 0, 32, 32), Batch(8, 3, 96, 32), Batch(50, 0, 50, 32),
                 Batch(7, 1, 56, 32), Batch(16, 0, 64, 32)]
        seen, samples, step = [], 0, 0
        while samples < 3 * n:
            b = plans[step % len(plans)]  # a new world size or batch every step
            seen.extend(step_indices(s, samples, b))
            samples += b.total
            step += 1
        for epoch in range(3):
            chunk = seen[epoch * n:(epoch + 1) * n]
            self.assertEqual(sorted(chunk), list(range(n)), "epoch %d" % epoch)
        # The order is the stream's, whatever the plans were.
        self.assertEqual(seen[:3 * n], s.positions(0, 3 * n))

    def test_resume_from_a_checkpoint_in_another_process(self):
        # A new sampler (a restarted worker) continues where `samples` says.
        a = ElasticSampler(300, seed=9)
        b = ElasticSampler(300, seed=9)
        first = step_indices(a, 0, Batch(10, 0, 40, 40)) + step_indices(a, 40, Batch(10, 0, 40, 40))
        rest = step_indices(b, 80, Batch(5, 1, 20, 40))  # resumed at 2 workers
        self.assertEqual(first + rest, a.positions(0, 100))
        self.assertEqual(len(set(first + rest)), 100)

    def test_epochs_differ_and_seed_matters(self):
        s = ElasticSampler(50, seed=1)
        self.assertNotEqual(s.permutation(0), s.permutation(1))
        self.assertNotEqual(s.permutation(0), ElasticSampler(50, seed=2).permutation(0))
        self.assertEqual(s.epoch(125), 2.5)

    def test_bad_arguments(self):
        for size in (0, -3, 2.5, True):
            with self.assertRaises(ValueError):
                ElasticSampler(size)
        s = ElasticSampler(10)
        with self.assertRaises(ValueError):
            s.micro_batch(0, Batch(2, 0, 4, 4), 2, 0)  # 2 workers: rank 2 is not one
        with self.assertRaises(ValueError):
            s.micro_batch(0, Batch(2, 0, 4, 4), 0, 1)  # one micro-batch
        with self.assertRaises(ValueError):
            s.positions(-1, 3)


if __name__ == "__main__":
    unittest.main()
