"""Runs the PyTorch examples as an agent would, where torch is installed; skipped, with the
reason printed, where it is not.

    python3 -m unittest -v examples/pytorch/test_examples.py

The interpreter is $CONVERGE_TORCH_PYTHON, else this one. The kit (python/) is put on
PYTHONPATH, so it need not be installed. Each example trains, is stopped by SIGTERM (exit
143 after a checkpoint), resumes from its checkpoint (ddp_mnist at another world size) and
finishes (exit 0) with a lower loss; every progress line is checked against the format
the agent parses.
"""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON = os.environ.get("CONVERGE_TORCH_PYTHON") or sys.executable


def torch_missing():
    r = subprocess.run([PYTHON, "-c", "import torch"], capture_output=True, text=True)
    if r.returncode == 0:
        return None
    return "torch is not installed for %s (set CONVERGE_TORCH_PYTHON to a Python with torch)" % PYTHON


SKIP = torch_missing()
if SKIP and os.environ.get("CONVERGE_REQUIRE_TORCH") == "1":
    raise SystemExit("CONVERGE_REQUIRE_TORCH=1 but " + SKIP)
if SKIP:
    print("SKIPPED the PyTorch examples: " + SKIP, file=sys.stderr)


def progress_lines(text):
    """The progress lines of a worker's stdout, parsed as the agent does."""
    out = []
    for line in text.splitlines():
        if line.startswith("CONVERGE_PROGRESS "):
            p = json.loads(line[len("CONVERGE_PROGRESS "):])
            assert isinstance(p["step"], int) and p["step"] >= 0, line
            assert isinstance(p["samples"], int) and p["samples"] >= 0, line
            assert math.isfinite(p["loss"]), line
            assert set(p) <= {"step", "samples", "loss", "eval_loss", "epoch", "sync_s",
                              "model_bytes", "grad_sqr", "grad_var"}, line
            out.append(p)
    return out


