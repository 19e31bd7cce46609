"""Reward hooks and the dispatcher, with real worker processes that hang, raise and die."""

from __future__ import annotations

import os
import time

import pytest

from rollyard.reward.dispatcher import RewardDispatcher, load_hook
from rollyard.tasks.base import HookError
from rollyard.types import Sample

HERE = os.path.dirname(os.path.abspath(__file__))
HOOKS = os.path.join(HERE, "verifiers_for_tests.py")
EOS = 1


def decode(ids: list[int]) -> str:
    assert EOS not in ids, "the dispatcher strips the trailing EOS before decoding"
    return "".join(chr(i) for i in ids)


def sample(i: int, completion: str, **meta) -> Sample:
    return Sample(id=f"s{i}", request_id=f"r{i}", prompt_ids=[ord(c) for c in "1+1="],
                  completion_ids=[ord(c) for c in completion] + [EOS], logprobs=[], versions=[0],
                  finish_reason="stop", meta=meta)


def dispatcher(fn: str, **kw) -> RewardDispatcher:
    return RewardDispatcher(f"{HOOKS}:{fn}", decode=decode, eos_token_id=EOS, **kw)


# ----------------------------------------------------------------------------------------- hooks
def test_load_hook_module_and_file_paths():
    fn = load_hook("rollyard.reward.verifiers:arithmetic")
    assert fn("19 ", "9+10=", {"answer": "19"}) == 1.0
    assert load_hook(f"{HOOKS}:ok")("x", "", {"answer": "x"}) == 1.0
    rel = os.path.relpath(HOOKS)
    assert load_hook(f"{rel}:ok")("y", "", {"answer": "x"}) == 0.0


