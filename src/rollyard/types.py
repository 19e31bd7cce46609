"""The shared vocabulary of a step: requests, samples, weight updates.

Every role speaks these types and nothing else, so a placement can move a role to another
process (Ray) without changing what crosses the edge. Plain dataclasses of Python lists and
tensors: they pickle, they have an obvious byte size (``payload_bytes``), and tests can build
them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
SyncMode = Literal["inprocess", "full", "delta", "lora"]


@dataclass
class Request:
    """One prompt to sample ``n`` completions for (one GRPO group).

    ``id`` is unique within a run (the dataset's prompt id, plus a round suffix if a prompt is
    re-issued); each of the ``n`` samples gets the id ``f"{id}#{k}"``. ``meta`` travels unchanged
    to the samples (task fields the verifier needs: the answer, the task name).
    """

    id: str
    prompt_ids: list[int]
    n: int = 1
    max_new_tokens: int = 64
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One completion with everything the trainer needs to correct for how it was sampled.

    ``logprobs[i]`` is the sampling-time log-probability of ``completion_ids[i]`` under
    ``log_softmax(logits / T)`` (T the sampling temperature, 1 when greedy; before any top-p
    truncation) at weight version ``versions[i]``; the trainer recomputes the same quantity, so the
    two are comparable token by token. A partial rollout spanning a weight update carries more
    than one version.
    """

    id: str
    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    meta: dict[str, Any] = field(default_factory=dict)
    # Filled in by later roles.
    reward: float | None = 0.0  # None: no reward hook scored it (left out of the loss)
    reward_flag: str | None = None  # "timeout" | "error: ..." when the verifier failed
    ref_logprobs: list[float] | None = None
    teacher_logprobs: list[float] | None = None  # the teacher's, same support (algo.objective=distill)
    # algo.objective=gkd: per completion token, the teacher's top-k token ids and their log-probs (algo/gkd.py)
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    advantage: float = 0.0
    reward_parts: list[float | None] = field(default_factory=list)  # per reward hook, before weighting
    reward_extras: dict[str, float] = field(default_factory=dict)  # "<hook>/<key>": a verl dict result's extras
    # Multi-turn (env/loop.py): 1 where completion_ids[i] is the model's, 0 for a tool/environment token
    # (in the context, out of the loss; its logprob is a 0.0 placeholder). None: every token is the model's.
    completion_mask: list[int] | None = None

    @property
    def loss_mask(self) -> list[int]:
        """Per completion token: 1 trained on (the model sampled it), 0 not (a tool's or environment's)."""
        return [1] * len(self.completion_ids) if self.completion_mask is None else self.completion_mask

    @property
    def version(self) -> int:
        """Oldest weight version any token was sampled under (what staleness is measured by)."""
        return min(self.versions) if self.versions else -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def payload_bytes(self) -> int:
        """Bytes this sample puts on the rollout->trainer ``samples`` edge.

        The runbook's payload model exactly: int32 token id + fp32 logprob per generated token.
        (Prompt ids are counted on the ``prompts`` edge; version stamps are run-length encoded
        in practice and left out so plan and ledger agree.)
        """
        return 8 * len(self.completion_ids)


@dataclass
class WeightUpdate:
    """What the trainer publishes and the rollout side applies, at a version.

    ``mode``:
      - ``inprocess``: colocated; the engine shares the trainer's module, ``tensors`` is empty
        and zero bytes move. The engine must refresh anything it derived from the weights.
      - ``full``: ``tensors`` maps every parameter name to its new value (rollout dtype).
      - ``delta``: ``tensors`` maps ``name -> values`` of the elements whose rollout-dtype bits
        changed since ``base_version``; ``indices[name]`` says which (int32: flat indices,
        uint8: a packed bitmask; see ``sync/delta.py``). Applies only on top of ``base_version``.
      - ``lora``: adapter tensors (``<module>.lora_A``, ``.lora_B``, ``.scaling``), plus every base
        parameter by name when it is a full LoRA sync (start-up, or after a rejected update).
    ``checksum`` is sha256 over the payload (names, dtypes, shapes, raw bytes of tensors and
    indices), stamped by ``sync.wire.pack`` when the update goes on a wire (``None`` in process);
    the receiver recomputes it over what arrived before it touches its weights.
    ``nbytes`` is set by a transport to what it moved (values + indices + framing).
    """

    version: int
    mode: SyncMode
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    indices: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    checksum: str | None = None
    base_version: int | None = None
