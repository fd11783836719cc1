"""An elastic, checkpointable data order for data-parallel workers whose world size and
batch change between generations.

The order depends only on the number of samples the job has consumed, never on the world
size: the job reads an endless stream made of one seeded permutation of the dataset per
epoch, and the optimizer step that starts at sample ``s`` with a planned batch of ``total``
samples reads stream positions ``[s, s + total)``. Within the step, micro-batch ``j`` of
worker ``r`` reads ``[s + j * per_step + r * per_worker, ... + per_worker)`` with
``per_step = workers * per_worker``. So the only state to checkpoint is ``samples`` (which
progress lines already carry), and after any resize every sample of an epoch is read once:
none repeated, none skipped. A step may straddle two epochs.
"""

import random
from typing import Dict, List

from .contract import Batch

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """The data order of a job over a dataset of ``size`` samples (module docs).

    ``seed`` fixes every epoch's permutation (Python's ``random.Random(seed * 1_000_003 +
    epoch)``), so all ranks of all generations agree without communicating.
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError("the dataset size must be a positive whole number, not %r" % (size,))
        self.size = size
        self.seed = seed
        self._cache: Dict[int, List[int]] = {}

    def permutation(self, epoch: int) -> List[int]:
        """Epoch ``epoch``'s order of the dataset's indices (the last two are cached)."""
        perm = self._cache.get(epoch)
        if perm is None:
            perm = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm

    def positions(self, start: int, count: int) -> List[int]:
        """Dataset indices at stream positions ``[start, start + count)``."""
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0 (got %r, %r)" % (start, count))
        out: List[int] = []
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, self.size)
            take = min(count - done, self.size - offset)
            out.extend(self.permutation(epoch)[offset:offset + take])
            done += take
        return out

    def micro_batch(self, samples: int, batch: Batch, rank: int, micro: int) -> List[int]:
        """Dataset indices of worker ``rank``'s micro-batch ``micro`` (``0 <= micro <
        batch.micro_batches``) in the optimizer step that starts at ``samples``."""
        workers = batch.total // (batch.per_worker * batch.micro_batches)
        if not 0 <= rank < workers:
            raise ValueError("rank %r is not a worker of this batch (%d workers)" % (rank, workers))
        if not 0 <= micro < batch.micro_batches:
            raise ValueError(
                "micro-batch %r is not below the batch's %d micro-batches" % (micro, batch.micro_batches)
            )
        first = samples + micro * batch.per_worker * workers + rank * batch.per_worker
        return self.positions(first, batch.per_worker)

    def epoch(self, samples: int) -> float:
        """Epochs consumed after ``samples`` samples."""
        return samples / self.size
