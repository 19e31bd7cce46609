"""reasoning-gym's tasks as data (``data.task=reasoning_gym:<task>``): splits, prompts, the task's own verifier
through the verifier pool, bad inputs as one line, and a short run whose accuracies are the task's verdicts."""

from __future__ import annotations

import json

import pytest

from rollyard.cli import main
from rollyard.model.loading import char_tokenizer
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.tasks import builtin_verifier, load_task, render_task
from rollyard.tasks import reasoning_gym as rgt
from rollyard.tasks.base import DataError
from rollyard.telemetry import rundir
from rollyard.types import Sample

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (pip install 'rollyard[reasoning-gym]')")

TASK = "reasoning_gym:chain_sum"
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def test_splits_come_from_seeds_that_never_meet_and_are_deterministic():
    train = load_task(TASK, "train", 300, seed=0)
    held = load_task(TASK, "eval", 60, seed=0)
    assert len(train) == 300 and len(held) == 60
    # item i of a split is reasoning-gym's item i of a dataset seeded at the split's seed: the ranges are disjoint
    t0, e0 = rgt.split_seed("train", 0), rgt.split_seed("eval", 0)
    assert t0 + 300 <= e0 and {p.meta["entry"]["metadata"]["source_index"] for p in held} == set(range(60))
    assert not {p.text for p in train} & {p.text for p in held}  # 2-6 terms of up to 4 digits: no chance repeats
    assert [p.meta for p in load_task(TASK, "eval", 60, seed=0)] == [p.meta for p in held]
    assert [p.text for p in load_task(TASK, "train", 50, seed=1)] != [p.text for p in train[:50]]
    for s in (0, 1, 2146, 2147, 10**9):  # every data.seed: train below 2**31, eval above, neither past 2**32
        assert rgt.split_seed("train", s) + rgt.SPAN <= 2**31 <= rgt.split_seed("eval", s)
        assert rgt.split_seed("eval", s) + rgt.SPAN <= 2**32
    p = train[0]
    assert p.id == f"{TASK}/train/0" and p.meta["task"] == TASK and p.demo == p.meta["answer"]
    assert p.messages == [{"role": "user", "content": p.meta["entry"]["question"]}]
    json.dumps([q.meta for q in train + held])  # meta travels to the verifier workers and into the run files


def test_task_options_reach_create_dataset():
    prompts = load_task(TASK, "train", 40, seed=3, min_terms=3, max_terms=3, max_digits=1)
    assert {p.meta["entry"]["metadata"]["num_terms"] for p in prompts} == {3}
    assert all(p.meta["entry"]["metadata"]["expression"].count(" ") == 4 for p in prompts)
    assert all(p.meta["options"] == {"min_terms": 3, "max_terms": 3, "max_digits": 1} for p in prompts)


def test_chat_or_plain_prompts_by_the_model_template():
    tok = char_tokenizer()  # no chat template: a base model's plain prompt
    plain = load_task(TASK, "train", 3, seed=0, **SMALL)
    render_task(TASK, plain, tok)
    assert all(p.messages is None and p.text == p.meta["entry"]["question"] + "\nAnswer:" for p in plain)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    chats = load_task(TASK, "train", 3, seed=0, **SMALL)
    render_task(TASK, chats, tok)
    assert all(p.messages and p.text == f"<user>{p.meta['entry']['question']}\n<assistant>" for p in chats)
    bare = load_task(TASK, "train", 1, seed=0, **SMALL)
    render_task(TASK, bare, char_tokenizer(), override="{{ messages[0]['content'] }}!")  # data.chat_template
    assert bare[0].text == bare[0].meta["entry"]["question"] + "!"


def _sample(p, text: str) -> Sample:
    ids = list(text.encode())
    return Sample(id=p.id, request_id=p.id, prompt_ids=[1], completion_ids=ids, logprobs=[0.0] * len(ids),
                  versions=[0] * len(ids), finish_reason="stop", meta={**p.meta, "prompt": p.text})


def test_the_task_own_score_answer_scores_in_the_verifier_pool():
    prompts = load_task(TASK, "eval", 4, seed=0, **SMALL)
    answers = [p.meta["answer"] for p in prompts]
    completions = [answers[0],                                  # the answer: 1
                   f"<answer>{answers[1]}</answer> then more",  # the last <answer> tag: 1
                   f"\n +{answers[2]}.00\nQuestion: 1 + 1 =",   # first non-empty line; chain_sum's decimal compare: 1
                   answers[3] + "9",                            # the task's partial credit: len(oracle) / len(answer)
                   "x"]                                         # wrong: 0
    pool = RewardDispatcher([builtin_verifier(TASK)], num_workers=1, timeout_s=30.0, decode=lambda ids: bytes(ids).decode())
    try:
        scored = pool.score([_sample(p, c) for p, c in zip(prompts + prompts[:1], completions)])
    finally:
        pool.close()
    partial = len(answers[3]) / (len(answers[3]) + 1)
    assert [s.reward for s in scored] == [1.0, 1.0, 1.0, partial, 0.0], [(s.reward, s.reward_flag) for s in scored]
    # an exact-match verifier would give the third 0: these are chain_sum's own verdicts
    assert rgt.extract(completions[2]) != answers[2]


@pytest.mark.parametrize("name,options,says", [
    ("reasoning_gym:chain_summ", {}, "has no task 'chain_summ'; did you mean reasoning_gym:chain_sum?"),
    (TASK, {"max_term": 3}, "data.task_options.max_term: reasoning_gym:chain_sum has no such option; its options "
                            "are min_terms, max_terms"),
    (TASK, {"size": 3}, "data.task_options.size is set by rollyard"),
    (TASK, {"min_terms": 5, "max_terms": 2}, "not valid for reasoning_gym:chain_sum: AssertionError: max_terms must "
                                             "be >= min_terms"),
])
def test_bad_task_names_and_options_are_data_errors(name, options, says):
    with pytest.raises(DataError) as e:
        load_task(name, "train", 2, 0, **options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setattr(rgt, "reasoning_gym", None)
    with pytest.raises(DataError, match=r"needs the reasoning_gym package, which is not installed; pip install "
                                        r"'rollyard\[reasoning-gym\]'"):
        load_task(TASK, "train", 2, 0)


TINY = ["model.context=128", "data.train_size=16", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false", "reward.timeout_s=30"]


def test_unknown_task_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", *TINY, "steps=1", "data.task=reasoning_gym:no_such_task", f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no task 'no_such_task'" in err[0] and "Traceback" not in err[0], err


def test_a_run_on_a_reasoning_gym_task_scores_with_its_verifier(tmp_path):
    run = tmp_path / "run"
    opts = "data.task_options={min_terms: 2, max_terms: 2, max_digits: 1}"
    assert main(["train", *TINY, "steps=1", f"data.task={TASK}", opts, f"out_dir={run}"]) == 0
    rows = [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines()]
    assert any("reward/accuracy" in r for r in rows) and any("eval/accuracy" in r for r in rows)
    info = json.loads((run / rundir.RUN_INFO).read_text())
    assert TASK in json.dumps(info)
