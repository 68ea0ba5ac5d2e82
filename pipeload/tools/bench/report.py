"""The benchmark's report: medians and ratios per (mode, loader), the targets, the headline, the table
and the chart. Pure functions of the result dict (no torch, no I/O but the chart)."""

from __future__ import annotations

import statistics
from typing import Any

from .config import FLOOR, LOADER_LABELS, MiB, SEPARATE, TIMING_KEYS


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None or not b else a / b


def summarize(runs: list[dict[str, Any]], unique: int) -> list[dict[str, Any]]:
    """One row per (mode, loader): medians over the repeats and the ratios the targets are stated in."""
    rows = []
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for mode in modes:
        in_mode = [r for r in runs if r["mode"] == mode]
        loaders = list(dict.fromkeys(r["loader"] for r in in_mode))
        med = {l: _median([r["wall"] for r in in_mode if r["loader"] == l]) for l in loaders}
        for loader in loaders:
            rs = [r for r in in_mode if r["loader"] == loader]
            wall = med[loader]
            row = {
                "mode": mode,
                "loader": loader,
                "runs": len(rs),
                "wall": wall,
                "walls": [r["wall"] for r in rs],
                "vs_floor": wall / med[FLOOR] if med.get(FLOOR) else None,
                "vs_dcp": wall / med["dcp"] if med.get("dcp") else None,
                "vs_plain": wall / med["safetensors"] if med.get("safetensors") else None,
                "read_amp": _median([r["read_bytes"] for r in rs]) / unique,
                "requested_amp": _ratio(_median([r["requested_bytes"] for r in rs]), unique),
                "resident_before": min(r["resident_before"] for r in rs),
                "peak_rss_mib": _median([r["peak_rss_mib"] for r in rs]),
                "peak_rss_delta_mib": _median([r["peak_rss_delta_mib"] for r in rs]),
                "broadcasts": _median([r.get("broadcasts") for r in rs]),
                "timings": {k: _median([r["timings"][k] for r in rs]) for k in TIMING_KEYS}
                if all("timings" in r for r in rs) else None,
                "plan_exchange": _median([r.get("plan_exchange") for r in rs]),
                "disk": _disk(rs),
            }
            rows.append(row)
    return rows


def _disk(rs: list[dict[str, Any]]) -> dict[str, float] | None:
    """Medians of the disk's own timeline of these runs (cold/throttled: ``system.DiskReads``), with the
    time a load went on after the disk's last byte (its drain); None where it was not sampled."""
    spans = [(r["disk"], r["wall"]) for r in rs if r.get("disk")]
    if not spans or len(spans) < len(rs):
        return None
    return {"first_s": _median([d["first_s"] for d, _ in spans]), "last_s": _median([d["last_s"] for d, _ in spans]),
            "after_s": _median([w - d["last_s"] for d, w in spans]), "mib": _median([d["mib"] for d, _ in spans])}


