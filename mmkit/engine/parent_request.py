"""ParentRequest: a request with n > 1 samples, fanned out into n child requests (vLLM v1's).

`LLMEngine.add_processed` turns a user request with `n` samples into `n` independent
scheduler requests of one sample each, `"{index}_{request_id}"` (a request with n = 1 keeps
its own id and has no parent). Each child carries its own seed (the derivation of
`LLMEngine._seed`, unchanged, so seeded samples are what they were) and shares the prompt's
KV blocks with its siblings only through the prefix cache. The output processor gathers the
children back into one `RequestOutput` (CompletionOutput index = child index); aborting the
parent aborts every child. This registry is the engine's record of which children of a
parent are still held by the scheduler, so request counts are counts of parents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmkit.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


@dataclass(frozen=True)
class ChildRequest:
    """One sample of a user request, as the scheduler receives it (n = 1)."""

    request_id: str
    index: int  # the CompletionOutput index it fills
    params: SamplingParams
    seed: int  # of its sampling generator


def fan_out(request_id: str, params: SamplingParams, seeds: list[int]) -> list[ChildRequest]:
    """`params.n` child requests (one seed each); n = 1 gives the request itself."""
    if params.n == 1:
        return [ChildRequest(request_id, 0, params, seeds[0])]
    children = []
    for index, seed in enumerate(seeds):
        # NOTE: prompt log-probs are the prompt's, the same for every sample: the first child
        # computes them; the others stay free to take the whole prompt from the prefix cache.
        child_params = params.clone(n=1, prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        children.append(ChildRequest(child_request_id(request_id, index), index, child_params, seed))
    return children


@dataclass(eq=False)
class ParentRequest:
    request_id: str
    child_ids: tuple[str, ...]
    live: set[str] = field(default_factory=set)  # children the scheduler still holds


class ParentRequests:
    """The engine's live n > 1 requests: parent id <-> child ids."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> its parent
        # Children beyond the first of every live parent: scheduler requests minus this is
        # the number of unfinished user requests.
        self.num_extra_children = 0

    def add(self, request_id: str, child_ids: list[str]) -> None:
        if len(child_ids) == 1 and child_ids[0] == request_id:
            return  # n = 1: the request is its own (and only) scheduler request
        parent = self._parents[request_id] = ParentRequest(request_id, tuple(child_ids), set(child_ids))
        for child_id in child_ids:
            self._parent_of[child_id] = parent
        self.num_extra_children += len(child_ids) - 1

    def child_ids(self, request_id: str) -> tuple[str, ...]:
        """The scheduler requests of user request `request_id` (itself when n = 1)."""
        parent = self._parents.get(request_id)
        return parent.child_ids if parent is not None else (request_id,)

    def parent_id(self, child_id: str) -> str:
        parent = self._parent_of.get(child_id)
        return parent.request_id if parent is not None else child_id

    def child_done(self, child_id: str) -> None:
        """The scheduler no longer holds `child_id` (finished, aborted or failed)."""
        parent = self._parent_of.pop(child_id, None)
        if parent is None or child_id not in parent.live:
            return
        parent.live.discard(child_id)
        if parent.live:
            self.num_extra_children -= 1
        else:
            del self._parents[parent.request_id]
            for other in parent.child_ids:
                self._parent_of.pop(other, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._parents

    def __len__(self) -> int:
        return len(self._parents)
