"""The logprob canary probes the support the rollout samples from (issue 47): at top_p < 1 / top_k both sides
score the fixed probe on the truncated, renormalised distribution (``algo/support.py``'s rule with the probe's
token kept, as the trainer keeps a sampled one). At equal weights the native fast path and the trainer's forward
agree to the kernels' rounding; a rollout that samples from another support than the trainer's shows as a gap
of the truncated mass's log. vLLM's side: ``tests/test_vllm.py``."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rollyard.algo.support import FULL, Support
from rollyard.config import load_config
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.placement import step as grpo
from rollyard.placement.colocated import LocalRollout
from rollyard.placement.run import start
from rollyard.rollout.engine import RolloutEngine
from rollyard.sync import canary
from rollyard.sync.factory import resolve
from rollyard.telemetry import rundir

TOK = char_tokenizer()
V = len(TOK)
CTX = 96
EQUAL = 1e-6  # nats: the fast path's fp32 kernels against the trainer's HF forward at equal weights (issue 47)
SUPPORTS = [(0.9, 0, 1.0), (1.0, 20, 1.0), (0.9, 20, 0.8)]  # (top_p, top_k, temperature)


def _model(seed: int = 0):
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=CTX).eval()


def naive_logprobs(model, probe, top_p: float, top_k: int, T: float) -> list[float]:
    """The probe's completion logprobs on the support, token by token in Python floats: the k largest logits
    (ties at the k-th stay), then tokens in descending probability until the mass taken reaches top_p, the
    probe's token added; its probability renormalised over that set."""
    ids = torch.tensor([probe.prompt_ids + probe.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(probe.prompt_ids) - 1:-1].double() / T
    out = []
    for row, t in zip(logits.tolist(), probe.completion_ids):
        order = sorted(range(len(row)), key=lambda i: -row[i])
        if top_k:
            order = [i for i in order if row[i] >= row[order[top_k - 1]]]
        z = sum(math.exp(row[i]) for i in order)
        kept, mass = {t}, 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += math.exp(row[i]) / z
        out.append(row[t] - math.log(sum(math.exp(row[i]) for i in kept)))
    return out


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("top_p, top_k, T", SUPPORTS)
def test_the_native_canary_at_equal_weights_reads_rounding_on_the_truncated_support(top_p, top_k, T):
    model = _model()
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=-1, temperature=T, top_p=top_p, top_k=top_k)
    assert engine.own_copy  # the fast path's fused copies answer, not the module
    probe = canary.probe(V, CTX)
    under = Support.of(T, top_p, top_k)
    ours, trainers = canary.answer(engine, probe), canary.score(model, probe, under)
    assert gap(ours, trainers) <= EQUAL, gap(ours, trainers)
    assert gap(trainers, naive_logprobs(model, probe, top_p, top_k, T)) < 1e-5  # the rule, computed another way
    full = canary.score(model, probe)  # the full distribution at T = 1: what the canary scored before
    assert gap(trainers, full) > 1e-2


@pytest.mark.parametrize("top_p, top_k, T", SUPPORTS)
def test_a_rollout_sampling_from_another_support_than_the_trainers_shows_in_the_canary(top_p, top_k, T):
    model = _model()
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=-1, temperature=T, top_p=top_p, top_k=top_k)
    probe = canary.probe(V, CTX)
    ours = canary.answer(engine, probe)
    trainer_full = canary.score(model, probe, Support.of(T, 1.0, 0))  # the trainer at top_p=1, no top-k
    assert gap(ours, trainer_full) > 1e-2, gap(ours, trainer_full)
    metrics = canary.compare(1, trainer_full, {"local": (1, ours)})
    assert metrics["canary/logprob_gap"] > 1e-2 and metrics["canary/lag"] == 0.0


def test_an_hf_backend_engine_scores_its_module_on_its_support():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_layer=2, n_embd=64, n_head=4, n_positions=CTX)).eval()
    engine = RolloutEngine(copy.deepcopy(gpt2), eos_token_id=-1, temperature=0.8, top_p=0.9, top_k=20)
    assert not engine.own_copy  # a model the fast path does not run: the HF backend, the module answers
    probe = canary.probe(V, CTX)
    ours = canary.answer(engine, probe)
    assert gap(ours, canary.score(gpt2, probe, Support(0.8, 0.9, 20))) <= EQUAL
    assert gap(ours, naive_logprobs(gpt2, probe, 0.9, 20, 0.8)) < 1e-5
    assert canary.answer(engine, probe, shared=True) is None  # mode inprocess: it would score the trainer's module


