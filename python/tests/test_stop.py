import os
import signal
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

import _kit  # noqa: F401  (the kit from the source tree when not installed)

from converge_worker import EXIT_STOPPED, install_stop_handler

KIT = str(Path(__file__).resolve().parents[1])


class Stop(unittest.TestCase):
    def test_sigterm_sets_the_flag_and_calls_back_once(self):
        seen = []
        stop = install_stop_handler(callback=seen.append)
        try:
            self.assertFalse(stop)
            os.kill(os.getpid(), signal.SIGTERM)
            self.assertTrue(stop.wait(5))
            os.kill(os.getpid(), signal.SIGTERM)
            self.assertTrue(stop.requested)
            self.assertEqual((stop.signal, seen), (signal.SIGTERM, [signal.SIGTERM]))
        finally:
            stop.restore()
        self.assertEqual(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)

    def test_a_training_loop_checkpoints_and_exits_on_sigterm(self):
        # A child process runs a loop with the kit; SIGTERM makes it save and exit 143.
        program = textwrap.dedent(
            """
            import sys, time
            sys.path.insert(0, sys.argv[1])
            from converge_worker import install_stop_handler, save_checkpoint, EXIT_STOPPED
            stop = install_stop_handler()
            step = 0
            print("ready", flush=True)
            while not stop.requested:
                step += 1
                stop.wait(0.01)
            save_checkpoint({"step": step}, sys.argv[2])
            print("saved", step, flush=True)
            sys.exit(EXIT_STOPPED)
            """
        )
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            p = subprocess.Popen(
                [sys.executable, "-c", program, KIT, d], stdout=subprocess.PIPE, text=True
            )
            self.assertEqual(p.stdout.readline().strip(), "ready")
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=30)
            self.assertEqual(p.returncode, EXIT_STOPPED)
            self.assertEqual(EXIT_STOPPED, 143)
            self.assertTrue(out.startswith("saved "))
            from converge_worker import load_checkpoint

            self.assertEqual(load_checkpoint(d).state["step"], int(out.split()[1]))


if __name__ == "__main__":
    unittest.main()
