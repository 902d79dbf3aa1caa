"""mmkit/envs.py is the one reader of MMKIT_* switches: every switch the package reads is declared
and documented there, and no other module reads one from the environment itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mmkit import envs

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_but_envs_reads_an_mmkit_switch():
    listed = subprocess.run(["git", "ls-files", "mmkit", "models", "processors"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    readers = re.compile(r"(os\.environ(\.get)?|os\.getenv)\s*[\(\[]\s*[\"']MMKIT_")
    offenders = [f for f in listed if f.endswith(".py") and f != "mmkit/envs.py"
                 and readers.search((ROOT / f).read_text())]
    assert offenders == []


def test_every_switch_is_declared_and_documented():
    doc = envs.__doc__
    for name in envs.environment_variables:
        assert name in doc, f"{name} missing from envs.py's table"
        assert name in envs.__annotations__, f"{name} has no static annotation"
    assert set(dir(envs)) == set(envs.environment_variables)


def test_switches_keep_their_historical_reading(monkeypatch):
    monkeypatch.setenv("MMKIT_DECODE_STACK", "no")  # on by default: only "0" turns it off
    assert envs.MMKIT_DECODE_STACK is True
    monkeypatch.setenv("MMKIT_DECODE_STACK", "0")
    assert envs.MMKIT_DECODE_STACK is False
    monkeypatch.setenv("MMKIT_KERNEL_CHECKS", "")  # off by default: any value but "" and "0"
    assert envs.MMKIT_KERNEL_CHECKS is False
    monkeypatch.setenv("MMKIT_KERNEL_CHECKS", "yes")
    assert envs.MMKIT_KERNEL_CHECKS is True
    monkeypatch.delenv("MMKIT_GEMV_MAX_ROWS", raising=False)
    assert envs.MMKIT_GEMV_MAX_ROWS == 16
    monkeypatch.setenv("MMKIT_GEMV_MAX_ROWS", "0")
    assert envs.MMKIT_GEMV_MAX_ROWS == 0
    monkeypatch.setenv("MMKIT_GEMV_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="MMKIT_GEMV_MAX_ROWS: got 'many'; expected an integer"):
        envs.MMKIT_GEMV_MAX_ROWS
