"""The benchmark's configuration and names (shared by the parent and the ranks)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20
LOADERS = ("pipeload", "pipeload-nobcast", "safetensors", "dcp")
FORMATS = ("pipeload", "dcp", "hf")
HF_LOADERS = ("pipeload", "pipeload-nobcast", "safetensors")
DCP_LOADERS = ("pipeload", "pipeload-nobcast", "dcp", "dcp-install")  # --format dcp: every loader reads DCP's files
# --via dcp.load: DCP's own load, stock and with pipeload.dcp.install(), beside pipeload.load on the same files
VIA_DCP_LOADERS = ("pipeload", "dcp", "dcp-install")
FLOOR = "floor"
MODES = ("warm", "cold1", "cold", "throttled")
# separate nodes emulated: each rank its own copy of every checkpoint and a host identity of its own
SEPARATE = ("cold", "throttled")
TIMING_KEYS = ("plan", "exchange", "groups", "shared", "private", "teardown")
LOADER_LABELS = {
    FLOOR: "floor (raw read, once)",
    "pipeload": "pipeload",
    "pipeload-nobcast": "pipeload broadcast off",
    "dcp": "torch DCP",
    "dcp-install": "dcp.load, pipeload.dcp.install()",
    "safetensors": "plain safetensors reader",
}
DEFAULT_SIZE_MB = 256
# `pipeload bench` without --full: shared storage (the regime pipeload is for) and one host with a hot
# page cache, against DCP and the floor; --full runs every mode and loader
QUICK_MODES = ("warm", "throttled")
QUICK_BASELINE_MODES = ("throttled", "cold")
QUICK_LOADERS = {"pipeload": ("pipeload", "dcp"), "dcp": ("pipeload", "dcp"), "hf": ("pipeload", "safetensors")}


def layout_dims(layout: str, world: int) -> tuple[int, int]:
    """(dp, tp) of a layout name on ``world`` ranks: ``tpN`` (N-way tensor parallel, the rest data
    parallel; ``tp1`` holds every tensor whole on every rank) or ``dpXtpY``."""
    m = re.fullmatch(r"(?:dp(\d+))?tp(\d+)", layout)
    if not m or int(m.group(2)) < 1:
        raise ValueError(f"layout {layout!r}: write tpN or dpXtpY")
    tp = int(m.group(2))
    dp = int(m.group(1)) if m.group(1) else world // tp
    if dp * tp != world:
        raise ValueError(f"layout {layout!r}: dp {dp} x tp {tp} is not the world ({world} ranks)")
    return dp, tp


@dataclass
class BenchConfig:
    world: int = 4
    tp: int = 2
    dp: int = 2
    size_mb: float = DEFAULT_SIZE_MB
    seed: int = 0
    repeats: int = 3
    modes: tuple[str, ...] = QUICK_MODES
    loaders: tuple[str, ...] | None = None  # None: QUICK_LOADERS of the format
    read_mbps: float = 200.0
    dir: str | None = None
    layers: int = 8
    experts: int = 128
    timeout: float = 1800.0
    quiet: bool = False
    # which checkpoint pipeload loads: its own ("pipeload"), the one dcp.save wrote ("dcp"), or an HF
    # layout copy ("hf", compared with a plain per-rank safetensors reader instead of DCP)
    format: str = "pipeload"
    # "dcp.load": compare stock dcp.load with dcp.load under pipeload.dcp.install() (--format dcp)
    via: str = "pipeload"
    # many small tensors: the expert count is chosen so the state dict holds about this many tensors
    # (model + optimizer steps); None: the --experts given
    tensors: int | None = None
    # modes in which a baseline (DCP, the plain reader) runs; None: every mode. The quick default runs it
    # on shared storage only, where the comparison is the point (a warm DCP load takes seconds here)
    baseline_modes: tuple[str, ...] | None = None
    # the layout the checkpoints are saved in (layout_dims; None: the load's, TP x DP): a load into
    # another layout than the save's (resharding), every loader reading the same files
    save_layout: str | None = None
    # filled by the parent before the world starts
    throttle: dict[str, Any] = field(default_factory=dict)

