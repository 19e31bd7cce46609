"""The contract between :class:`~rollyard.rollout.engine.RolloutEngine` and a rollout backend.

The engine owns scheduling (queue, admission, sampling, versions, abort, weight updates: the shared
part is ``engine.EngineBase``); a backend owns where the KV cache lives and how a forward runs. The
engine holds its backend as a ``Backend`` (``RolloutEngine.backend``); ``tests/test_backends.py``
checks every backend class against this protocol, method by method and parameter by parameter.
vLLM is not a backend of this kind: it owns its own scheduler and cache, so ``rollout/vllm.py`` is
an engine over ``EngineBase`` instead. One file per backend:

- ``rollout/native.py``: the fast path, a static slot cache over ``rollyard.model.llama``.
- ``rollout/hf.py``: a model's own Hugging Face forward, batched over one transformers cache, or one
  cache per sequence as the last resort.

A backend never knows the placement, the trainer or the sync mode. Its methods (all called from
the engine's thread, between decode steps):

- ``reserve(active, needs) -> slots``: slots for the longest prefix of ``needs`` (cache positions
  per sample) that fits next to the ``active`` sequences; may re-lay out the cache.
- ``release(slot)``: a finished sequence's slot is free again.
- ``maybe_compact(active)``: optional housekeeping after a decode step.
- ``prefill(prompts, slots) -> [len(prompts), V]``: each prompt's last-position logits, its K/V in its slot.
- ``fork(src, dst, P)``: copy the first ``P`` cached positions of slots ``src`` to ``dst``.
- ``snapshot(slot, P) -> stash`` / ``restore(stash, slots)``: keep a prompt's K/V for samples admitted later.
- ``decode(seqs) -> [len(seqs), V]``: one step; ``seqs[i].tokens[-1]`` is fed at position ``seqs[i].length``.
- ``refresh()``: the model's weights changed in place (re-read packed or cached copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollyard.types import Request


@dataclass(eq=False)
class Seq:
    sid: str
    req: Request
    k: int
    max_new: int
    slot: object = None
    length: int = 0  # tokens whose K/V are in the cache (the last sampled token is not yet)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@runtime_checkable
class Backend(Protocol):
    name: str

    def reserve(self, active: list[Seq], needs: list[int]) -> list: ...
    def release(self, slot) -> None: ...
    def maybe_compact(self, active: list[Seq]) -> None: ...
    def prefill(self, prompts: list[list[int]], slots: list): ...
    def fork(self, src: list, dst: list, P: int) -> None: ...
    def snapshot(self, slot, P: int): ...
    def restore(self, stash, slots: list) -> None: ...
    def decode(self, seqs: list[Seq]): ...
    def refresh(self) -> None: ...


def reject_reason(r: Request, context: int, max_cache_tokens: int, ids: set[str]) -> str | None:
    """Why an engine must refuse request ``r`` at submission (``None``: accept it): one rule for every
    engine (native, HF, vLLM), so a request is refused or admitted the same whatever the backend."""
    P = len(r.prompt_ids)
    need = P + r.max_new_tokens
    if P == 0:
        return "prompt is empty: a request needs at least one prompt token"
    if r.n < 1:
        return f"n must be >= 1 samples per request, got {r.n}"
    if r.max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {r.max_new_tokens}"
    if need > context:
        return (f"prompt ({P} tokens) + max_new_tokens ({r.max_new_tokens}) = {need} exceeds the model "
                f"context of {context}; shorten the prompt or lower max_new_tokens to {context - P}")
    if need > max_cache_tokens:
        return (f"one sample needs {need} KV-cache positions (prompt + max_new_tokens), more than "
                f"max_cache_tokens={max_cache_tokens}; raise rollout.max_cache_tokens or lower max_new_tokens")
    if r.id in ids:
        return f"request id {r.id!r} is already queued or in flight; ids must be unique"
    return None
