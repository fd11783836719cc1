"""Converge's worker contract for Python training programs (docs/protocol.md, "Worker
contract"): the environment the agent sets, ``CONVERGE_PROGRESS`` lines, atomic
checkpoints with generation fencing, SIGTERM as a stop flag, an elastic data order and the
gradient statistics' arithmetic. Pure Python, no framework dependency; the PyTorch half
(gradient statistics from DDP, the planned batch, AdaScale) is ``converge_worker.torch``."""

from .checkpoint import (
    DEFAULT_NAME,
    Checkpoint,
    CheckpointError,
    CheckpointFenced,
    checkpoint_path,
    load_checkpoint,
    read_checkpoint_header,
    save_checkpoint,
)
from .contract import Batch, Contract, ContractError
from .gradstats import LR_RULES, adascale_gain, scaled_lr
from .progress import PREFIX, ProgressError, format_progress, report_progress
from .sampler import ElasticSampler
from .stop import EXIT_STOPPED, StopRequest, install_stop_handler

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NAME",
    "LR_RULES",
    "ElasticSampler",
    "adascale_gain",
    "scaled_lr",
    "EXIT_STOPPED",
    "PREFIX",
    "Batch",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFenced",
    "Contract",
    "ContractError",
    "ProgressError",
    "StopRequest",
    "checkpoint_path",
    "format_progress",
    "install_stop_handler",
    "load_checkpoint",
    "read_checkpoint_header",
    "report_progress",
    "save_checkpoint",
]
