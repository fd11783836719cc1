"""The worker contract's environment (docs/protocol.md, "Worker contract") as a dataclass.

The Converge agent starts every worker with these variables. Run under an agent
(``CONVERGE_JOB_ID`` is set), every variable every agent sets (``AGENT_VARIABLES``, from
the contract's table in common/src/contract.rs) is required and a missing one is an
error: it means the program was not started by a Converge agent, or by an incompatible
one. Run by hand (no ``CONVERGE_JOB_ID``), the rest default to a single
process: rank 0 of 1, ``127.0.0.1:29500``, generation 0, no checkpoint directory.
"""

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .gradstats import scaled_lr

__all__ = ["Batch", "Contract", "ContractError"]


def _load_variables() -> Tuple[Dict[str, Any], ...]:
    path = Path(__file__).with_name("contract_variables.json")
    with open(path, encoding="utf-8") as f:
        return tuple(json.load(f)["variables"])


#: The worker contract's variables, one dict each (``name``, ``when``, ``required``,
#: ``reserved``, ``meaning``): ``contract_variables.json``, generated from the contract's one
#: definition, the table in common/src/contract.rs (a Rust test keeps the file equal to it).
VARIABLES: Tuple[Dict[str, Any], ...] = _load_variables()

#: Variables every agent sets on every worker and a program may require under an agent
#: (``when == "always"`` and ``required``), in the table's order.
AGENT_VARIABLES: Tuple[str, ...] = tuple(
    str(v["name"]) for v in VARIABLES if v["when"] == "always" and v["required"]
)

#: The planned batch's variables, set for jobs with a ``[batch]`` table only
#: (``when == "batch"``): ``CONVERGE_BATCH_SIZE`` first, then ``CONVERGE_ACCUM_STEPS``,
#: ``CONVERGE_TOTAL_BATCH``, ``CONVERGE_REFERENCE_BATCH``.
BATCH_VARIABLES: Tuple[str, ...] = tuple(str(v["name"]) for v in VARIABLES if v["when"] == "batch")

_WHOLE = re.compile(r"[0-9]+\Z")


