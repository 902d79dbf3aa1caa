"""Which engine replica a request goes to: the same first image (or prompt prefix) goes to the
same replica while that replica is not overloaded, so its prefix cache and encoder cache hit.

The ingress (`serve_deployments.OpenAIIngress`) has read the body and passes a `routing_key`
with the call; `AffinityRouter` runs inside every DeploymentHandle that calls the engine
deployment (Ray Serve's `RequestRouter` API, as `ray.serve.llm`'s prefix-aware router does).
The preferred replica comes from rendezvous hashing over the live replicas' ids, so it needs
no shared table, and a replica that dies or is added moves only its own keys.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

#: Characters of the prompt text that make the key when a request has no image.
PREFIX_CHARS = 512


class AffinityRouter(RequestRouter):
    """Ranks the replicas for one request.

    NOTE: no `FIFOMixin`: with it, a replica found for one request goes to the oldest waiting
    request, whatever its key; without it each request gets the replica chosen for it.

    - a `routing_key=`: its preferred replica first, unless its queue is longer than the
      shortest one's by more than `imbalanced_threshold` requests; then two random replicas,
      of which Serve takes the shorter queue (power of two choices). A preferred replica
      whose queue is full (`max_ongoing_requests`) is skipped by Serve for the next rank;
    - no key: two random replicas.
    """

    def initialize_state(self, imbalanced_threshold: int = 8, **kwargs: Any) -> None:
        self.imbalanced_threshold = imbalanced_threshold

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        key = kwargs.get("routing_key")
        if key is None or len(candidate_replicas) == 1:
            return [fallback]
        ranked = sorted(candidate_replicas, key=lambda r: _weight(key, r.replica_id.unique_id), reverse=True)
        preferred = ranked[0]
        cache = self.replica_queue_len_cache
        lens = [q for q in (cache.get(r.replica_id) for r in candidate_replicas) if q is not None]
        mine = cache.get(preferred.replica_id)
        if mine is not None and lens and mine - min(lens) > self.imbalanced_threshold:
            return [fallback]
        return [[preferred], ranked[1:3]]


def _weight(key: str, replica: str) -> int:
    """Rendezvous (highest random weight) hashing: the replica with the largest weight wins."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


def routing_key(path: str, body: bytes) -> str | None:
    """The affinity key of a request body: a digest of its first image (the `image_url` as
    sent: a data URI holds the bytes themselves), else of its prompt's first characters;
    None for bodies with neither (then any replica will do)."""
    if not body or not path.endswith(("/chat/completions", "/completions")):
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    image, text = _first_image_and_text(request)
    if image is not None:
        return "image:" + hashlib.blake2b(image.encode(), digest_size=16).hexdigest()
    if text:
        return "text:" + hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=16).hexdigest()
    return None


def _first_image_and_text(request: dict[str, Any]) -> tuple[str | None, str]:
    prompt = request.get("prompt")
    if prompt is not None:  # completions: a string, token ids, or a list of either
        first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else prompt
        return None, first if isinstance(first, str) else json.dumps(first)
    texts: list[str] = []
    messages = request.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str):
                return url, ""
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
    return None, "\n".join(texts)
