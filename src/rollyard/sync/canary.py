"""The logprob canary: right after each sync, the rollout side scores a fixed probe and the trainer
compares it with its own score of the same probe at the same version.

Samples' logprob gap (trainer vs sampling time) mixes two things in the Ray placements: the
designed staleness (a sample drawn one version ago) and a real mismatch (a copy that stopped taking
weights, a wrong load). The canary separates them: it is read only where the rollout copy holds the
version just published (``canary/logprob_gap``), and the lag is its own metric (``canary/lag``:
versions the copy is behind when it answers). It is not the checksum: it runs after every sync (one
forward of ``PROBE_TOKENS`` tokens) and says how far the copy's outputs are off, not only that its
bytes differ.

The trainer scores with :func:`score` in its weights' precision (the placement passes
``model.families.completion_logits``: the trainer's own fast forward where it computes what the module does, else
the module's forward). The rollout side answers with
:func:`answer`, through the weights and kernels it *samples with*, which are not always its module.
Each engine answers through its own ``score`` (the engine contract, ``rollout/engine.py``); the sync layer
never reaches into an engine's internals:

- vLLM (``rollout/vllm.py``): the engine's own forward over the copy inside vLLM (``engine.score``:
  prompt logprobs, which are raw: enough of them are requested to restrict them here), so a reload that
  did not reach vLLM shows. The gap at equal versions is the kernels' rounding (fp32: 4.8e-7 on ``tiny64``
  at init, at top_p=0.9 and top_k=20 too: ``tests/test_canary_support.py``; the samples' gap, the same kernels, stays
  <= 2e-6 over a trained run: ``tests/test_vllm.py``), never exactly 0.
- the native fast path (``rollout/native.py``): its fused weight copies (:func:`score_fast`,
  rebuilt from the module at every load) through its prefill and decode, the path that draws the
  samples; fp32 reads the kernels' rounding (1.9e-6 to 2.9e-6 over a 20-step ``tiny64`` run,
  ``bench/canary.py``), a bf16 copy its rounding. Copies freed for the trainer's step and not rebuilt
  by a load since: the module the engine's next step rebuilds them from.
- an HF backend (a model the fast path does not run): the engine's module, :func:`score`.

Both sides score the probe on the support the rollout samples from (``algo.support.Support``: ``rollout.temperature``,
``rollout.top_p``, ``rollout.top_k``, through ``algo/support.py``'s rule with the probe's token kept, as the trainer
keeps a sampled one): the engine from its own settings (``Support.of_engine``), the trainer from the settings its
ratio is taken with. At equal weights the gap is the kernels' rounding at any top-p / top-k; a rollout that samples
from another support than the trainer's (a worker at top_p=0.9 against a trainer at 1.0) shows as a gap of the
truncated mass's log, as it would bias every ratio.

In mode ``inprocess`` the engine reads the trainer's own module: no version can lag, so a gap is a
kernel mismatch or fused copies the refresh did not rebuild (the fast path; vLLM's copy is
reloaded from the module at every sync, so there the canary means what it means elsewhere). An HF
backend there would score the trainer's module against itself: no canary (``answer`` returns None).

The alarm (``telemetry/alarms.py``) takes the first canary of a run (the first sync, checked by the
equality check by default) as the copy's noise floor.
"""

from __future__ import annotations

import inspect

import torch

from rollyard.types import Sample

PROBE_TOKENS = 32  # prompt + completion tokens of the probe
# Completion tokens scored. The prefill's last position already runs every fused weight; a few decode steps
# add the decode kernels (cache, RoPE, attention) without costing the engine a rollout's worth of steps.
PROBE_COMPLETION = 4


def probe(vocab_size: int, context: int) -> Sample:
    """A fixed probe: ``PROBE_TOKENS`` (at most ``context - 1``: vLLM scores it as a prompt and adds one
    token) token ids spread over the vocabulary, the last ``PROBE_COMPLETION`` of them the completion; the
    same on every side and every run, needs no data."""
    n = max(2, min(PROBE_TOKENS, context - 1))
    ids = [(7 * i + 3) % vocab_size for i in range(n)]
    c = min(PROBE_COMPLETION, n - 1)
    return Sample(id="canary", request_id="canary", prompt_ids=ids[:-c], completion_ids=ids[-c:],
                  logprobs=[0.0] * c, versions=[0] * c, finish_reason="length")


def scorable(model) -> bool:
    """``model`` is a module :func:`score` can run (a vLLM engine's ``model`` is a view of its weights)."""
    return isinstance(model, torch.nn.Module) and callable(getattr(model, "forward", None))


def logprobs(logits: torch.Tensor, targets: torch.Tensor, under=None) -> list[float]:
    """``log q(targets[i])`` for ``logits [C, V]`` in fp32: on the support ``under`` (an ``algo.support.Support``:
    its ``logprobs``, the rule the trainer's ratio uses; this layer does not import algo), or with None the full
    ``log_softmax``. Every side of the canary ends here."""
    if under is not None:
        return under.logprobs(logits, targets).cpu().tolist()
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, targets.reshape(-1, 1).to(lp.device))[:, 0].cpu().tolist()


