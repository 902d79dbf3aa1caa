"""Joining or starting the Ray cluster that `mmkit eval --ray` and `mmkit serve --ray-serve` run on."""

from __future__ import annotations

import logging
import os
import time

import ray

__all__ = ["RayStartError", "init_ray"]

logger = logging.getLogger(__name__)

# Seconds to wait before each retry of a local start. Ray's own start is flaky on a small busy
# machine (its GCS or raylet misses a startup deadline: 3 of 6 starts on a loaded 2-core host);
# a second try usually succeeds. A connection to a given address is not retried.
RETRY_DELAYS_S = (1.0, 3.0)


class RayStartError(RuntimeError):
    """Ray could not be started or joined; the message is one line: what failed, the log
    folder and what to try next."""


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             object_store_memory: int | None = None) -> None:
    """Connect to the cluster at `address` (or `$RAY_ADDRESS`), else start Ray on this machine.

    A local start reserves `num_cpus` logical CPUs (default: this machine's) and no dashboard,
    and is tried again up to `len(RETRY_DELAYS_S)` times. Any failure is a `RayStartError`.
    Does nothing when Ray is already initialized in this process.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address)
        except Exception as exc:  # noqa: BLE001 - Ray raises many types; each becomes one line
            raise RayStartError(f"could not connect to the Ray cluster at {address}: {_first_line(exc)}; "
                                f"Ray's logs: {ray_log_dir()}; check that the cluster is running and the "
                                "address (--ray-address or $RAY_ADDRESS), or leave both unset to start Ray "
                                "on this machine") from exc
        return
    num_tries = len(RETRY_DELAYS_S) + 1
    for attempt in range(num_tries):
        try:
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     object_store_memory=object_store_memory or _default_object_store_memory())
            return
        except Exception as exc:  # noqa: BLE001 - as above
            _shutdown_quietly()  # what the failed start left running
            if attempt + 1 == num_tries:
                raise RayStartError(f"could not start Ray on this machine ({num_tries} tries): {_first_line(exc)}; "
                                    f"Ray's logs: {ray_log_dir()}; run the command again, or join a running "
                                    "cluster with --ray-address ADDR (start one with `ray start --head`)") from exc
            logger.warning("starting Ray failed (%s); trying again in %.0f s", _first_line(exc), RETRY_DELAYS_S[attempt])
            time.sleep(RETRY_DELAYS_S[attempt])


def ray_log_dir() -> str:
    """Where Ray writes the logs of its latest session on this machine."""
    try:
        from ray._common.utils import get_default_ray_temp_dir

        base = get_default_ray_temp_dir()
    except (ImportError, AttributeError):  # a Ray without that helper: its documented default
        base = os.path.join(os.environ.get("RAY_TMPDIR") or "/tmp", "ray")
    return os.path.join(base, "session_latest", "logs")


def _first_line(exc: BaseException) -> str:
    """The exception's first non-empty message line (Ray's messages run to many lines)."""
    for line in str(exc).splitlines():
        if line.strip():
            return f"{type(exc).__name__}: {line.strip()}"
    return type(exc).__name__


def _shutdown_quietly() -> None:
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - nothing more to clean up
        pass


def _default_object_store_memory() -> int:
    """A modest store (Ray spills beyond it to disk): 10% of RAM, between 256 MiB and 2 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(max(total // 10, 256 << 20), 2 << 30))
