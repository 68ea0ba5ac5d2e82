"""``dcp.save`` of large tensors, stock against under ``pipeload.dcp.install()``, alternating.

    torchrun --nproc-per-node 2 bench/dcp_save_large.py DIR [--saves 12]

An FSDP2 (``fully_shard``) model of two ``Linear`` layers (2048 x 4096 and back) with AdamW's state
after one step, through ``get_state_dict``: 16 MiB shards, ~96 MiB a rank. Each round saves with stock
DCP, then with the switch installed (each into its own directory, over the previous save), barrier to
barrier; rank 0 prints every time and the medians without the first round (which plans).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as fsdp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

import pipeload.dcp as pdcp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--saves", type=int, default=12)
    args = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))
    for m in model:
        fsdp.fully_shard(m, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    times: dict[str, list[float]] = {"stock": [], "engine": []}
    for _ in range(args.saves):
        for kind in times:
            msd, osd = get_state_dict(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "engine":
                with pdcp.installed():
                    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.dir, kind))
            else:
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.dir, kind))
            dist.barrier()
            times[kind].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        for kind, v in times.items():
            print(f"{kind:<7} median {statistics.median(v[1:]):.3f} s  " + " ".join(f"{x:.3f}" for x in v))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
