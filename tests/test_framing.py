"""What comes before each question: ``data.system_prompt`` and ``data.few_shot`` (``tasks/framing.py``), for chat
prompts (a model with a chat template) and plain prompts (a base model), and their bad inputs as one line."""

from __future__ import annotations

import pytest

from rollyard import roles
from rollyard.cli import main
from rollyard.config import load_config
from rollyard.model.loading import char_tokenizer
from rollyard.tasks import framing
from rollyard.tasks import reasoning_gym as rgt
from rollyard.tasks.base import DataError, Prompt

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (pip install 'rollyard[reasoning-gym]')")

TASK = "reasoning_gym:chain_sum"
OPTS = "data.task_options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def _prompts(*overrides, template=None):
    cfg = load_config(None, [f"data.task={TASK}", OPTS, "data.train_size=6", "data.eval_size=3", *overrides])
    tok = char_tokenizer()
    tok.chat_template = template
    return roles.prompts(cfg, [], tok)


def test_system_prompt_and_shots_come_before_every_chat_prompt():
    train, held = _prompts("data.system_prompt=Reply with the number.", "data.few_shot=2", template=TEMPLATE)
    bare_train, bare_held = _prompts(template=TEMPLATE)
    shots = rgt.generate(TASK, "shots", 2, 0, min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                         exclude=rgt.questions(held))
    head = (f"<system>Reply with the number.\n<user>{shots[0].meta['entry']['question']}\n<assistant>"
            f"{shots[0].meta['answer']}\n<user>{shots[1].meta['entry']['question']}\n<assistant>"
            f"{shots[1].meta['answer']}\n")
    for framed, bare in zip(train + held, bare_train + bare_held):
        assert framed.text == head + bare.text  # the question itself is untouched, after the same head
        assert framed.meta == bare.meta and framed.id == bare.id  # the verifier sees the same entry
        assert [m["role"] for m in framed.messages] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_a_base_model_gets_question_answer_paragraphs():
    (p, *_), held = _prompts("data.system_prompt=Add the numbers.", "data.few_shot=1")
    shot = rgt.generate(TASK, "shots", 1, 0, min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                        exclude=rgt.questions(held))[0]
    q = p.meta["entry"]["question"]
    assert p.messages is None
    assert p.text == (f"Add the numbers.\n\n{shot.meta['entry']['question']}\nAnswer: {shot.meta['answer']}\n\n"
                      f"{q}\nAnswer:")


def test_the_three_seed_ranges_never_meet():
    for s in (0, 1, 2146, 10**9):
        seeds = sorted(rgt.split_seed(split, s) for split in ("train", "eval", "shots"))
        assert all(a + rgt.SPAN <= b for a, b in zip(seeds, seeds[1:]))


def test_a_prompt_with_its_own_system_turn_keeps_it():
    own = Prompt(id="a", text="", meta={}, messages=[{"role": "system", "content": "mine"},
                                                     {"role": "user", "content": "q"}])
    none = Prompt(id="b", text="", meta={}, messages=[{"role": "user", "content": "q"}])
    plain = Prompt(id="c", text="2+2=", meta={})
    framing.frame([own, none, plain], "theirs")
    assert own.messages == [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    assert none.messages == [{"role": "system", "content": "theirs"}, {"role": "user", "content": "q"}]
    assert plain.text == "theirs\n\n2+2="


def test_reasoning_gym_system_prompts_by_name():
    assert framing.system_text("reasoning_gym:direct").startswith("Answer the question directly.")
    assert framing.system_text("Be brief.") == "Be brief." and framing.system_text(None) is None
    with pytest.raises(DataError, match=r"reasoning-gym has no system prompt 'terse'; its names are .*direct"):
        framing.system_text("reasoning_gym:terse")


@pytest.mark.parametrize("args, says", [
    (["data.task=arithmetic", "data.few_shot=2"], "data.few_shot=2 needs a reasoning_gym:<task>"),
    ([f"data.task={TASK}", "data.system_prompt=reasoning_gym:terse"], "has no system prompt 'terse'"),
    ([f"data.task={TASK}", "data.few_shot=-1"], "data.few_shot"),
    (["data.path=DATA", "data.few_shot=1"], "this run reads prompts from data.path"),
])
def test_bad_framing_is_one_line_exit_2(tmp_path, capsys, args, says):
    capsys.readouterr()
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    args = [a.replace("DATA", str(data)) for a in args]
    assert main(["train", "steps=1", "sft.auto=false", "progress=false", *args, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "Traceback" not in err[0], err


def test_no_held_out_question_is_trained_on_or_shown_as_an_example():
    # two 1-digit terms: 200 questions, so a 4000-prompt train split and 64 held-out prompts would share ~55
    one_digit = "data.task_options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"
    cfg = load_config(None, [f"data.task={TASK}", one_digit, "data.train_size=4000", "data.eval_size=64",
                             "data.few_shot=8"])
    train, held = roles.prompts(cfg, [], char_tokenizer())
    q = {p.meta["entry"]["question"] for p in held}
    raw_train = rgt.generate(TASK, "train", 4000, 0, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len(q) > 40 and sum(p.meta["entry"]["question"] in q for p in raw_train) > 500  # the case is real
    assert len(train) == 4000 and not {p.meta["entry"]["question"] for p in train} & q
    shots = train[0].text.split("\n\n")[:8]  # the examples' paragraphs, before the question
    assert len(shots) == 8 and all(s.rsplit("\nAnswer:", 1)[0] not in q for s in shots)
    # every question outside the held-out split is still trained on
    assert {p.meta["entry"]["question"] for p in train} == {p.meta["entry"]["question"] for p in raw_train} - q


def test_a_problem_space_the_held_out_split_fills_is_one_line(tmp_path, capsys):
    capsys.readouterr()
    tiny = "data.task_options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"
    assert main(["train", "steps=1", "sft.auto=false", "progress=false", f"data.task={TASK}", tiny,
                 "data.eval_size=4000", f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "problem space is too small for a held-out split" in err[0], err
