"""The allocation figure a job leaves beside its result.json (``allocation.png``) and logs to its
W&B run: how the method spread its budget over layers and KV heads (``KVMethod.allocation()``,
methods/base.py), one heatmap panel per quantity (a codec's rank and bits per key coordinate, its
bpd per head; an eviction's kept fraction), layers down, KV heads across. matplotlib's Agg backend:
no display needed.
"""

from __future__ import annotations

from pathlib import Path

ALLOCATION_FILE = "allocation.png"
#: panel titles and colour-bar labels, in the order the panels are drawn
LABELS = {
    "k_rank": "key rank r",
    "k_bits": "bits per kept key coordinate",
    "k_bpd": "key bits per element",
    "v_bpd": "value bits per element",
    "kept": "kept fraction of the tokens",
}
#: cells up to which each one is annotated with its value
ANNOTATE_CELLS = 96
#: colour ranges fixed by what the quantity is (the others span their values)
RANGES = {"kept": (0.0, 1.0)}


def _grid(values):
    """A [layers, heads] list of floats from a tensor, an array or nested lists."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    import numpy as np

    grid = np.asarray(values, dtype=float)
    return grid.reshape(grid.shape[0], -1) if grid.ndim != 2 else grid


def allocation_png(allocation: dict, out_dir: Path, title: str) -> Path | None:
    """Draw ``allocation`` (name -> [layers, heads]) into ``out_dir/allocation.png``; None when
    there is nothing to draw."""
    panels = [(name, _grid(allocation[name])) for name in LABELS if name in allocation]
    panels += [(name, _grid(v)) for name, v in allocation.items() if name not in LABELS]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = panels[0][1].shape
    width = max(1.2 + len(panels) * (1.6 + 0.45 * heads), 1.0 + 0.075 * len(title))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 1.8 + 0.24 * layers), squeeze=False)
    for ax, (name, grid) in zip(axes[0], panels):
        vmin, vmax = RANGES.get(name, (None, None))
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=vmin, vmax=vmax)
        uniform = grid.size and grid.min() == grid.max()
        ax.set_title(LABELS.get(name, name) + ("\n(the same in every head)" if uniform else ""), fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(0, grid.shape[0], max(1, grid.shape[0] // 16)))
        fig.colorbar(image, ax=ax, fraction=0.08, pad=0.04)
        if grid.size <= ANNOTATE_CELLS or uniform:
            mid = (image.norm.vmax + image.norm.vmin) / 2
            for (i, j), v in _cells(grid):
                ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7,
                        color="black" if v > mid else "white")
    axes[0][0].set_ylabel("layer")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / ALLOCATION_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cells(grid):
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            yield (i, j), float(grid[i, j])
