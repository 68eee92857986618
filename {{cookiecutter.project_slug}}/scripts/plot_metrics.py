"""Draw a run's curves from its metrics.jsonl: the losses, and every other validation metric.

    python scripts/plot_metrics.py runs/latest/metrics.jsonl -o runs/latest/metrics.png

Needs matplotlib (pip install matplotlib); training does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("metrics", type=Path, nargs="?", default=Path("runs/latest/metrics.jsonl"),
                        help="a metrics.jsonl or the run folder holding it")
    parser.add_argument("-o", "--output", type=Path,
                        help="PNG to write (default: metrics.png beside the metrics)")
    args = parser.parse_args(argv)
    if args.metrics.is_dir():  # a run's folder, such as runs/latest
        args.metrics = args.metrics / "metrics.jsonl"
    if not args.metrics.is_file():
        parser.error(f"{args.metrics}: no such file; train first, or pass a metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in records if key in r]
        return [s for s, _ in points], [v for _, v in points]

    others = sorted({k for r in records for k in r if k.startswith("val_") and k != "val_loss"})
    fig, axes = plt.subplots(1, 2 if others else 1, figsize=(12 if others else 7, 4),
                             squeeze=False)
    loss_ax = axes[0][0]
    loss_ax.plot(*series("loss"), "-", label="training loss (mean over ranks)")
    loss_ax.plot(*series("val_loss"), "o-", label="validation loss")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="loss")
    loss_ax.legend()
    loss_ax.grid(True, alpha=0.3)
    if others:
        metric_ax = axes[0][1]
        for key in others:
            metric_ax.plot(*series(key), "o-", label=key)
        metric_ax.set(xlabel="optimizer step", ylabel="value", title="validation metrics")
        metric_ax.legend()
        metric_ax.grid(True, alpha=0.3)
    fig.suptitle(str(args.metrics.parent))
    output = args.output or args.metrics.with_name("metrics.png")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    print(output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
