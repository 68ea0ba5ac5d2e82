"""An owner's :func:`pipeload.move.plan.answer` with and without the vectorised pass over names with no
choice (``direct``), in one process, on the synthetic MoE model's tensors (:mod:`pipeload.tools.synth`,
the bench's 256 MiB spec: 3,147 tensors) planned by 4 ranks, every owner's answer timed and summed.

    PYTHONPATH=. python bench/answer_direct.py [--repeats 7]

Cases (sources: the saved files as ranks list them; destinations: the state dict's boxes):

- ``same``: TP2 x DP2 into TP2 x DP2, each rank listing its own file: every piece a local copy;
- ``tp2->tp4 one holder``: TP 2 saved by two ranks, into TP 4 on four: every quarter inside one half that
  one rank holds (or its own needer);
- ``tp2xdp2->tp4``: TP2 x DP2 into TP 4, each rank listing its own file: each half held by two ranks (the
  DP replicas), so half of the quarters have a choice of sender;
- ``tp2xdp2->tp4 replicas``: as the tier bench's restore: each file also on the next rank (replicas=2),
  rank 0's root wiped.

The answers of both ways must be the same words (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pipeload.move import plan as P
from pipeload.plan.exchange import hash64
from pipeload.tools import synth

BF16 = 1


def box(name: int, shape, role: str, tp: int, t: int) -> P.Box:
    """Rank ``t`` of ``tp``'s box of a tensor with ``role`` (:func:`pipeload.tools.synth._placements`)."""
    off, ln = [0] * len(shape), list(shape)
    d = {"col": 0, "row": 1}.get(role)
    if d is not None and tp > 1:
        c = shape[d] // tp
        off[d], ln[d] = t * c, c
    return P.Box(name, BF16, tuple(shape), tuple(off), tuple(ln))


def case(kind: str, tensors) -> tuple[list[list[P.Box]], list[list[P.Box]]]:
    names = [(hash64(f.encode()), s, r) for f, s, r in tensors]
    if kind == "same":
        files = {r: [r] for r in range(4)}
        saved_tp, want_tp = 2, 2
    elif kind == "tp2->tp4 one holder":
        files = {0: [0], 1: [1], 2: [], 3: []}
        saved_tp, want_tp = 2, 4
    elif kind == "tp2xdp2->tp4":
        files = {r: [r] for r in range(4)}
        saved_tp, want_tp = 2, 4
    else:
        files = {0: [], 1: [0, 1], 2: [1, 2], 3: [2, 3]}
        saved_tp, want_tp = 2, 4
    srcs = [[box(n, s, role, saved_tp, f % saved_tp) for f in files[r] for n, s, role in names] for r in range(4)]
    dsts = [[box(n, s, role, want_tp, r % want_tp) for n, s, role in names] for r in range(4)]
    return srcs, dsts


def owners(srcs, dsts, nd=2, size=4):
    sent = [P.encode(srcs[r], dsts[r], nd, size) for r in range(size)]
    out = []
    for o in range(size):
        counts = np.array([c[o] for c, _ in sent])
        out.append((counts, np.concatenate([w[int(c[:o].sum()): int(c[: o + 1].sum())] for c, w in sent])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tensors = synth.model_spec(256).tensors()
    print(f"{len(tensors)} tensors, 4 ranks; answer() summed over the 4 owners, median of {args.repeats}")
    for kind in ("same", "tp2->tp4 one holder", "tp2xdp2->tp4", "tp2xdp2->tp4 replicas"):
        inc = owners(*case(kind, tensors))
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for direct in (False, True):
                t0 = time.process_time()
                got = [P.answer(c, w, 2, 4, None, direct=direct) for c, w in inc]
                times[direct].append(time.process_time() - t0)
                if direct:
                    assert all(np.array_equal(a[1], b[1]) for a, b in zip(got, ref))
                else:
                    ref = got
        direct_names = sum(_direct_share(c, w) for c, w in inc)
        print(f"{kind:24s} one by one {statistics.median(times[False]) * 1e3:7.1f} ms   "
              f"direct {statistics.median(times[True]) * 1e3:7.1f} ms   "
              f"names answered at once {direct_names[0]}/{direct_names[1]}")


def _direct_share(counts, words, nd=2):
    rec = words.reshape(-1, P.width(nd))
    ranks = np.repeat(np.arange(len(counts)), counts // P.width(nd))
    order = np.lexsort((rec[:, P.K_INDEX], rec[:, P.K_KIND], rec[:, P.K_NAME]))
    starts = P._bounds(rec[order][1:, P.K_NAME] != rec[order][:-1, P.K_NAME])
    d = P._direct(rec[order], ranks[order], starts, nd, None)
    return np.array([len(starts) - 1 - len(d.slow), len(starts) - 1])


if __name__ == "__main__":
    main()
