"""Learning-rate schedules with warm-up and AdamW's settings, as TRL 1.16 / transformers compute them.

The oracle is transformers' ``get_scheduler`` (the pure multipliers) and TRL's own ``GRPOTrainer`` (built offline
by ``tests/trl_oracle.py``: ``create_optimizer_and_scheduler``), against rollyard's Trainer built from the same
TRL names through the config. A real run logs the rate every step and a resumed run continues it.
"""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from rollyard import schedule
from rollyard.api import GRPOConfig, with_trl_defaults
from rollyard.config import ConfigError, from_dict, load_config
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.telemetry import rundir
from rollyard.trainer.settings import trainer_kwargs
from rollyard.trainer.trainer import Trainer

TOK = char_tokenizer()

# (schedule, its keyword arguments): every schedule, the defaults and other values of its arguments
CASES = [("constant", {}), ("constant_with_warmup", {}), ("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}),
         ("cosine_with_restarts", {}), ("cosine_with_restarts", {"num_cycles": 3}), ("polynomial", {}),
         ("polynomial", {"lr_end": 1e-4, "power": 2.0}), ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 5}),
         ("cosine_with_min_lr", {"min_lr_rate": 0.1}), ("cosine_with_min_lr", {"min_lr": 1e-4, "num_cycles": 0.7}),
         ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
         ("cosine_warmup_with_min_lr", {"min_lr": 2e-4, "warmup_lr_rate": 0.05})]


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _transformers_lrs(name, kwargs, lr, total, warmup, steps) -> list[float]:
    """The rate each optimizer step applies under transformers' scheduler (read before the step)."""
    from transformers import get_scheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=dict(kwargs))
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_schedule_is_transformers_at_every_step(name, kwargs):
    lr = 1e-3
    for total, warmup in itertools.product((1, 7, 20), (0, 1, 3)):
        if (name == "constant" and warmup) or (name == "polynomial" and warmup >= total):
            continue  # refused at start-up (test_bad_schedules_are_one_line)
        args = schedule.resolve(name, kwargs, lr, warmup)
        mine = [lr * schedule.multiplier(name, k, total, warmup, args) for k in range(total + 1)]
        assert mine == pytest.approx(_transformers_lrs(name, kwargs, lr, total, warmup, total + 1), rel=1e-12,
                                     abs=1e-18), (total, warmup)


def test_warmup_ratio_rounds_up_as_transformers_and_down_as_verl():
    assert schedule.warmup_steps(30, ratio=0.1) == 3 and schedule.warmup_steps(31, ratio=0.1) == 4
    assert schedule.warmup_steps(31, ratio=0.1, rounding="floor") == 3
    assert schedule.warmup_steps(31, steps=5, ratio=0.1) == 5  # steps win, as in transformers


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.lr_schedule=constant", "trainer.warmup_steps=2"], "use trainer.lr_schedule=constant_with_warmup"),
    (["trainer.lr_schedule=linear", "trainer.lr_schedule_kwargs={num_cycles: 2}"], "does not take schedule argument"),
    (["trainer.lr_schedule=cosine_with_min_lr"], "needs min_lr or min_lr_rate"),
    (["trainer.lr_schedule=cosine_with_min_lr", "trainer.lr_schedule_kwargs={min_lr: 1.0e-7, min_lr_rate: 0.1}"],
     "not both"),
    (["trainer.lr_schedule=polynomial", "trainer.lr=1e-7"], "lr_end (1e-07) must be below it"),
    (["trainer.warmup_steps=3", "trainer.warmup_ratio=0.1"], "keep one"),
    (["trainer.lr_schedule=cosine_warm"], "trainer.lr_schedule: Input should be"),
    (["lr_scheduler_type=reduce_lr_on_plateau"], "it follows an eval metric"),
    (["optim=adamw_bnb_8bit"], "closest rollyard setting: trainer.optimizer_state=bf16"),
    (["trainer.adam_beta2=1.0"], "trainer.adam_beta2: Input should be less than 1"),
])
def test_bad_schedules_are_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value) and len(str(e.value).splitlines()) == 1


