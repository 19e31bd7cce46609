"""Per-role peak memory (telemetry/memory.py): host RSS everywhere, PyTorch's device memory on CUDA."""

import pytest
import torch

from rollyard.telemetry.memory import PeakMemory


def test_a_role_is_credited_the_peak_reached_while_it_ran_and_only_that():
    mem = PeakMemory("driver")
    mem.step_metrics()
    mem.enter("train")
    big = torch.ones(300 * 2**20 // 4)  # 300 MiB touched while 'train' runs
    del big
    mem.exit("train")
    mem.enter("rollout")
    mem.exit("rollout")
    got = mem.step_metrics()
    assert got["memory/trainer_peak_gb"] - got["memory/rollout_peak_gb"] > 0.25, got  # the reset between spans
    assert got["memory/driver_peak_gb"] >= got["memory/trainer_peak_gb"]
    if not torch.cuda.is_available():  # a process that never initialized CUDA reports no device figure
        assert not any("_gpu_" in k for k in got) and mem.run_peaks_gb(gpu=True) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_role_is_credited_its_device_memory_peak():
    weights = torch.ones(64 * 2**20 // 4, device="cuda")  # 64 MiB held throughout
    mem = PeakMemory("driver")
    mem.step_metrics()
    mem.enter("train")
    act = torch.ones(512 * 2**20 // 4, device="cuda")  # 512 MiB of 'activations', freed before the rollout
    del act
    mem.exit("train")
    mem.enter("rollout")
    mem.exit("rollout")
    got = mem.step_metrics()
    assert 0.6 < got["memory/trainer_gpu_peak_gb"] < 0.7, got
    assert 0.06 < got["memory/rollout_gpu_peak_gb"] < 0.12, got  # only the weights: the peak was reset
    assert mem.run_peaks_gb(gpu=True)["driver"] >= got["memory/trainer_gpu_peak_gb"]
    del weights
