"""converge_worker.torch on the CPU: gradient statistics against per-sample gradients, the
DDP communication hook against plain autograd in a real two-process gloo run, the planned
batch and the learning-rate rule.

Skipped, with the reason printed, where torch does not import, unless
CONVERGE_REQUIRE_TORCH=1 (run-tests.sh sets it when the python tier is required), which
makes a missing torch a failure.
"""

import json
import os
import socket
import subprocess
import sys
import unittest
from pathlib import Path

import _kit  # noqa: F401  (the kit from the source tree when not installed)

try:
    import torch
    import torch.nn.functional as F

    MISSING = None
except ImportError as e:  # pragma: no cover - depends on the interpreter
    MISSING = "torch does not import for %s: %s" % (sys.executable, e)
    if os.environ.get("CONVERGE_REQUIRE_TORCH") == "1":
        raise
    print("SKIPPED converge_worker.torch's tests: " + MISSING, file=sys.stderr)

from converge_worker import Batch, ContractError
from converge_worker.sampler import ElasticSampler

if MISSING is None:
    from converge_worker.torch import AdaptiveBatch

HERE = Path(__file__).resolve().parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data(n=1024):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long() + (x[:, 1] > 1).long()
    return x, y


if MISSING is None:
    class Frozen(torch.optim.SGD):
        def step(self, closure=None):  # keep the model fixed: only the statistics matter
            return None


def run_step(model, ab, sampler, x, y, samples):
    ab.optimizer.zero_grad(set_to_none=True)
    for micro in ab.micro_batches(sampler, samples, rank=0):
        with micro.sync():
            (F.cross_entropy(model(x[micro.indices]), y[micro.indices]) * micro.weight).backward()
        ab.after_backward()
    return ab.step()


@unittest.skipIf(MISSING, MISSING)
class Statistics(unittest.TestCase):
    def test_within_5_percent_of_per_sample_reference(self):
        x, y = data()
        model = mlp()
        # Reference: every per-sample gradient at the fixed model.
        grads = []
        for i in range(len(y)):
            model.zero_grad()
            F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
        g = torch.stack(grads)
        ref_sqr = float(g.mean(0).pow(2).sum())
        ref_var = float((g - g.mean(0)).pow(2).sum(1).sum() / (len(g) - 1))
        # The kit: one worker, 64 micro-batches of 16 per step = one epoch per step, a new
        # permutation each; 40 steps.
        batch = Batch(16, 63, 1024, 64)
        ab = AdaptiveBatch(model, Frozen(model.parameters(), lr=0.1), batch, lr=0.1, measure_every=1)
        sampler = ElasticSampler(len(y), seed=2)
        for k in range(40):
            run_step(model, ab, sampler, x, y, k * len(y))
        got = ab.take_stats()
        self.assertLess(abs(got["grad_sqr"] / ref_sqr - 1), 0.05, (got, ref_sqr))
        self.assertLess(abs(got["grad_var"] / ref_var - 1), 0.05, (got, ref_var))

    def test_a_lone_worker_splits_its_micro_batch(self):
        x, y = data()
        model = mlp()
        ab = AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), Batch(32, 0, 32, 32), lr=0.1)
        self.assertTrue(ab.split)
        self.assertEqual(ab.passes, 2)
        sampler = ElasticSampler(len(y))
        for k in range(5):
            run_step(model, ab, sampler, x, y, 32 * k)
        stats = ab.take_stats()
        self.assertIsNotNone(stats)
        self.assertGreater(stats["grad_var"], 0)
        self.assertIn("every 10 steps (the batch split in two halves)", ab.describe())
        # Unmeasured steps make one pass, as without the kit.
        passes = [len(list(ab.micro_batches(sampler, 0, rank=0)))]
        self.assertEqual(passes, [1])
        off = AdaptiveBatch(model, ab.optimizer, Batch(32, 0, 32, 32), lr=0.1, split_single=False)
        run_step(model, off, sampler, x, y, 0)
        self.assertIsNone(off.take_stats())  # one gradient per step: nothing to estimate


@unittest.skipIf(MISSING, MISSING)
class Ddp(unittest.TestCase):
    def run_ranks(self, per_worker, accum):
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.pop("CONVERGE_JOB_ID", None)
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "_ddp_check.py"), str(per_worker), str(accum)],
                env=env, cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=120) for p in procs]
        for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
            self.assertEqual(p.returncode, 0, "rank %d: %s" % (rank, err))
        return json.loads(outs[0][0].strip().splitlines()[-1])

    def check(self, r, passes):
        self.assertEqual(r["passes"], passes)
        self.assertLess(r["grad_diff"], 1e-5, "DDP's averaged gradient is the micro-batches' mean")
        for kit, ref in zip(r["kit"], r["reference"]):
            self.assertAlmostEqual(kit, ref, delta=1e-4 * max(abs(ref), 1e-6), msg=r)

    def test_hook_reads_each_replicas_gradient_before_the_all_reduce(self):
        self.check(self.run_ranks(16, 0), passes=1)

    def test_hook_with_gradient_accumulation(self):
        self.check(self.run_ranks(8, 2), passes=3)


@unittest.skipIf(MISSING, MISSING)
class Plan(unittest.TestCase):
    def test_a_batch_that_does_not_fit_is_refused_before_any_step(self):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with self.assertRaises(ContractError):
            AdaptiveBatch(model, opt, Batch(16, 0, 32, 32), lr=0.1)  # 2 workers planned, 1 here
        with self.assertRaises(ValueError):
            AdaptiveBatch(model, opt, Batch(16, 0, 16, 16), lr=0.1, rule="cosine")
        with self.assertRaises(ValueError):
            AdaptiveBatch(model, opt, Batch(16, 0, 16, 16), lr=float("nan"))

    def test_adascale_learning_rate_and_its_checkpoint(self):
        x, y = data()
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batch = Batch(64, 1, 128, 32)  # 4x the reference
        ab = AdaptiveBatch(model, opt, batch, lr=0.1)
        self.assertAlmostEqual(ab.lr, 0.2)  # sqrt until the first estimate
        self.assertIn("sqrt", ab.applied_rule)
        sampler = ElasticSampler(len(y))
        first = None
        for k in range(30):
            lr = run_step(model, ab, sampler, x, y, 128 * k)
            first = lr if first is None else first
        self.assertEqual(ab.applied_rule, "adascale")
        self.assertTrue(0.1 <= lr <= 0.4, lr)  # gain in [1, 4]
        self.assertEqual(opt.param_groups[0]["lr"], lr)
        # The next generation (another batch) starts from the smoothed statistics.
        model2 = mlp()
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
        ab2 = AdaptiveBatch(model2, opt2, Batch(32, 0, 32, 32), lr=0.1)
        ab2.load_state_dict(ab.state_dict())
        self.assertEqual(ab2.applied_rule, "adascale")
        self.assertAlmostEqual(ab2.lr, 0.1)  # at the reference the gain is 1
        with self.assertRaises(ValueError):
            ab2.load_state_dict({"stats": {"sqr": 1}})


if __name__ == "__main__":
    unittest.main()
