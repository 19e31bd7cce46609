"""The optimisation loop users bring: several optimizer steps per generation batch (epochs x mini-batches) with pi_old
computed once, in every placement; DAPO's dynamic sampling and overlong shaping; the reference following the policy;
dropout off and an fp32 head; the settings a placement cannot honour refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rollyard.algo.advantages import overlong_penalty
from rollyard.cli import main
from rollyard.config import load_config
from rollyard.model.loading import load_policy
from rollyard.placement.reference import InlineReference
from rollyard.telemetry import rundir
from rollyard.trainer.logprobs import chunked_token_logprobs
from rollyard.trainer.optimize import optimize, split_groups
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "reward.hook=tests/dense_reward.py:digits", "rollout.temperature=1.0"]


def _metrics(run: Path) -> list[dict]:
    return list(rundir.read_jsonl(run / rundir.METRICS))


def _samples(groups: int = 4, n: int = 4, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = torch.randint(3, 60, (5,), generator=g).tolist()
        for j in range(n):
            k = int(torch.randint(3, 9, (1,), generator=g))
            s = Sample(id=f"s{i}.{j}", request_id=f"r{i}", prompt_ids=prompt,
                       completion_ids=torch.randint(3, 60, (k,), generator=g).tolist(), logprobs=[-3.0] * k,
                       versions=[0] * k, finish_reason="stop")
            s.advantage = float(torch.randn((), generator=g))
            out.append(s)
    return out


def test_split_groups_keeps_groups_whole_and_in_order():
    samples = _samples(groups=5, n=3)
    parts = split_groups(samples, 2)
    assert [i for p in parts for i in p] == list(range(15))
    for p in parts:
        assert len({samples[i].request_id for i in p}) * 3 == len(p)  # whole groups only
    assert [len(p) for p in parts] == [9, 6]
    assert len(split_groups(samples, 9)) == 5  # never more parts than groups


def test_fewer_groups_than_mini_batches_still_make_every_optimizer_step():
    model, _ = load_policy("tiny")
    trainer = Trainer(model, lr=1e-3)
    m = optimize(trainer, _samples(groups=2), epochs=1, mini_batches=3)
    assert m["updates"] == 3 and trainer.optimizer.param_groups[0]["schedule_step"] == 3


def test_epochs_x_mini_batches_steps_the_optimizer_on_a_ratio_baseline_computed_once():
    model, _ = load_policy("tiny")
    trainer = Trainer(model, lr=5e-3, clip_low=0.05, clip_high=0.05)
    calls = []
    scored = trainer.logprobs

    def counting(samples, model=None):
        calls.append(len(samples))
        return scored(samples, model)

    trainer.logprobs = counting
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    samples = _samples()
    steps = []
    real_step = trainer.step
    trainer.step = lambda sub, old=None, **kw: steps.append((len(sub), old is not None)) or real_step(sub, old, **kw)
    m = optimize(trainer, samples, epochs=2, mini_batches=2)
    assert calls == [len(samples)]  # pi_old once, for the whole generation batch
    assert steps == [(8, True)] * 4 and m["updates"] == 4 and m["applied"] == 4
    # from the second update on the ratio moved off 1 and the clip acts
    assert m["clip_frac"] > 0 and abs(m["ratio_p95"] - 1) > 1e-4
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # one update: no pi_old pass, the training forward's own log-probs are the baseline
    calls.clear()
    one = optimize(trainer, samples, epochs=1, mini_batches=1)
    assert calls == [] and one["updates"] == 1


def test_a_colocated_run_makes_a_version_per_optimizer_step_and_resumes(tmp_path):
    run = tmp_path / "r"
    args = [*TINY, "trainer.epochs=2", "trainer.mini_batches=2", f"out_dir={run}", "checkpoint_every=1"]
    assert main(["train", *args, "steps=2"]) == 0
    rows = _metrics(run)
    assert [r["version"] for r in rows] == [4, 8]
    assert all(r["train/updates"] == 4 and r["train/old_logprob_s"] > 0 for r in rows)
    assert main(["train", "--resume", str(run), "steps=3"]) == 0
    assert [r["version"] for r in _metrics(run)] == [4, 8, 12]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement", ["disaggregated", "async"])
def test_ray_placements_count_optimizer_steps_as_versions(tmp_path, placement):
    run = tmp_path / placement
    extra = ["max_staleness=2"] if placement == "async" else []
    assert main(["train", *TINY, "steps=3", "trainer.epochs=2", f"placement={placement}", *extra,
                 f"out_dir={run}"]) == 0
    rows = _metrics(run)
    assert [r["version"] for r in rows] == [2, 4, 6]
    assert all(r["train/updates"] == 2 for r in rows)
    # the samples a step trains lag by the optimizer steps of the step before at most (and the bound holds)
    assert all(r[rundir.STALENESS_MAX] <= 2 for r in rows)


def test_async_refuses_a_bound_the_steps_versions_outrun(tmp_path, capsys):
    code = main(["train", *TINY, "placement=async", "max_staleness=0", "sync.every=3", "trainer.epochs=2",
                 f"out_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "trainer.epochs x trainer.mini_batches = 2 versions a step" in err and "max_staleness=2" in err


@pytest.mark.parametrize("override, says", [
    (["rollout.scheduler=tail", "trainer.epochs=2"], "trainer.epochs needs the whole batch"),
    (["rollout.scheduler=tail", "algo.top_entropy_quantile=0.2"], "algo.top_entropy_quantile needs the whole batch"),
    (["trainer.dp=2", "algo.top_entropy_quantile=0.2"], "splits over ranks"),
    (["reference.sync_every=4"], "algo.kl_coef=0 uses no reference"),
    (["reference.sync_every=4", "algo.kl_coef=0.1", "model.lora.r=4"], "model.lora.r=4 does not have"),
    (["algo.multi_objective=normalize_then_sum"], "1 reward function is set"),
    (["algo.overlong_buffer=6"], "must be below rollout.max_new_tokens=6"),
])
def test_a_setting_the_run_cannot_honour_is_one_line_exit_2(tmp_path, capsys, override, says):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_dynamic_sampling_trains_only_groups_with_signal_and_accounts_for_every_prompt(tmp_path):
    run = tmp_path / "dyn"
    assert main(["train", *TINY, "reward.hook=tests/dense_reward.py:first_is_digit", "algo.dynamic_sampling=true",
                 "algo.dynamic_sampling_rounds=4", "steps=3", f"out_dir={run}", "log.completions_every=1"]) == 0
    rows = _metrics(run)
    assert all(1 <= r["dynamic/rounds"] <= 4 for r in rows)
    # a step stops drawing once it holds prompts_per_step groups with signal, or after 4 rounds
    # and trains exactly prompts_per_step of them (verl trims its batch): the rest of a last round is surplus
    for r in rows:
        assert r["dynamic/kept_groups"] == 2 or (r["dynamic/rounds"] == 4 and r["dynamic/kept_groups"] < 2)
    drawn = sum(r["dynamic/rounds"] for r in rows) * 2
    assert sum(r["dynamic/kept_groups"] + r["dynamic/dropped_groups"] + r["dynamic/surplus_groups"]
               for r in rows) == drawn
    ckpt = max((run / rundir.CHECKPOINTS).iterdir())
    ledger = json.loads((ckpt / "state.json").read_text())["cursor"]["ledger"]
    assert len(ledger["trained"]) == drawn and not ledger["live"]  # every drawn prompt consumed, none twice


def test_overlong_penalty_by_hand():
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20, 25)] == [0.0, 0.0, -0.25, -0.5, -1.0,
                                                                                  -1.0]
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0 and overlong_penalty(19, 20, 4, 0.5) == -0.375


def test_the_reference_follows_the_policy_by_its_mixup():
    policy, _ = load_policy("tiny")
    ref = InlineReference(policy)
    start = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    trainer = type("T", (), {"model": policy})()
    ref_cfg = load_config(None, ["reference.sync_every=4", "reference.mixup_alpha=0.25", "algo.kl_coef=0.1"]).reference
    ref.follow(trainer, 2, 3, ref_cfg)  # no multiple of 4 crossed
    assert all(torch.equal(start[n], p) for n, p in ref.model.named_parameters())
    ref.follow(trainer, 3, 5, ref_cfg)
    for n, p in ref.model.named_parameters():
        want = start[n] + 0.25 * 0.5  # 0.25 x (start + 0.5) + 0.75 x start
        assert torch.allclose(p, want, atol=1e-6), n
    assert ref.metrics() == {"reference/syncs": 1.0}


def test_a_run_with_the_reference_following_logs_its_syncs(tmp_path):
    run = tmp_path / "ref"
    assert main(["train", *TINY, "algo.kl_coef=0.1", "reference.sync_every=2", "steps=4", f"out_dir={run}"]) == 0
    assert [r.get("reference/syncs", 0.0) for r in _metrics(run)] == [0.0, 1.0, 1.0, 2.0]


def test_disable_dropout_makes_the_training_forward_deterministic():
    model, _ = load_policy("tiny")
    model.config.attention_dropout = 0.5
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    model.train()
    ids = torch.randint(3, 60, (1, 12))
    differ = not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert differ  # dropout on: two forwards differ
    Trainer(model, disable_dropout=True)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_fp32_head_under_bf16_autocast_is_the_fp32_product():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False)
    hidden = torch.randn(10, 64)
    y = torch.randint(0, 500, (10,))
    exact, _ = chunked_token_logprobs(hidden, head, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _ = chunked_token_logprobs(hidden, head, y, fp32_head=True)
        bf16, _ = chunked_token_logprobs(hidden, head, y)
    assert (fp32 - exact).abs().max() < 1e-5 < (bf16 - exact).abs().max()


def test_adaptive_entropy_state_survives_a_checkpoint(tmp_path):
    cfg = load_config(None, ["model.name=tiny", "algo.adaptive_entropy=true", "algo.entropy_target=100",
                             "algo.entropy_coef=0.01", "algo.entropy_coef_delta=0.01"])
    from rollyard.trainer.settings import trainer_kwargs

    model, _ = load_policy("tiny")
    trainer = Trainer(model, **trainer_kwargs(cfg))
    samples = _samples(groups=2)
    trainer.step(samples)
    trainer.step(samples)
    assert trainer.entropy.value == pytest.approx(0.03)  # +delta each step while entropy <= target
    state = copy.deepcopy(trainer.optimizer.state_dict())
    fresh = Trainer(copy.deepcopy(model), **trainer_kwargs(cfg))
    fresh.optimizer.load_state_dict(state)
    m = fresh.step(samples)
    assert m["entropy_coef"] == pytest.approx(0.03) and fresh.entropy.value == pytest.approx(0.04)


def test_prompts_over_max_prompt_tokens_are_dropped_or_cut_and_file_order_without_shuffle():
    from rollyard.rollout.scheduler import PromptStream, to_requests
    from rollyard.tasks.base import Prompt

    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    prompts = [Prompt(id="a", text="abcdefgh", meta={}), Prompt(id="b", text="xyz", meta={})]
    kept, dead = to_requests(prompts, Tok(), n=2, max_new_tokens=4, context=64, max_prompt=(5, "drop"))
    assert [q.id for q in kept] == ["b"] and dead[0]["source"] == "a" and "max_prompt_tokens=5" in dead[0]["reason"]
    left, _ = to_requests(prompts, Tok(), n=2, max_new_tokens=4, context=64, max_prompt=(5, "left"))
    right, _ = to_requests(prompts, Tok(), n=2, max_new_tokens=4, context=64, max_prompt=(5, "right"))
    assert left[0].prompt_ids == [ord(c) for c in "defgh"] and right[0].prompt_ids == [ord(c) for c in "abcde"]
    many = [Prompt(id=str(i), text=str(i), meta={}) for i in range(6)]
    assert [p.id for p in PromptStream(many, shuffle=False).take(8)] == ["0", "1", "2", "3", "4", "5", "0", "1"]
    assert [p.id for p in PromptStream(many, seed=1).take(6)] != ["0", "1", "2", "3", "4", "5"]


def test_epochs_of_data_set_the_steps(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    cfg = load_config(None, [f"data.path={data}", "data.epochs=1.5", "rollout.prompts_per_step=4"])
    assert cfg.steps == 4  # ceil(1.5 x 10 / 4)
    assert load_config(None, [f"data.path={data}", "data.epochs=1.5", "steps=2"]).steps == 2  # explicit steps win


def test_the_bound_counts_the_versions_a_step_makes():
    from rollyard import staleness

    assert staleness.bound_of("disaggregated", 0, 1, 2) == 2  # one step off = the step's two versions
    assert staleness.bound_of("colocated", 0, 3, 2) == 2  # published at versions 4, 8, ...: up to 2 behind
    assert staleness.bound_of("colocated", 0, 2, 2) == 0 and staleness.bound_of("async", 3, 1, 4) == 3
    assert [staleness.published_lag(e, 1) for e in (1, 2, 3)] == [0, 1, 2]  # one version a step: sync.every - 1


@pytest.mark.parametrize("override, says", [
    (["algo.sapo_temperature_pos=2"], "algo.sapo_temperature_pos=2.0 has no effect without algo.policy_loss=sapo"),
    (["algo.vespo_k_neg=1"], "without algo.policy_loss=vespo"),
    (["algo.policy_loss=cispo", "algo.delta=3"], "algo.delta=3.0 has no effect without algo.policy_loss=ppo_clip"),
    (["algo.tis_mode=none", "algo.tis_cap=3"], "has no effect without algo.tis_mode=token_truncate"),
    (["algo.entropy_target=0.5"], "without algo.adaptive_entropy=true"),
    (["algo.dynamic_sampling_rounds=3"], "without algo.dynamic_sampling=true"),
    (["trainer.lm_head_fp32=true", "trainer.precision=fp32"], "runs every matmul in fp32 already"),
    (["reference.mixup_alpha=0.9"], "without reference.sync_every > 0"),
    (["rollout.backend=vllm", "rollout.precision=bf16"], "set rollout.dtype=bf16 for vLLM"),
])
def test_a_setting_without_effect_is_one_line_exit_2(tmp_path, capsys, override, says):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    # TRL's own defaults of the same names change nothing, so a TRL config listing them still starts
    assert main(["train", *TINY, "sapo_temperature_neg=1.05", "vespo_k_pos=2.0", "steps=1",
                 f"out_dir={tmp_path / 'ok'}"]) == 0 if override == ["algo.sapo_temperature_pos=2"] else True
