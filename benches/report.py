"""Presenting a run: the summary table, the targets of the data-plane issue, the JSON file and the
optional PNG chart (matplotlib, the `bench` extra)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benches.matrix import FIGURES, fmt

HOLD_FOR_PER_CONN = 10_000  # the per-connection memory target reads only a run holding this many
TARGET_WORKERS = 2  # the idle memory target is for a ztunnel with this many workers


@dataclass(frozen=True)
class Target:
    """A target of the data-plane issues: `get` reads its value from the run's JSON; `unless` says
    why this run cannot judge it (then n/a, with that reason), or None."""

    label: str
    get: Callable[[dict[str, Any]], float | None]
    at_least: float | None = None
    at_most: float | None = None
    unless: Callable[[dict[str, Any]], str | None] | None = None

    def check(self, data: dict[str, Any]) -> tuple[float | None, bool | None, str]:
        try:
            v = self.get(data)
        except KeyError:
            v = None
        reason = self.unless(data) if self.unless is not None else None
        if v is None:
            return None, None, reason or "not measured in this run"
        if reason:
            return v, None, reason
        if self.at_least is not None:
            return v, v >= self.at_least, ""
        assert self.at_most is not None
        return v, v <= self.at_most, ""


def _vs_stunnel(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda d: d["summary"]["vs_stunnel"]["hbone"][key]


def _largest(data: dict[str, Any], get: Callable[[dict[str, float | None]], float | None]) -> float | None:
    """The largest of `get` over the ztunnel modes (tcp, hbone) of the run."""
    values = [get(data["summary"]["value"][m]) for m in ("tcp", "hbone") if m in data["summary"]["value"]]
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _growth(v: dict[str, float | None]) -> float | None:
    idle, loaded = v.get("rss_idle_mb"), v.get("rss_loaded_mb")
    return loaded - idle if idle is not None and loaded is not None else None


def _paced_unreached(data: dict[str, Any]) -> str | None:
    reached = data["summary"].get("paced_reached", {})
    short = [m for m in ("hbone", "stunnel") if reached.get(m) is False]
    return f"the asked rate was not reached by {' and '.join(short)}" if short else None


def _workers_other(data: dict[str, Any]) -> str | None:
    workers = data.get("workers")
    if workers is not None and workers != TARGET_WORKERS:
        return f"measured with {workers} workers per ztunnel, the target is for {TARGET_WORKERS}"
    return None


def _held_too_few(data: dict[str, Any]) -> str | None:
    held = [m["held"] for m in data.get("memory", {}).get("hbone", [])]
    if not held or min(held) < HOLD_FOR_PER_CONN:
        return (
            f"measured at {min(held) if held else 0:,} held, the target is for {HOLD_FOR_PER_CONN:,} (--hold)"
        )
    return None


TARGETS = (
    Target(
        "paced 1,000 req/s: vCPU of the busier hbone proxy ≤ 1.0x the busier stunnel's",
        _vs_stunnel("paced_vcpu"),
        at_most=1.0,
        unless=_paced_unreached,
    ),
    Target("hbone 1-byte round trips ≥ 1.0x stunnel", _vs_stunnel("rr_per_s"), at_least=1.0),
    Target("hbone throughput, 1 stream ≥ 1.25x stunnel", _vs_stunnel("throughput_1"), at_least=1.25),
    Target("hbone new connections (warm pool) ≥ 3x stunnel", _vs_stunnel("conn_per_s"), at_least=3.0),
    Target(
        f"idle PSS of the largest ztunnel (parent and {TARGET_WORKERS} workers) ≤ 40 MB",
        lambda d: _largest(d, lambda v: v["rss_idle_mb"]),
        at_most=40.0,
        unless=_workers_other,
    ),
    Target(
        "ztunnel PSS after the bench's traffic within 10 MB of idle (MB over idle, larger of tcp, hbone)",
        lambda d: _largest(d, _growth),
        at_most=10.0,
    ),
    Target(
        f"hbone RSS per idle connection ≤ 16 KiB at {HOLD_FOR_PER_CONN:,} held",
        lambda d: d["summary"]["value"]["hbone"]["rss_per_conn_kib"],
        at_most=16.0,
        unless=_held_too_few,
    ),
)


def table(summary: dict[str, Any], modes: list[str]) -> str:
    """Each cell: the median value, and its median ratio to `direct` of the same round."""
    header = ["figure", "unit", *modes]
    rows = [header]
    unreached = [m for m, ok in summary.get("paced_reached", {}).items() if ok is False]
    for f in FIGURES:
        if all(summary["value"][m][f.key] is None for m in modes):
            continue  # not measured in this run (e.g. `--worker-counts ''`)
        row = [f.label, f.unit]
        for m in modes:
            v = summary["value"][m][f.key]
            x = summary["vs_direct"][m][f.key]
            cell = fmt(v)
            if m != "direct" and x is not None:
                cell += f" ({x:.2f}x)"
            if f.key.startswith("paced_") and m in unreached:
                cell = "*" + cell
            row.append(cell)
        rows.append(row)
    if summary.get("vs_stunnel"):
        rows.append(["hbone ÷ stunnel", "", *[""] * len(modes)])
        for f in FIGURES:
            x = summary["vs_stunnel"].get("hbone", {}).get(f.key)
            if x is not None:
                rows.append([f"  {f.label}", "x", *["" if m != "hbone" else f"{x:.2f}x" for m in modes]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if unreached:
        lines.append(
            f"* paced: the asked rate was not reached (errors, or under 99 % of it) by {', '.join(unreached)}: "
            "its CPU and latency are not those of the asked load (the JSON's `paced` has each round)"
        )
    return "\n".join(lines)


def targets_report(data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The targets judged on a run's JSON (`summary`, `memory`, `workers`): text and JSON rows."""
    lines = ["targets:"]
    out = []
    for t in TARGETS:
        v, ok, note = t.check(data)
        status = "n/a" if ok is None else ("met" if ok else "NOT met")
        lines.append(f"  {status:<8} {t.label}: {fmt(v)}" + (f" ({note})" if note else ""))
        out.append({"target": t.label, "value": v, "met": ok, "note": note})
    return "\n".join(lines), out


