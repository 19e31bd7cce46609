"""``rollout.stop_tokens``: strings that end a response as EOS does (vLLM's stop_token_ids), for a base model that
answers a plain prompt and then goes on writing the next question."""

from __future__ import annotations

import pytest
import torch

from rollyard.cli import main
from rollyard.config import ConfigError
from rollyard.model.loading import build_preset, char_tokenizer, eos_ids
from rollyard.rollout.engine import RolloutEngine
from rollyard.types import Request

TOK = char_tokenizer()


def test_a_stop_token_ends_the_response_where_it_first_appears():
    torch.manual_seed(0)
    model = build_preset("tiny", TOK, seed=0, max_position_embeddings=64).eval()
    prompts = [TOK.encode(t, add_special_tokens=False) for t in ("12+7=", "3+45=", "60+2=", "9+9=")]
    free = [s.completion_ids for s in RolloutEngine(model, eos_token_id=-1, pad_token_id=0, temperature=0.0).generate(
        [Request(id=f"r{i}", prompt_ids=p, n=1, max_new_tokens=16) for i, p in enumerate(prompts)])[0]]
    # a token that a greedy completion writes somewhere in its middle: with it as a stop token, greedy decoding
    # gives that completion's prefix up to and including its first occurrence, and stops there
    inner = [t for c in free for t in c[1:-1]]
    stop = max(set(inner), key=inner.count)
    word = TOK.decode([stop])
    ids = eos_ids(model, TOK, [word])
    assert stop in ids and TOK.eos_token_id in ids
    cut = RolloutEngine(model, eos_token_id=ids, pad_token_id=0, temperature=0.0).generate(
        [Request(id=f"r{i}", prompt_ids=p, n=1, max_new_tokens=16) for i, p in enumerate(prompts)])[0]
    stopped = 0
    for c, s in zip(free, cut):
        want = c[:c.index(stop) + 1] if stop in c else c
        assert s.completion_ids == want, (word, c, s.completion_ids)
        stopped += stop in c
        assert s.finish_reason == ("stop" if stop in c else "length")
    assert stopped >= 1


def test_a_stop_string_of_several_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.stop_tokens: 'ab' is 2 tokens of this tokenizer .* exactly one"):
        eos_ids(None, TOK, ["ab"])


def test_on_the_command_line_one_line_exit_2(tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", "steps=1", "sft.auto=false", "progress=false", "log.plots=false", "rollout.stop_tokens=[ab]",
                 f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'ab' is 2 tokens" in err[0] and "Traceback" not in err[0], err
