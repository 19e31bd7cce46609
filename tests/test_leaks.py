"""The suite's leak check (``tests/conftest.py``, ``leaves_no_trace``): a test that leaves a default process group, a
child process or a non-daemon thread behind fails at its teardown with one line naming what it left, and the next
test starts clean. Run on a tiny test file under this conftest in its own pytest process (pytester)."""

from __future__ import annotations

import os
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

LEAKY = '''
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

def test_leaves_a_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)

def test_then_a_process_group_starts_clean(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    dist.destroy_process_group()

def test_leaves_a_child():
    pytest.child = subprocess.Popen(["sleep", "300"])

def test_then_the_child_is_gone():
    assert pytest.child.wait(timeout=10) is not None

def test_leaves_a_thread():
    threading.Thread(target=time.sleep, args=(8.0,), name="forgotten").start()  # outlives the check's grace

def test_a_thread_on_its_way_out_is_not_a_leak():
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=1)  # as transformers' weight loading leaves it: shut down, not waited for
    pool.submit(time.sleep, 0.5)
    pool.shutdown(wait=False)

@pytest.fixture(scope="module")
def engine():
    p = subprocess.Popen(["sleep", "300"])
    yield p  # never stopped: the module's leak

def test_uses_a_module_engine(engine):
    assert engine.poll() is None  # alive while the module runs: not this test's leak

def test_cleans_up_after_itself(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    dist.destroy_process_group()
    subprocess.run(["true"], check=True)
'''


def test_a_leaking_test_fails_naming_what_it_left_and_the_next_starts_clean(pytester, monkeypatch):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=8, errors=4)
    said = {line.split(" left behind: ")[0]: line.split(" left behind: ")[1].split(". Close it in the test")[0]
            for line in result.outlines if " left behind: " in line and not line.startswith("ERROR")}
    assert sorted(said) == ["test_leaky.py (its module-scoped fixtures)", "test_leaky.py::test_leaves_a_child",
                            "test_leaky.py::test_leaves_a_process_group", "test_leaky.py::test_leaves_a_thread"]
    assert said["test_leaky.py::test_leaves_a_process_group"] == "a default torch.distributed process group (gloo, world size 1)"
    assert said["test_leaky.py::test_leaves_a_child"].startswith("1 child process alive (pid ")
    assert said["test_leaky.py::test_leaves_a_child"].endswith(": sleep 300)")
    assert said["test_leaky.py::test_leaves_a_thread"] == "1 non-daemon thread running (forgotten)"
    assert said["test_leaky.py (its module-scoped fixtures)"].startswith("1 child process alive (pid ")