def _trainer(cfg, model=None) -> Trainer:
    return Trainer(model or build_preset("tiny", TOK, seed=0, max_position_embeddings=64), **trainer_kwargs(cfg),
                   device="cpu")


def _rollyard_lrs(trl_kwargs: dict, steps: int) -> tuple[list[float], Trainer]:
    """The rate of each of ``steps`` optimizer steps of rollyard's Trainer built from a TRL script's arguments."""
    cfg = from_dict(with_trl_defaults(dict(GRPOConfig(**trl_kwargs, max_steps=steps))))
    t = _trainer(cfg)
    return [t.schedule_lr() for _ in range(steps)], t


# A TRL user's settings: every schedule, with warm-up in steps and as a share (transformers 5's float
# warmup_steps, and transformers 4's warmup_ratio on rollyard's side), and their kwargs; TRL's defaults elsewhere
TRL_CASES = [
    {},  # TRL's defaults: linear decay, no warm-up
    {"lr_scheduler_type": "constant"},
    {"lr_scheduler_type": "linear", "warmup_steps": 3},
    {"lr_scheduler_type": "cosine", "warmup_steps": 0.2},
    {"lr_scheduler_type": "cosine", "warmup_steps": 2, "lr_scheduler_kwargs": {"num_cycles": 1.25}},
    {"lr_scheduler_type": "cosine_with_min_lr", "warmup_steps": 0.15, "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
    {"lr_scheduler_type": "cosine_with_min_lr", "warmup_steps": 2, "lr_scheduler_kwargs": {"min_lr": 1e-6}},
    {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 4},
    {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0.3},
    {"lr_scheduler_type": "polynomial", "warmup_steps": 2, "lr_scheduler_kwargs": {"power": 2.0, "lr_end": 1e-6}},
    {"lr_scheduler_type": "cosine_with_restarts", "warmup_steps": 1, "lr_scheduler_kwargs": {"num_cycles": 2}},
    {"lr_scheduler_type": "inverse_sqrt", "warmup_steps": 3},
    {"lr_scheduler_type": "cosine_warmup_with_min_lr", "warmup_steps": 3,
     "lr_scheduler_kwargs": {"min_lr_rate": 0.05}},
]


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("trl", reason="trl==1.16.0 (the test extra) is the oracle")
    import trl_oracle
    return trl_oracle


def _trl_optimizer_and_lrs(oracle, trl_kwargs: dict, steps: int):
    tok = oracle.tiny_tokenizer()
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok,
                                       **{"learning_rate": 1e-5, "max_steps": steps, **trl_kwargs})
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    lrs = []
    for _ in range(steps):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()  # no gradients: nothing moves; the scheduler sees its steps in order
        trainer.lr_scheduler.step()
    return trainer.optimizer, lrs


@pytest.mark.parametrize("trl_kwargs", TRL_CASES, ids=[c.get("lr_scheduler_type", "default") + f"-{i}"
                                                       for i, c in enumerate(TRL_CASES)])
def test_the_rate_of_every_step_is_trls_own(oracle, trl_kwargs):
    steps = 13
    trl_opt, trl_lrs = _trl_optimizer_and_lrs(oracle, trl_kwargs, steps)
    lrs, t = _rollyard_lrs({"learning_rate": 1e-5, **trl_kwargs}, steps)
    assert lrs == pytest.approx(trl_lrs, rel=1e-12, abs=1e-20)
    group = trl_opt.param_groups[0]  # TRL's AdamW settings at its defaults: beta2 0.999, not rollyard's 0.99
    assert (group["betas"], group["eps"]) == (t.optimizer.param_groups[0]["betas"], t.optimizer.param_groups[0]["eps"])
    if "warmup_steps" in trl_kwargs and trl_kwargs["warmup_steps"] < 1:  # transformers 4's name for the same share
        old = {k: v for k, v in trl_kwargs.items() if k != "warmup_steps"}
        assert _rollyard_lrs({"learning_rate": 1e-5, **old, "warmup_ratio": trl_kwargs["warmup_steps"]}, steps)[0] == lrs


