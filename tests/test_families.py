"""Model families routed in one place (``model/families.py``): the table from a model to its fast forward, the HF
fallback for the rest, and the contract a family file fills in (``model/fast.py``'s ``FastForward``)."""

import pytest
import torch
import torch.nn.functional as F
from test_engine import V
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from rollyard.model import families, gemma3, llama
from rollyard.model.fast import FastForward, train_attention, train_mlp

DIMS = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _model(cfg):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_every_model_type_has_one_family_and_the_rest_take_the_hf_fallback():
    assert [t for f in families.FAMILIES for t in f.MODEL_TYPES] == list(families.MODEL_TYPES)  # no type twice
    assert families.family_of(_model(LlamaConfig(**DIMS))) is llama.LlamaFast
    assert families.family_of(_model(Qwen2Config(**DIMS))) is llama.LlamaFast
    assert gemma3.Gemma3Fast in families.FAMILIES and families.family_of(object()) is None
    other = _model(Gemma2Config(head_dim=16, **DIMS))
    assert families.family_of(other) is None
    why = families.unsupported_reason(other)
    assert "'gemma2'" in why and "gemma3_text" in why and "llama" in why  # what it is, what is covered
    with pytest.raises(ValueError, match="fast path unsupported: model_type 'gemma2'"):
        families.fast_forward(other)
    with pytest.raises(ValueError, match="model_type 'gemma2'"):
        families.train_hidden(other, torch.zeros(1, 3, dtype=torch.long))
    assert families.train_unsupported_reason(other) == why and not families.train_forward_matches(other)


def test_a_family_refuses_a_variant_it_does_not_implement():
    windowed = _model(MistralConfig(sliding_window=5, **DIMS))
    assert families.family_of(windowed) is llama.LlamaFast
    assert "sliding-window attention" in families.unsupported_reason(windowed)


class PlainLlama(FastForward):
    """A family written against the base alone, as a new family's file would be: its activation, the residual
    wiring after attention, and the training layer."""

    MODEL_TYPES = ("qwen2",)
    unsupported_reason = staticmethod(llama.unsupported_reason)

    def _act(self, gu):
        return F.silu(gu[..., :self.I]) * gu[..., self.I:]

    def block(self, x, o, w):  # the fused weights through the base's matmul (whatever layout refresh chose)
        x = x + self._mm(o, w["wo"], w["bo"])
        h = self._rms(x, *w["post_attention_layernorm"])
        return x + self._mm(self._act(self._mm(h, w["wgu"])), w["wd"])

    @classmethod
    def train_layer(cls, x, layer, cos, sin, mask=None):
        a = layer.self_attn
        x = x + train_attention(cls.train_norm(x, layer.input_layernorm), a, cos, sin, mask, cls.train_qk_norm(a))
        act = lambda gu: F.silu(gu[..., :gu.shape[-1] // 2]) * gu[..., gu.shape[-1] // 2:]  # noqa: E731
        return x + train_mlp(cls.train_norm(x, layer.post_attention_layernorm), layer.mlp, act)


def test_a_family_is_its_hooks_over_the_shared_base():
    """A family class of ~15 lines over ``FastForward`` decodes and trains as transformers' forward does."""
    model = _model(Qwen2Config(**DIMS))
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial q/k biases
            for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias):
                p.normal_(0, 0.5)
    ids = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    fwd = PlainLlama(model)
    kv = fwd.new_cache(3, 16)
    got = [fwd.prefill(ids[:, :5], kv, torch.arange(3), torch.tensor([4, 4, 4]))]
    got += [fwd.decode(ids[:, t], torch.full((3,), t), kv, t + 1) for t in range(5, 12)]
    assert (torch.stack(got, 1) - ref[:, 4:]).abs().max() < 1e-4
    hidden = PlainLlama.train_hidden(model, ids)
    assert (hidden - model.model(input_ids=ids).last_hidden_state).abs().max() < 1e-4


def test_rope_tables_are_the_fp64_cos_and_sin_of_hfs_angles_and_an_unknown_rotary_keeps_hfs_own():
    """The fast path's RoPE tables: cos / sin of HF's fp32 angles taken in fp64 (one rounding each), over a long
    table, with rotate_half's sign folded into sin; Gemma 3's two layer kinds each from its own frequencies. A rotary
    module that is not cos / sin(position x inv_freq) x scaling keeps HF's output as it is."""
    from transformers import Gemma3TextConfig

    from rollyard.model.fast import rope_tables

    like = torch.zeros(1)
    T = 4096
    cases = [(_model(LlamaConfig(**{**DIMS, "max_position_embeddings": T})), None)]
    g3 = _model(Gemma3TextConfig(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                 **{**DIMS, "max_position_embeddings": T}))
    cases += [(g3, "full_attention"), (g3, "sliding_attention")]
    for model, kind in cases:
        rot = model.model.rotary_emb
        prefix = "" if kind is None else f"{kind}_"
        inv, scale = getattr(rot, f"{prefix}inv_freq"), getattr(rot, f"{prefix}attention_scaling")
        cos, sin = rope_tables(model.model, T, like, kind)
        half = inv.numel()
        angles = (torch.arange(T, dtype=torch.float32)[:, None] * inv.float()[None]).double()  # HF's fp32 angles
        want_c, want_s = angles.cos() * scale, angles.sin() * scale
        assert cos.shape == sin.shape == (T, 2 * half) and cos.dtype == torch.float32
        for got, want in ((cos[:, :half], want_c), (cos[:, half:], want_c), (sin[:, :half], -want_s),
                          (sin[:, half:], want_s)):
            assert torch.equal(got, want.float())  # one rounding from fp64: no entry off by more than that
    # the two kinds' frequencies differ (Gemma 3: 10k local, 1M global)
    assert not torch.equal(rope_tables(g3.model, 64, like, "full_attention")[0],
                           rope_tables(g3.model, 64, like, "sliding_attention")[0])
    # a rotary module of another form: its own output, not the recomputed tables
    model = _model(LlamaConfig(**DIMS))
    rot = model.model.rotary_emb
    plain = rot.forward

    def shifted(x, position_ids):
        c, s = plain(x, position_ids)
        return c * 0.5, s * 0.5

    rot.forward = shifted
    cos, sin = rope_tables(model.model, 32, like)
    want_c, want_s = shifted(like, torch.arange(32)[None])
    assert torch.equal(cos, want_c[0]) and torch.equal(sin[:, cos.shape[1] // 2:], want_s[0][:, cos.shape[1] // 2:])
