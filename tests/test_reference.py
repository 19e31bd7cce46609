"""reference.placement: inline, fused (LoRA adapter disabled) and pool (Ray actors) give the same KL
term; bad settings end in one line (exit 2)."""

import random

import pytest
import torch

from rollyard.cli import main
from rollyard.config import RunConfig
from rollyard.model.loading import attach_lora, build_preset, char_tokenizer
from rollyard.placement.reference import FusedReference, InlineReference
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "algo.kl_coef=0.5"]


def _samples(seed: int, groups: int = 3, n: int = 2) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(3, 9))]
        for k in range(n):
            c = [rng.randrange(3, 40) for _ in range(rng.randint(2, 8))]
            out.append(Sample(id=f"r{g}#{k}", request_id=f"r{g}", prompt_ids=prompt, completion_ids=c,
                              logprobs=[-1.0] * len(c), versions=[0] * len(c), finish_reason="stop",
                              advantage=rng.uniform(-1, 1)))
    return out


def _lora_policy():
    return attach_lora(build_preset("tiny", char_tokenizer(), seed=0), r=4, alpha=8.0, targets=["q_proj", "v_proj"])


def _ref(scorer, trainer, samples) -> list[list[float]]:
    scorer.fill(trainer, samples)
    return [s.ref_logprobs for s in samples]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_fused_equals_inline_after_the_policy_moved():
    """The LoRA policy with its adapter disabled scores what a frozen copy of the initial policy scores,
    also after training moved the adapter away from zero (the policy's own logprobs then differ)."""
    torch.manual_seed(0)
    policy = _lora_policy()
    inline, fused = InlineReference(policy), FusedReference(policy)
    trainer = Trainer(policy, lr=5e-2, kl_coef=0.5)
    samples = _samples(1)
    assert _max_diff(_ref(inline, trainer, samples), _ref(fused, trainer, samples)) < 1e-6
    for s in samples:
        s.logprobs = [float(x) for x in trainer.logprobs([s])[0]]
    for _ in range(3):
        trainer.step(samples)
    moved = [lp.tolist() for lp in trainer.logprobs(samples)]
    a, b = _ref(inline, trainer, samples), _ref(fused, trainer, samples)
    assert _max_diff(moved, a) > 1e-3  # the policy moved: a reference that followed it would fail below
    assert _max_diff(a, b) < 1e-5
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)  # the adapter is back on


@pytest.mark.parametrize("override, needle", [
    (["reference.placement=pool"], "placement=colocated runs one process without Ray"),
    (["reference.placement=fused"], "model.lora.r=0 trains every weight"),
    (["reference.placement=pool", "algo.kl_coef=0", "placement=async"], "algo.kl_coef=0 uses none"),
])
def test_bad_reference_placement_exit_2(tmp_path, capsys, override, needle):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_fused_run_matches_inline_run(tmp_path):
    """Colocated, LoRA, kl_coef > 0: the fused run trains exactly as the inline one (same KL, same loss)."""
    rows = {}
    for where in ("inline", "fused"):
        run = tmp_path / where
        assert main(["train", *TINY, "steps=3", "model.lora.r=4", "trainer.lr=5e-2", _dense_reward(tmp_path),
                     f"reference.placement={where}", f"out_dir={run}"]) == 0
        rows[where] = list(rundir.read_jsonl(run / rundir.METRICS))
    assert rows["inline"][-1]["kl"] > 0  # the policy moved off the reference: the comparison means something
    for a, b in zip(rows["inline"], rows["fused"], strict=True):
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-6) and b["loss"] == pytest.approx(a["loss"], abs=1e-6)


def _dense_reward(tmp_path) -> str:
    """A reward that differs within every group (completion length), so advantages are never all zero."""
    f = tmp_path / "length_reward.py"
    f.write_text("def reward(completion, prompt, meta):\n    return float(len(completion))\n")
    return f"reward.hook={f}:reward"


def ray_test(fn):
    return pytest.mark.ray(pytest.mark.slow(pytest.mark.usefixtures("ray_session")(fn)))


