"""The notebooks in notebooks/: stored executed (captions, images, the chart), and each still
runs top to bottom on the embedded default model and shows what is stored.

After a change that changes what a notebook shows: python notebooks/make_notebooks.py
"""

import base64
import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REGENERATE = "run `python notebooks/make_notebooks.py` to store current outputs"


def _make_notebooks():
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "notebooks" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _make_notebooks()


def _images(notebook) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]


def test_there_are_three_notebooks_as_the_generator_writes_them():
    assert {p.stem for p in NOTEBOOKS} == set(make.NOTEBOOKS) >= {"captioning", "vqa", "batch_evaluation"}
    for path in NOTEBOOKS:
        stored = nbformat.read(path, as_version=4)
        generated = make.NOTEBOOKS[path.stem]
        assert [(c.cell_type, c.source) for c in stored.cells] == [(c.cell_type, c.source) for c in generated.cells], \
            f"{path.name} differs from notebooks/make_notebooks.py; {REGENERATE}"


def test_stored_notebooks_show_their_images_and_chart_and_stay_small():
    counts = {}
    for path in NOTEBOOKS:
        stored = nbformat.read(path, as_version=4)
        code = [c for c in stored.cells if c.cell_type == "code"]
        assert sum(bool(c.outputs) for c in code) >= 2, f"{path.name} is stored without outputs; {REGENERATE}"
        images = _images(stored)
        counts[path.stem] = len(images)
        assert all(len(png) < 12_000 for png in images), [len(png) for png in images]
        assert path.stat().st_size < 40_000, path
    assert counts == {"captioning": 2, "vqa": 1, "batch_evaluation": 1}  # scene, strip; red circle; chart


def test_ipywidgets_comes_with_the_extras_that_run_notebooks():
    # Without it tqdm prints "TqdmWarning: IProgress not found" in a notebook as mmkit loads.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("notebooks", "test"):
        assert any(dep.split(">")[0].split("=")[0].strip() == "ipywidgets" for dep in extras[extra]), extra


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_its_stored_outputs_are_current(path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    stored = nbformat.read(path, as_version=4)
    fresh = make.execute(stored)
    streams = "".join(o.get("text", "") for c in fresh.cells for o in c.get("outputs", []))
    assert "TqdmWarning" not in streams and "IProgress not found" not in streams, streams
    assert "Traceback" not in streams
    assert make.normalized_outputs(fresh) == make.normalized_outputs(stored), f"{path.name}: {REGENERATE}"
    assert len(_images(fresh)) == len(_images(stored))

