"""The reward worker pool on its own: frames, a worker that cannot be restarted, and the broken pool."""

from __future__ import annotations

import pytest

from rollyard.reward import pool
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.types import Sample


def test_frames_survive_being_split_anywhere():
    data = pool.encode(("ready", 1)) + pool.encode((7, "ok", [[("ok", 1.0)]], 0.01))
    for cut in range(len(data) + 1):
        buf = bytearray(data[:cut])
        got = pool.decode_frames(buf)
        buf += data[cut:]
        got += pool.decode_frames(buf)
        assert got == [("ready", 1), (7, "ok", [[("ok", 1.0)]], 0.01)] and not buf


HOOK = '''
import os, sys
if os.path.exists({flag!r}) and "rollyard" not in sys.modules:  # a worker started after the flag
    raise RuntimeError("cannot import any more")

def score(completion, prompt, meta):
    if meta.get("die"):
        os._exit(3)
    return 1.0
'''


def _sample(i: int, **meta) -> Sample:
    return Sample(id=f"s{i}", request_id=f"r{i}", prompt_ids=[1], completion_ids=[2], logprobs=[], versions=[0],
                  finish_reason="stop", meta=meta)


def test_workers_that_cannot_restart_break_the_pool_and_flag_every_call(tmp_path, capsys):
    flag = tmp_path / "broken"
    hook = tmp_path / "flaky_hook.py"
    hook.write_text(HOOK.format(flag=str(flag)))
    with RewardDispatcher(f"{hook}:score", num_workers=1, decode=str) as d:
        assert [s.reward for s in d.score([_sample(0)])] == [1.0]
        flag.write_text("")
        [dead] = d.score([_sample(1, die=True)])
        assert dead.reward_flag == "error: worker died (exit code 3)"
        later = d.score([_sample(i) for i in range(2, 5)])  # the replacements fail to import: the pool breaks
        assert {s.reward_flag for s in later} == {"error: reward workers cannot start (RuntimeError: cannot import "
                                                 "any more)"}
        # one replacement for the dead worker, then MAX_START_FAILURES - 1 more before the pool gives up
        assert d._workers == [] and d.stats["worker_restarts"] == pool.MAX_START_FAILURES
    assert capsys.readouterr().err.count("every further reward call scores 0 with an error flag") == 1


def test_a_worker_that_cannot_start_at_all_is_a_start_up_error(tmp_path):
    hook = tmp_path / "only_here.py"
    hook.write_text('import sys\nif "rollyard" not in sys.modules:\n    raise ImportError("not in a worker")\n'
                    "def score(c, p, m):\n    return 1.0\n")
    with pytest.raises(ValueError, match="imports in this process but not in a worker process: ImportError: not in a"):
        RewardDispatcher(f"{hook}:score", num_workers=2, decode=str)


def test_a_worker_that_closes_its_pipe_and_lives_on_is_killed_within_the_bound(tmp_path, monkeypatch):
    """End of file on a worker's pipe means it is exiting; one whose hook closed the pipe and went on (here while
    importing) was waited for without a bound (a hang): it is killed after ``EOF_GRACE_S`` and said in one line."""
    import time

    monkeypatch.setattr(pool, "EOF_GRACE_S", 1.0)
    hook = tmp_path / "closes_its_pipe.py"
    hook.write_text('import os, sys, time\nif "rollyard" not in sys.modules:  # in the worker: the protocol pipe too\n'
                    '    os.closerange(3, 1024)\n    time.sleep(3600)\n'
                    "def score(c, p, m):\n    return 1.0\n")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="a worker process ended while importing it \\(closed its pipe to rollyard "
                                         "and was still running 1 s later: killed\\)") as e:
        RewardDispatcher(f"{hook}:score", num_workers=1, decode=str, start_timeout_s=600)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 60
