"""Suite-wide settings: one intra-op thread (tiny models are overhead-bound, and on a busy 2-core
machine a second thread costs more in contention than it gains), Ray without auth or dashboard."""

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def toy_defaults():
    """In-process configs get the toy lr / max_new_tokens the suite was written for (tests/toy_defaults.py)."""
    from toy_defaults import defaults
    with defaults():
        yield


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray session for the whole test run (tests marked ``ray`` use it)."""
    import ray

    from rollyard.placement import cluster

    cluster.connect()
    yield ray
    ray.shutdown()
