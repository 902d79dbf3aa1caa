"""Plugins: every entry point in the group `mmkit.plugins` is a zero-argument callable,
called once per process before the first engine is built (`LLM`, `mmkit serve`, Ray
replicas: all build their engine through `EngineArgs.create_engine_config`). A plugin
typically registers families with `mmkit.ModelRegistry.register_model`.

`MMKIT_PLUGINS=a,b` loads only the entry points named a and b; unset loads all of them
(vLLM's `VLLM_PLUGINS`). A plugin that fails to load or raises stops the engine from being
built, naming the plugin (a family silently missing would fail later and less clearly).
"""

from __future__ import annotations

import threading

from mmkit import envs

PLUGIN_GROUP = "mmkit.plugins"
_lock = threading.Lock()
_loaded: list[str] | None = None  # names of the plugins called, once loaded


def load_plugins() -> list[str]:
    """Call every selected `mmkit.plugins` entry point (the first call in a process only);
    returns the names of those called, in entry-point order."""
    global _loaded
    with _lock:  # NOTE: held while plugins run, so concurrent first engines wait for them
        if _loaded is not None:
            return list(_loaded)
        from importlib.metadata import entry_points

        selected = envs.MMKIT_PLUGINS
        allowed = None if selected is None else {n.strip() for n in selected.split(",") if n.strip()}
        called = []
        for ep in entry_points(group=PLUGIN_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            try:
                plugin = ep.load()
                plugin()
            except Exception as exc:
                raise RuntimeError(f"mmkit plugin {ep.name!r} ({ep.value}) failed: {exc!r}; "
                                   f"MMKIT_PLUGINS=<names> selects which plugins load") from exc
            called.append(ep.name)
        _loaded = called
        return list(called)
