"""The decode step's packed weights on 2 MiB pages (``model/hugepages.py``): the arena's memory is advised for
transparent huge pages where Linux allows it, a reset lays tensors out again in memory no one holds and never under a
tensor still held, ``ROLLYARD_HUGE_PAGES=0`` is plain ``torch.empty``, and the fast forward's refresh writes its new
weights into the same memory, its logits those of a forward built afresh, until its first release (a colocated
engine's sleep), after which its copies are torch's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rollyard.model import families
from rollyard.model import kernels as cpu_kernels
from rollyard.model.hugepages import HUGE, Arena

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_entry(addr: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the mapping holding ``addr``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and not span.endswith(":"):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                fields = {}
                for f in lines[i + 1:]:
                    if "-" in f.split()[0] and not f.split()[0].endswith(":"):
                        break
                    key, _, value = f.partition(":")
                    fields[key] = value.strip()
                return fields
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and THP as Linux has them")
def test_arena_memory_is_advised_for_huge_pages_where_linux_gives_them(monkeypatch):
    monkeypatch.delenv("ROLLYARD_HUGE_PAGES", raising=False)
    arena = Arena()
    t = arena.empty((3, HUGE // 4), torch.float32)
    t.fill_(1.5)
    assert t.shape == (3, HUGE // 4) and t.dtype == torch.float32 and float(t.sum()) == 1.5 * 3 * HUGE // 4
    assert arena.mapped >= 3 * HUGE
    fields = _smaps_entry(t.data_ptr())
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" in mode:  # Linux without THP: ordinary pages, the same tensor
        assert fields["AnonHugePages"] == "0 kB", fields
    else:  # THP on (madvise or always): the mapping may get them (smaps says so since Linux 5.0)
        assert fields["THPeligible"] == "1", (mode, fields)


def test_a_reset_reuses_memory_no_one_holds_and_never_a_held_tensors(monkeypatch):
    monkeypatch.setenv("ROLLYARD_HUGE_PAGES", "1")
    arena = Arena(chunk=4 * HUGE)
    a = arena.empty((HUGE // 4,), torch.float32)
    where = a.data_ptr()
    b = arena.empty((HUGE // 2,), torch.bfloat16)  # the next bytes of the same chunk, cache-line aligned
    assert b.data_ptr() == where + HUGE and b.data_ptr() % 64 == 0
    del a, b
    arena.reset()
    a = arena.empty((HUGE // 4,), torch.float32)
    assert a.data_ptr() == where and arena.mapped == 4 * HUGE  # laid out again in the same memory
    a.fill_(7.0)
    view = a[10:20]  # a view keeps the chunk in use, as the tensor does
    del a
    arena.reset()
    c = arena.empty((HUGE // 4,), torch.float32)
    c.fill_(-1.0)
    assert c.data_ptr() != where and torch.equal(view, torch.full((10,), 7.0))
    big = arena.empty((3, HUGE), torch.float32)  # past a chunk's size: a chunk of its own, rounded up to 2 MiB
    assert big.numel() == 3 * HUGE and arena.mapped == 4 * HUGE + 3 * HUGE * 4
    assert arena.empty((16,), torch.float32).numel() == 16  # small tensors stay with torch's allocator
    assert arena.mapped == 4 * HUGE + 3 * HUGE * 4


def test_huge_pages_off_is_torchs_allocator(monkeypatch):
    monkeypatch.setenv("ROLLYARD_HUGE_PAGES", "0")
    arena = Arena()
    t = arena.empty((2, HUGE), torch.float32)
    assert t.shape == (2, HUGE) and arena.mapped == 0


def _model():
    """A Llama whose fused matmul weights are 1-4 MB (the arena takes tensors of 1 MB and more)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _logits(fwd, ids: torch.Tensor) -> torch.Tensor:
    kv = fwd.new_cache(1, ids.shape[1])
    return fwd.prefill(ids, kv, torch.tensor([0]), torch.tensor([ids.shape[1] - 1]))


@pytest.mark.skipif(cpu_kernels.kernel() is None or not cpu_kernels.f32_packs(1024, 512),
                    reason="the fp32 matmul kernel (AVX-512 or AVX2 + FMA) packs the weights the arena holds")
def test_a_refresh_writes_the_new_weights_into_the_same_memory(monkeypatch):
    monkeypatch.setenv("ROLLYARD_HUGE_PAGES", "1")
    model = _model()
    fwd = families.fast_forward(model, torch.float32)
    assert cpu_kernels.is_packed_f32(fwd.layers[0]["wgu"]) and fwd._arena.mapped > 0
    where = [w[k].data_ptr() for w in fwd.layers for k in ("wgu", "wd")]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(fwd, ids)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    fwd.refresh()
    assert [w[k].data_ptr() for w in fwd.layers for k in ("wgu", "wd")] == where
    after = _logits(fwd, ids)
    assert not torch.equal(after, before)
    assert torch.equal(after, _logits(families.fast_forward(model, torch.float32), ids))
    held = fwd.layers[0]["wgu"]  # held across a refresh: keeps its weights and its memory
    kept = held.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fwd.refresh()
    assert torch.equal(held, kept) and fwd.layers[0]["wgu"].data_ptr() != held.data_ptr()
    assert torch.equal(_logits(fwd, ids), _logits(families.fast_forward(model, torch.float32), ids))
    fwd.release()  # a colocated engine's sleep: from here its copies are torch's (the heap the trainer freed)
    fwd.refresh()
    assert fwd._arena is None and cpu_kernels.is_packed_f32(fwd.layers[0]["wgu"])
    assert torch.equal(_logits(fwd, ids), _logits(families.fast_forward(model, torch.float32), ids))
