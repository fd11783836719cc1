import json
import math
import unittest

import _kit  # noqa: F401  (the kit from the source tree when not installed)
from pathlib import Path

from converge_worker import Batch, Contract, ContractError
from converge_worker import contract as contract_module
from converge_worker.contract import AGENT_VARIABLES, BATCH_VARIABLES

PYTHON_DIR = Path(__file__).resolve().parents[1]
# The worker contract's table (common/src/contract.rs) as the source tree has it; a Rust test
# (cargo test -p converge-common contract) keeps the file equal to the table.
TABLE_FILE = PYTHON_DIR / "converge_worker" / "contract_variables.json"

# What the agent sets on a worker (agent/src/supervisor.rs, worker_env), but CONVERGE_SYNC:
# it stands for agents older than that variable too.
AGENT = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "2",
    "ROLE_RANK": "3",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "23456",
    "TORCHELASTIC_RUN_ID": "mnist-ddp",
    "TORCHELASTIC_RESTART_COUNT": "7",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "CUDA_VISIBLE_DEVICES": "2,3",
    "CONVERGE_JOB_ID": "mnist-ddp",
    "CONVERGE_GENERATION": "7",
    "CONVERGE_CHECKPOINT_DIR": "/ckpt/mnist-ddp",
    "CONVERGE_NUM_PS": "0",
}

BATCH = {
    "CONVERGE_BATCH_SIZE": "12",
    "CONVERGE_ACCUM_STEPS": "1",
    "CONVERGE_TOTAL_BATCH": "96",
    "CONVERGE_REFERENCE_BATCH": "64",
}


def env(**changes):
    e = dict(AGENT)
    for k, v in changes.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


class ContractFromAgent(unittest.TestCase):
    def test_reads_every_variable_the_agent_sets(self):
        c = Contract.from_env(dict(AGENT, **BATCH))
        self.assertEqual((c.rank, c.world_size, c.local_rank, c.local_world_size), (3, 4, 1, 2))
        self.assertEqual((c.master_addr, c.master_port), ("10.0.0.5", 23456))
        self.assertEqual((c.job_id, c.generation, c.num_ps), ("mnist-ddp", 7, 0))
        self.assertEqual(c.checkpoint_dir, Path("/ckpt/mnist-ddp"))
        self.assertEqual((c.group_rank, c.run_id, c.restart_count), (2, "mnist-ddp", 7))
        self.assertEqual(c.devices, ("2", "3"))
        self.assertEqual(c.batch, Batch(per_worker=12, accum_steps=1, total=96, reference=64))
        self.assertEqual(c.batch.micro_batches, 2)
        self.assertTrue(c.under_agent and c.is_worker and not c.is_rank0)
        self.assertEqual(c.workers, 4)
        d = c.to_dict()
        self.assertEqual(d["checkpoint_dir"], "/ckpt/mnist-ddp")
        self.assertEqual(d["batch"]["total"], 96)

    def test_no_batch_table_means_no_batch(self):
        c = Contract.from_env(AGENT)
        self.assertIsNone(c.batch)
        b = c.batch_or(32)
        self.assertEqual(b, Batch(32, 0, 128, 128))
        self.assertEqual(b.scaled_lr(0.1), 0.1)

    def test_sync_and_shadow_algorithm(self):
        c = Contract.from_env(env(CONVERGE_SYNC="shadow", CONVERGE_SHADOW_ALGORITHM="bmuf"))
        self.assertEqual((c.sync, c.shadow_algorithm), ("shadow", "bmuf"))
        c = Contract.from_env(env(CONVERGE_SYNC="ring"))
        self.assertEqual((c.sync, c.shadow_algorithm), ("ring", None))
        self.assertEqual(Contract.from_env(AGENT).sync, None)

    def test_older_agents_without_torchrun_extras(self):
        c = Contract.from_env(env(GROUP_RANK=None, TORCHELASTIC_RUN_ID=None, TORCHELASTIC_RESTART_COUNT=None))
        self.assertEqual((c.group_rank, c.run_id, c.restart_count), (None, None, None))

    def test_missing_variables_under_an_agent_are_named(self):
        for name in ["RANK", "WORLD_SIZE", "MASTER_PORT", "CONVERGE_CHECKPOINT_DIR", "CUDA_VISIBLE_DEVICES"]:
            with self.subTest(name=name):
                with self.assertRaises(ContractError) as cm:
                    Contract.from_env(env(**{name: None}))
                self.assertIn(name, str(cm.exception))
        with self.assertRaises(ContractError) as cm:
            Contract.from_env(env(RANK=None, MASTER_ADDR="  "))
        self.assertIn("RANK, MASTER_ADDR", str(cm.exception))

    def test_parameter_server_shards_have_no_gpu(self):
        c = Contract.from_env(env(CUDA_VISIBLE_DEVICES="", CONVERGE_NUM_PS="1"))
        self.assertEqual(c.devices, ())
        self.assertEqual(c.workers, 3)
        self.assertFalse(c.is_worker)

    def test_malformed_values_are_refused_with_the_variable(self):
        cases = {
            "RANK": ["-1", "1.0", "x", "+1", "4"],
            "WORLD_SIZE": ["0", "two"],
            "LOCAL_RANK": ["2"],
            "MASTER_PORT": ["0", "70000", "http"],
            "CONVERGE_GENERATION": ["-3", "1e3"],
            "CONVERGE_NUM_PS": ["4"],
            "GROUP_RANK": ["a"],
        }
        for name, values in cases.items():
            for value in values:
                with self.subTest(name=name, value=value):
                    with self.assertRaises(ContractError) as cm:
                        Contract.from_env(env(**{name: value}))
                    self.assertIn(name, str(cm.exception))

    def test_require_agent_refuses_a_hand_run(self):
        with self.assertRaises(ContractError) as cm:
            Contract.from_env({}, require_agent=True)
        self.assertIn("CONVERGE_JOB_ID", str(cm.exception))


class ContractByHand(unittest.TestCase):
    def test_defaults_to_one_process(self):
        c = Contract.from_env({})
        self.assertEqual((c.rank, c.world_size, c.local_rank, c.local_world_size), (0, 1, 0, 1))
        self.assertEqual((c.master_addr, c.master_port, c.generation), ("127.0.0.1", 29500, 0))
        self.assertIsNone(c.checkpoint_dir)
        self.assertIsNone(c.cuda_visible_devices)
        self.assertFalse(c.under_agent)
        self.assertTrue(c.is_rank0)

    def test_world_size_above_one_needs_rank(self):
        with self.assertRaises(ContractError) as cm:
            Contract.from_env({"WORLD_SIZE": "2"})
        self.assertIn("RANK", str(cm.exception))
        self.assertEqual(Contract.from_env({"WORLD_SIZE": "2", "RANK": "1"}).rank, 1)


class PlannedBatch(unittest.TestCase):
    def test_defaults_follow_the_trainer(self):
        c = Contract.from_env(env(CONVERGE_BATCH_SIZE="16"))
        self.assertEqual(c.batch, Batch(16, 0, 64, 64))

    def test_inconsistent_batches_are_refused(self):
        bad = [
            dict(BATCH, CONVERGE_TOTAL_BATCH="100"),
            dict(BATCH, CONVERGE_BATCH_SIZE="0", CONVERGE_TOTAL_BATCH="0"),
            dict(BATCH, CONVERGE_REFERENCE_BATCH="0"),
            dict(BATCH, CONVERGE_ACCUM_STEPS="-1"),
            {"CONVERGE_TOTAL_BATCH": "96"},
        ]
        for extra in bad:
            with self.subTest(extra=extra):
                with self.assertRaises(ContractError) as cm:
                    Contract.from_env(dict(AGENT, **extra))
                self.assertIn("CONVERGE_", str(cm.exception))

    def test_total_counts_workers_not_shards(self):
        c = Contract.from_env(env(CONVERGE_NUM_PS="1", CONVERGE_BATCH_SIZE="8", CONVERGE_TOTAL_BATCH="24"))
        self.assertEqual(c.batch.total, 24)

    def test_learning_rate_scaling(self):
        b = Batch(per_worker=32, accum_steps=0, total=256, reference=64)
        self.assertAlmostEqual(b.scaled_lr(0.1), 0.2)
        self.assertAlmostEqual(b.scaled_lr(0.1, "linear"), 0.4)
        self.assertEqual(b.scaled_lr(0.1, "none"), 0.1)
        with self.assertRaises(ValueError):
            b.scaled_lr(0.1, "cubic")
        self.assertTrue(math.isclose(Batch(8, 0, 16, 64).scaled_lr(1.0), 0.5))


def table():
    with open(TABLE_FILE, encoding="utf-8") as f:
        return json.load(f)["variables"]


class _Recording(dict):
    """An environment that records the names read from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


class ContractTable(unittest.TestCase):
    """The kit's variables are the worker contract's one definition (common/src/contract.rs),
    through contract_variables.json."""

    def test_the_kits_tuples_are_the_tables(self):
        t = table()
        self.assertEqual(
            AGENT_VARIABLES,
            tuple(v["name"] for v in t if v["when"] == "always" and v["required"]),
        )
        self.assertEqual(BATCH_VARIABLES, tuple(v["name"] for v in t if v["when"] == "batch"))
        # _batch reads the micro-batch first and the rest after it.
        self.assertEqual(BATCH_VARIABLES[0], "CONVERGE_BATCH_SIZE")
        self.assertIn("RANK", AGENT_VARIABLES)
        self.assertIn("CONVERGE_JOB_ID", AGENT_VARIABLES)
        # The kit imported (installed or from the source tree) has the source tree's table:
        # reinstall it (pip install ./python) when this fails.
        self.assertEqual(list(contract_module.VARIABLES), t)

    def test_from_env_reads_only_the_tables_variables(self):
        names = {v["name"] for v in table()}
        for extra in [{}, BATCH, {"CONVERGE_SYNC": "shadow", "CONVERGE_SHADOW_ALGORITHM": "ma"}]:
            with self.subTest(extra=extra):
                environ = _Recording(AGENT, **extra)
                Contract.from_env(environ)
                self.assertLessEqual(environ.read, names, "names outside the contract's table")
                self.assertLessEqual(set(AGENT_VARIABLES) | set(BATCH_VARIABLES), environ.read)

    def test_the_fixtures_are_what_the_agent_sets(self):
        t = table()
        every_worker = {v["name"] for v in t if v["when"] in ("always", "spec_default")}
        self.assertLessEqual(set(AGENT), every_worker)
        self.assertEqual(every_worker - set(AGENT), {"CONVERGE_SYNC"})
        self.assertEqual(set(BATCH), set(BATCH_VARIABLES))

    def test_the_package_ships_the_table(self):
        pyproject = (PYTHON_DIR / "pyproject.toml").read_text(encoding="utf-8")
        package_data = [line for line in pyproject.splitlines() if line.startswith("converge_worker = [")]
        self.assertEqual(len(package_data), 1, pyproject)
        self.assertIn('"contract_variables.json"', package_data[0])


if __name__ == "__main__":
    unittest.main()
