"""Atomic checkpoints in ``CONVERGE_CHECKPOINT_DIR`` with generation fencing.

The conventions of converge-trainer (``trainer/src/checkpoint.rs``) and the worker
contract: rank 0 writes one file in the checkpoint directory, through a temporary file in
the same directory (``.<name>.tmp.<random>``, created exclusively by ``tempfile.mkstemp``
so that two writers on shared storage, even with equal process ids on different hosts,
never share one; the file is readable by its owner only) that is flushed to disk,
renamed over the
checkpoint and followed by a sync of the directory, so a reader sees the old or the new
checkpoint, never a torn one. The checkpoint records the generation that wrote it; a
worker of an older generation must not overwrite it (fencing), and a worker of generation
0 (run by hand) is never fenced. The fence check and the rename happen under an exclusive
lock on ``.<name>.lock`` in the directory (``flock``; NFS clients carry it to the server
as a POSIX lock), which converge-trainer takes too: a stale generation that passed its
check cannot rename over a newer generation's checkpoint written in between.

File format: one header line ``CONVERGE-CHECKPOINT 1 {json}\\n`` (generation, encoding,
payload size and SHA-256, the caller's metadata) followed by the payload, the bytes the
serializer wrote. The payload is whatever the serializer produced, so
``torch.save``/``torch.load`` work as the serializer and deserializer.
"""

import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Optional, Union

__all__ = [
    "DEFAULT_NAME",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFenced",
    "checkpoint_path",
    "load_checkpoint",
    "read_checkpoint_header",
    "save_checkpoint",
]

#: The default file name inside the checkpoint directory.
DEFAULT_NAME = "checkpoint.ckpt"
MAGIC = b"CONVERGE-CHECKPOINT"
FORMAT_VERSION = 1
_MAX_HEADER = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]
Serializer = Callable[[Any, BinaryIO], Any]
Deserializer = Callable[[BinaryIO], Any]


class CheckpointError(Exception):
    """A checkpoint that exists but cannot be read (corrupt, truncated, foreign)."""


class CheckpointFenced(CheckpointError):
    """The checkpoint was written by a newer generation: this worker is stale and must
    exit without writing (the trainer's ``fenced: ...``)."""


@dataclass
class Checkpoint:
    """A loaded checkpoint."""

    state: Any
    generation: int
    metadata: Dict[str, Any] = field(default_factory=dict)
    path: Optional[Path] = None