@ray_test
def test_pool_scores_what_inline_scores():
    from rollyard.placement.reference_pool import ReferencePool

    cfg = RunConfig.model_validate({"algo": {"kl_coef": 0.5}, "reference": {"placement": "pool", "workers": 2},
                                    "trainer": {"precision": "fp32"}})
    policy = build_preset("tiny", char_tokenizer(), seed=0)
    trainer = Trainer(policy, kl_coef=0.5, precision="fp32")
    pool, inline = ReferencePool(cfg, policy), InlineReference(policy)
    try:
        early = _samples(2)
        pool.submit(early[:2], step=0)  # one group sent ahead, as a rollout worker does; the rest at fill
        spans = pool.fill(trainer, early, step=0)
        assert _max_diff(_ref(inline, trainer, _samples(2)), [s.ref_logprobs for s in early]) < 1e-5
        assert {s["role"] for s in spans} == {"reference_pool"} and len(spans) == 2  # the early call, the rest
        assert {s["worker"] for s in spans} == {"reference-0", "reference-1"}
        assert pool.metrics()["reference/ready_frac"] <= 1 / 3 + 1e-9
    finally:
        pool.stop()


@ray_test
def test_async_pool_run_matches_colocated_inline_run(tmp_path):
    """Async at bound 0 trains on exactly colocated's samples; with the reference on its pool (scored as
    each group ships) the KL and the loss equal the inline reference's, step by step."""
    colo, asyn = tmp_path / "colo", tmp_path / "async"
    hook = _dense_reward(tmp_path)
    assert main(["train", *TINY, "steps=3", "trainer.lr=5e-2", hook, f"out_dir={colo}"]) == 0
    assert main(["train", *TINY, "steps=3", "trainer.lr=5e-2", hook, f"out_dir={asyn}", "placement=async",
                 "max_staleness=0", "reference.placement=pool"]) == 0
    a, c = list(rundir.read_jsonl(asyn / rundir.METRICS)), list(rundir.read_jsonl(colo / rundir.METRICS))
    assert c[-1]["kl"] > 0
    for ra, rc in zip(a, c, strict=True):
        assert ra["tokens/generated"] == rc["tokens/generated"]
        assert ra["kl"] == pytest.approx(rc["kl"], abs=1e-5) and ra["loss"] == pytest.approx(rc["loss"], abs=1e-5)
    assert sum(r["reference/ready_frac"] for r in a) > 0  # some groups were scored before the trainer asked
    spans = list(rundir.read_jsonl(asyn / rundir.SPANS))
    assert any(s["role"] == "reference_pool" for s in spans) and any(s["role"] == "reference" for s in spans)


def test_plan_prices_the_reference_placement():
    """Disaggregated: rollout 30 s, train 20 s, reference 15 s. Inline the trainer's side is 15 + 20 = 35 s, over
    rollout; on a pool the reference leaves the trainer's path (30 s, rollout-bound) and its memory; fused keeps
    the time but holds no copy; colocated cannot run a pool, so it keeps the inline price."""
    from rollyard.plan.inputs import load_plan
    from rollyard.plan.planner import make_plan

    base = ["placement=disaggregated", "phases.rollout_s=30", "phases.train_s=20", "phases.reference_s=15",
            "sync.receiver=none", "sync.fixed_s=0"]
    plans = {w: make_plan(load_plan(None, [*base, f"phases.reference_placement={w}"])) for w in ("inline", "pool", "fused")}
    period = {w: p.sims["disaggregated"].period_s for w, p in plans.items()}
    sync = period["inline"] - 35.0
    assert 0 <= sync < 1
    assert period["pool"] == pytest.approx(30.0 + sync) and period["fused"] == pytest.approx(period["inline"])
    assert plans["inline"].sims["colocated"].period_s == pytest.approx(plans["pool"].sims["colocated"].period_s)
    held = {w: p.memory.reference_per_gpu for w, p in plans.items()}
    assert held["inline"] > 0 and held["pool"] == 0 and held["fused"] == 0