@pytest.mark.parametrize("hook, message", [
    ("rollyard.reward.verifiers", "is malformed: a reward hook is 'module:function'"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    ("rollyard.reward.verifiers:exact_mach", "has no function 'exact_mach'; did you mean 'exact_match'"),
    ("missing/dir/hook.py:f", "does not exist"),
    (f"{HOOKS}:NOT_CALLABLE", "is a int, not a function"),
    (f"{HOOKS}:two_args", r"matches none of the three accepted reward forms: fn\(completion, prompt, meta\)"),
])
def test_bad_hooks_are_hook_errors(hook, message):
    with pytest.raises(HookError, match=message):
        load_hook(hook)
    with pytest.raises(HookError, match=message):  # the dispatcher fails in the parent, before any worker
        RewardDispatcher(hook, decode=decode)


def test_hook_whose_import_raises(tmp_path):
    bad = tmp_path / "broken_hook.py"
    bad.write_text("import no_such_dependency_abc\n\ndef f(c, p, m):\n    return 1.0\n")
    with pytest.raises(HookError, match=r"importing .*broken_hook.py failed: ModuleNotFoundError.*no_such_dependency_abc"):
        load_hook(f"{bad}:f")
    bad.write_text("raise RuntimeError('half-written module')\n")
    with pytest.raises(HookError, match="raised RuntimeError: half-written module"):
        load_hook(f"{bad}:f")
    assert issubclass(HookError, ValueError)


# ------------------------------------------------------------------------------------ dispatcher
def test_builtin_verifier_scores_in_input_order():
    samples = [sample(i, str(i % 3), answer="1") for i in range(40)]
    with RewardDispatcher("rollyard.reward.verifiers:arithmetic", num_workers=2, timeout_s=5, decode=decode,
                          eos_token_id=EOS) as d:
        out = d.score(samples)
        assert out == samples
        assert [s.reward for s in out] == [1.0 if i % 3 == 1 else 0.0 for i in range(40)]
        assert all(s.reward_flag is None for s in out)
        assert d.stats["scored"] == 40 and d.stats["errors"] == 0 and d.stats["timeouts"] == 0
        assert 0 < d.stats["latency_p50_s"] <= d.stats["latency_p99_s"] < 5
        assert 0 < d.stats["worker_start_s"] < 10


def test_prompt_text_comes_from_meta_or_decoded_prompt_ids():
    with dispatcher("echo_prompt") as d:
        a = sample(0, "ab", expect_prompt="1+1=", expect_completion="ab")
        b = sample(1, "cd", prompt="Q: 1+1=", expect_prompt="Q: 1+1=", expect_completion="cd")
        assert [s.reward for s in d.score([a, b])] == [1.0, 1.0]


def test_workers_do_not_import_torch():
    with dispatcher("torch_loaded", num_workers=1) as d:
        [s] = d.score([sample(0, "x")])
        assert s.reward_flag is None and s.reward == 0.0


def test_hanging_verifier_times_out_and_worker_is_replaced():
    with dispatcher("hang", num_workers=2, timeout_s=0.3) as d:
        pids_before = {w.proc.pid for w in d._workers}
        samples = [sample(i, "x", hang=(i % 3 == 0)) for i in range(7)]
        t0 = time.monotonic()
        d.score(samples)
        assert time.monotonic() - t0 < 10
        assert [s.reward_flag for s in samples] == ["timeout" if i % 3 == 0 else None for i in range(7)]
        assert [s.reward for s in samples] == [0.0 if i % 3 == 0 else 1.0 for i in range(7)]
        assert d.stats["timeouts"] == 3 and d.stats["errors"] == 0 and d.stats["scored"] == 7
        # the pool keeps its size, with fresh processes where the hung ones were killed
        assert len(d._workers) == 2 and d.stats["worker_restarts"] == 3
        killed = pids_before - {w.proc.pid for w in d._workers}
        assert killed
        for pid in killed:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        # and it still works afterwards
        more = d.score([sample(10 + i, "x", hang=False) for i in range(4)])
        assert [s.reward for s in more] == [1.0] * 4


def test_raising_verifier_is_flagged_not_fatal():
    with dispatcher("boom") as d:
        samples = d.score([sample(0, "x"), sample(1, "x", boom=False)])
        assert samples[0].reward == 0.0 and samples[0].reward_flag == "error: RuntimeError: verifier exploded"
        assert samples[1].reward == 1.0 and samples[1].reward_flag is None
        assert d.stats["errors"] == 1 and d.stats["worker_restarts"] == 0


def test_dying_worker_is_flagged_and_replaced():
    with dispatcher("die", num_workers=2) as d:
        samples = d.score([sample(i, "x", die=(i < 3)) for i in range(6)])
        for s in samples[:3]:
            assert s.reward == 0.0 and s.reward_flag.startswith("error: worker died") and "exit code 3" in s.reward_flag
        assert [s.reward for s in samples[3:]] == [1.0] * 3
        assert d.stats["errors"] == 3
        assert d.stats["worker_restarts"] == 3 and len(d._workers) == 2


def test_bad_return_values_and_prints():
    with dispatcher("not_a_number", num_workers=1) as d:
        [s] = d.score([sample(0, "x")])
        assert s.reward == 0.0 and s.reward_flag.startswith("error: TypeError: reward hook returned str")
    with dispatcher("noisy", num_workers=1) as d:  # print() in a hook goes to stderr, not into the protocol
        assert [s.reward for s in d.score([sample(i, "x") for i in range(3)])] == [0.5] * 3


def test_submit_and_stream_results():
    with dispatcher("ok", num_workers=3) as d:
        samples = [sample(i, "a" if i % 2 else "b", answer="a") for i in range(20)]
        for s in samples:
            d.submit(s)
        got = list(d.results())
        assert sorted(s.id for s in got) == sorted(s.id for s in samples)
        assert sum(s.reward for s in got) == 10
        assert list(d.results()) == []


def test_close_stops_workers():
    d = dispatcher("ok", num_workers=2)
    procs = [w.proc for w in d._workers]
    d.close()
    d.close()
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        d.submit(sample(0, "x"))
