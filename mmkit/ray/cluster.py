"""Joining or starting the Ray cluster that `mmkit eval --ray` and `mmkit serve --ray-serve` run on."""

from __future__ import annotations

import os

import ray

__all__ = ["init_ray"]


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             object_store_memory: int | None = None) -> None:
    """Connect to the cluster at `address` (or `$RAY_ADDRESS`), else start Ray on this machine.

    A local start reserves `num_cpus` logical CPUs (default: this machine's) and no dashboard.
    Does nothing when Ray is already initialized in this process.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
             object_store_memory=object_store_memory or _default_object_store_memory())


def _default_object_store_memory() -> int:
    """A modest store (Ray spills beyond it to disk): 10% of RAM, between 256 MiB and 2 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(max(total // 10, 256 << 20), 2 << 30))
