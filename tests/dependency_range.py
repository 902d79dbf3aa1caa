"""The supported dependency range, read from pyproject.toml: the floors `.ci/range.sh` installs,
the newest-release requirements, and the family parity tests it runs at both ends.

    python tests/dependency_range.py floor    # torch==2.11.0 ... (one requirement per line)
    python tests/dependency_range.py newest   # pyproject's requirement strings: pip takes the newest
    python tests/dependency_range.py tests    # the parity test paths
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
RANGED = ("torch", "torchvision", "transformers")  # the packages whose range CI tests at both ends
# Every family's parity tests (greedy ids against transformers on checkpoints it builds), and the
# spans-from-the-processor checks.
PARITY_TESTS = ["tests/models/llava", "tests/models/qwen2_vl", "tests/models/qwen3_vl", "tests/models/gemma3",
                "tests/models/idefics3", "tests/models/internvl", "tests/models/mistral3",
                "tests/models/qwen3_5", "tests/models/lfm2_vl", "tests/models/transformers_backend",
                "tests/models/test_second_configs.py", "tests/models/test_tied_embeddings.py",
                "tests/multimodal/test_processor_spans.py"]


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {Requirement(d).name: Requirement(d) for d in deps}
    return {name: reqs[name] for name in RANGED}


def floor(req: Requirement) -> str:
    """The lowest version a requirement admits, from its `>=` bound."""
    lows = [s.version for s in req.specifier if s.operator == ">="]
    if len(lows) != 1:
        raise ValueError(f"pyproject.toml: {req} needs exactly one '>=' bound (the floor CI tests)")
    version = lows[0]
    return version if version.count(".") >= 2 else version + ".0"


def main(what: str) -> None:
    if what == "floor":
        print("\n".join(f"{name}=={floor(req)}" for name, req in requirements().items()))
    elif what == "newest":
        print("\n".join(str(req).replace(" ", "") for req in requirements().values()))
    elif what == "tests":
        print(" ".join(PARITY_TESTS))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} floor|newest|tests")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