def keeps_logits(model) -> bool:
    """``model``'s forward computes the head at its last positions only when asked (HF's ``logits_to_keep``)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def score(model, sample: Sample, under=None, forward=None) -> list[float]:
    """Completion-token logprobs of ``sample`` under ``model`` (one forward, over every token but the last, whose
    logits nothing reads) on the support ``under`` (:func:`logprobs`), in the weights' own precision (a caller's
    autocast is off). ``forward(model, ids, C)``: the logits ``[C, V]`` at the last ``C`` positions of ``ids [1, T]``
    (the trainer's side passes ``model.families.completion_logits``: the trainer's own fast forward where it matches
    the module); None: the module's forward, the head at the completion's positions where it takes
    ``logits_to_keep``."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids], device=device)
    C = len(sample.completion_ids)
    was_training = model.training
    model.eval()
    with torch.autocast(device.type, enabled=False):
        if forward is not None:
            logits = forward(model, ids[:, :-1], C)
        else:
            keep = {"logits_to_keep": C} if keeps_logits(model) else {}
            logits = model(input_ids=ids[:, :-1], use_cache=False, **keep).logits[0, -C:]
    model.train(was_training)
    return logprobs(logits, ids[0, -C:], under)


@torch.no_grad()
def score_fast(fwd, sample: Sample, under=None) -> list[float]:
    """Completion-token logprobs of ``sample`` through a fast-path forward (``model.llama.LlamaFast``) on the
    support ``under``, as the engine computes the logprobs of what it samples, in a cache of its own (the engine's is
    untouched), in two passes over the weights: one prefill of the prompt and the completion but its last two tokens,
    whose logits at the prompt's last position score the first token (causal: what a prefill of the prompt alone
    gives); its K/V copied into ``C - 1`` slots (the engine's fork of a prompt); one decode step of those slots, slot
    ``r`` feeding token ``r`` at its own position (the decode kernels' masked path over lengths that differ by slot) to
    score token ``r + 1``. One decode step per token measured ~50 ms a sync on SmolLM2-135M's bf16 copy (2 threads),
    each step a pass over the weights."""
    P, C = len(sample.prompt_ids), sample.completion_ids
    dev, rows = fwd.device, max(1, len(C) - 1)
    seq = sample.prompt_ids + C[:max(0, len(C) - 2)]
    kv = fwd.new_cache(rows, P + len(C) - 1)
    logits = [fwd.prefill(torch.tensor([seq], device=dev), kv, torch.tensor([0], device=dev),
                          torch.tensor([P - 1], device=dev))[0]]
    if len(C) > 1:
        kv[:, :, 1:] = kv[:, :, :1]
        logits += list(fwd.decode(torch.tensor(C[:-1], device=dev), torch.arange(rows, device=dev) + P, kv,
                                  P + len(C) - 1))
    return logprobs(torch.stack(logits), torch.tensor(C, device=dev), under)


def answer(engine, sample: Sample, shared: bool = False) -> list[float] | None:
    """The rollout side's score of ``sample`` through what ``engine`` samples with (module docstring): the
    engine's own ``score`` (``rollout.engine.EngineBase``); ``shared``: the engine reads the trainer's module
    (mode ``inprocess``). None: nothing to compare."""
    return engine.score(sample, copy_only=shared)


def not_measured(engine, shared: bool) -> str | None:
    """Why ``answer`` cannot measure anything for ``engine`` (a start-up line), or None."""
    if shared and not engine.own_copy:
        return ("logprob canary: off (mode inprocess with an HF rollout backend: the engine decodes with the trainer's "
                "own module, so the probe would be scored against itself; the fast path or rollout.backend=vllm keep "
                "a copy the canary can check)")
    return None


def compare(version: int, trainer: list[float], answers: dict[str, tuple[int, list[float]]]) -> dict[str, float]:
    """The step's canary metrics from each receiver's ``(version it held, its score)``: the largest
    absolute logprob gap over receivers at ``version`` (absent when none held it) and the largest lag."""
    gaps = [max(abs(a - b) for a, b in zip(lp, trainer)) for held, lp in answers.values() if held == version]
    out = {"canary/lag": float(max((version - held for held, _ in answers.values()), default=0))}
    if gaps:
        out["canary/logprob_gap"] = max(gaps)
    return out


class Answers:
    """Canaries asked of receivers that answer later (Ray rollout workers, through their queue, so the step is not
    held up): the step's row carries the latest canary every live receiver has answered."""

    def __init__(self):
        self.asked: dict[int, tuple] = {}  # version -> (trainer's probe logprobs, {receiver: answer}) not complete
        self.done: dict[str, float] = {}  # the latest complete canary's metrics, for the next row

    def ask(self, version: int, trainer_lp: list[float]) -> None:
        self.asked[version] = (trainer_lp, {})

    def answer(self, name: str, version: int, held: int, logprobs: list[float] | None, live) -> None:
        """Receiver ``name`` holding ``held`` scored the canary of ``version`` (None: nothing to compare)."""
        if version not in self.asked:
            return
        trainer_lp, answers = self.asked[version]
        answers[name] = (held, logprobs)
        if set(answers) >= set(live):
            scored = {n: a for n, a in answers.items() if a[1] is not None}
            self.done = {**compare(version, trainer_lp, scored), "canary/version": version}
            for v in [v for v in self.asked if v <= version]:  # older ones a replaced receiver never answered
                del self.asked[v]

    def latest(self) -> dict[str, float]:
        """The metrics of the latest canary answered by all since the last call ({} when none)."""
        out, self.done = self.done, {}
        return out