def checkpoint_path(directory: PathLike, name: str = DEFAULT_NAME) -> Path:
    """The checkpoint's path inside ``directory``."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError("checkpoint name must be a plain file name, got %r" % (name,))
    return Path(directory) / name


def read_checkpoint_header(directory: PathLike, name: str = DEFAULT_NAME) -> Optional[Dict[str, Any]]:
    """The header of the checkpoint in ``directory`` (``generation``, ``encoding``,
    ``payload_bytes``, ``sha256``, ``metadata``), without reading the payload; ``None``
    when there is none. Raises :class:`CheckpointError` when the header is unreadable."""
    path = checkpoint_path(directory, name)
    try:
        with open(path, "rb") as f:
            return _read_header(f, path)
    except FileNotFoundError:
        return None


def _read_header(f: BinaryIO, path: Path) -> Dict[str, Any]:
    line = f.readline(_MAX_HEADER)
    prefix = MAGIC + b" "
    if not line.startswith(prefix) or not line.endswith(b"\n"):
        raise CheckpointError("%s is not a Converge checkpoint (no %s header)" % (path, MAGIC.decode()))
    version, _, text = line[len(prefix):].partition(b" ")
    if version != str(FORMAT_VERSION).encode():
        raise CheckpointError(
            "%s has checkpoint format %r; this kit reads format %d"
            % (path, version.decode(errors="replace"), FORMAT_VERSION)
        )
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointError("%s has a bad checkpoint header: %s" % (path, e)) from None
    if not isinstance(header, dict) or not isinstance(header.get("generation"), int):
        raise CheckpointError("%s has a bad checkpoint header (no generation)" % path)
    return header


def save_checkpoint(
    state: Any,
    directory: PathLike,
    *,
    generation: int = 0,
    serializer: Optional[Serializer] = None,
    metadata: Optional[Dict[str, Any]] = None,
    name: str = DEFAULT_NAME,
) -> Path:
    """Writes ``state`` atomically to ``directory/name`` (the directory is created).

    ``serializer(state, file)`` writes the payload (``torch.save`` fits); without one,
    ``bytes``-like states are written as they are and anything else is pickled.
    ``generation`` is the writer's ``CONVERGE_GENERATION``: when the existing checkpoint
    was written by a newer generation (and ``generation > 0``), nothing is written and
    :class:`CheckpointFenced` is raised. ``metadata``: JSON values kept in the header
    (step, samples, loss...), readable without the payload. Returns the path.
    """
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError("generation must be a whole number >= 0, got %r" % (generation,))
    directory = Path(directory)
    target = checkpoint_path(directory, name)
    directory.mkdir(parents=True, exist_ok=True)
    _check_fence(directory, name, generation)

    buf = io.BytesIO()
    if serializer is not None:
        serializer(state, buf)
        encoding = "custom"
    elif isinstance(state, (bytes, bytearray, memoryview)):
        buf.write(state)
        encoding = "bytes"
    else:
        pickle.dump(state, buf, protocol=pickle.HIGHEST_PROTOCOL)
        encoding = "pickle"
    payload = buf.getbuffer()
    header = {
        "generation": generation,
        "encoding": encoding,
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "metadata": metadata or {},
    }
    try:
        header_line = json.dumps(header, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError("checkpoint metadata must be JSON values (finite numbers): %s" % e) from None

    fd, tmp_name = tempfile.mkstemp(prefix=".%s.tmp." % name, dir=str(directory))
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + b" %d " % FORMAT_VERSION + header_line.encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        # The check again, and the rename, under the directory's lock: atomic with respect
        # to every other writer of this checkpoint.
        with _locked(directory, name):
            _check_fence(directory, name, generation)
            os.replace(tmp, target)
            # Make the rename itself durable.
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


@contextlib.contextmanager
def _locked(directory: Path, name: str):
    """Holds the exclusive lock of checkpoint ``name`` in ``directory``
    (``.<name>.lock``, created with mode 0600 when missing; converge-trainer locks the
    same way) while the block runs."""
    fd = os.open(directory / (".%s.lock" % name), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_fence(directory: Path, name: str, generation: int) -> None:
    if generation == 0:
        return
    try:
        header = read_checkpoint_header(directory, name)
    except CheckpointError:
        # A corrupt or foreign file says nothing about generations: overwrite it.
        return
    if header is not None and header["generation"] > generation:
        raise CheckpointFenced(
            "fenced: %s was written by generation %d, newer than this worker's %d"
            % (checkpoint_path(directory, name), header["generation"], generation)
        )


def load_checkpoint(
    directory: Optional[PathLike],
    *,
    generation: int = 0,
    deserializer: Optional[Deserializer] = None,
    name: str = DEFAULT_NAME,
) -> Optional[Checkpoint]:
    """Reads ``directory/name``; ``None`` when ``directory`` is ``None`` or holds no
    checkpoint.

    ``deserializer(file)`` reads a payload written with a custom serializer
    (``torch.load`` fits, with its ``map_location``/``weights_only`` bound by the caller);
    bytes and pickle payloads need none. A worker of ``generation > 0`` that finds a newer
    generation's checkpoint gets :class:`CheckpointFenced`. A truncated, corrupt or
    foreign file raises :class:`CheckpointError` (never a silent fresh start).
    """
    if directory is None:
        return None
    path = checkpoint_path(directory, name)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        header = _read_header(f, path)
        payload = f.read()
    if generation > 0 and header["generation"] > generation:
        raise CheckpointFenced(
            "fenced: %s was written by generation %d, newer than this worker's %d"
            % (path, header["generation"], generation)
        )
    if len(payload) != header.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CheckpointError(
            "%s is corrupt: %d payload bytes, header says %r (or the checksum differs)"
            % (path, len(payload), header.get("payload_bytes"))
        )
    encoding = header.get("encoding")
    stream = io.BytesIO(payload)
    if deserializer is not None:
        state = deserializer(stream)
    elif encoding == "bytes":
        state = payload
    elif encoding == "pickle":
        state = pickle.load(stream)
    else:
        raise CheckpointError(
            "%s was written with a custom serializer: pass deserializer= to read it" % path
        )
    metadata = header.get("metadata")
    return Checkpoint(
        state=state,
        generation=header["generation"],
        metadata=metadata if isinstance(metadata, dict) else {},
        path=path,
    )
