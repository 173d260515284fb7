"""What every benchmark's plot shares: matplotlib without a screen, and a figure written and closed.

Each benchmark's ``plot(figures)`` draws its figure from ``figures``, the very object it writes as
``benchmarks/results/<name>.json``, and ``save`` writes it, so that ``python -m benchmarks.replot``
can draw them all again from those files; the documentation's pages show the PNGs
(``docs/results`` links to the results).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: monarch's bars are blue in every plot; the reference they are measured against (``ddp``, or
#: Lightning's own strategy of the same kind) is grey beside them.
MONARCH, REFERENCE = "tab:blue", "tab:gray"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, which needs no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colors(labels: list[str]) -> list[str]:
    """Each bar's colour by its label: ``REFERENCE`` for one that does not start with "monarch"."""
    return [MONARCH if label.startswith("monarch") else REFERENCE for label in labels]


def pairs(
    axis: Any,
    measures: list[str],
    bars: tuple[list[float], list[float]],
    notes: list[str],
    monarch: tuple[Any, str] = (MONARCH, "monarch"),
    reference: str = "ddp",
) -> None:
    """One pair of horizontal bars per measure, monarch's above its reference's, with a note at the
    end of each pair; ``monarch`` is its bars' colour (one, or one per bar) and legend label."""
    positions = range(len(measures))
    height = 0.38
    axis.barh([p - height / 2 for p in positions], bars[0], height, color=monarch[0], label=monarch[1])
    axis.barh([p + height / 2 for p in positions], bars[1], height, color=REFERENCE, label=reference)
    for position, note, ends in zip(positions, notes, zip(*bars, strict=True), strict=True):
        axis.annotate(note, (max(ends), position), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    axis.set_yticks(list(positions), measures, fontsize=7)
    axis.invert_yaxis()


def save(figure: Any, path: Path) -> None:
    """Lay ``figure`` out, write it to ``path`` and close it."""
    figure.tight_layout()
    figure.savefig(path)
    pyplot().close(figure)