def test_greedy_and_an_untruncated_support_score_the_full_distribution_at_t1():
    assert Support.of(0.0, 0.5, 3) == FULL  # greedy records log_softmax(logits) (trainer_kwargs)
    assert Support.of(0.7, 1.0, 0) == FULL  # nothing truncated: weights and kernels only
    assert Support.of(0.7, 0.9, 0) == Support(0.7, 0.9, 0)


HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sft.auto=false", "progress=false",
       "reward.num_workers=1", HOOK, "steps=3", "log.plots=false", "trainer.lr=5e-3", "sync.check_every=0",
       "sync.mode=full"]


def _canary_gaps(tmp_path, overrides: list[str], engine_support: tuple[float, int] | None = None) -> list[float]:
    cfg = load_config(None, [*RUN, *overrides, f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = LocalRollout(run, r, resolve(cfg, "cpu"), extra)
    if engine_support is not None:  # the engine samples from another support than the trainer's ratio uses
        side.engine.top_p, side.engine.top_k = engine_support
    grpo.train(run, r, side)
    return [row for row in rundir.read_jsonl(Path(run.run_dir) / rundir.METRICS) if "canary/logprob_gap" in row]


def test_a_colocated_run_at_top_p_reads_the_kernels_and_a_mismatched_one_reads_the_truncated_mass(tmp_path):
    rows = _canary_gaps(tmp_path / "ok", ["rollout.top_p=0.9", "rollout.top_k=20"])
    ok = [row["canary/logprob_gap"] for row in rows]
    assert len(ok) == 3 and max(ok) < 1e-5, ok  # trained weights: the kernels' rounding (test_canary's KERNELS)
    assert not any(row["alarm/logprob_canary"] for row in rows)
    rows = _canary_gaps(tmp_path / "off", ["rollout.top_p=1.0"], engine_support=(0.9, 20))
    off = [row["canary/logprob_gap"] for row in rows]
    assert len(off) == 3 and min(off) > 1e-2, off
    # mismatched from the first sync on: the first canary is past an fp32 copy's rounding ceiling, so the alarm
    # fires there and holds (judging later syncs against a first gap that was already wrong would say nothing)
    assert [row["alarm/logprob_canary"] for row in rows] == [1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def vllm_engine():
    pytest.importorskip("vllm")
    from rollyard.model.loading import load_policy
    from rollyard.rollout.vllm import VllmEngine

    model, tok = load_policy("tiny64", max_position_embeddings=48)  # head_dim 64: vLLM's CPU attention takes it
    engine = VllmEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, max_concurrent=4, max_cache_tokens=1024)
    yield model, engine
    engine.close()


VLLM_GAP = 1e-4  # nats: vLLM's fp32 kernels against the trainer's HF forward (tests/test_vllm.py's GAP)


@pytest.mark.slow
@pytest.mark.parametrize("top_p, top_k, T", [*SUPPORTS, (1.0, 0, 1.0)])
def test_vllms_canary_restricts_its_raw_prompt_logprobs_to_the_support(vllm_engine, top_p, top_k, T):
    """vLLM's prompt logprobs are the raw distribution's; enough are asked for (the top k, or the whole vocabulary
    for top-p alone) to restrict them here with the trainer's rule. Equal weights: the kernels' rounding."""
    model, engine = vllm_engine
    engine.temperature, engine.top_p, engine.top_k = T, top_p, top_k  # what VllmEngine(...) sets; one engine
    try:
        probe = canary.probe(model.config.vocab_size, 48)
        ours = canary.answer(engine, probe)
    finally:
        engine.temperature, engine.top_p, engine.top_k = 1.0, 1.0, 0
    trainers = canary.score(model, probe, Support.of(T, top_p, top_k))
    assert gap(ours, trainers) < VLLM_GAP, gap(ours, trainers)
    assert gap(ours, naive_logprobs(model, probe, top_p, top_k, T)) < VLLM_GAP
    if (top_p, top_k) != (1.0, 0):  # the trainer at top_p=1 / no top-k against this rollout: the truncated mass
        assert gap(ours, canary.score(model, probe, Support.of(T, 1.0, 0))) > 1e-2
