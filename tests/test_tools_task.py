"""The built-in multi-turn task (``data.task=calculator``), the held-out eval with tools, and `rollyard plan`
pricing tool latency (issue 37 items 3-4)."""

from __future__ import annotations

import pytest
import torch

from rollyard.config import RunConfig
from rollyard.env import setup, template
from rollyard.evaluate import greedy_accuracy
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.plan.inputs import load_plan
from rollyard.plan.planner import make_plan
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.tasks import calculator, load_task

CALC = {"data": {"task": "calculator"}}


def test_the_calc_tool_evaluates_integer_arithmetic_and_refuses_anything_else():
    assert calculator.calc("47*38") == "1786" and calculator.calc(" 2*(3+4)-10 ") == "4"
    for bad in ("2**99", "__import__('os')", "7/2", "1" * 13 + "*2", "x*2", "1" * 201):
        with pytest.raises(ValueError):
            calculator.calc(bad)


def test_the_task_gives_its_tool_and_chat_template_and_tools_0_takes_them_away():
    assert setup.functions(RunConfig(**CALC)) == ["rollyard.tasks.calculator:calc"]
    off = RunConfig(data={"task": "calculator", "task_options": {"tools": 0}})
    assert setup.functions(off) == [] and not setup.enabled(off)
    assert setup.functions(RunConfig()) == []  # arithmetic has no tools
    assert setup.functions(RunConfig(data={"task": "calculator"}, tools={"functions": ["tool_fns:add"]})) == ["tool_fns:add"]
    (p,) = load_task("calculator", "train", 1, seed=0, tools=0)
    assert p.demo == p.meta["answer"] and p.text.endswith("=")  # tools=0: the answer, single-turn


@pytest.mark.parametrize("name, split, n, seed, options, digest", [
    ("arithmetic", "train", 3000, 0, {}, "5e85e2f0d078abb5"),  # cycles the 1319-problem train split
    ("arithmetic", "eval", 500, 3, {}, "a37b09b0159bffea"),  # all 138 held-out problems, none twice
    ("arithmetic", "train", 50, 7, {"max_operand": 9, "ops": "+"}, "81e88cf6207297b6"),
    ("calculator", "train", 9000, 0, {}, "3e2329aa26b845e6"),
    ("calculator", "eval", 64, 1, {}, "d114f0b3f8c2065c"),
    ("calculator", "train", 40, 2, {"tools": 0, "digits": 1}, "ecc448b8d3b79945"),
])
def test_arithmetic_and_calculator_draw_the_same_prompts_as_before_their_shared_draw(name, split, n, seed, options,
                                                                                      digest):
    """tasks.base.draw_problems replaced the draw loop both tasks had: every prompt (id, text, meta, demo) is the
    one each task drew before it, for the same seed (digests taken from the code before the change)."""
    import hashlib
    import json

    prompts = load_task(name, split, n, seed=seed, **options)
    blob = json.dumps([[p.id, p.text, p.meta, p.demo] for p in prompts])
    assert hashlib.sha256(blob.encode()).hexdigest()[:16] == digest


def test_a_calculator_demo_is_the_token_sequence_the_multi_turn_loop_builds():
    tok = char_tokenizer()
    setup.chat_template(RunConfig(**CALC), tok)  # a preset's character tokenizer gets the task's template
    (spec,) = setup.specs(RunConfig(**CALC))[0]
    template.check_template(tok, [spec.schema])  # renders the tools, tool messages and <tool_call>
    (p,) = load_task("calculator", "eval", 1, seed=0)
    expr, answer = p.text[:-1], p.meta["answer"]
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # the model's call ending its turn, the template's tool turn (what MultiTurn inserts), the copied answer
    loop = ids(calculator.call_text(expr)) + [tok.eos_token_id] + \
        template.turn_tokens(tok, [("calc", calculator.calc(expr))], "<eos>") + ids(answer)
    assert ids(p.demo) == loop
    assert template.parse_calls(calculator.call_text(expr))[0].arguments == {"expr": expr}


