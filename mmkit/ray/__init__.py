"""mmkit on Ray: batch inference over Ray Data (`build_processor`, this package's `data` module)
and online serving over Ray Serve (`mmkit.ray.serve.build_app`).

The Ray Data names load on first use, so `mmkit.ray.serve` needs only the `ray-serve` extra and
`mmkit.ray.build_processor` only the `ray` extra. `batch_rows.py` (dataset rows -> requests ->
output columns, the loop each replica runs) imports no Ray, so it runs in a plain process too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_processor", "Processor", "EngineReplica", "init_ray"]
_DATA_NAMES = ("build_processor", "Processor", "EngineReplica", "sampling_params_from")


def __getattr__(name: str) -> Any:
    if name in _DATA_NAMES:
        from mmkit.ray import data

        return getattr(data, name)
    if name == "init_ray":
        from mmkit.ray.cluster import init_ray

        return init_ray
    raise AttributeError(f"module 'mmkit.ray' has no attribute {name!r}")
