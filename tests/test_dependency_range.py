"""pyproject's ranges for torch, torchvision and transformers: what they admit, and that CI
tests both ends (`.ci/range.sh` runs the family parity tests at the floors and at the newest
releases; the floors are what the lent GPU machines carry: torch 2.11, transformers 5.17)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from dependency_range import PARITY_TESTS, ROOT, floor, requirements


@pytest.mark.parametrize("name, admitted, refused", [
    ("transformers", ["5.17.0", "5.24.0", "5.25.0", "5.99.0"], ["5.16.1", "4.57.6", "6.0.0"]),
    ("torch", ["2.11.0", "2.14.1", "2.15.0"], ["2.10.0"]),
    ("torchvision", ["0.26.0", "0.29.2"], ["0.25.0"]),
])
def test_ranges_admit_the_releases_users_have(name, admitted, refused):
    spec = requirements()[name].specifier
    for v in admitted:
        assert spec.contains(v), f"{name} {v} should be admitted by {spec}"
    for v in refused:
        assert not spec.contains(v), f"{name} {v} should be refused by {spec}"


def test_installed_versions_are_in_range():
    for name, req in requirements().items():
        assert req.specifier.contains(Version(version(name)).base_version, prereleases=True), (name, version(name))


def test_floor_and_newest_requirements_for_ci():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "dependency_range.py"), "floor"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch==2.11.0", "torchvision==0.26.0", "transformers==5.17.0"]
    assert floor(requirements()["transformers"]) == "5.17.0"
    for path in PARITY_TESTS:
        assert (ROOT / path).exists(), path
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".ci/range.sh" in ci
    assert "dependency_range.py tests" in (ROOT / ".ci" / "range.sh").read_text()


def test_readme_states_the_supported_range():
    readme = (ROOT / "README.md").read_text()
    reqs = requirements()
    assert f"transformers {floor(reqs['transformers'])}" in readme and f"torch {floor(reqs['torch'])}" in readme
