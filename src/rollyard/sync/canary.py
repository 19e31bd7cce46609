"""The logprob canary: right after each sync, the rollout side scores a fixed probe and the trainer
compares it with its own score of the same probe at the same version.

Samples' logprob gap (trainer vs sampling time) mixes two things in the Ray placements: the
designed staleness (a sample drawn one version ago) and a real mismatch (a copy that stopped taking
weights, a wrong load). The canary separates them: it is read only where the rollout copy holds the
version just published (``canary/logprob_gap``), and the lag is its own metric (``canary/lag``:
versions the copy is behind when it answers). Both sides score with :func:`score`, one plain forward
of their own model, so at equal versions the gap is the copy's dtype rounding only (0 for an fp32
copy), whatever the engine's decode kernels do. It is not the checksum: it runs after every sync
(one forward of ``PROBE_TOKENS`` tokens) and says how far the copy's outputs are off, not only that
its bytes differ. vLLM's copy lives inside vLLM; there the canary reads the engine's ``model``.

The alarm (``telemetry/alarms.py``) takes the first canary of a run (the first sync, checked by the
equality check by default) as the copy's noise floor.
"""

from __future__ import annotations

import torch

from rollyard.types import Sample

PROBE_TOKENS = 32  # prompt + completion tokens of the probe


def probe(vocab_size: int, context: int) -> Sample:
    """A fixed probe: ``PROBE_TOKENS`` (at most ``context``) token ids spread over the vocabulary, half
    prompt, half completion; the same on every side and every run, needs no data."""
    n = max(2, min(PROBE_TOKENS, context))
    ids = [(7 * i + 3) % vocab_size for i in range(n)]
    return Sample(id="canary", request_id="canary", prompt_ids=ids[: n // 2], completion_ids=ids[n // 2:],
                  logprobs=[0.0] * (n - n // 2), versions=[0] * (n - n // 2), finish_reason="length")


def scorable(model) -> bool:
    """``model`` is a module the canary can run (a vLLM engine's weights live inside vLLM: not scored)."""
    return isinstance(model, torch.nn.Module) and callable(getattr(model, "forward", None))


@torch.no_grad()
def score(model, sample: Sample) -> list[float]:
    """Completion-token logprobs of ``sample`` under ``model`` (one forward, fp32 log-softmax)."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids], device=device)
    was_training = model.training
    model.eval()
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    model.train(was_training)
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(sample.prompt_ids) - 1:].cpu().tolist()


def compare(version: int, trainer: list[float], answers: dict[str, tuple[int, list[float]]]) -> dict[str, float]:
    """The step's canary metrics from each receiver's ``(version it held, its score)``: the largest
    absolute logprob gap over receivers at ``version`` (absent when none held it) and the largest lag."""
    gaps = [max(abs(a - b) for a, b in zip(lp, trainer)) for held, lp in answers.values() if held == version]
    out = {"canary/lag": float(max((version - held for held, _ in answers.values()), default=0))}
    if gaps:
        out["canary/logprob_gap"] = max(gaps)
    return out