def write_json(out_dir: Path, data: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"bench-{stamp}.json"
    text = json.dumps(data, indent=2, sort_keys=False)
    path.write_text(text)
    (out_dir / "latest.json").write_text(text)
    return path


def plot(out_dir: Path, summary: dict[str, Any], modes: list[str]) -> Path | None:
    """A PNG with the rate figures as ratios to direct, and the per-mode costs. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rates = [f for f in FIGURES if f.higher_is_better]
    costs = [f for f in FIGURES if not f.higher_is_better]
    fig, axes = plt.subplots(1, 1 + len(costs), figsize=(4 + 2.6 * len(costs) + 4, 4.5))
    ax = axes[0]
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ys = [summary["vs_direct"][m][f.key] or 0 for f in rates]
        ax.bar([j + i * width for j in range(len(rates))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rates))])
    ax.set_xticklabels([f.key.replace("_per_s", "/s") for f in rates], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ratio to direct (same round)")
    ax.set_yscale("log")
    ax.set_title("rates vs direct (higher is better)", fontsize=9)
    ax.legend(fontsize=8)
    for ax, f in zip(axes[1:], costs, strict=True):
        ys = [summary["value"][m][f.key] or 0 for m in modes]
        ax.bar(modes, ys, color=[f"C{i}" for i in range(len(modes))])
        ax.set_title(f"{f.label} ({f.unit})", fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "latest.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(data: dict[str, Any]) -> str:
    """A run's JSON as the markdown tables of benches/README.md: `python -m benches.report FILE`."""
    summary = data["summary"]
    modes = [m["name"] for m in data["modes"]]
    unreached = [m for m, ok in summary.get("paced_reached", {}).items() if ok is False]
    lines = ["| figure | unit | " + " | ".join(modes) + " |", "|---|---|" + "---:|" * len(modes)]
    for f in FIGURES:
        if all(summary["value"][m][f.key] is None for m in modes):
            continue
        cells = []
        for m in modes:
            v, x = summary["value"][m][f.key], summary["vs_direct"][m][f.key]
            mark = "\\*" if f.key.startswith("paced_") and m in unreached else ""
            cells.append(mark + fmt(v) + (f" ({x:.2f}x)" if x is not None and m != "direct" else ""))
        lines.append(f"| {f.label} | {f.unit} | " + " | ".join(cells) + " |")
    if unreached:
        lines += ["", f"\\* paced: the asked rate was not reached by {', '.join(unreached)}"]
    lines += ["", "| target | hbone | met |", "|---|---:|---|"]
    for t in data.get("targets", []):
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        if t.get("note"):
            met += f" ({t['note']})"
        lines.append(f"| {t['target']} | {fmt(t['value'])} | {met} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
