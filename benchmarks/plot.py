"""Bar chart of median step time per contender, one panel per model.

Usage::

    python benchmarks/plot.py benchmarks/out/bench.json [more.json ...] \\
        --out benchmarks/results.png

Reads the JSON written by ``bench_fsdp.py``.  Each model gets its own panel
(models differ by orders of magnitude in step time); the ``local`` floor is
drawn as a dashed line and failed contenders are marked instead of drawn.
When a model appears in several files, the last file wins.

``--vs-size`` instead draws one line per contender: median step time against
parameter count, one point per (file, model) -- the files of a size sweep
(``bench_fsdp.py --set d_model=...`` runs), log-log.

``--muon`` reads ``bench_muon.py``'s files (one per world size) and draws, per world size, the
median optimizer step time, the Newton–Schulz work on the busiest rank and the peak memory
per rank (RSS growth over a step, the largest rank's) of each contender.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "local": "#9e9e9e",
    "cfsdp": "#2e7d32",
    "cfsdp_fs": "#66bb6a",
    "fsdp1": "#1565c0",
    "fsdp2": "#6a1b9a",
    "ddp": "#ef6c00",
}


def load_models(paths: list[Path]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Models from all files (later files override earlier ones) and the
    machine block of the last file."""
    models: dict[str, dict[str, Any]] = {}
    machine: dict[str, Any] = {}
    for path in paths:
        report = json.loads(path.read_text())
        models.update(report["models"])
        machine = report["machine"]
    return models, machine


def plot(models: dict[str, dict[str, Any]], machine: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, (model_name, model) in zip(axes[0], models.items()):
        contenders: dict[str, dict[str, Any]] = model["contenders"]
        names = list(contenders)
        for i, name in enumerate(names):
            res = contenders[name]
            if "error" in res:
                ax.text(i, 0, "error", ha="center", va="bottom", rotation=90, color="red")
                continue
            ax.bar(i, res["step_ms"], color=COLORS.get(name, "#607d8b"))
            ax.text(i, res["step_ms"], f"{res['step_ms']:.0f}", ha="center", va="bottom",
                    fontsize=8)
        local = contenders.get("local", {}).get("step_ms")
        if local is not None:
            ax.axhline(local, color="black", linestyle="--", linewidth=1, label="local floor")
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("median step time (ms)")
        n_params = model["config"].get("n_params")
        subtitle = f"{n_params / 1e6:.1f}M params" if n_params else ""
        ax.set_title(f"{model_name} {subtitle}", fontsize=10)
        ax.margins(y=0.12)
    mode = ""
    if machine.get("mixed_precision", "none") != "none":
        mode += f"{machine['mixed_precision']} mixed precision, "
    if machine.get("strategy", "full") == "hybrid":
        shape = machine.get("mesh_shape") or []
        mode += f"HSDP {' x '.join(map(str, shape))} mesh, "
    fig.suptitle(
        f"{mode}world {machine.get('world_size')} x {machine.get('threads_per_rank')} thread, "
        f"{machine.get('backend')}, torch {machine.get('torch')}, "
        f"cfsdp {machine.get('cfsdp')}, {machine.get('date', '')[:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def plot_vs_size(paths: list[Path], out: Path) -> None:
    """Step time against model size, one line per contender (see module doc)."""
    points: dict[str, list[tuple[int, float]]] = {}
    machine: dict[str, Any] = {}
    for path in paths:
        report = json.loads(path.read_text())
        machine = report["machine"]
        for model in report["models"].values():
            n = model["config"]["n_params"]
            for name, res in model["contenders"].items():
                if "error" not in res:
                    points.setdefault(name, []).append((n, res["step_ms"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in points.items():
        pts.sort()
        ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker="o",
                color=COLORS.get(name, "#607d8b"), label=name,
                linestyle="--" if name == "local" else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("median step time (ms)")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(
        f"world {machine.get('world_size')} x {machine.get('threads_per_rank')} thread, "
        f"torch {machine.get('torch')}, {machine.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


MUON_COLORS = {"allgather": "#1565c0", "torch_dtensor": "#6a1b9a", "single": "#9e9e9e",
               "cfsdp_pg": "#a5d6a7", "cfsdp": "#2e7d32"}


def plot_muon(paths: list[Path], out: Path) -> None:
    """``bench_muon.py``'s step time, Newton–Schulz GFLOP and peak memory per rank, one group per
    world size."""
    reports = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["world"])
    names = list(MUON_COLORS)
    fig, axes = plt.subplots(1, 3, figsize=(13.2, 3.8))
    width = 0.8 / len(names)
    for j, (key, label) in enumerate((("step_ms_median", "median step() time (ms)"),
                                      ("ns_gflop_per_rank", "Newton-Schulz GFLOP, busiest rank"),
                                      ("peak_mib_per_rank", "peak RSS growth MiB, largest rank"))):
        ax = axes[j]
        for i, name in enumerate(names):
            xs, ys = [], []
            for w, rep in enumerate(reports):
                res = rep["results"].get(name, {})
                if key in res:
                    xs.append(w + (i - (len(names) - 1) / 2) * width)
                    ys.append(res[key])
            ax.bar(xs, ys, width, color=MUON_COLORS[name], label=name)
        ax.set_xticks(range(len(reports)), [f"{r['world']} ranks" for r in reports])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    m = reports[-1]["machine"]
    fig.suptitle(f"Muon step on fully_shard shards, 1 thread per rank, torch {m['torch']}, "
                 f"{m['date'][:10]}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help="JSON files from bench_fsdp.py")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results.png"))
    p.add_argument("--vs-size", action="store_true",
                   help="step time against parameter count (a size sweep), one line per contender")
    p.add_argument("--muon", action="store_true",
                   help="bench_muon.py's files: step time, Newton-Schulz work and peak memory "
                   "per world size")
    args = p.parse_args()
    if args.muon:
        plot_muon(args.inputs, args.out)
    elif args.vs_size:
        plot_vs_size(args.inputs, args.out)
    else:
        models, machine = load_models(args.inputs)
        plot(models, machine, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
