"""A wheel ships the embedded default model: installed (no deps) into a scratch folder, away
from the source tree, `LLM()` and `mmkit caption` work from there."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "processor_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # NOTE: built from a copy, so setuptools' build/ and egg-info never land in the checkout.
    src = tmp_path_factory.mktemp("src") / "mmkit-src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", "training", "notebooks"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, cwd=out, timeout=600)
    wheels = list(out.glob("mmkit-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in MODEL_FILES:
        assert f"mmkit/default_model/{f}" in names
    assert "mmkit/models/llava.py" in names and "mmkit/processors/llava.py" in names
    assert any(n.startswith("mmkit/layers/csrc/") for n in names)
    # Every package of the source tree is in the wheel (pyproject lists them one by one).
    for init in sorted((ROOT / "mmkit").rglob("__init__.py")):
        package = init.parent.relative_to(ROOT).as_posix()
        assert f"{package}/__init__.py" in names, f"{package} is missing from [tool.setuptools] packages"
    for folder in ("models", "processors"):  # installed as mmkit.models / mmkit.processors
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            package = "mmkit/" + init.parent.relative_to(ROOT).as_posix()
            assert f"{package}/__init__.py" in names, f"{package} is missing from [tool.setuptools] packages"
    assert not any(n.startswith(("tests/", "training/", "assets/", "models/", "processors/")) for n in names)
    assert wheel.stat().st_size < 24 * 2**20  # the model (17 MB fp32) dominates


def test_installed_wheel_runs_the_default_model(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_WAIT_POLICY": "PASSIVE"}
    code = (
        "import mmkit, sys; from mmkit import LLM, SamplingParams\n"
        f"assert mmkit.__file__.startswith({str(target)!r}), mmkit.__file__\n"
        "out = LLM(seed=0).generate('USER: Hello ASSISTANT:', SamplingParams(temperature=0, max_tokens=4),"
        " use_tqdm=False)\n"
        "print('OK', len(out[0].outputs[0].token_ids))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-2000:]
    image = ROOT / "assets" / "scenes" / "red_circle.png"
    cli = subprocess.run([sys.executable, "-m", "mmkit", "caption", str(image)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "circle" in cli.stdout.lower()
