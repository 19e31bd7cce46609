"""Suite-wide settings: one intra-op thread (tiny models are overhead-bound, and on a busy 2-core
machine a second thread costs more in contention than it gains), Ray without auth or dashboard."""

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Memory: the suite's peak is measured with bench/suite_memory.py (docs/benchmarks.md, beside its time). Ray sizes its
# shared-memory object store from the machine (30% of the available memory) and its memory monitor kills
# workers once the machine passes 95% used, whoever holds the rest. The suite's objects are a few MB (tiny
# models' weights): a 512 MB store bounds what Ray may take whatever the machine, leaving the monitor's
# headroom to other processes (the suite passes with another process holding 8 GB of 24).
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(512 << 20))
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def toy_defaults():
    """In-process configs get the toy lr / max_new_tokens the suite was written for (tests/toy_defaults.py)."""
    from toy_defaults import defaults
    with defaults():
        yield


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray session per test process (tests marked ``ray`` use it): one for the run, or one per
    pytest-xdist worker under ``make test`` (TEST_WORKERS, each worker a whole file at a time)."""
    import ray

    from rollyard.placement import cluster

    cluster.connect()
    yield ray
    ray.shutdown()


# The files whose Ray / subprocess tests take longest, started first: `make test` runs whole files on two
# pytest-xdist workers, handed out in collection order, so a long file collected last would run alone at the
# end while the other worker idles (longest first: the last file to start is a short one). Order only: every
# file still runs every test. The list: the files with the longest tests in `pytest --durations=60` (2026-11-27).
LONGEST_FIRST = ("test_sync_grid.py", "test_placements.py", "test_restarts.py", "test_vllm.py", "test_reference.py",
                 "test_tail_ray.py", "test_reliability.py", "test_two_nodes.py", "test_dp_faults.py",
                 "test_determinism.py", "test_orphans.py", "test_tools.py", "test_ray_dp.py", "test_trainer.py",
                 "test_restart_booking.py", "test_review_runs.py", "test_security.py", "test_weight_check.py",
                 "test_dp.py", "test_trl_script.py", "test_support_learning.py", "test_memory_peaks.py",
                 "test_output.py", "test_plan.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
