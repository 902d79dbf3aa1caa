"""`mmkit serve ... --ray-serve`: the same flags, the engine replicas on Ray Serve.

Starts (or joins, with `--ray-address`) Ray, runs `build_app` behind Serve's HTTP proxy at
`--host/--port`, prints the same "ready at" line as `mmkit serve`, and on SIGTERM or SIGINT
takes the app down (and, for a Ray it started, Serve and Ray too), then exits 0.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

from mmkit.entrypoints.openai.preflight import bind_listen_socket

APP_NAME = "default"


def run_ray_serve(args: Any) -> int:
    if args.threads:
        raise ValueError("--threads: with --ray-serve each replica runs --num-cpus-per-replica torch threads; "
                         "pass that instead")
    if isinstance(args.num_replicas, bool) or args.num_replicas < 1:
        raise ValueError(f"--num-replicas: got {args.num_replicas}; expected an integer >= 1")
    # Serve's proxy binds the port itself: checked (and --port 0 resolved) here, before Ray starts.
    sock = bind_listen_socket(args.host, args.port)
    port = sock.getsockname()[1]
    sock.close()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}

    import ray
    from ray import serve

    from mmkit.entrypoints.openai.api_server import engine_kwargs
    from mmkit.ray.cluster import init_ray
    from mmkit.ray.serve import build_app

    local = not (args.ray_address or os.environ.get("RAY_ADDRESS"))
    cpus = args.num_cpus_per_replica or 1
    print(f"mmkit serve: starting {args.num_replicas} replica(s) of {args.model or 'the embedded default model'} "
          f"on Ray Serve ...", flush=True)
    start = time.perf_counter()
    # Logical CPUs: replicas reserve them, the machine's cores are shared (the ingress takes none).
    init_ray(args.ray_address, num_cpus=max(os.cpu_count() or 1, math.ceil(args.num_replicas * cpus)))
    # NOTE: Ray's core worker installs its own SIGTERM handler (it logs and kills the process,
    # leaving Serve and Ray's agents running); ours goes back on top, so a signal stops cleanly.
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    try:
        app = build_app(args.model, num_replicas=args.num_replicas, num_gpus_per_replica=args.num_gpus_per_replica,
                        num_cpus_per_replica=args.num_cpus_per_replica, served_model_name=args.served_model_name,
                        api_key=args.api_key, chat_template=args.chat_template,
                        allowed_local_media_path=args.allowed_local_media_path,
                        allowed_media_domains=args.allowed_media_domains, allowed_origins=args.allowed_origins,
                        generation_config=args.generation_config, enable_ui=args.enable_ui, **engine_kwargs(args))
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        _wait_running(stop)
        if not stop.is_set():
            name = (args.served_model_name or [args.model or "default-model"])[0]
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(f"mmkit serve: model loaded in {time.perf_counter() - start:.1f} s", flush=True)
            print(f"mmkit serve: {name} ready at http://{host}:{port}/v1 ({args.num_replicas} Ray Serve replica(s))",
                  flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        print("mmkit serve: shutting down", flush=True)
        try:
            if local:
                serve.shutdown()
            else:  # a shared cluster: take down this app only
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0


def _wait_running(stop: threading.Event) -> None:
    """Until the app is RUNNING (replicas loaded), or a signal came; a failed deploy raises."""
    from ray import serve

    while not stop.wait(0.5):
        status = serve.status().applications.get(APP_NAME)
        state = str(getattr(status, "status", ""))
        if state.endswith("RUNNING"):
            return
        if state.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            raise RuntimeError(f"--ray-serve: the app failed to start: {status.message}")
