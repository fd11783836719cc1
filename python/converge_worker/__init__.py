"""Converge's worker contract for Python training programs (docs/protocol.md, "Worker
contract"): the environment the agent sets, ``CONVERGE_PROGRESS`` lines, atomic
checkpoints with generation fencing, and SIGTERM as a stop flag. Pure Python, no framework
dependency."""

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
from .progress import PREFIX, ProgressError, format_progress, report_progress
from .stop import EXIT_STOPPED, StopRequest, install_stop_handler

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NAME",
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
