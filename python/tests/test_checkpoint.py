import os
import pickle
import tempfile
import threading
import unittest
from pathlib import Path
from unittest import mock

import _kit  # noqa: F401  (the kit from the source tree when not installed)

from converge_worker import (
    CheckpointError,
    CheckpointFenced,
    checkpoint_path,
    load_checkpoint,
    read_checkpoint_header,
    save_checkpoint,
)


class Checkpoints(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name) / "job"

    def tearDown(self):
        self._tmp.cleanup()

    def test_absent_is_none(self):
        self.assertIsNone(load_checkpoint(self.dir))
        self.assertIsNone(load_checkpoint(None))
        self.assertIsNone(read_checkpoint_header(self.dir))

    def test_objects_round_trip_with_metadata(self):
        state = {"step": 40, "params": [0.5, -1.25], "rng": (1, 2)}
        path = save_checkpoint(state, self.dir, generation=3, metadata={"step": 40, "loss": 0.31})
        self.assertEqual(path, self.dir / "checkpoint.ckpt")
        got = load_checkpoint(self.dir, generation=3)
        self.assertEqual((got.state, got.generation, got.path), (state, 3, path))
        self.assertEqual(got.metadata, {"step": 40, "loss": 0.31})
        self.assertEqual(read_checkpoint_header(self.dir)["encoding"], "pickle")
        # Only the checkpoint remains: no temporary file is left behind.
        self.assertEqual(sorted(os.listdir(self.dir)), [".checkpoint.ckpt.lock", "checkpoint.ckpt"])

    def test_bytes_stay_bytes(self):
        save_checkpoint(b"\x00raw\xff", self.dir)
        self.assertEqual(load_checkpoint(self.dir).state, b"\x00raw\xff")

    def test_custom_serializer_like_torch_save(self):
        calls = []

        def save(obj, f):  # the shape of torch.save(obj, f)
            calls.append("save")
            f.write(repr(obj).encode())

        def load(f):  # the shape of torch.load(f)
            calls.append("load")
            return eval(f.read().decode())

        save_checkpoint([1, 2, 3], self.dir, serializer=save, name="model.pt")
        self.assertEqual(load_checkpoint(self.dir, deserializer=load, name="model.pt").state, [1, 2, 3])
        self.assertEqual(calls, ["save", "load"])
        with self.assertRaises(CheckpointError) as cm:
            load_checkpoint(self.dir, name="model.pt")
        self.assertIn("deserializer", str(cm.exception))

    def test_overwrite_replaces(self):
        save_checkpoint({"step": 1}, self.dir, generation=1)
        save_checkpoint({"step": 2}, self.dir, generation=2)
        got = load_checkpoint(self.dir, generation=2)
        self.assertEqual((got.state, got.generation), ({"step": 2}, 2))

    def test_an_older_generation_is_fenced(self):
        save_checkpoint({"step": 9}, self.dir, generation=5)
        with self.assertRaises(CheckpointFenced) as cm:
            save_checkpoint({"step": 3}, self.dir, generation=4)
        self.assertIn("fenced", str(cm.exception))
        with self.assertRaises(CheckpointFenced):
            load_checkpoint(self.dir, generation=4)
        self.assertEqual(load_checkpoint(self.dir).state, {"step": 9})
        # Generation 0 (run by hand) is never fenced.
        save_checkpoint({"step": 0}, self.dir, generation=0)
        self.assertEqual(load_checkpoint(self.dir, generation=0).generation, 0)

    def test_a_failing_serializer_leaves_the_old_checkpoint(self):
        save_checkpoint({"step": 1}, self.dir)

        def broken(obj, f):
            f.write(b"half")
            raise RuntimeError("disk full")

        with self.assertRaises(RuntimeError):
            save_checkpoint({"step": 2}, self.dir, serializer=broken)
        self.assertEqual(load_checkpoint(self.dir).state, {"step": 1})
        self.assertEqual(sorted(os.listdir(self.dir)), [".checkpoint.ckpt.lock", "checkpoint.ckpt"])

    def test_another_writers_temporary_file_is_never_used(self):
        # A writer on another host with the same process id (shared storage) has its
        # temporary file in the directory: the old `.<name>.tmp.<pid>` name would have been
        # truncated and renamed under it.
        self.dir.mkdir(parents=True, exist_ok=True)
        theirs = self.dir / (".checkpoint.ckpt.tmp.%d" % os.getpid())
        theirs.write_bytes(b"their half-written checkpoint")
        path = save_checkpoint({"step": 3}, self.dir)
        self.assertEqual(theirs.read_bytes(), b"their half-written checkpoint")
        self.assertEqual(load_checkpoint(self.dir).state, {"step": 3})
        self.assertEqual(
            sorted(os.listdir(self.dir)),
            sorted([".checkpoint.ckpt.lock", "checkpoint.ckpt", theirs.name]),
        )
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)

    def test_a_stale_generation_cannot_rename_over_a_newer_ones_checkpoint(self):
        # Generation 1 has passed its fence check and is about to rename its file when
        # generation 2 saves. Without the lock, generation 2 wrote in between and
        # generation 1's rename then replaced the newer checkpoint with its stale one.
        save_checkpoint(b"first", self.dir, generation=1)
        real_replace = os.replace
        newer_done = threading.Event()
        outcome = {}

        def newer():
            outcome["newer"] = save_checkpoint(b"newer", self.dir, generation=2)
            newer_done.set()

        writer = threading.Thread(target=newer, name="generation-2")

        def replace(src, dst):
            if threading.current_thread().name == "generation-1":
                writer.start()
                # Long enough for generation 2 to finish, were it not held by the lock.
                outcome["newer_finished_in_between"] = newer_done.wait(timeout=1.0)
            return real_replace(src, dst)

        def stale():
            try:
                save_checkpoint(b"stale", self.dir, generation=1)
                outcome["stale"] = "written"
            except CheckpointFenced:
                outcome["stale"] = "fenced"

        with mock.patch("converge_worker.checkpoint.os.replace", side_effect=replace):
            t = threading.Thread(target=stale, name="generation-1")
            t.start()
            t.join(10)
            writer.join(10)
        self.assertFalse(outcome["newer_finished_in_between"], outcome)
        self.assertEqual(outcome["stale"], "written", "it held the lock first")
        loaded = load_checkpoint(self.dir)
        self.assertEqual((loaded.state, loaded.generation), (b"newer", 2))
        # And once the newer checkpoint is there, the stale generation is fenced.
        with self.assertRaises(CheckpointFenced):
            save_checkpoint(b"stale again", self.dir, generation=1)
        self.assertEqual(load_checkpoint(self.dir).state, b"newer")

    def test_corrupt_truncated_and_foreign_files_are_errors(self):
        save_checkpoint({"params": list(range(100))}, self.dir)
        path = checkpoint_path(self.dir)
        data = path.read_bytes()
        path.write_bytes(data[:-10])
        with self.assertRaises(CheckpointError) as cm:
            load_checkpoint(self.dir)
        self.assertIn("corrupt", str(cm.exception))
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with self.assertRaises(CheckpointError):
            load_checkpoint(self.dir)
        path.write_bytes(pickle.dumps({"a": 1}))
        with self.assertRaises(CheckpointError) as cm:
            load_checkpoint(self.dir)
        self.assertIn("not a Converge checkpoint", str(cm.exception))
        path.write_bytes(b"CONVERGE-CHECKPOINT 9 {}\n")
        with self.assertRaises(CheckpointError) as cm:
            load_checkpoint(self.dir)
        self.assertIn("format", str(cm.exception))
        # A foreign file does not fence anyone: it is overwritten.
        save_checkpoint({"ok": True}, self.dir, generation=2)
        self.assertEqual(load_checkpoint(self.dir).state, {"ok": True})

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            save_checkpoint({}, self.dir, name="../escape")
        with self.assertRaises(ValueError):
            save_checkpoint({}, self.dir, generation=-1)
        with self.assertRaises(ValueError) as cm:
            save_checkpoint({}, self.dir, metadata={"loss": float("nan")})
        self.assertIn("metadata", str(cm.exception))
        self.assertFalse((self.dir / "checkpoint.ckpt").exists())


if __name__ == "__main__":
    unittest.main()
