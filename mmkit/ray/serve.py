"""`mmkit serve` on Ray Serve: engine replicas behind one OpenAI endpoint.

    from ray import serve
    from mmkit.ray.serve import build_app

    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(build_app("path/to/checkpoint", num_replicas=2), route_prefix="/")

The app serves what `mmkit serve` serves (chat, completions, models, tokenize, health,
metrics, streaming, API key, media rules). An ingress deployment reads each request and
sends it to an engine replica through a DeploymentHandle whose router keeps one image's (or
prompt prefix's) requests on one replica while it is not overloaded (`serve_router`).
Needs the `ray-serve` extra: `pip install -e ".[ray-serve]"` from a clone.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from mmkit.ray.serve_deployments import LLMServer, OpenAIIngress

__all__ = ["build_app", "replica_metrics", "ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT"]

ENGINE_DEPLOYMENT = "LLMServer"
INGRESS_DEPLOYMENT = "OpenAIIngress"
_ROUTER = "mmkit.ray.serve_router.AffinityRouter"


def build_app(model: str | None = None, *, num_replicas: int = 1, autoscaling_config: Mapping[str, Any] | None = None,
              num_gpus_per_replica: float = 0, num_cpus_per_replica: float | None = None,
              served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
              chat_template: str | None = None, allowed_local_media_path: str | os.PathLike | None = None,
              allowed_media_domains: str | Sequence[str] | None = None,
              allowed_origins: str | Sequence[str] | None = None, generation_config: str = "auto",
              enable_ui: bool = True, max_ongoing_requests: int | None = None,
              imbalanced_threshold: int = 8, **engine_args: Any) -> serve.Application:
    """The Serve application: `OpenAIIngress` in front of `num_replicas` `LLMServer` replicas.

    `model`: a checkpoint folder on every node, or a cached model id; None: the embedded model.
    `autoscaling_config`: Serve's (e.g. `{"min_replicas": 1, "max_replicas": 4,
    "target_ongoing_requests": 16}`), instead of a fixed `num_replicas`.
    `num_gpus_per_replica` / `num_cpus_per_replica`: what each engine replica reserves (CPUs
    default to 1); on CPU the replica runs that many torch threads. The ingress reserves none.
    `served_model_name`, `api_key`, `chat_template` (a Jinja template or a file holding one),
    `allowed_local_media_path`, `allowed_media_domains`, `allowed_origins`, `generation_config`,
    `enable_ui`: as `mmkit serve`'s flags of the same names.
    `max_ongoing_requests`: requests one replica holds at once (default `max_num_seqs`);
    `imbalanced_threshold`: how many more queued requests than the least loaded replica the
    preferred replica may have before affinity gives way to the shorter queue.
    Every other keyword is an `EngineArgs` field (dtype, max_model_len, max_num_seqs, ...),
    checked here, before any replica starts.
    """
    from mmkit.config import EngineArgs
    from mmkit.entrypoints.openai.api_server import check_generation_config, read_chat_template, split_flag_values
    from mmkit.entrypoints.openai.media import MediaPolicy

    if model is not None and not isinstance(model, str):
        model = os.fspath(model)
    if autoscaling_config is None:
        _check_int("num_replicas", num_replicas, 1)
    elif num_replicas != 1:
        raise ValueError(f"num_replicas: got {num_replicas!r} with an autoscaling_config; give one of the two")
    elif not isinstance(autoscaling_config, Mapping):
        raise TypeError(f"autoscaling_config: got {type(autoscaling_config).__name__}; expected a dict")
    if isinstance(num_gpus_per_replica, bool) or not isinstance(num_gpus_per_replica, (int, float)) \
            or num_gpus_per_replica < 0:
        raise ValueError(f"num_gpus_per_replica: got {num_gpus_per_replica!r}; expected a number >= 0")
    cpus = 1 if num_cpus_per_replica is None else num_cpus_per_replica
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0:
        raise ValueError(f"num_cpus_per_replica: got {num_cpus_per_replica!r}; expected a number > 0")
    _check_int("imbalanced_threshold", imbalanced_threshold, 0)
    engine = EngineArgs(model=model, **engine_args)  # unknown or invalid arguments fail here, not in a replica
    if max_ongoing_requests is None:
        max_ongoing_requests = engine.max_num_seqs
    _check_int("max_ongoing_requests", max_ongoing_requests, 1)
    if isinstance(allowed_media_domains, str):
        allowed_media_domains = [allowed_media_domains]
    if isinstance(allowed_origins, str):
        allowed_origins = [allowed_origins]
    check_generation_config(generation_config)
    media = MediaPolicy.from_args(os.fspath(allowed_local_media_path) if allowed_local_media_path else None,
                                  list(split_flag_values(allowed_media_domains)))
    server_options = dict(served_model_name=served_model_name, media=media,
                          chat_template=read_chat_template(os.fspath(chat_template) if isinstance(chat_template, Path)
                                                           else chat_template),
                          api_key=api_key, allowed_origins=allowed_origins, generation_config=generation_config)
    scale: dict[str, Any] = ({"num_replicas": num_replicas} if autoscaling_config is None
                             else {"autoscaling_config": dict(autoscaling_config)})
    server = serve.deployment(LLMServer).options(
        name=ENGINE_DEPLOYMENT, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": cpus, "num_gpus": num_gpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class=_ROUTER, request_router_kwargs={"imbalanced_threshold": imbalanced_threshold}),
        health_check_period_s=5, **scale,
    ).bind(model, dict(engine_args), server_options, max(1, int(cpus)), enable_ui)
    # The ingress only forwards bytes: no CPU reserved, so N replicas fit on N cores.
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(server)


def replica_metrics(app_name: str = "default", timeout_s: float = 5.0) -> dict[str, str]:
    """Each live engine replica's `/metrics` text (mmkit's metric names), keyed by Serve's
    replica id: the last field of its actor name `SERVE_REPLICA::<app>#LLMServer#<id>`.

    Asks every replica's actor at once, directly (not through a router, which would pick any
    replica); one that does not answer within `timeout_s` (starting, or just died) is left out.
    """
    prefix = f"SERVE_REPLICA::{app_name}#{ENGINE_DEPLOYMENT}#"
    refs = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == "serve" and actor["name"].startswith(prefix):
            try:
                handle = ray.get_actor(actor["name"], namespace="serve")
            except ValueError:  # gone since it was listed
                continue
            # NOTE: Serve's replica actor hands this call to the deployment's own
            # `record_routing_stats` (LLMServer's returns its metrics text).
            refs[handle.record_routing_stats.remote()] = actor["name"][len(prefix):]
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    out: dict[str, str] = {}
    for ref in ready:
        try:
            out[refs[ref]] = ray.get(ref)["metrics"]
        except Exception:  # noqa: BLE001 - died meanwhile, or not initialized yet
            continue
    for ref in late:
        ray.cancel(ref)
    return dict(sorted(out.items()))


def metric_value(text: str, name: str) -> float:
    """The value of metric `name` (e.g. "mmkit:encoder_cache_misses_total") in a `/metrics` text."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}: not in the metrics text")


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: got {value!r}; expected an integer >= {lo}")
