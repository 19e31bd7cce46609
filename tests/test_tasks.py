"""Built-in tasks and the prompt dataset loader."""

from __future__ import annotations

import json

import pytest

from rollyard.reward import verifiers
from rollyard.tasks import TASKS, builtin_verifier, load_task
from rollyard.tasks.base import DataError, Prompt
from rollyard.tasks.dataset import load_prompts

CHARS = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=()<>?.,:;!'\"#[]{}_|^%&$@~\n")


# ---------------------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_splits_disjoint_and_deterministic(name):
    train = load_task(name, "train", 3000, seed=0)
    held = load_task(name, "eval", 200, seed=0)
    assert len(train) == 3000 and 100 <= len(held) <= 200
    assert len({p.text for p in held}) == len(held)  # an eval set never repeats a problem
    assert not {p.text for p in train} & {p.text for p in held}
    # disjoint across seeds too: the split is a property of the problem, not of the draw
    assert not {p.text for p in load_task(name, "train", 3000, seed=1)} & {p.text for p in held}
    assert [p.text for p in load_task(name, "eval", 50, seed=0)] == [p.text for p in held[:50]]
    assert [(p.id, p.text, p.meta, p.demo) for p in load_task(name, "train", 3000, seed=0)] == \
           [(p.id, p.text, p.meta, p.demo) for p in train]
    assert [p.text for p in load_task(name, "train", 50, seed=1)] != [p.text for p in train[:50]]
    assert len({p.id for p in train + held}) == len(train) + len(held)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_prompts_fit_the_char_vocab_and_demos_verify(name):
    fn = getattr(verifiers, builtin_verifier(name).split(":")[1])
    for p in load_task(name, "train", 500, seed=3) + load_task(name, "eval", 100, seed=3):
        assert isinstance(p, Prompt) and p.demo is not None
        assert len(p.text) < 24 and set(p.text) <= CHARS and set(p.demo) <= CHARS
        assert p.meta["task"] == name
        json.dumps(p.meta)
        assert fn(p.demo, p.text, p.meta) == 1.0
        assert fn(p.demo + "x", p.text, p.meta) == 0.0
        assert fn(" " + p.demo + "\n", p.text, p.meta) == 1.0


def test_arithmetic_values_and_difficulty():
    for p in load_task("arithmetic", "train", 300, seed=0, max_operand=12):
        a, op, b = p.text[:-1].partition("+") if "+" in p.text else p.text[:-1].partition("-")
        assert p.text.endswith("=") and max(int(a), int(b)) <= 12
        assert int(p.meta["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert all(len(p.meta["answer"]) <= 2 for p in load_task("arithmetic", "train", 1000, seed=0))


def test_repeat_lengths_are_long_tailed():
    lengths = sorted(len(p.demo) for p in load_task("repeat", "train", 2000, seed=0))
    median, p95 = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))]
    assert median <= 6 and p95 >= 3 * median and lengths[-1] >= 24
    p = load_task("repeat", "train", 1, seed=0)[0]
    k, unit = p.text[len("rep "):-1].split(" ")
    assert p.meta["answer"] == unit * int(k)


def test_tiny_problem_spaces_terminate():
    held = load_task("repeat", "eval", 100, seed=0, max_times=1, max_unit=1)
    assert len(held) < 26 and len({p.text for p in held}) == len(held)
    assert len(load_task("repeat", "train", 100, seed=0, max_times=1, max_unit=1)) == 100
    assert len(load_task("arithmetic", "train", 100, seed=0, max_operand=3)) == 100


def test_unknown_task_and_option_are_data_errors():
    with pytest.raises(DataError, match="did you mean 'arithmetic'"):
        load_task("arithmetc", "train", 1, 0)
    with pytest.raises(DataError, match="no option 'max_op'.*max_operand"):
        load_task("arithmetic", "train", 1, 0, max_op=5)
    with pytest.raises(ValueError, match="split"):
        load_task("arithmetic", "test", 1, 0)
    assert builtin_verifier("repeat") == "rollyard.reward.verifiers:repeat"