class ContractError(ValueError):
    """A worker-contract variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Batch:
    """The batch the allocator planned for a job with a ``[batch]`` table, in samples.

    ``total == workers * per_worker * (accum_steps + 1)``.
    """

    #: ``CONVERGE_BATCH_SIZE``: samples per worker per forward/backward pass (micro-batch).
    per_worker: int
    #: ``CONVERGE_ACCUM_STEPS``: extra micro-batches each worker accumulates per optimizer
    #: step (0 = none).
    accum_steps: int
    #: ``CONVERGE_TOTAL_BATCH``: samples per optimizer step over all workers.
    total: int
    #: ``CONVERGE_REFERENCE_BATCH``: the total the job's learning rate was tuned for.
    reference: int

    @property
    def micro_batches(self) -> int:
        """Micro-batches per worker per optimizer step: ``accum_steps + 1``."""
        return self.accum_steps + 1

    def scaled_lr(self, lr: float, rule: str = "sqrt") -> float:
        """``lr`` (tuned at the reference batch) scaled to the planned total.

        ``rule``: ``"sqrt"`` (``lr * sqrt(total / reference)``, converge-trainer's
        fallback before it has gradient statistics), ``"linear"`` (``lr * total /
        reference``) or ``"none"``. AdaScale needs the statistics: see
        :func:`converge_worker.gradstats.scaled_lr` and ``converge_worker.torch``.
        """
        if rule in ("sqrt", "linear", "none"):
            return scaled_lr(lr, self.total, self.reference, rule)[0]
        raise ValueError("unknown learning-rate scaling rule %r: sqrt, linear or none" % (rule,))


@dataclass(frozen=True)
class Contract:
    """Everything the agent tells a worker. Build it with :meth:`from_env`."""

    #: ``RANK``: this process's rank, ``0 <= rank < world_size``.
    rank: int
    #: ``WORLD_SIZE``: processes of the generation (workers and parameter-server shards).
    world_size: int
    #: ``LOCAL_RANK``: index among this job's processes on this host.
    local_rank: int
    #: ``LOCAL_WORLD_SIZE``: this job's processes on this host.
    local_world_size: int
    #: ``MASTER_ADDR`` and ``MASTER_PORT``: rank 0's rendezvous (fresh port per generation).
    master_addr: str
    master_port: int
    #: ``CUDA_VISIBLE_DEVICES`` as given (``None`` when unset, ``""`` for no GPU).
    cuda_visible_devices: Optional[str]
    #: ``CONVERGE_JOB_ID`` (``None`` when run by hand).
    job_id: Optional[str]
    #: ``CONVERGE_GENERATION``: bumped on every allocation change; 0 when run by hand.
    generation: int
    #: ``CONVERGE_CHECKPOINT_DIR`` (shared storage across hosts); ``None``: no checkpoints.
    checkpoint_dir: Optional[Path]
    #: ``CONVERGE_NUM_PS``: parameter-server shards among the ``world_size`` ranks.
    num_ps: int
    #: The planned batch (``CONVERGE_BATCH_SIZE`` and its siblings); ``None`` for jobs
    #: without a ``[batch]`` table: the program keeps its own batch.
    batch: Optional[Batch]
    #: torchrun's ``GROUP_RANK`` (the agent sets ``RANK - LOCAL_RANK``, the lowest rank on
    #: the host: 0 on rank 0's host, distinct across hosts); ``None`` with older agents.
    group_rank: Optional[int] = None
    #: ``TORCHELASTIC_RUN_ID`` (the job id) and ``TORCHELASTIC_RESTART_COUNT`` (the
    #: generation); ``None`` with older agents or by hand.
    run_id: Optional[str] = None
    restart_count: Optional[int] = None
    #: ``CONVERGE_SYNC``: the spec's sync architecture (``ring``, ``ps`` or ``shadow``);
    #: ``None`` with older agents or by hand.
    sync: Optional[str] = None
    #: ``CONVERGE_SHADOW_ALGORITHM`` of a shadow job (``ma``, ``bmuf``, ``easgd``); its
    #: parameters are ``CONVERGE_SHADOW_BLOCK_MOMENTUM`` and the other ``CONVERGE_SHADOW_*``
    #: variables, set only when the spec gives them (docs/protocol.md).
    shadow_algorithm: Optional[str] = None

    @classmethod
    def from_env(
        cls, environ: Optional[Mapping[str, str]] = None, *, require_agent: bool = False
    ) -> "Contract":
        """Reads the contract from ``environ`` (default ``os.environ``).

        Raises :class:`ContractError` naming the variable when one is missing (under an
        agent, or with ``require_agent=True``) or malformed. Empty values count as unset,
        except ``CUDA_VISIBLE_DEVICES`` (empty: no GPU, as parameter-server shards get).
        """
        env = os.environ if environ is None else environ

        def get(name: str) -> Optional[str]:
            value = env.get(name)
            if value is None or value.strip() == "":
                return None
            return value.strip()

        under_agent = require_agent or get("CONVERGE_JOB_ID") is not None
        if under_agent:
            missing = [
                k
                for k in AGENT_VARIABLES
                if (env.get(k) is None if k == "CUDA_VISIBLE_DEVICES" else get(k) is None)
            ]
            if missing:
                raise ContractError(
                    "missing worker-contract variable%s %s: a Converge agent sets %s on every worker"
                    % ("s" if len(missing) > 1 else "", ", ".join(missing), ", ".join(AGENT_VARIABLES))
                )

        def number(name: str, default: Optional[int] = None, minimum: int = 0) -> int:
            value = get(name)
            if value is None:
                if default is None:
                    raise ContractError("%s is required but not set" % name)
                return default
            if not _WHOLE.match(value):
                raise ContractError("%s=%r is not a whole number" % (name, env.get(name)))
            n = int(value)
            if n < minimum:
                raise ContractError("%s=%d must be at least %d" % (name, n, minimum))
            return n

        world_size = number("WORLD_SIZE", 1, minimum=1)
        rank = number("RANK", 0 if world_size == 1 else None)
        if rank >= world_size:
            raise ContractError("RANK=%d is not below WORLD_SIZE=%d" % (rank, world_size))
        local_world_size = number("LOCAL_WORLD_SIZE", 1, minimum=1)
        local_rank = number("LOCAL_RANK", 0 if local_world_size == 1 else None)
        if local_rank >= local_world_size:
            raise ContractError(
                "LOCAL_RANK=%d is not below LOCAL_WORLD_SIZE=%d" % (local_rank, local_world_size)
            )
        if local_world_size > world_size:
            raise ContractError(
                "LOCAL_WORLD_SIZE=%d is above WORLD_SIZE=%d" % (local_world_size, world_size)
            )
        master_port = number("MASTER_PORT", 29500, minimum=1)
        if master_port > 65535:
            raise ContractError("MASTER_PORT=%d is not a TCP port (1-65535)" % master_port)
        num_ps = number("CONVERGE_NUM_PS", 0)
        if num_ps >= world_size:
            raise ContractError(
                "CONVERGE_NUM_PS=%d leaves no worker among WORLD_SIZE=%d ranks: WORLD_SIZE "
                "counts workers and parameter-server shards" % (num_ps, world_size)
            )
        checkpoint_dir = get("CONVERGE_CHECKPOINT_DIR")
        group_rank = get("GROUP_RANK")
        restart_count = get("TORCHELASTIC_RESTART_COUNT")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            master_addr=get("MASTER_ADDR") or "127.0.0.1",
            master_port=master_port,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            job_id=get("CONVERGE_JOB_ID"),
            generation=number("CONVERGE_GENERATION", 0),
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None,
            num_ps=num_ps,
            batch=_batch(get, world_size - num_ps),
            group_rank=None if group_rank is None else number("GROUP_RANK"),
            run_id=get("TORCHELASTIC_RUN_ID"),
            restart_count=None if restart_count is None else number("TORCHELASTIC_RESTART_COUNT"),
            sync=get("CONVERGE_SYNC"),
            shadow_algorithm=get("CONVERGE_SHADOW_ALGORITHM"),
        )

    @property
    def workers(self) -> int:
        """Data-parallel workers: ``world_size - num_ps``."""
        return self.world_size - self.num_ps

    @property
    def is_worker(self) -> bool:
        """Whether this rank is a worker (not a parameter-server shard)."""
        return self.rank < self.workers

    @property
    def is_rank0(self) -> bool:
        """Rank 0 reports progress and writes checkpoints, by convention."""
        return self.rank == 0

    @property
    def under_agent(self) -> bool:
        """Whether a Converge agent started this process (``CONVERGE_JOB_ID`` is set)."""
        return self.job_id is not None

    @property
    def devices(self) -> Tuple[str, ...]:
        """``CUDA_VISIBLE_DEVICES`` split on commas (``()`` when unset or empty)."""
        if not self.cuda_visible_devices:
            return ()
        return tuple(d.strip() for d in self.cuda_visible_devices.split(",") if d.strip())

    def batch_or(self, per_worker: int, reference: Optional[int] = None) -> Batch:
        """The planned batch, or ``per_worker`` samples per worker without accumulation
        when the job has no ``[batch]`` table (``reference`` defaults to the resulting
        total, so that no learning-rate scaling happens)."""
        if self.batch is not None:
            return self.batch
        if per_worker < 1:
            raise ValueError("per_worker must be at least 1, not %r" % (per_worker,))
        total = per_worker * self.workers
        return Batch(per_worker, 0, total, reference if reference is not None else total)

    def to_dict(self) -> Dict[str, object]:
        """Plain values (paths as strings), for logging as JSON."""
        d = asdict(self)
        d["checkpoint_dir"] = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        return d


def _batch(get: Callable[[str], Optional[str]], workers: int) -> Optional[Batch]:
    def number(name: str) -> Optional[int]:
        value = get(name)
        if value is None:
            return None
        if not _WHOLE.match(value):
            raise ContractError("%s=%r is not a whole number" % (name, value))
        return int(value)

    per_worker = number("CONVERGE_BATCH_SIZE")
    if per_worker is None:
        for k in BATCH_VARIABLES[1:]:
            if get(k) is not None:
                raise ContractError("%s is set but CONVERGE_BATCH_SIZE is not" % k)
        return None
    if per_worker < 1:
        raise ContractError("CONVERGE_BATCH_SIZE must be at least 1")
    accum = number("CONVERGE_ACCUM_STEPS")
    accum = 0 if accum is None else accum
    expect = workers * per_worker * (accum + 1)
    total = number("CONVERGE_TOTAL_BATCH")
    total = expect if total is None else total
    if total != expect:
        raise ContractError(
            "CONVERGE_TOTAL_BATCH=%d is not %d workers x CONVERGE_BATCH_SIZE=%d x "
            "(CONVERGE_ACCUM_STEPS=%d + 1)" % (total, workers, per_worker, accum)
        )
    reference = number("CONVERGE_REFERENCE_BATCH")
    reference = total if reference is None else reference
    if reference < 1:
        raise ContractError("CONVERGE_REFERENCE_BATCH must be at least 1")
    return Batch(per_worker=per_worker, accum_steps=accum, total=total, reference=reference)
