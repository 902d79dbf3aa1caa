"""The notebook's accuracy chart stays readable: no bar label runs into the title or another label."""

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from mmkit.eval.chart import accuracy_chart  # noqa: E402
from mmkit.eval.evaluation import Summary  # noqa: E402


@pytest.mark.parametrize("accuracies", [[1.0, 1.0, 1.0, 1.0], [1.0, 0.05, 0.0, 0.97],
                                        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
def test_accuracy_chart_labels_do_not_overlap_its_title_or_each_other(accuracies):
    names = ["color", "count", "exists", "left_shape", "right_shape", "relation", "material"]
    summary = Summary(per_type={names[i]: {"n": 4, "accuracy": a} for i, a in enumerate(accuracies)})
    fig = accuracy_chart(summary)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    title = ax.title.get_window_extent(renderer)
    value_labels = [t.get_window_extent(renderer) for t in ax.texts]
    tick_labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    assert len(value_labels) == len(accuracies)
    for box in value_labels + tick_labels:
        assert not box.overlaps(title)
    for labels in (value_labels, tick_labels):
        for i, a in enumerate(labels):
            assert not any(a.overlaps(b) for b in labels[i + 1:])
    # Everything inside the figure.
    figure_box = fig.bbox
    for box in value_labels + tick_labels + [title]:
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 and figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1