def check_targets(rows: list[dict[str, Any]], dp: int, format: str = "pipeload",
                  default_size: bool = True) -> list[dict[str, Any]]:
    """The ratios the project commits to, evaluated on this run (those whose rows exist).

    ``default_size``: the checkpoint is the default one (size, tensor count), where the fixed cost of
    a load (plan + exchange) has a target; elsewhere it is reported only."""
    get = {(r["mode"], r["loader"]): r for r in rows}
    out = []

    def add(name: str, value: float | None, ok: bool | None, want: str) -> None:
        out.append({"target": name, "value": value, "want": want, "ok": ok})

    t_pl = get.get(("throttled", "pipeload"))
    if format == "dcp":  # pipeload reading the checkpoint dcp.save wrote, against dcp.load on it
        t_dcp = get.get(("throttled", "dcp"))
        if t_pl and t_dcp:
            speed = t_dcp["wall"] / t_pl["wall"]
            add("throttled, DCP checkpoint: dcp.load / pipeload (speed-up)", speed, speed >= 2.0, ">= 2.0")
        if t_pl:
            add("throttled, DCP checkpoint: pipeload read amplification", t_pl["read_amp"],
                t_pl["read_amp"] <= 1.02, "<= 1.02")
        for mode in (*SEPARATE, "warm"):  # --via dcp.load: DCP's load, stock and under pipeload.dcp.install()
            ours, stock, engine = (get.get((mode, x)) for x in ("dcp-install", "dcp", "pipeload"))
            if ours and mode != "warm":
                add(f"{mode}: dcp.load under install() read amplification", ours["read_amp"],
                    ours["read_amp"] <= 1.05, "<= 1.05")
            if ours and engine:
                bound = 1.5 if mode == "warm" else 1.10
                add(f"{mode}: dcp.load under install() / pipeload.load (time)", ours["wall"] / engine["wall"],
                    ours["wall"] / engine["wall"] <= bound, f"<= {bound:.2f}")
            if mode == "warm":
                continue
            if ours and stock:
                add(f"{mode}: stock dcp.load read amplification", stock["read_amp"], None, f"~{dp:.2f}")
                add(f"{mode}: stock dcp.load / under install() (speed-up)", stock["wall"] / ours["wall"], None,
                    "report")
        return out
    if format == "hf":  # pipeload reading the HF layout, against a plain per-rank safetensors reader
        t_st = get.get(("throttled", "safetensors"))
        if t_pl and t_st:
            speed = t_st["wall"] / t_pl["wall"]
            add("throttled, HF layout: plain safetensors / pipeload (speed-up)", speed, speed >= 1.8, ">= 1.8")
        if t_pl:  # whole tensors into TP: Shard(1) boxes come from chunk units, each stored byte read once
            add("throttled, HF layout: pipeload read amplification", t_pl["read_amp"], t_pl["read_amp"] <= 1.05,
                "<= 1.05")
            if t_pl["vs_floor"] is not None:
                add("throttled, HF layout: pipeload / floor (reading the files once)", t_pl["vs_floor"],
                    t_pl["vs_floor"] <= 1.10, "<= 1.10")
        return out

    t_pl, t_dcp = get.get(("throttled", "pipeload")), get.get(("throttled", "dcp"))
    for mode in ("warm", "cold1"):
        pl, st = get.get((mode, "pipeload")), get.get((mode, "safetensors"))
        if pl and st and pl["vs_plain"] is not None:
            add(f"{mode}: pipeload / plain safetensors reader", pl["vs_plain"], pl["vs_plain"] <= 0.8, "<= 0.80")
    for mode in SEPARATE:
        pl = get.get((mode, "pipeload"))
        if pl:
            add(f"{mode}: pipeload read amplification", pl["read_amp"], pl["read_amp"] <= 1.02, "1.00 (<= 1.02)")
    if t_pl and t_pl["vs_floor"] is not None:
        add("throttled: pipeload / floor", t_pl["vs_floor"], t_pl["vs_floor"] <= 1.10, "<= 1.10")
    if t_pl and t_dcp:
        speed = t_dcp["wall"] / t_pl["wall"]
        add("throttled: DCP / pipeload (speed-up)", speed, speed >= 1.8, ">= 1.8")
    if t_dcp:
        add(f"throttled: DCP read amplification (dp={dp})", t_dcp["read_amp"], None, f"~{dp:.2f}")
    w_off = get.get(("warm", "pipeload-nobcast"))
    if w_off and w_off["vs_dcp"] is not None:
        add("warm: pipeload broadcast off / DCP", w_off["vs_dcp"], w_off["vs_dcp"] <= 1.10, "<= 1.10")
    w_on = get.get(("warm", "pipeload"))
    if w_on and w_on["vs_dcp"] is not None:
        add("warm: pipeload / DCP", w_on["vs_dcp"], None, "report")
    fixed = [r["plan_exchange"] for r in rows if r["loader"] == "pipeload" and r.get("plan_exchange") is not None]
    if fixed:
        worst = max(fixed)
        add("pipeload plan + exchange (max over ranks, median, worst mode)", worst,
            worst <= 0.15 if default_size else None, "<= 0.15" if default_size else "report (0.15 s at the default size)")
    return out


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(result: dict[str, Any], targets: bool = False) -> str:
    """The table of every (mode, loader), pipeload's phase timings, plan reuse, and (``targets``) the
    pass/fail lines of :func:`check_targets`."""
    rows = result["summary"]
    head = ["loader", "mode", "median s", "x floor", "x DCP", "x plain", "read amp", "requested", "bcasts",
            "plan+exch s", "peak RSS MiB (+load)", "cache before"]
    lines = []
    table = []
    for r in rows:
        table.append([
            LOADER_LABELS.get(r["loader"], r["loader"]),
            r["mode"],
            _fmt(r["wall"], ".2f"),
            _fmt(r["vs_floor"], ".2f"),
            _fmt(r["vs_dcp"], ".2f"),
            _fmt(r.get("vs_plain"), ".2f"),
            _fmt(r["read_amp"], ".2f"),
            _fmt(r["requested_amp"], ".2f"),
            _fmt(r["broadcasts"], ".0f"),
            _fmt(r.get("plan_exchange"), ".3f"),
            f"{r['peak_rss_mib']:.0f} (+{r['peak_rss_delta_mib']:.0f})" if r["loader"] != FLOOR else "-",
            f"{r['resident_before'] * 100:.0f}%",
        ])
    lines += _aligned(head, table, rule=True)
    timed = [r for r in rows if r.get("timings")]
    if timed:
        lines.append("")
        lines.append("pipeload LoadStats timings (median of the per-run max over ranks, seconds):")
        lines += _aligned(["loader", "mode", *TIMING_KEYS, "wall"],
                          [[LOADER_LABELS[r["loader"]], r["mode"], *(_fmt(r["timings"][k], ".3f") for k in TIMING_KEYS),
                            _fmt(r["wall"], ".3f")] for r in timed])
    lines += _disk_lines(rows)
    pr = result.get("plan_reuse")
    if pr and pr.get("first"):
        lines.append("")
        lines.append(f"plan + exchange (warm, max over ranks, median): first load {pr['first']:.4f} s, a second load "
                     f"reusing its plan {pr['reused']:.4f} s ({pr['reused'] / pr['first'] * 100:.1f} %)")
        if pr.get("first_span"):
            lines.append(f"  from the last rank's start to the last rank's end of exchange: first load "
                         f"{pr['first_span']:.4f} s, reused {pr['reused_span']:.4f} s "
                         f"({pr['reused_span'] / pr['first_span'] * 100:.1f} %)")
    if targets and result.get("targets"):
        lines.append("")
        lines.append("targets:")
        for t in result["targets"]:
            mark = {True: "ok  ", False: "MISS", None: "    "}[t["ok"]]
            lines.append(f"  [{mark}] {t['target']}: {_fmt(t['value'], '.2f')} (want {t['want']})")
    return "\n".join(lines)