# -------------------------------------------------------------------------------------- dataset
def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_jsonl_defaults_and_field_mapping(tmp_path):
    f = write_jsonl(tmp_path / "gsm.jsonl", [
        {"prompt": "2+2=", "answer": "4"},
        "",
        {"prompt": "3+3=", "id": 7, "answer": "6", "level": 1},
    ])
    ps = load_prompts(f)
    assert [p.id for p in ps] == ["gsm:1", "7"]
    assert ps[1].meta == {"answer": "6", "level": 1} and ps[1].demo is None

    g = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "uid": "a", "solution": "2", "ref": "2", "answer": "x"}])
    [p] = load_prompts(g, fields={"prompt": "question", "id": "uid", "answer": "solution", "demo": "ref"})
    assert (p.id, p.text, p.demo) == ("a", "1+1=", "2")
    assert p.meta == {"answer": "2"}  # the mapped column wins over an unmapped one of the same name


@pytest.mark.parametrize("line, rule", [
    ('{"prompt": "ok", ', "not valid JSON"),
    ('["prompt", "x"]', "not an object"),
    ('{"question": "x"}', "no 'prompt' field"),
    ('{"prompt": 5}', "must be a string or a list of chat messages, got int"),
    ('{"prompt": ""}', "empty string"),
    ('{"prompt": "x", "id": [1]}', "id field 'id' must be a string or an integer"),
    ('{"prompt": "x", "id": "a"}', "duplicate id 'a' \\(first at line 1\\)"),
])
def test_malformed_line_names_file_line_and_rule(tmp_path, line, rule):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "first", "id": "a"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"data\.jsonl:2: .*{rule}") as e:
        load_prompts(f)
    assert "data.on_error=deadletter" in str(e.value)
    dead: list = []
    ps = load_prompts(f, on_error="deadletter", deadletter=dead)
    assert [p.text for p in ps] == ["first"]
    assert len(dead) == 1 and dead[0]["source"] == f"{f}:2"
    assert dead[0]["reason"] and "deadletter" not in dead[0]["reason"]


def test_bad_utf8_mapped_column_missing_and_empty_file(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: .*UTF-8"):
        load_prompts(f)
    g = write_jsonl(tmp_path / "m.jsonl", [{"q": "x", "sol": "1"}, {"q": "y"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: no 'sol' field \(data.fields maps answer to it\)"):
        load_prompts(g, fields={"prompt": "q", "answer": "sol"})
    with pytest.raises(DataError, match="no 'question' field .*data.fields maps prompt"):
        load_prompts(g, fields={"prompt": "question"})
    h = write_jsonl(tmp_path / "dead.jsonl", ["nope", "{}"])
    with pytest.raises(DataError, match="all 2 lines were malformed"):
        load_prompts(h, on_error="deadletter", deadletter=[])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no usable prompts"):
        load_prompts(tmp_path / "empty.jsonl")


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DataError, match="no such dataset file"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="unsupported dataset format '.csv'"):
        load_prompts(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="needs a `deadletter` list"):
        load_prompts(tmp_path / "x.csv", on_error="deadletter")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["1+1=", None, "2+2="], "solution": ["2", "0", "4"],
                             "n": [1, 2, 3]}), f)
    with pytest.raises(DataError, match=r"d\.parquet:2: field 'question' must be a string or a list of chat messages, got NoneType"):
        load_prompts(f, fields={"prompt": "question", "answer": "solution"})
    dead: list = []
    ps = load_prompts(f, fields={"prompt": "question", "answer": "solution"}, on_error="deadletter", deadletter=dead)
    assert [(p.id, p.text, p.meta) for p in ps] == [("d:1", "1+1=", {"answer": "2", "n": 1}),
                                                    ("d:3", "2+2=", {"answer": "4", "n": 3})]
    assert dead[0]["source"].endswith("d.parquet:2")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet")
