"""Draw the loss curves of a run from its metrics.jsonl (matplotlib is optional: pip install matplotlib).

    python scripts/plot_metrics.py runs/latest/metrics.jsonl -o runs/latest/loss.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, nargs="?", default=Path("runs/latest/metrics.jsonl"))
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: loss.png beside the metrics)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"{args.metrics}: no such file; train first, or pass the path of a metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style, label in (("loss", "-", "training loss (mean over ranks)"), ("val_loss", "o-", "validation loss")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(True, alpha=0.3)
    output = args.output or args.metrics.with_name("loss.png")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    print(output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