def _disk_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The disk's timeline per separate-nodes row: where a loader's time over the floor went (before the
    first byte, bytes beyond the floor's, after the last byte)."""
    sampled = [r for r in rows if r.get("disk")]
    if not sampled:
        return []
    head = ["loader", "mode", "first MiB", "last byte", "returned", "after last", "MiB read"]
    cells = [[LOADER_LABELS.get(r["loader"], r["loader"]), r["mode"], _fmt(r["disk"]["first_s"], ".3f"),
              _fmt(r["disk"]["last_s"], ".3f"), _fmt(r["wall"], ".3f"), _fmt(r["disk"]["after_s"], ".3f"),
              _fmt(r["disk"]["mib"], ".1f")] for r in sampled]
    return ["", "the disk's own read counter (whole disk, sampled every 5 ms; median seconds from the load's start):",
            *_aligned(head, cells)]


def _aligned(head: list[str], cells: list[list[str]], rule: bool = False) -> list[str]:
    """A table's lines: the first two columns (loader, mode) left-aligned, the numbers right-aligned;
    ``rule``: a line of dashes under the head."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    row = lambda c: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))
    return [row(head), *(["  ".join("-" * w for w in widths)] if rule else []), *(row(c) for c in cells)]


def describe(result: dict[str, Any]) -> str:
    cfg = result["config"]
    ck = result["checkpoint"]
    th = result["throttle"]
    out = [
        f"world {cfg['world']} = TP{cfg['tp']} x DP{cfg['dp']} (gloo, CPU), {ck['tensors']} tensors, "
        f"{ck['unique_bytes'] / MiB:.1f} MiB unique ({ck['local_bytes'] / MiB:.1f} MiB per rank), "
        f"seed {cfg['seed']}, {cfg['repeats']} repeats, median reported",
        f"checkpoint files: pipeload {ck['file_bytes'].get('pipeload', 0) / MiB:.1f} MiB, "
        f"DCP {ck['file_bytes'].get('dcp', 0) / MiB:.1f} MiB"
        + (f", HF {ck['file_bytes']['hf'] / MiB:.1f} MiB" if "hf" in ck["file_bytes"] else "")
        + f"; pipeload loads the {cfg.get('format', 'pipeload')} checkpoint; saves: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in ck["save_seconds"].items()),
    ]
    if any(m in SEPARATE for m in cfg["modes"]):
        out.append("cold/throttled: separate nodes emulated - each rank reads its own copy of each checkpoint "
                   "(same bytes, separate page cache), dropped from the page cache before every run, and "
                   "tells pipeload it runs on a host of its own (PIPELOAD_HOST_ID=emulated-node-<rank>)")
    if "cold1" in cfg["modes"]:
        out.append("cold1: one host - all ranks read one shared copy, dropped from the page cache before "
                   "every run (PIPELOAD_HOST_ID unset)")
    if "warm" in cfg["modes"]:
        out.append("warm: one host - all ranks read one shared copy, page cache hot (PIPELOAD_HOST_ID unset)")
    if "pipeload" in cfg["loaders"]:
        out.append("pipeload: default policy (broadcast_replicated_tensors='auto': same-host replicas read "
                   "from the page cache under gloo, replicas on other hosts get a broadcast); every timed "
                   "load plans afresh (reuse_plan=False); plan+exch s = LoadStats plan + exchange, max over "
                   "ranks, median")
    if "dcp-install" in cfg["loaders"]:
        out.append("dcp.load, pipeload.dcp.install(): dcp.load(sd, checkpoint_id=...) with DCP's FileSystemReader "
                   "switched to pipeload's (share='auto': a box whose readers span hosts is read by one and sent); "
                   "requested = the bytes its readers asked for")
    if cfg.get("baseline_modes"):
        out.append(f"baselines (DCP, the plain reader) run in {', '.join(m for m in cfg['modes'] if m in cfg['baseline_modes'])} "
                   "only; --full runs every loader in every mode")
    if cfg.get("tensors"):
        out.append(f"--tensors {cfg['tensors']}: {cfg['layers']} layers x {cfg['experts']} experts")
    if "throttled" in cfg["modes"]:
        if th.get("ok"):
            out.append(f"throttled: all ranks together limited to {cfg['read_mbps']:g} MiB/s ({th['mechanism']})")
        else:
            out.append(f"throttled: SKIPPED - {th.get('reason')}")
    busy = max(result["environment"].get("loadavg", [0.0]))
    ncpu = result["environment"].get("cpus") or 1
    if busy > max(ncpu, cfg["world"]) + 0.5:
        out.append(f"WARNING: the machine was busy (1-minute load average up to {busy:.1f} on {ncpu} CPUs, "
                   f"{cfg['world']} of it this benchmark's ranks): timings are noisy")
    stuck = sorted({r["mode"] for r in result["summary"] if r["mode"] != "warm" and r["resident_before"] > 0.05})
    if stuck:
        out.append(f"WARNING: in {', '.join(stuck)} mode the page cache could not be emptied before every run "
                   "(is --dir on tmpfs?): those runs are not cold")
    out.append("read amp = bytes the ranks read from storage (/proc/<pid>/io read_bytes) / unique bytes; "
               "requested = bytes pipeload asked for (LoadStats.bytes_read, all ranks) / unique bytes")
    return "\n".join(out)


def plot(result: dict[str, Any], path: str) -> None:
    """A PNG: median wall per loader and mode (floor dashed), and read amplification."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pipeload[plot]' (or pip install matplotlib)")
    rows = result["summary"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    loaders = list(dict.fromkeys(r["loader"] for r in rows if r["loader"] != FLOOR))
    get = {(r["mode"], r["loader"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(loaders))
    for i, loader in enumerate(loaders):
        xs = [m + (i - (len(loaders) - 1) / 2) * width for m in range(len(modes))]
        walls = [get[(m, loader)]["wall"] if (m, loader) in get else 0 for m in modes]
        amps = [get[(m, loader)]["read_amp"] if (m, loader) in get else 0 for m in modes]
        axes[0].bar(xs, walls, width, label=LOADER_LABELS[loader])
        axes[1].bar(xs, amps, width, label=LOADER_LABELS[loader])
    for m, mode in enumerate(modes):
        f = get.get((mode, FLOOR))
        if f:
            axes[0].hlines(f["wall"], m - 0.45, m + 0.45, colors="black", linestyles="dashed",
                           label="floor" if m == 0 else None)
    cfg = result["config"]
    axes[0].set_title(f"load time, {result['checkpoint']['unique_bytes'] / MiB:.0f} MiB, "
                      f"TP{cfg['tp']}xDP{cfg['dp']}")
    axes[0].set_ylabel("median wall (s)")
    axes[1].set_title("read amplification (storage bytes / unique bytes)")
    for ax in axes:
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(result: dict[str, Any]) -> str:
    """At most five lines, printed first: pipeload against DCP (or the plain reader) and the floor on
    shared storage, the bytes each read from storage, and the one-host time."""
    cfg, ck = result["config"], result["checkpoint"]
    get = {(r["mode"], r["loader"]): r for r in result["summary"]}
    other = "safetensors" if cfg.get("format") == "hf" else "dcp"
    label = LOADER_LABELS[other]
    main = "dcp-install" if cfg.get("via") == "dcp.load" else "pipeload"
    name = "pipeload" if main == "pipeload" else LOADER_LABELS[main]
    lines = [f"pipeload bench: {cfg['world']} ranks (TP{cfg['tp']} x DP{cfg['dp']}, gloo), "
             f"{ck['unique_bytes'] / MiB:.0f} MiB checkpoint of {ck['tensors']} tensors "
             f"({cfg.get('format', 'pipeload')} layout"
             + (f", saved at {cfg['save_layout']}" if cfg.get("save_layout") else "")
             + "), every load checked bit for bit"]
    mode = next((m for m in ("throttled", "cold") if (m, main) in get), None)
    pl, ot = get.get((mode, main)), get.get((mode, other))
    if pl is not None:
        where = (f"shared storage ({cfg['read_mbps']:g} MiB/s for all ranks)" if mode == "throttled"
                 else "separate nodes, cold page cache")
        text = f"{where}: {name} {pl['wall']:.2f} s"
        if pl["vs_floor"] is not None:
            text += f" = {pl['vs_floor']:.2f}x the floor (reading the bytes once)"
        if ot is not None and pl["wall"]:
            text += f", {ot['wall'] / pl['wall']:.1f}x faster than {label} ({ot['wall']:.2f} s)"
        lines.append(text)
        amp = f"bytes read from storage per checkpoint byte: {name} {pl['read_amp']:.2f}"
        lines.append(amp + (f", {label} {ot['read_amp']:.2f}" if ot is not None else ""))
    w_pl, w_ot = get.get(("warm", main)), get.get(("warm", other))
    if w_pl is not None:
        lines.append(f"one host, page cache hot: {name} {w_pl['wall']:.2f} s"
                     + (f", {label} {w_ot['wall']:.2f} s" if w_ot is not None else ""))
    return "\n".join(lines[:5])