class Worker:
    """One rank started with the worker-contract environment."""

    def __init__(self, script, ckpt, generation, world, rank, port, args):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "", "CONVERGE_JOB_ID": "example",
            "CONVERGE_GENERATION": str(generation), "CONVERGE_CHECKPOINT_DIR": str(ckpt),
            "CONVERGE_NUM_PS": "0", "TORCHELASTIC_RUN_ID": "example",
            "TORCHELASTIC_RESTART_COUNT": str(generation),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")])),
        })
        self.proc = subprocess.Popen(
            [PYTHON, str(HERE / script), "--data-dir", str(ROOT / "data")] + args,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def finish(self, timeout=300):
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_until_progress(workers, lines):
    """Waits until rank 0 has printed `lines` progress lines, then SIGTERMs every rank."""
    seen = 0
    first = workers[0].proc
    while seen < lines:
        line = first.stdout.readline()
        if not line:
            break
        seen += line.startswith("CONVERGE_PROGRESS ")
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    return seen


@unittest.skipIf(SKIP, SKIP or "")
class Examples(unittest.TestCase):
    def stop_two_ranks_and_resume_on_one(self, script, ckpt, args):
        """Two ranks of `script` until three progress lines, then SIGTERM: both exit 143; one
        rank of generation 2 resumes from the checkpoint and finishes. Returns the first
        run's rank 0 stderr and the resumed run's progress lines."""
        port = free_port()
        ranks = [Worker(script, ckpt, 1, 2, r, port, args) for r in range(2)]
        self.assertEqual(run_until_progress(ranks, 3), 3)
        results = [w.finish() for w in ranks]
        for code, _, err in results:
            self.assertEqual(code, 143, err)
        code, out, err = Worker(script, ckpt, 2, 1, 0, free_port(), args).finish()
        self.assertEqual(code, 0, err)
        self.assertIn("resumed at step", err)
        return results[0][2], progress_lines(out)

    def test_plain_mnist_stops_resumes_and_finishes(self):
        args = ["--epochs", "3", "--log-every", "5", "--step-delay-ms", "20"]
        with tempfile.TemporaryDirectory() as ckpt:
            w = Worker("plain_mnist.py", ckpt, 1, 1, 0, free_port(), args)
            self.assertEqual(run_until_progress([w], 3), 3)
            code, _, err = w.finish()
            self.assertEqual(code, 143, err)
            self.assertIn("checkpointed", err)
            self.assertTrue((Path(ckpt) / "plain_mnist.pt").exists())
            w = Worker("plain_mnist.py", ckpt, 2, 1, 0, free_port(), args)
            code, out, err = w.finish()
            self.assertEqual(code, 0, err)
            self.assertIn("resumed at step", err)
            lines = progress_lines(out)
            self.assertGreater(lines[0]["step"], 5, "did not resume: %s" % lines[0])
            self.assertLess(lines[-1]["loss"], 0.5, lines[-1])
            self.assertGreaterEqual(lines[-1]["epoch"], 3.0)
            # An older generation is fenced.
            code, _, err = Worker("plain_mnist.py", ckpt, 1, 1, 0, free_port(), args).finish()
            self.assertEqual(code, 1, err)
            self.assertIn("fenced", err)

    def test_ddp_mnist_two_ranks_stop_and_resume_on_one(self):
        args = ["--epochs", "3", "--log-every", "5", "--eval-every", "10",
                "--step-delay-ms", "20", "--timeout-s", "60"]
        with tempfile.TemporaryDirectory() as ckpt:
            rank0_err, lines = self.stop_two_ranks_and_resume_on_one("ddp_mnist.py", ckpt, args)
            self.assertIn("checkpointed", rank0_err)
            self.assertGreater(lines[0]["step"], 5, "did not resume: %s" % lines[0])
            self.assertLess(lines[-1]["loss"], lines[0]["loss"])
            self.assertTrue(any("eval_loss" in p for p in lines))
            self.assertEqual(lines[-1]["model_bytes"], (784 * 256 + 256 + 256 * 10 + 10) * 4)
            # Gradient statistics (a lone worker splits its batch in halves every 10th
            # step), so the allocator can adapt the batch.
            stats = [p for p in lines if "grad_var" in p]
            self.assertGreaterEqual(len(stats), len(lines) // 3, lines)
            for p in stats:
                self.assertGreater(p["grad_var"], 0, p)
                self.assertGreaterEqual(p["grad_sqr"], 0, p)

    def test_ddp_mnist_takes_the_planned_batch(self):
        with tempfile.TemporaryDirectory() as ckpt:
            os.environ.update({"CONVERGE_BATCH_SIZE": "16", "CONVERGE_ACCUM_STEPS": "1",
                               "CONVERGE_TOTAL_BATCH": "32", "CONVERGE_REFERENCE_BATCH": "64"})
            try:
                w = Worker("ddp_mnist.py", ckpt, 1, 1, 0, free_port(),
                           ["--epochs", "0.5", "--log-every", "5"])
            finally:
                for k in ["CONVERGE_BATCH_SIZE", "CONVERGE_ACCUM_STEPS",
                          "CONVERGE_TOTAL_BATCH", "CONVERGE_REFERENCE_BATCH"]:
                    del os.environ[k]
            code, out, err = w.finish()
            self.assertEqual(code, 0, err)
            self.assertIn("batch 32 = 1 workers x 16 x 2 micro-batches", err)
            lines = progress_lines(out)
            self.assertEqual(lines[0]["samples"], 5 * 32)
            self.assertIn("grad_var", lines[0])
            self.assertIn("(sqrt (no gradient statistics yet))", err)  # AdaScale from then on

    def test_ddp_resnet_two_ranks_adapt_stop_and_resume_on_one(self):
        args = ["--width", "4", "--train-size", "512", "--test-size", "128", "--epochs", "2",
                "--log-every", "2", "--eval-every", "4", "--batch-size", "16",
                "--timeout-s", "60"]
        with tempfile.TemporaryDirectory() as ckpt:
            _, lines = self.stop_two_ranks_and_resume_on_one("ddp_resnet.py", ckpt, args)
            self.assertTrue(any("grad_var" in p for p in lines), lines)
            self.assertLess(lines[-1]["loss"], 2.3)  # below chance (ln 10)
            self.assertGreaterEqual(lines[-1]["epoch"], 2.0)


if __name__ == "__main__":
    unittest.main()
