"""The accuracy-per-question-type bar chart of an evaluation summary (matplotlib, imported lazily)."""

from __future__ import annotations

from typing import Any

from mmkit.eval.evaluation import Summary


def accuracy_chart(summary: Summary, *, title: str = "Accuracy per question type", ax: Any = None) -> Any:
    """Draw one bar per question type (accuracy in %), each labelled with its value; return the figure.

    NOTE: a bar's label sits inside the bar's top (above it when the bar is too short to hold
    it), so a 100% bar's label never reaches up into the title.
    """
    import matplotlib.pyplot as plt

    types = list(summary.per_type)
    accuracy = [100 * summary.per_type[t]["accuracy"] for t in types]
    if ax is None:
        # About an inch per bar, so the types' names fit side by side under their bars.
        width = max(6.0, 0.2 + max((len(t) for t in types), default=1) * 0.09 * len(types))
        _, ax = plt.subplots(figsize=(width, 3), layout="constrained")
    bars = ax.bar(types, accuracy, color="tab:blue")
    ax.set_ylim(0, 100)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, pad=10)
    for bar, value in zip(bars, accuracy):
        inside = value >= 15
        ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                    va="top" if inside else "bottom", xytext=(0, -3 if inside else 3), textcoords="offset points",
                    color="white" if inside else "black", fontweight="bold")
    return ax.figure