def test_several_optimizer_steps_per_generation_batch_follow_trls_schedule(oracle):
    """TRL counts max_steps in optimizer steps: with num_iterations=2 and steps_per_generation=2 (x gradient
    accumulation 1) a generation batch makes 4 of them, and rollyard's 3 steps x 2 epochs x 2 mini-batches run the
    same 12 rates."""
    kw = {"lr_scheduler_type": "cosine", "warmup_steps": 0.25, "num_iterations": 2, "steps_per_generation": 2}
    _, trl_lrs = _trl_optimizer_and_lrs(oracle, kw, 12)
    cfg = from_dict(with_trl_defaults(dict(GRPOConfig(learning_rate=1e-5, max_steps=12, **kw))))
    assert (cfg.steps, cfg.trainer.epochs, cfg.trainer.mini_batches) == (3, 2, 2)
    t = _trainer(cfg)
    assert [t.schedule_lr() for _ in range(12)] == pytest.approx(trl_lrs, rel=1e-12, abs=1e-20)


def test_trl_adam_settings_reach_the_optimizer(oracle):
    kw = {"adam_beta1": 0.85, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "optim": "adamw_torch"}
    trl_opt, _ = _trl_optimizer_and_lrs(oracle, kw, 2)
    _, t = _rollyard_lrs({"learning_rate": 1e-5, **kw}, 2)
    for key in ("betas", "eps"):
        assert t.optimizer.param_groups[0][key] == trl_opt.param_groups[0][key]


def test_weight_decay_skips_biases_and_norms_as_trl_does(oracle):
    """TRL's optimizer (transformers' Trainer) decays neither biases nor normalisation weights; a TRL weight_decay
    does the same in rollyard (the tiny Qwen2 has q/k/v biases and RMSNorms); verl's decays every parameter."""
    kw = {"weight_decay": 0.1}
    tok = oracle.tiny_tokenizer()
    trl = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, max_steps=2, **kw)
    trl.create_optimizer_and_scheduler(num_training_steps=2)
    trl_names = {id(p): n for n, p in trl.model.named_parameters()}
    theirs = {trl_names[id(p)]: g["weight_decay"] for g in trl.optimizer.param_groups for p in g["params"]}
    model = oracle.tiny_model(tokenizer=tok)
    names = {id(p): n for n, p in model.named_parameters()}
    t = Trainer(model, **trainer_kwargs(from_dict(with_trl_defaults(dict(GRPOConfig(**kw, max_steps=2))))),
                device="cpu")
    mine = {names[id(p)]: g["weight_decay"] for g in t.optimizer.param_groups for p in g["params"]}
    assert mine == theirs and set(mine.values()) == {0.0, 0.1}
    assert {wd for n, wd in mine.items() if "bias" in n or "norm" in n} == {0.0}
    verl = from_dict({"actor_rollout_ref": {"actor": {"optim": {"weight_decay": 0.1}}}})
    assert {g["weight_decay"] for g in _trainer(verl).optimizer.param_groups} == {0.1}


