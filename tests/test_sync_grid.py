"""Every sync mode over every transport in both Ray placements, with weights that really change.

Each run trains 3 steps on a reward a random tiny model earns some of (tests/dense_reward.py), so
every step moves the weights; ``sync.check_every=1`` makes the driver compare every worker's
weights checksum with the trainer's after every sync (the run stops on a mismatch). The test then
checks that each sync was checked (``sync/checked``, the ``sync_check`` spans), that the checked
checksums differ from sync to sync (the weights changed), and that the bytes the transport
reported for every sync are within 5% of ``rollyard plan``'s prediction
(``plan.bytes.predicted_sync_bytes``) for the same parameters, rollout dtype and -- for a delta --
the fraction of values it carried, -- for LoRA -- the adapter / base ratio.
"""

import json
from pathlib import Path

import pytest

from rollyard.cli import main
from rollyard.plan.bytes import predicted_sync_bytes
from rollyard.telemetry import rundir

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
BASE = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "eval_every=0", HOOK, "steps=3", "sync.check_every=1"]
MODES = {
    "full": ["sync.mode=full"],
    # bf16 at a small learning rate: a sparse delta (indices or a bitmask), not a dense one
    "delta": ["sync.mode=delta", "rollout.dtype=bf16", "trainer.lr=2e-5"],
    # r=4: the adapter's values are ~12x its wire header (a ~80 B entry per tensor, 60 tensors), which the
    # plan counts from the format (plan/bytes.py framing_bytes; without it: 8.7% over)
    "lora": ["model.lora.r=4"],
}
GRID = [(p, m, t) for p in ("disaggregated", "async") for m in MODES for t in ("ray", "dist")]


def index_bytes(frac: float, bpp: int) -> float:
    """Index bytes per changed element the plan charges for the encoding delta.py picks at ``frac``."""
    if frac < 1 / 32:
        return 4.0
    return 1 / (8 * frac) if bpp * (1 - frac) > 1 / 8 else 0.0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement,mode,transport", GRID)
def test_every_mode_over_every_transport(tmp_path, placement, mode, transport):
    run = tmp_path / "r"
    assert main(["train", *BASE, *MODES[mode], f"placement={placement}", f"sync.transport={transport}",
                 f"out_dir={run}"]) == 0
    info = json.loads((run / rundir.RUN_INFO).read_text())
    assert (info["sync_mode"], info["sync_transport"]) == (mode, transport)
    spans = list(rundir.read_jsonl(run / rundir.SPANS))
    syncs = [s for s in spans if s["role"] == "sync" and s["worker"] == "driver"]
    checks = [s for s in spans if s["role"] == "sync_check"]
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert [s["version"] for s in syncs] == [1, 2, 3] and [c["version"] for c in checks] == [1, 2, 3]
    assert [r["sync/checked"] for r in rows] == [1, 1, 1]
    assert len({c["checksum"] for c in checks}) == 3, "the weights did not change between syncs"
    assert any(r["reward_std"] > 0 for r in rows)
    # the logprob canary answered by the workers at equal versions: fp32 kernels or bf16 rounding, no alarm
    canaries = [r for r in rows if "canary/logprob_gap" in r]  # the alarm is judged in the same row
    assert canaries and not any(r["alarm/logprob_canary"] for r in canaries)
    P, bpp = info["policy_params"], info["bytes_per_param"]
    for s in syncs:
        if mode == "delta":
            frac = s["values"] / P
            assert frac < 0.5, f"a dense delta ({frac:.0%} of the values): not the sparse path"
            predicted = predicted_sync_bytes(P, bpp, "delta", delta_fraction=frac,
                                             delta_index_bytes=index_bytes(frac, bpp))
        else:
            predicted = predicted_sync_bytes(P, bpp, mode, lora_fraction=info["lora_fraction"] or 0.0,
                                             tensors=info["lora_tensors" if mode == "lora" else "weight_tensors"])
        assert abs(s["bytes"] / predicted - 1) < 0.05, (s, predicted)
    # the ledger's weights edge is what the transport reported: the start-up sync, then one per step
    traffic = [r["bytes"] for r in rundir.read_jsonl(run / rundir.TRAFFIC) if r["edge"] == "weights"]
    assert traffic[1:] == [s["bytes"] for s in syncs[1:]] and traffic[0] > syncs[0]["bytes"]
