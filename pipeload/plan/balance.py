"""The one balancing rule pipeload uses on both sides of a checkpoint.

Save decides which holder writes each replicated chunk; load decides which replica reads each shared
shard. Both use :func:`assign`, so for an unchanged layout each rank tends to read on load the very
file it wrote on save (the reads are then contiguous, and readahead works for us).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)


def assign(
    weights: Mapping[K, int], holders: Mapping[K, Sequence[int]], base: Mapping[int, int] | None = None
) -> dict[K, int]:
    """Give each key to one of its holders: heaviest key first, to the holder with the fewest bytes so far.

    Deterministic and independent of the mappings' iteration order: keys are visited by
    (-weight, key), so keys must be totally ordered; ties between holders go to the one listed first
    in ``holders[key]`` (callers list holders in rank order, so a tie goes to the lower rank).
    Every rank that evaluates this on the same data gets the same answer, which is what lets a reader
    broadcast to receivers that never asked who reads. ``base`` is the bytes each rank has to handle
    anyway (what only it holds): save and load pass the same, so their answers coincide.
    """
    load: dict[int, int] = dict(base or {})
    owner: dict[K, int] = {}
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        best = None
        best_load = 0
        for r in holders[key]:
            lr = load.get(r, 0)
            if best is None or lr < best_load:
                best, best_load = r, lr
        if best is None:
            raise ValueError(f"key {key!r} has no holder")
        owner[key] = best
        load[best] = best_load + weights[key]
    return owner