# -- AdamW's settings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_betas_and_eps_reach_the_optimizer_and_its_update(state):
    cfg = load_config(None, ["trainer.adam_beta1=0.8", "trainer.adam_beta2=0.95", "trainer.adam_eps=1e-4",
                             f"trainer.optimizer_state={state}", "trainer.lr=1e-2"])
    model = build_preset("tiny", TOK, seed=0, max_position_embeddings=64)
    t = _trainer(cfg, model)
    assert {(g["betas"], g["eps"]) for g in t.optimizer.param_groups} == {((0.8, 0.95), 1e-4)}
    p = t.params[0]
    before = p.detach().clone()
    g = torch.randn_like(p)
    for q in t.params:
        q.grad = torch.zeros_like(q)
    p.grad = g.clone()
    t.schedule_lr()
    t.optimizer.step()
    # the first AdamW step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected: g / (|g| + eps / ...) per element
    m, v = g * (1 - 0.8) / (1 - 0.8), g * g * (1 - 0.95) / (1 - 0.95)
    want = before - 1e-2 * m / (v.sqrt() + 1e-4)
    tol = 1e-6 if state == "fp32" else 1e-5
    torch.testing.assert_close(p.detach(), want, rtol=tol, atol=tol)
    assert not torch.allclose(want, before - 1e-2 * m / (v.sqrt() + 1e-8), rtol=0, atol=1e-7)  # eps matters here
    # a resume with other settings runs with them, not the checkpoint's (load_state_dict would bring those back)
    other = _trainer(load_config(None, [f"trainer.optimizer_state={state}"]), model)
    other.optimizer.load_state_dict(t.optimizer.state_dict())
    assert (other.optimizer.param_groups[0]["betas"], other.optimizer.param_groups[0]["eps"]) == ((0.9, 0.99), 1e-8)
    assert other.optimizer.param_groups[0]["schedule_step"] == 1  # the schedule's position is the checkpoint's


def test_trl_script_gets_trls_defaults_only_where_it_sets_none():
    cfg = from_dict(with_trl_defaults(dict(GRPOConfig("out", learning_rate=1e-6))))
    assert (cfg.trainer.lr_schedule, cfg.trainer.adam_beta2) == ("linear", 0.999)
    cfg = from_dict(with_trl_defaults(dict(GRPOConfig("out", lr_scheduler_type="cosine", adam_beta2=0.98))))
    assert (cfg.trainer.lr_schedule, cfg.trainer.adam_beta2) == ("cosine", 0.98)
    cfg = from_dict(with_trl_defaults({"trainer": {"lr_schedule": "constant", "adam_beta2": 0.9}}))
    assert (cfg.trainer.lr_schedule, cfg.trainer.adam_beta2) == ("constant", 0.9)  # rollyard's keys count as set
    cfg = load_config(None, ["learning_rate=1e-6"])  # a config file or the command line: rollyard's defaults
    assert (cfg.trainer.lr_schedule, cfg.trainer.adam_beta2) == ("constant", 0.99)


