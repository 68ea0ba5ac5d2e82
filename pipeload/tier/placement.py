"""Where a snapshot's files go: a pure function of the gathered host ids, the same on every rank.

- hosts are the distinct host ids of the group, ordered by their lowest rank: host index ``h(r)``;
- saved rank ``r``'s file is kept on ``h(r)`` (its own host: a restart there reads its own memory) and
  on ``(h(r) + k) mod H`` for ``k = 1 .. replicas - 1`` (the next hosts of the ring: a different host,
  each host receiving from as many hosts as it sends to); with ``H < replicas``, on every host;
- on a receiving host ``g``, the copy of ``r``'s file is written by the member of ``g`` at ``r``'s
  position within its own host, modulo ``g``'s size: the copies' writes spread over ``g``'s ranks;
- copies travel in one global order: sorted by (saved rank, destination host).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, Sequence


class Copy(NamedTuple):
    """Saved rank ``rank``'s file, sent by ``rank`` to ``writer`` (a rank of host ``host``), who writes it."""

    rank: int
    host: int
    writer: int


class Placement(NamedTuple):
    """``hosts[h]``: the ranks of host ``h`` (ascending), hosts ordered by their lowest rank;
    ``host_of[r]``: ``h(r)``; ``copies``: every copy, in the global order; ``held[h]``: the saved ranks
    whose files host ``h`` holds (its own ranks' and the copies it receives), ascending."""

    hosts: list[list[int]]
    host_of: list[int]
    copies: list[Copy]
    held: list[list[int]]


def place(host_ids: Sequence[int], replicas: int) -> Placement:
    """The placement of a snapshot of ``len(host_ids)`` ranks (``host_ids[r]``: rank ``r``'s host id)."""
    index: dict[int, int] = {}
    hosts: list[list[int]] = []
    host_of: list[int] = []
    for r, hid in enumerate(host_ids):
        h = index.setdefault(int(hid), len(hosts))
        if h == len(hosts):
            hosts.append([])
        hosts[h].append(r)
        host_of.append(h)
    n = len(hosts)
    copies: list[Copy] = []
    held: list[set[int]] = [set(members) for members in hosts]
    for r, h in enumerate(host_of):
        pos = bisect.bisect_left(hosts[h], r)  # members are ascending: r's position within its host
        for k in range(1, min(replicas, n)):
            g = (h + k) % n
            copies.append(Copy(r, g, hosts[g][pos % len(hosts[g])]))
            held[g].add(r)
    copies.sort(key=lambda c: (c.rank, c.host))
    return Placement(hosts, host_of, copies, [sorted(s) for s in held])