def test_sft_demos_mask_the_tool_turn_as_the_grpo_loss_does_and_train_only_the_models_tokens():
    """A calculator demo's mask is the multi-turn loop's (call + EOS trained, the tool turn context only, the copied
    answer + EOS trained); sft_step's loss is the NLL over exactly those tokens (HF's loss with the tool turn's
    labels at -100), and not the loss over every token."""
    from rollyard import sft
    from rollyard.trainer.trainer import Trainer

    cfg = RunConfig(**CALC)
    tok = char_tokenizer()
    setup.chat_template(cfg, tok)
    (p,) = load_task("calculator", "eval", 1, seed=0)
    expr, answer = p.text[:-1], p.meta["answer"]
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = ids(calculator.call_text(expr)) + [tok.eos_token_id]
    turn = template.turn_tokens(tok, [("calc", calculator.calc(expr))], "<eos>")
    ((prompt, comp, mask),) = sft.demos([p], tok, sft.tool_demos(cfg, tok))
    assert comp == call + turn + ids(answer) + [tok.eos_token_id]
    assert mask == [1] * len(call) + [0] * len(turn) + [1] * (len(answer) + 1)
    off = RunConfig(data={"task": "calculator", "task_options": {"tools": 0}})
    assert sft.tool_demos(off, tok) is None and sft.cache_key(off) != sft.cache_key(cfg)

    torch.manual_seed(0)
    model = build_preset("tiny", tok, max_position_embeddings=192)
    x = torch.tensor([prompt + comp])
    labels = torch.tensor([[-100] * len(prompt) + [c if m else -100 for c, m in zip(comp, mask)]])
    with torch.no_grad():
        want = float(model(input_ids=x, labels=labels).loss)  # HF's shifted cross-entropy, mean over kept labels
        every = float(model(input_ids=x, labels=torch.tensor([[-100] * len(prompt) + comp])).loss)
    trainer = Trainer(model, lr=0.0, micro_batch_tokens=4096)
    assert trainer.sft_step([(prompt, comp, mask)])["loss"] == pytest.approx(want, rel=1e-5)
    assert trainer.sft_step([(prompt, comp)])["loss"] == pytest.approx(every, rel=1e-5)  # no mask: every token
    assert abs(want - every) > 1e-3


def test_the_held_out_eval_runs_with_the_runs_tools():
    """A tiny preset taught one demonstration: greedy, it calls calc and copies the output. The eval with the
    run's tools scores it correct; the single-turn eval (no tools) sees only the call."""
    cfg = RunConfig(**CALC, reward={"num_workers": 1}, tools={"num_workers": 1})
    tok = char_tokenizer()
    setup.chat_template(cfg, tok)
    (p,) = load_task("calculator", "eval", 1, seed=0)
    torch.manual_seed(0)
    model = build_preset("tiny", tok, max_position_embeddings=192)
    x = torch.tensor([tok(p.text + p.demo, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    labels = x.clone()
    labels[0, :len(p.text)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        model(input_ids=x, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    with RewardDispatcher([calculator.VERIFIER], num_workers=1, decode=decode, eos_token_id=tok.eos_token_id) as rw:
        with setup.for_eval(cfg, tok) as tools:
            assert greedy_accuracy(model, tok, [p], rw, 128, 192, tools=tools) == 1.0
        assert greedy_accuracy(model, tok, [p], rw, 128, 192) == 0.0


# ------------------------------------------------------------------------------------- rollyard plan
def _plan(*tools):
    return make_plan(load_plan(None, ["rollout.prompts=64", "rollout.samples=8", "phases.rollout_s=20",
                                      "phases.train_s=30", "phases.use_reference=false", *tools]))


def test_plan_prices_tool_latency_a_slow_tool_widens_the_colocated_step_and_async_hides_part():
    base = _plan()
    assert base.tools.round_tail_s == 0.0 and base.edges[-1].name == "tools" and base.edges[-1].bytes_per_step == 0
    # constant 3 s calls, 2 per sample: every sample waits 6 s, the slowest too
    const = _plan("tools.calls_per_sample=2", "tools.latency_s=3", "tools.latency_sigma=0", "tools.bytes_per_call=100")
    assert const.tools.mean_s == pytest.approx(6.0) and const.tools.round_tail_s == pytest.approx(6.0)
    assert const.sims["colocated"].period_s == pytest.approx(base.sims["colocated"].period_s + 6.0)
    assert {e.name: e.bytes_per_step for e in const.edges}["tools"] == 64 * 8 * 2 * 100
    # slow and spread (median 5 s, sigma 1.5): the round waits for its slowest sample's tools, async for the mean
    slow = _plan("tools.calls_per_sample=2", "tools.latency_s=5", "tools.latency_sigma=1.5")
    t = slow.tools
    assert t.round_tail_s > 5 * t.mean_s > 0
    colo = slow.sims["colocated"].period_s - base.sims["colocated"].period_s
    asyn = slow.sims["async"].period_s - base.sims["async"].period_s
    assert colo == pytest.approx(t.round_tail_s, rel=1e-6)
    assert 0 <= asyn <= t.mean_s + 1e-9 < colo  # async: R + mean against T = 30 s; the tail is hidden
    from rollyard.plan.record import decision_record
    assert "async hides" in decision_record(slow) and "Tools:" not in decision_record(base)