def test_verl_names_set_verls_schedule():
    optim = {"lr": 1e-5, "lr_warmup_steps_ratio": 0.15, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1,
             "num_cycles": 0.5, "betas": [0.9, 0.95]}
    t = from_dict({"steps": 10, "actor_rollout_ref": {"actor": {"optim": optim}}}).trainer
    assert (t.lr_schedule, t.lr_schedule_kwargs, t.lr_schedule_unit) == (
        "cosine_with_min_lr", {"num_cycles": 0.5, "min_lr_rate": 0.1}, "step")
    assert (t.warmup_ratio, t.warmup_rounding, t.adam_beta1, t.adam_beta2) == (0.15, "floor", 0.9, 0.95)
    t = from_dict({"actor_rollout_ref": {"actor": {"optim": {"lr_warmup_steps": 3, "lr_warmup_steps_ratio": 0.5,
                                                             "warmup_style": "constant"}}}}).trainer
    assert (t.lr_schedule, t.warmup_steps, t.warmup_ratio) == ("constant_with_warmup", 3, 0.0)
    # verl's default schedule warms up: a ratio alone is constant_with_warmup, rounded down over the steps
    t = from_dict({"steps": 15, "actor_rollout_ref": {"actor": {"optim": {"lr_warmup_steps_ratio": 0.1}}}}).trainer
    assert (t.lr_schedule, t.warmup_ratio, t.warmup_rounding) == ("constant_with_warmup", 0.1, "floor")
    cfg = load_config(None, ["steps=15", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.lr=1.0"])
    t = _trainer(cfg)
    assert [t.schedule_lr() for _ in range(3)] == [0.0, 1.0, 1.0]  # int(1.5) = 1 warm-up step
    with pytest.raises(ConfigError, match="set actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"):
        from_dict({"actor_rollout_ref": {"actor": {"optim": {"min_lr_ratio": 0.1}}}})


def test_a_schedule_counted_in_steps_holds_the_rate_over_a_batchs_optimizer_steps():
    cfg = load_config(None, ["steps=4", "trainer.lr_schedule=linear", "trainer.lr_schedule_unit=step", "trainer.lr=1.0"])
    kw = {**trainer_kwargs(cfg), "schedule_every": 3}  # 3 optimizer steps per generation batch (verl's epochs x minis)
    t = Trainer(build_preset("tiny", TOK, seed=0, max_position_embeddings=64), **kw, device="cpu")
    assert [t.schedule_lr() for _ in range(12)] == pytest.approx([1.0] * 3 + [0.75] * 3 + [0.5] * 3 + [0.25] * 3)


# -- a real run ---------------------------------------------------------------------------------------------------

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false", "trainer.lr=1e-3"]


@pytest.mark.slow
def test_a_run_logs_the_rate_every_step_and_a_resumed_run_continues_it(tmp_path):
    from rollyard.cli import main

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sched = ["trainer.lr_schedule=cosine", "trainer.warmup_steps=2", "steps=6", "checkpoint_every=3"]
    assert main(["train", *TINY, *sched, f"out_dir={straight}"]) == 0
    rows = list(rundir.read_jsonl(straight / rundir.METRICS))
    args = schedule.resolve("cosine", {}, 1e-3, 2)
    want = [1e-3 * schedule.multiplier("cosine", k, 6, 2, args) for k in range(6)]
    assert [r["learning_rate"] for r in rows] == pytest.approx(want, rel=1e-12, abs=1e-20)
    assert "train/lr" not in rows[0]  # one name: TRL's
    # the same run stopped after its step-3 checkpoint (the later one removed) and resumed to the end
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / rundir.CHECKPOINTS / "step_000006")
    state = json.loads((resumed / rundir.CHECKPOINTS / "step_000003" / "state.json").read_text())
    assert state["step"] == 3
    assert main(["train", "--resume", str(resumed)]) == 0
    again = list(rundir.read_jsonl(resumed / rundir.METRICS))
    assert [r["step"] for r in again] == list(range(6))
    assert [r["learning_rate"] for r in again] == [r["learning_rate"] for r in rows]


def _samples(seed, n=6):
    from rollyard.types import Sample
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, 20, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(4, 20, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i % 3}", prompt_ids=p, completion_ids=c,
                          logprobs=(-torch.rand(len(c), generator=g)).tolist(), versions=[0] * len(c),
                          finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


def test_a_skipped_step_and_a_step_with_nothing_to_learn_advance_the_schedule():
    cfg = load_config(None, ["steps=4", "trainer.lr_schedule=linear", "trainer.lr=1.0"])
    t = _trainer(cfg)
    bad = _samples(0)
    bad[0].advantage = float("nan")  # a non-finite loss: the update is skipped, the schedule still advances
    m = t.step(bad)
    assert (m["skipped"], m["lr"]) == (1.0, 1.0)
    empty = _samples(1)
    for s in empty:
        s.completion_mask = [0] * len(s.completion_ids)  # no loss token: nothing to learn
    assert t.step(empty)["lr"] == 0.75
    assert t.step(_samples(2))["lr"] == 0.5 and t.optimizer.param_groups[0]["schedule_step"] == 3


@pytest.mark.slow
def test_the_schedule_counts_every_optimizer_step_of_several_per_batch(tmp_path):
    from rollyard.cli import main

    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=3", "trainer.lr_schedule=linear", "trainer.epochs=2", "trainer.mini_batches=2",
                 f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    # 3 steps x 2 epochs x 2 mini-batches = 12 optimizer steps; a row logs the rate of its last one (4s + 3)
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-3 * (12 - (4 * s + 3)) / 12 for s in range(3)])
