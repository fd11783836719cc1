import io
import json
import math
import unittest

import _kit  # noqa: F401  (the kit from the source tree when not installed)

from converge_worker import PREFIX, ProgressError, format_progress, report_progress


def parse(line):
    # The agent's parser: the prefix, then one JSON object (common/src/messages.rs).
    assert line.startswith("CONVERGE_PROGRESS "), line
    return json.loads(line[len("CONVERGE_PROGRESS "):])


class Format(unittest.TestCase):
    def test_minimal_line(self):
        line = format_progress(20, 2560, 0.4)
        self.assertEqual(line, 'CONVERGE_PROGRESS {"step":20,"samples":2560,"loss":0.4}')
        self.assertEqual(PREFIX, "CONVERGE_PROGRESS ")

    def test_every_field(self):
        line = format_progress(
            120, 3840, 0.53, epoch=0.118, eval_loss=0.55, sync_s=0.0021, model_bytes=5200,
            grad_sqr=0.0153, grad_var=2.41, sync_rounds_per_s=42.5, model_gap=0.012,
        )
        self.assertNotIn("\n", line)
        self.assertEqual(
            parse(line),
            {"step": 120, "samples": 3840, "loss": 0.53, "epoch": 0.118, "eval_loss": 0.55,
             "sync_s": 0.0021, "model_bytes": 5200, "grad_sqr": 0.0153, "grad_var": 2.41,
             "sync_rounds_per_s": 42.5, "model_gap": 0.012},
        )

    def test_numbers_from_other_types(self):
        class Index:
            def __index__(self):
                return 7

        class Real:
            def __float__(self):
                return 0.25

        p = parse(format_progress(Index(), 56, Real(), sync_s=0))
        self.assertEqual((p["step"], p["loss"], p["sync_s"]), (7, 0.25, 0.0))
        self.assertIsInstance(p["sync_s"], float)

    def test_bad_figures_are_refused_by_name(self):
        nan, inf = float("nan"), float("inf")
        cases = [
            ("step", dict(step=-1)),
            ("step", dict(step=1.5)),
            ("step", dict(step=True)),
            ("samples", dict(samples="8")),
            ("samples", dict(samples=2**64)),
            ("loss", dict(loss=nan)),
            ("loss", dict(loss=inf)),
            ("loss", dict(loss="low")),
            ("loss", dict(loss=None)),
            ("eval_loss", dict(eval_loss=-inf)),
            ("epoch", dict(epoch=-0.5)),
            ("sync_s", dict(sync_s=-0.001)),
            ("sync_s", dict(sync_s=nan)),
            ("model_bytes", dict(model_bytes=-8)),
            ("model_bytes", dict(model_bytes=8.0)),
            ("grad_var", dict(grad_sqr=0.1)),
            ("grad_sqr", dict(grad_var=0.1)),
            ("grad_sqr", dict(grad_sqr=nan, grad_var=1.0)),
            ("grad_var", dict(grad_sqr=1.0, grad_var=-1.0)),
            ("grad_var", dict(grad_sqr=1.0, grad_var=inf)),
            ("both 0", dict(grad_sqr=0.0, grad_var=0)),
            ("sync_rounds_per_s", dict(sync_rounds_per_s=-1.0)),
            ("sync_rounds_per_s", dict(sync_rounds_per_s="many")),
            ("model_gap", dict(model_gap=-0.5)),
            ("model_gap", dict(model_gap=inf)),
        ]
        for name, change in cases:
            args = dict(step=1, samples=8, loss=0.9)
            args.update(change)
            with self.subTest(change=change):
                with self.assertRaises(ProgressError) as cm:
                    format_progress(**args)
                self.assertIn(name, str(cm.exception))
                self.assertIsInstance(cm.exception, ValueError)

    def test_negative_loss_is_a_loss(self):
        # Log-likelihood objectives can be negative; the agent only wants finite losses.
        self.assertEqual(parse(format_progress(1, 8, -3.5))["loss"], -3.5)


class Report(unittest.TestCase):
    def test_writes_one_line_and_flushes(self):
        class Out(io.StringIO):
            flushes = 0

            def flush(self):
                Out.flushes += 1
                super().flush()

        out = Out()
        line = report_progress(5, 40, 0.7, epoch=0.01, file=out)
        self.assertEqual(out.getvalue(), line + "\n")
        self.assertGreaterEqual(Out.flushes, 1)

    def test_nothing_is_written_for_a_bad_line(self):
        out = io.StringIO()
        with self.assertRaises(ProgressError):
            report_progress(5, 40, math.nan, file=out)
        self.assertEqual(out.getvalue(), "")


if __name__ == "__main__":
    unittest.main()
