"""A global sample order that does not depend on the number of workers.

The run consumes one infinite stream of sample positions. Position p lies in
epoch p // N, and maps to index perm(epoch)[p % N] where perm is a seeded
permutation of the N samples. Optimizer step s consumes positions
[s * B, (s + 1) * B) for global batch B, and rank r of a world of W takes the
r-th contiguous slice of B / W of them. The only cursor a checkpoint needs is
the number of positions consumed, so resuming, and resizing, are exact: every
sample of an epoch is seen exactly once whatever the world size history.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class GlobalOrder:
    num_samples: int
    seed: int

    def __post_init__(self):
        if self.num_samples < 1:
            raise ValueError(f"dataset is empty (len {self.num_samples}); train.dataset must return samples")

    def indices(self, start: int, stop: int) -> list[int]:
        """Dataset indices at global positions [start, stop)."""
        out: list[int] = []
        p = start
        while p < stop:
            epoch, offset = divmod(p, self.num_samples)
            take = min(stop - p, self.num_samples - offset)
            out.extend(_permutation(self.num_samples, self.seed, epoch)[offset:offset + take])
            p += take
        return out

    def rank_indices(self, step: int, global_batch_size: int, world_size: int, rank: int) -> list[int]:
        """Indices rank `rank` trains on in step `step` (0-based, the step about to run)."""
        per_rank = global_batch_size // world_size
        start = step * global_batch_size + rank * per_rank
        return self.indices(start, start + per_rank)


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    import torch  # here, not at import: the controller keeps the ledger and imports no torch until then
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def cursor_after(step: int, global_batch_size: int) -> int:
    """Positions consumed after `step` completed steps: what a checkpoint saves."""
    return step * global_batch_size
