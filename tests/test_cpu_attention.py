"""The compiled CPU decode-attention kernel (rollyard.cpu_attention) against a float64 reference
written row by row, inside the decode engine's forward against torch's path, and its fallbacks:
no compiler, the off switch, the must-have switch."""

import shutil

import pytest
import torch

from rollyard import cpu_attention
from rollyard.models import build_preset, char_tokenizer
from rollyard.rollout.llama_forward import LlamaFast

HAVE_CXX = shutil.which("g++") is not None
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no g++ on this machine: the kernel cannot be built")


def _attention_fp64(q, K, V, lens):
    """Row by row, head by head, in float64: softmax(q . k_w for w < n) weighted sum of v_w."""
    B, H, hd = q.shape
    KVH = K.shape[1]
    G = H // KVH
    out = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        n = K.shape[2] if lens is None else int(lens[b])
        for h in range(H):
            k, v = K[b, h // G, :n].double(), V[b, h // G, :n].double()
            p = torch.softmax(k @ q[b, h].double(), dim=0)
            out[b, h] = p @ v
    return out.reshape(B, H * hd)


def _case(G, hd, B=7, KVH=3, W=37, seed=0):
    """q with a row stride wider than its heads (like the engine's q|k slice), K / V strided views
    of a wider cache, lengths from 1 to W."""
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, KVH * G + KVH, hd, generator=gen) * hd ** -0.25
    q = qk[:, :KVH * G]
    cache = torch.randn(2, B + 2, KVH, W + 11, hd, generator=gen)
    K, V = cache[0, :B, :, :W], cache[1, :B, :, :W]
    lens = torch.tensor([1, W, 2, 17, W - 1, 16, 33][:B], dtype=torch.int64)
    return q, K, V, lens


@needs_cxx
@pytest.mark.parametrize("G,hd", [(1, 16), (2, 24), (2, 32), (3, 40), (4, 8), (7, 64), (8, 128), (5, 32)])
def test_kernel_matches_fp64_attention(G, hd):
    assert cpu_attention.supports(3 * G, 3, hd), cpu_attention._STATE
    q, K, V, lens = _case(G, hd)
    for n in (None, lens):
        got = cpu_attention.attend(q, K, V, n)
        want = _attention_fp64(q, K, V, n)
        err = float((got.double() - want).abs().max())
        assert err < 2e-6, f"G={G} hd={hd} lens={'all' if n is None else 'varied'}: max error {err:.2e}"


@needs_cxx
def test_kernel_threads_split_rows_without_changing_results():
    q, K, V, lens = _case(2, 32, B=7)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.attend(q, K, V, lens)
        torch.set_num_threads(2)
        two = cpu_attention.attend(q, K, V, lens)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_unsupported_shapes_are_refused():
    assert not cpu_attention.supports(6, 4, 32)  # heads not a multiple of K/V heads
    assert not cpu_attention.supports(4, 4, 48)  # no kernel for head_dim 48
    assert not cpu_attention.supports(36, 4, 32)  # G = 9


@needs_cxx
def test_decode_with_kernel_equals_torch_attention():
    """The engine's forward with and without the kernel: uniform-position and per-row-position decode."""
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = LlamaFast(model)
    assert fwd.attn_kernel
    V = model.config.vocab_size
    ids = torch.randint(0, V, (4, 20), generator=torch.Generator().manual_seed(1))
    outs = []
    for on in (True, False):
        fwd.attn_kernel = on
        kv = fwd.new_cache(4, 32)
        fwd.prefill(ids[:, :8], kv, torch.arange(4), torch.tensor([7, 3, 7, 5]))
        got = [fwd.decode(ids[:, t], None, kv, t + 1, same_pos=t) for t in range(8, 12)]
        pos = torch.tensor([12, 13, 14, 15])  # rows at different positions: the per-row lengths path
        got += [fwd.decode(ids[:, t], pos + i, kv, int(pos.max()) + i + 1) for i, t in enumerate(range(12, 16))]
        outs.append(torch.stack(got))
    err = float((outs[0] - outs[1]).abs().max())
    assert err < 1e-4, f"kernel vs torch attention: max |logit diff| {err:.2e}"


def test_without_a_compiler_torch_attention_is_used_and_said_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu_attention, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLYARD_DECODE_KERNEL", "auto")
    assert cpu_attention.kernel() is None and cpu_attention.kernel() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not built" in err[0] and "torch's attention instead" in err[0], err
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    assert not LlamaFast(model).attn_kernel
    monkeypatch.setenv("ROLLYARD_DECODE_KERNEL", "1")
    with pytest.raises(RuntimeError, match="ROLLYARD_DECODE_KERNEL=1 but .* unavailable: .*install a C"):
        cpu_attention.kernel()


def test_off_switch_keeps_torch_attention(monkeypatch):
    monkeypatch.setenv("ROLLYARD_DECODE_KERNEL", "0")
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    assert cpu_attention.kernel() is None and not LlamaFast(model).attn_kernel


@needs_cxx
def test_built_once_into_the_cache_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_attention._compile("g++")
    assert first.parent == tmp_path / "rollyard" / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._compile("g++") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind
