"""Data-parallel trainer ranks (trainer/dp.py, trainer/fsdp.py): real gloo groups, real processes.

Each test starts one handle (rank 0 here, rank 1 a process rollyard spawns) and closes it.
"""

import copy
import json

import pytest
import torch
from cli_runs import straight_and_resumed

from rollyard import checkpoint, roles
from rollyard.cli import main
from rollyard.config import ConfigError, load_config
from rollyard.telemetry import rundir
from rollyard.trainer.dp import DataParallelTrainer
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

K = 2


def _cfg(*extra):
    return load_config(None, [f"trainer.dp={K}", "model.context=64", "trainer.micro_batch_tokens=64", *extra])


def _samples(seed, n=10, ref=False):
    """Random samples; ``ref``: with reference logprobs (then the step reports ``kl``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, 80, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(4, 80, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i % 3}", prompt_ids=p, completion_ids=c,
                          logprobs=(-torch.rand(len(c), generator=g)).tolist(), versions=[0] * len(c),
                          finish_reason="stop", advantage=float(torch.randn(1, generator=g)),
                          ref_logprobs=(-4 * torch.rand(len(c), generator=g)).tolist() if ref else None))
    return out


def _pair(cfg):
    """(dp handle over a tiny policy, a single-rank Trainer over an identical copy)."""
    model, _, _ = roles.policy(cfg, "cpu")
    single = Trainer(copy.deepcopy(model), **roles.trainer_kwargs(cfg), device="cpu")
    return DataParallelTrainer(cfg, model, "cpu"), single


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def test_dp2_update_equals_dp1_and_gradient_bytes_follow_the_ring(tmp_path):
    # a learning-rate schedule with warm-up: every rank steps at the same rate, and a checkpoint carries its position
    cfg = _cfg("steps=5", "trainer.lr_schedule=cosine", "trainer.warmup_steps=1")
    dp, single = _pair(cfg)
    start = copy.deepcopy(dp.model)
    try:
        for step in range(2):
            batch = _samples(step, ref=step == 1)
            m1, m2 = single.step(copy.deepcopy(batch)), dp.step(copy.deepcopy(batch))
            keys = ["loss", "pg_loss", "grad_norm", "entropy", "clip_frac", "logprob_diff", "logprob_diff_max",
                    "ratio_p05", "ratio_p50", "ratio_p95", "tokens"] + (["kl"] if step == 1 else [])
            for key in keys:
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
            assert m2["lr"] == m1["lr"] and (m1["lr"] > 0) == (step > 0)
            assert _max_diff(dp.model, single.model) < 2e-5
        assert _max_diff(dp.model, start) > 1e-4  # the steps did move the weights

        # The ring all-reduce's per-rank wire: 2 (k-1)/k x message, the message all fp32 gradients.
        message = 4 * sum(p.numel() for p in dp.model.parameters())
        ring = 2 * (K - 1) / K * message
        assert dp.wire["measured"] == 1.0  # socket bytes (/proc/self/io), not a count of tensors
        assert abs(dp.wire["gradient_bytes"] / ring - 1) < 0.05, (dp.wire, ring)

        # Checkpoint with dp=2; unsharded state is rank 0's in the single-rank format, so a dp=1
        # trainer resumes it and takes the same next step as the dp=2 ranks.
        state = checkpoint.TrainState(step=2, version=2)
        path = checkpoint.save(tmp_path, state, dp.model, dp.optimizer)
        model1, _, _ = roles.policy(cfg, "cpu")
        resumed = Trainer(model1, **roles.trainer_kwargs(cfg), device="cpu")
        checkpoint.load(path, model1, resumed.optimizer)
        batch = _samples(7)
        assert resumed.step(copy.deepcopy(batch))["lr"] == dp.step(copy.deepcopy(batch))["lr"] == single.step(batch)["lr"]
        assert _max_diff(dp.model, model1) < 2e-5
    finally:
        dp.close()


def test_dp2_skips_zero_advantage_and_a_rank_with_nothing_to_train_still_joins():
    """The ranks skip samples that cannot move the weights; the update equals an unskipped single rank's:
    with one rank left with nothing to train (it joins the all-reduce with zeros), then with a batch that is
    zero everywhere (no forward anywhere; the optimizer still steps, Adam's moments move the weights)."""
    cfg = _cfg()
    model, _, _ = roles.policy(cfg, "cpu")
    single = Trainer(copy.deepcopy(model), **{**roles.trainer_kwargs(cfg), "skip_zero_advantage": False}, device="cpu")
    dp = DataParallelTrainer(cfg, model, "cpu")
    try:
        for step, nonzero in enumerate((1, 0)):
            batch = _samples(30 + step)
            for s in batch[nonzero:]:
                s.advantage = 0.0
            m1, m2 = single.step(copy.deepcopy(batch)), dp.step(copy.deepcopy(batch))
            assert m2["skipped_frac"] == pytest.approx(1 - nonzero / len(batch)) and m1["skipped_frac"] == 0.0
            assert m2["micro_batches"] == nonzero and m1["micro_batches"] >= 1
            for key in ("loss", "grad_norm", "tokens"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
            assert _max_diff(dp.model, single.model) < 2e-5
    finally:
        dp.close()


def test_fsdp_gather_then_publish_equals_unsharded_and_resumes_on_same_k_only(tmp_path):
    cfg = _cfg("trainer.sharding=fsdp")
    dp, single = _pair(cfg)
    start = copy.deepcopy(dp.model)
    try:
        for step in range(2):
            batch = _samples(10 + step)
            single.step(copy.deepcopy(batch))
            dp.step(copy.deepcopy(batch))
        assert _max_diff(dp.model, start) == 0  # the published copy changes only by the gather
        layers = 4 * sum(p.numel() for p in dp.model.model.layers.parameters())
        sent = dp.gather()
        assert _max_diff(dp.model, single.model) < 2e-5 and _max_diff(dp.model, start) > 1e-4
        assert abs(sent / ((K - 1) / K * layers) - 1) < 0.05  # each rank sends its shard once

        path = checkpoint.save(tmp_path, checkpoint.TrainState(step=2), dp.model, dp.optimizer)
        saved = torch.load(path / checkpoint.OPTIM, weights_only=False)
        assert len(saved["rollyard_fsdp_ranks"]) == K
        plain = Trainer(copy.deepcopy(dp.model), **roles.trainer_kwargs(cfg), device="cpu")
        with pytest.raises(ConfigError, match=f"trainer.dp={K} trainer.sharding=fsdp"):
            checkpoint.load(path, plain.model, plain.optimizer)
        checkpoint.load(path, dp.model, dp.optimizer)  # same k: loads into every rank's shard
        batch = _samples(20)
        single.step(copy.deepcopy(batch))
        dp.step(copy.deepcopy(batch))
        dp.gather()
        assert _max_diff(dp.model, single.model) < 2e-5
    finally:
        dp.close()


TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", f"trainer.dp={K}"]


def test_sent_bytes_counts_the_collectives_threads_not_a_background_file_writer(tmp_path):
    """The gradient bytes are measured as the bytes the process writes around the all-reduce; a checkpoint
    written in the background at the same time (a Python thread writing files) must not count, the main
    thread's own writes must."""
    import threading

    from rollyard.trainer.dp import sent_bytes

    wrote, release = threading.Event(), threading.Event()

    def background():
        (tmp_path / "checkpoint.bin").write_bytes(b"x" * (4 << 20))
        wrote.set()
        release.wait(30)

    before = sent_bytes()
    t = threading.Thread(target=background)
    t.start()
    assert wrote.wait(30)
    (tmp_path / "main.bin").write_bytes(b"y" * (1 << 20))
    after = sent_bytes()
    release.set()
    t.join()
    assert before is not None and (1 << 20) <= after - before < (1 << 20) + (256 << 10), after - before


@pytest.mark.slow
def test_train_dp2_resume_and_review(tmp_path):
    straight, split = straight_and_resumed(TINY, tmp_path, stop_at=2, steps=3)
    a, b = (list(rundir.read_jsonl(r / rundir.METRICS)) for r in (straight, split))
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        assert ra["reward"] == rb["reward"]
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
    info = json.loads((straight / rundir.RUN_INFO).read_text())
    assert (info["dp"], info["sharding"], info["dp_backend"]) == (K, "none", "gloo")
    grads = [r["bytes"] for r in rundir.read_jsonl(straight / rundir.TRAFFIC) if r["edge"] == "gradients"]
    assert len(grads) == 3 and all(g > 0 for g in grads)
    from rollyard.plan.review import review
    rows = {r["edge"]: r for r in review(straight).traffic}
    assert rows["gradients"]["status"] == "ok", rows["gradients"]


def test_bad_input_exit_2(tmp_path, capsys):
    assert main(["train", "trainer.sharding=fsdp", f"out_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.sharding=fsdp" in err and "trainer.dp=1" in err and "Traceback" not in err
    assert main(["train", "trainer.dp=4096", "sft.auto=false", f"out_dir={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.dp=4096" in err and "available" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_train_fsdp_gather_is_a_span_and_an_edge(tmp_path):
    run = tmp_path / "fsdp"
    assert main(["train", *TINY, "trainer.sharding=fsdp", "steps=2", f"out_dir={run}"]) == 0
    spans = [s for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "gather"]
    assert [s["step"] for s in spans] == [0, 1]
    ledger = list(rundir.read_jsonl(run / rundir.TRAFFIC))
    assert all(r["bytes"] > 0 for r in ledger if r["edge"] in ("gather", "gradients"))
    from rollyard.plan.review import review
    rows = {r["edge"]: r for r in review(run).traffic}
    assert rows["gradients"]["status"] == "ok" and rows["gather"]["status"] == "ok", (rows["gradients"], rows["gather"])
