"""trainer.optimizer_state=bf16: AdamW's update with bf16 moments, stochastically rounded (trainer/adamw_bf16.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollyard.cli import main
from rollyard.model import kernels
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.trainer.adamw_bf16 import AdamWBf16, step_seed, torch_update


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Both implementations: the CPU kernel, and the torch ops a GPU (or the kernels off) uses."""
    if request.param == "kernel":
        assert kernels.kernel() is not None
    else:
        monkeypatch.setattr(kernels, "adamw_bf16_state", lambda *a, **k: False)
    return request.param


def _update(p, g, m, v, step, **kw):
    args = dict(lr=kw.get("lr", 0.0), beta1=0.9, beta2=kw.get("beta2", 0.999), eps=1e-8, weight_decay=0.0,
                bc1=1.0, bc2=1.0, seed=step_seed(step, 0, 0))
    if not kernels.adamw_bf16_state(p, g, m, v, **args):
        torch_update(p, g, m, v, **args)


def test_second_moment_moves_where_round_to_nearest_would_freeze_it(path):
    """v = 1, g^2 = 4, beta2 = 0.999: each step adds 0.003, under bf16's spacing at 1 (2^-7); rounded to
    nearest v would stay 1.0 forever. Stochastic rounding tracks the exact recurrence's 1.2856 after 100 steps."""
    n = 50_000
    p, g = torch.zeros(n), torch.full((n,), 2.0)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    for t in range(1, 101):
        _update(p, g, m, v, t)
    exact = 4 - 3 * 0.999 ** 100  # v_t = 4 + (1 - 4) beta2^t
    assert abs(v.float().mean().item() - exact) < 2e-3, (v.float().mean().item(), exact)
    assert v.float().std().item() > 0  # rounded per element, not one value for all
    assert torch.nn.functional.cosine_similarity(m.float(), torch.full((n,), 2 * (1 - 0.9 ** 100)), dim=0) > 0.999


def test_tracks_fp32_adamw_on_a_model(path):
    """Same model, data and hyper-parameters: 30 steps with bf16 moments land where fp32 AdamW lands (the
    difference is bf16 rounding of the moments, orders below the distance travelled)."""
    torch.manual_seed(0)
    model = build_preset("tiny", char_tokenizer(), seed=0, max_position_embeddings=32)
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, model.config.vocab_size, (4, 16))
    opts = [AdamWBf16(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01),
            torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)]
    for _ in range(30):
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            m(input_ids=x, labels=x).loss.backward()
            opt.step()
    moved = sum((p.detach() - start[n]).norm() ** 2 for n, p in ref.named_parameters()) ** 0.5
    apart = sum((a.detach() - b.detach()).norm() ** 2 for a, b in zip(model.parameters(), ref.parameters())) ** 0.5
    assert apart < 0.05 * moved, (apart.item(), moved.item())
    assert all(st[k].dtype == torch.bfloat16 for st in opts[0].state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_resume_from_a_state_dict_is_bit_exact():
    """torch's load_state_dict casts the moments to fp32; the next step casts them back (bf16-exact), and the
    seeds come from the step count: a run resumed from a checkpoint equals the uninterrupted one."""
    torch.manual_seed(1)
    w0 = torch.randn(3000)
    grads = [torch.randn(3000) for _ in range(6)]

    def run(stop: int | None):
        w = torch.nn.Parameter(w0.clone())
        opt = AdamWBf16([w], lr=1e-2)
        for i, g in enumerate(grads):
            if i == stop:
                saved, wsaved = copy.deepcopy(opt.state_dict()), w.detach().clone()
                w = torch.nn.Parameter(wsaved)
                opt = AdamWBf16([w], lr=1e-2)
                opt.load_state_dict(saved)
                assert opt.state[w]["exp_avg"].dtype == torch.float32  # torch's cast on load
            w.grad = g.clone()
            opt.step()
        return w.detach()

    assert torch.equal(run(None), run(3))


def test_fsdp_with_bf16_moments_is_one_line_exit_2(tmp_path, capsys):
    assert main(["train", "trainer.optimizer_state=bf16", "trainer.sharding=fsdp", "trainer.dp=2",
                 f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trainer.optimizer_state=bf16" in err and "set trainer.optimizer_state=fp32" in err


def test_an_update_bumps_the_version_counters_of_what_it_wrote(path):
    """Both paths mark the weight and the moments modified, as an in-place torch op does: autograd then refuses a
    backward through a graph that saved the old weight instead of using the new one silently."""
    p = torch.randn(64, requires_grad=True)
    with torch.no_grad():
        m, v = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
        before = [t._version for t in (p, m, v)]
        _update(p, torch.randn(64), m, v, 1, lr=1e-2)
    assert all(t._version > b for t, b in zip((p, m, v), before)), [t._version for t in (p, m, v)]
    y = (p * p).sum()  # saves p for its backward
    with torch.no_grad():
        _update(p, torch.randn(64), m, v, 2, lr=1e-2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
