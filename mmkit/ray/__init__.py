"""mmkit on Ray: batch inference over Ray Data (`build_processor`, this package's `data` module)
and online serving over Ray Serve (`mmkit.ray.serve.build_app`).

The Ray Data names load on first use, so `mmkit.ray.serve` needs only the `ray-serve` extra and
`mmkit.ray.build_processor` only the `ray` extra.
"""

from __future__ import annotations

from typing import Any

from mmkit.ray.cluster import init_ray

__all__ = ["build_processor", "Processor", "EngineReplica", "init_ray"]
_DATA_NAMES = ("build_processor", "Processor", "EngineReplica", "sampling_params_from")


def __getattr__(name: str) -> Any:
    if name in _DATA_NAMES:
        from mmkit.ray import data

        return getattr(data, name)
    raise AttributeError(f"module 'mmkit.ray' has no attribute {name!r}")
