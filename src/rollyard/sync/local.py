"""Sync within one process (the colocated driver; a template for the remote drivers).

``rollout_copy(model, dtype)``: the rollout side's own copy of the policy (LoRA merged, cast).
``push_pull(publisher, transport, model, engine, version, full)``: publish, send, receive, load;
on a rejected update (``SyncRejected``) one full sync follows. Returns the bytes the transport
reported for everything it sent.
"""

from __future__ import annotations

import copy

import torch

from rollyard.sync.wire import SyncRejected


def rollout_copy(model, dtype: torch.dtype):
    """A plain, frozen copy of ``model`` in ``dtype`` (a PEFT model is merged first)."""
    m = copy.deepcopy(model)
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    return m.to(dtype).eval().requires_grad_(False)


def push_pull(publisher, transport, model, engine, version: int, full: bool = False) -> int:
    nbytes = transport.send(publisher.publish(model, version, full=full))
    try:
        engine.load_weights(transport.recv())
    except SyncRejected:
        nbytes += transport.send(publisher.publish(model, version, full=True))
        engine.load_weights(transport.recv())
    return nbytes
