"""Planning time of a first save against saves that reuse its plan, on a real local gloo world.

    python bench/save_reuse.py [--world 4] [--tp 2] [--size 256] [--saves 20] [--dir DIR]

Each rank builds the bench's synthetic state dict (``pipeload bench``'s default layout: a (dp, tp) mesh,
``--size`` MB), then saves it ``--saves`` times into one directory (each save replaces the last). Planning
is ``SaveStats.plan_s``: from the start of ``save()`` to the end of planning, when the first byte is
written. A first save (no kept plan: every save after ``pipeload.clear_plan_cache()``) is timed as many
times as a reused one, and the medians are compared; each figure is the maximum over the ranks of one
save (the save waits for its slowest rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, world: int, tp: int, size_mb: float, saves: int, directory: str) -> dict:
    import pipeload
    from pipeload.tools import synth

    mesh = synth.make_mesh(world, tp, world // tp)
    sd = synth.build_state_dict(mesh, 0, size_mb)
    first, reused = [], []
    for i in range(saves):
        pipeload.clear_plan_cache()
        s = pipeload.save(sd, directory)
        assert not s.plan_reused
        first.append(s.plan_s)
        s = pipeload.save(sd, directory)
        assert s.plan_reused, f"rank {rank}: save {i} did not reuse the plan"
        reused.append(s.plan_s)
    return {"first": first, "reused": reused}


def main(argv=None) -> int:
    from pipeload.tools._world import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--size", type=float, default=256.0, help="state dict MB (the bench's default: 256)")
    p.add_argument("--saves", type=int, default=20, help="first saves and reused saves timed, each")
    p.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipeload-save-reuse-", dir=args.dir) as d:
        res = run_world(_rank, args.world, args.tp, args.size, args.saves, os.path.join(d, "ckpt"),
                        timeout=600 + 20 * args.saves)
    first = [max(r["first"][i] for r in res) for i in range(args.saves)]
    reused = [max(r["reused"][i] for r in res) for i in range(args.saves)]
    out = {"world": args.world, "tp": args.tp, "size_mb": args.size, "saves": args.saves,
           "first_plan_s_median": statistics.median(first), "reused_plan_s_median": statistics.median(reused),
           "ratio": statistics.median(reused) / statistics.median(first)}
    print(json.dumps(out, indent=2) if args.json else
          f"world {args.world} (tp {args.tp}), {args.size:g} MB, {args.saves} saves each: first save plans in "
          f"{out['first_plan_s_median'] * 1e3:.2f} ms (median), a reused plan in "
          f"{out['reused_plan_s_median'] * 1e3:.2f} ms: {100 * out['ratio']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
