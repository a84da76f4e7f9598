r"""Solo runs side by side: held-out accuracy (with the constant-answer baseline), share of groups with
signal and token entropy per round, one line per metrics file (docs/experiments/learning-rate-cpu-easy.md).

    python -m scripts.research.plot_solo docs/data/solo200/{lr1e-5,lr3e-5-kl,lr3e-6,lr1e-6}.metrics.jsonl \
        --out docs/figures/solo200.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from node.lab.stats import moving_average
from node.ops.metrics import read_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files; the label is the file name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=10, help="moving average of signal and entropy")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    baseline = None
    for path in args.metrics:
        rows = read_records(path)
        label = Path(path).name.split(".")[0]
        evals = [(r["round"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        baseline = baseline or next((r["eval_baseline"] for r in rows if "eval_baseline" in r), None)
        if evals:
            axes[0].plot(*zip(*evals), marker=".", label=label)
        rounds = np.array([r["round"] for r in rows])
        for ax, key in ((axes[1], "signal_frac"), (axes[2], "entropy_mean")):
            values = np.array([r.get(key, np.nan) for r in rows], dtype=float)
            ax.plot(rounds, moving_average(values, args.window), label=label)
    if baseline is not None:
        axes[0].axhline(baseline, color="k", linestyle="--", label=f"constant answers ({baseline:.3f})")
    for ax, title in zip(
        axes,
        (
            "held-out accuracy (greedy, 64 tasks)",
            f"groups with signal (MA {args.window})",
            f"token entropy, nats (MA {args.window})",
        ),
    ):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
