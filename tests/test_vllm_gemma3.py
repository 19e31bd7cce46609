"""rollout.backend=vllm on Gemma 3: vLLM's own ``Gemma3ForCausalLM`` (sliding window, QK-norm, GeGLU, norms on
1 + w, scaled embeddings, tied head) behind ``VllmEngine``, against transformers' Gemma 3 forward and rollyard's
trainer at equal weights (fp32, <= 1e-4 nats a token, as ``tests/test_vllm.py`` holds Llama). A real vLLM engine,
skipped when vllm is not installed.

The tiny model is ``tests/gemma3_files.py``'s (window 4, so every sample crosses it) at head_dim 32, the smallest
head size vLLM's CPU attention takes, written as a GGUF and loaded by rollyard as a user's Gemma-3-270M is.
rollyard's parameter names are transformers' and vLLM's Gemma 3 loads transformers' names (its ``hf_to_vllm_mapper``
stacks q/k/v and gate/up), so the sync needs no Gemma-specific mapping; these tests show that it lands.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gemma3_files import WINDOW, gemma_tokenizer, tiny_gemma3, write_gemma3_gguf
from perturb import perturbed

vllm = pytest.importorskip("vllm")

from rollyard.model.loading import load_policy  # noqa: E402
from rollyard.rollout.vllm import VllmEngine  # noqa: E402
from rollyard.sync.check import compare_weights  # noqa: E402
from rollyard.sync.delta import DeltaPublisher  # noqa: E402
from rollyard.sync.full import FullPublisher  # noqa: E402
from rollyard.trainer.trainer import Trainer  # noqa: E402
from rollyard.types import Request  # noqa: E402

GAP = 1e-4  # nats per token, fp32: kernels' rounding (measured 1.4e-6 here); a missed window or stale weight is >= 1e-2
NEW = 12  # new tokens a sample: prompt + completion run well past the window


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = gemma_tokenizer()
    # Gemma-3-270M's 32k context over a cache of 1024 tokens: vLLM refuses a cache shorter than max_model_len, so the
    # engine sizes max_model_len to the cache (rollout/vllm.py)
    path = write_gemma3_gguf(tiny_gemma3(tok, head_dim=32, context=32768), tok,
                             tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("ROLLYARD_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
    model, ltok = load_policy(str(path))
    engine = VllmEngine(copy.deepcopy(model.eval()), eos_token_id=ltok.eos_token_id, temperature=1.0, max_concurrent=8,
                        max_cache_tokens=1024, seed=0)
    yield model, ltok, engine
    engine.close()
    mp.undo()


def transformers_logprobs(model, samples) -> list[torch.Tensor]:
    out = []
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, len(s.prompt_ids) - 1:-1]
        out.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
    return out


def worst(samples, ref: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(s.logprobs) - r).abs().max()) for s, r in zip(samples, ref))


def test_vllm_samples_gemma3_at_transformers_and_the_trainers_logprobs(setup):
    model, tok, engine = setup
    assert type(engine.llm.llm_engine.model_config.hf_config).__name__ == "Gemma3TextConfig"
    compare_weights(FullPublisher(torch.float32).expected(model), engine.model, engine.version)  # every tensor, by name
    out, rejected = engine.generate([Request(f"p{i}", tok(f"{i} + {i} =")["input_ids"], n=4, max_new_tokens=NEW)
                                     for i in range(3)])
    assert not rejected and len(out) == 12
    assert all(len(s.prompt_ids) + len(s.completion_ids) > 2 * WINDOW for s in out)
    assert worst(out, transformers_logprobs(model, out)) < GAP
    trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096)  # rollyard's Gemma 3 train forward
    assert worst(out, [lp.float() for lp in trainer.logprobs(out)]) < GAP
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = 4096  # the same weights, every layer attending to the whole sequence
    assert worst(out, transformers_logprobs(unwindowed, out)) > 1e-2  # the check sees a window vLLM did not apply


def test_full_and_delta_updates_land_in_vllms_gemma3(setup):
    """Every tensor (norms, q/k norms, the tied embedding that is also vLLM's LM head) after each update, read inside
    the vLLM worker, equals the trainer's; samples then follow the new weights."""
    model, tok, engine = setup
    prompt = tok("7 * 8 =")["input_ids"]
    trainer, v = model, engine.version
    for pub in (FullPublisher(torch.float32), DeltaPublisher(torch.float32)):
        for full in (True, False):
            v += 1
            trainer = perturbed(trainer, 0.02, seed=v)
            engine.load_weights(pub.publish(trainer, v, full=full))
            compare_weights(pub.expected(trainer), engine.model, v)
            out, _ = engine.generate([Request(f"s{v}", prompt, n=2, max_new_tokens=NEW)])
            assert {x for s in out for x in s.versions} == {v}
            assert worst(out, transformers_logprobs(trainer, out)) < GAP
    assert worst(out, transformers_logprobs(model, out)) > 1e-2  # the first weights would score them otherwise
