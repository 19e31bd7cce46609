"""Placements: the staleness bound at admission and consumption, prompt accounting, on-policy
equivalence of async at bound 0, in-flight policies, a killed rollout actor, resume, bad input."""

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from rollyard import roles, staleness
from rollyard.accounting import PromptLedger
from rollyard.cli import main
from rollyard.config import ConfigError, load_config
from rollyard.model.loading import load_policy
from rollyard.placement.rollout_actor import RolloutWorker
from rollyard.telemetry import rundir
from rollyard.types import Request, WeightUpdate

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1"]
LONG = [*TINY, "model.context=64", "rollout.max_new_tokens=40"]  # generation outlasts a trainer step


def _metrics(run: Path) -> list[dict]:
    return list(rundir.read_jsonl(run / rundir.METRICS))


def _trained(run: Path) -> list[list[str]]:
    """Request ids of each optimizer step, from the train spans (async) or rollout spans (colocated)."""
    spans = list(rundir.read_jsonl(run / rundir.SPANS))
    role = "train" if any(s["role"] == "train" and "requests" in s for s in spans) else "rollout"
    return [s["requests"] for s in sorted(spans, key=lambda s: s["step"]) if s["role"] == role and "requests" in s]


def _ledger(run: Path) -> dict:
    ckpt = max((run / rundir.CHECKPOINTS).iterdir())
    return json.loads((ckpt / "state.json").read_text())["cursor"]["ledger"]


def _assert_accounted(run: Path) -> None:
    """Every prompt id in exactly one final state; trained ones are exactly those trained, once each."""
    led = _ledger(run)
    trained, dead, live = set(led["trained"]), set(led["dead"]), {r["id"] for r in led["live"]}
    assert not (trained & dead) and not (trained & live) and not (dead & live)
    steps = [i for ids in _trained(run) for i in ids]
    assert len(steps) == len(set(steps)), "a prompt was trained twice"
    assert set(steps) == trained


# ---- pure parts -------------------------------------------------------------------------------------

def test_staleness_functions():
    assert staleness.min_fresh_version(5, 2) == 3 and staleness.min_fresh_version(1, 3) == 0
    assert staleness.is_fresh(3, 5, 2) and not staleness.is_fresh(2, 5, 2)
    assert staleness.histogram(staleness.lags(4, [4, 3, 3, 1])) == [1, 2, 0, 1]
    # colocated samples from a copy published every sync.every steps: up to sync.every - 1 versions old
    assert staleness.bound_of("colocated", 3, 1) == 0 and staleness.bound_of("colocated", 0, 3) == 2
    assert staleness.bound_of("disaggregated", 0, 2) == 2
    assert staleness.bound_of("async", 3, 1) == 3


def test_ledger_transitions_and_checkpoint_round_trip():
    led = PromptLedger()
    reqs = [Request(id=f"p{i}", prompt_ids=[1, 2], n=2) for i in range(4)]
    led.add(reqs)
    led.hand_out(["p0", "p1", "p2"], "w0")
    led.finished(["p0"])
    led.trained(["p0"])
    with pytest.raises(RuntimeError, match="trained -> trained"):
        led.trained(["p0"])
    with pytest.raises(RuntimeError, match="queued -> deferred"):
        led.finished(["p3"])
    assert [q.id for q in led.requeue(led.on_worker("w0"))] == ["p1", "p2"]
    led.dead(["p3"])
    assert led.counts() == {"queued": 2, "in_flight": 0, "deferred": 0, "trained": 1, "dead": 1}
    assert [q.id for q in led.queued()] == ["p1", "p2"]
    again = PromptLedger()
    again.load_state_dict(json.loads(json.dumps(led.state_dict())))
    assert again.state == led.state and again.queued() == led.queued()


def _full(model, version):
    return WeightUpdate(version=version, mode="full", tensors={n: p.detach().clone() for n, p in model.named_parameters()})


class _Out(list):
    def put(self, item):
        self.append(item)


def test_worker_admission_holds_work_past_the_bound():
    """A round meant for step t starts only on weights >= t - bound; a weight update releases it."""
    cfg = load_config(None, TINY)
    model, _ = load_policy("tiny", seed=0, max_position_embeddings=48)
    out = _Out()
    w = RolloutWorker(cfg.model_dump(mode="json"), "w", 0, _full(model, 0), out, bound=1, inflight="finish",
                      settings=roles.settings(cfg))
    a, b = Request("a", [1, 5, 6], n=2, max_new_tokens=4), Request("b", [1, 7, 6], n=2, max_new_tokens=4)
    w.submit([(a, 1), (b, 2)])
    w.poll()
    assert w.info()["held"] == 1 and w.info()["active"] == 2  # a admitted at version 0, b held (needs 1)
    for _ in range(10):
        w.poll()
    assert [rid for o in out for rid, _ in o["groups"]] == ["a"] and w.info()["held"] == 1
    w.update(_full(model, 1))
    for _ in range(10):
        w.poll()
    groups = [g for o in out for g in o["groups"]]
    assert [rid for rid, _ in groups] == ["a", "b"]
    assert {s.version for s in groups[1][1]} == {1} and w.info()["version"] == 1


def test_a_cpu_rollout_actor_starts_on_the_settings_of_a_trainer_on_cuda(monkeypatch):
    """The driver resolves the device, the sync plan and the bound once and hands them to every actor: a
    rollout actor (no GPU) of a trainer on ``cuda`` builds its copy in the trainer's publishing dtype
    (bf16 there) and starts equal to the trainer; resolving the device itself it could not start."""
    cfg = load_config(None, [*TINY, "placement=disaggregated", "trainer.device=cuda", "sync.mode=full"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the driver's device query: a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings = roles.settings(cfg)
    monkeypatch.undo()  # the actor's process: CPU only
    assert (settings.device, settings.plan.dtype, settings.bound) == ("cuda", torch.bfloat16, 1)
    with pytest.raises(ConfigError, match="trainer.device=cuda"):  # what the actor met when it resolved them itself
        roles.settings(cfg)
    model, _ = load_policy("tiny", seed=0, max_position_embeddings=48)
    from rollyard.sync.check import weights_checksum
    from rollyard.sync.factory import make_publisher
    from rollyard.sync.session import expected_checksum
    update = make_publisher(settings.plan.mode, settings.plan.dtype).publish(model, 0, full=True)
    w = RolloutWorker(cfg.model_dump(mode="json"), "rollout-0", 0, update, _Out(), settings.bound, "finish", settings)
    assert next(w.engine.model.parameters()).dtype == torch.bfloat16
    assert weights_checksum(w.engine.model) == expected_checksum(update)  # the pool's start-up equality check
    assert w.bound == settings.bound  # the carried staleness bound (admission), not one of its own


# ---- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, needle", [
    ("placement=nearby", "placement='nearby'"),
    ("max_staleness=-1", "max_staleness must be >= 0"),
    ("rollout.workers=1000", "rollout.workers=1000"),
    ("sync.mode=inprocess", "sync.mode=inprocess (a shared module) cannot reach it"),
])
def test_bad_placement_input_exit_2(tmp_path, capsys, override, needle):
    extra = ["placement=async"] if override.startswith(("rollout", "sync")) else []
    assert main(["train", *TINY, *extra, override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_async_with_inprocess_transport_exit_2(tmp_path, capsys):
    assert main(["train", *TINY, "placement=async", "sync.transport=inprocess", f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sync.transport=inprocess" in err and "sync.transport=ray" in err and len(err.splitlines()) == 1


# ---- on Ray -------------------------------------------------------------------------------------------

def ray_test(fn):
    """Marked ``ray`` and ``slow``; runs in the test run's one Ray session."""
    return pytest.mark.ray(pytest.mark.slow(pytest.mark.usefixtures("ray_session")(fn)))


@ray_test
def test_async_at_bound_0_trains_on_exactly_colocated_samples(tmp_path):
    colo, asyn = tmp_path / "colo", tmp_path / "async"
    assert main(["train", *TINY, "steps=3", f"out_dir={colo}", "rollout.temperature=1.0"]) == 0
    assert main(["train", *TINY, "steps=3", f"out_dir={asyn}", "placement=async", "max_staleness=0"]) == 0
    assert _trained(asyn) == _trained(colo)
    a, c = _metrics(asyn), _metrics(colo)
    for ra, rc in zip(a, c, strict=True):
        assert ra["tokens/generated"] == rc["tokens/generated"] and ra["reward"] == rc["reward"]
        assert ra["loss"] == pytest.approx(rc["loss"], abs=1e-6)
        assert ra["train/logprob_diff"] == pytest.approx(rc["train/logprob_diff"], abs=1e-6)
        assert ra[rundir.STALENESS_MAX] == 0
    info = json.loads((asyn / rundir.RUN_INFO).read_text())
    assert (info["placement"], info["sync_mode"], info["sync_transport"], info["staleness_bound"],
            info["rollout_workers"]) == ("async", "full", "ray", 0, 1)
    weights = [r["bytes"] for r in rundir.read_jsonl(asyn / rundir.TRAFFIC) if r["edge"] == "weights"]
    # Full fp32 weights through the object store, as the transport measured them (payload + framing):
    # one sync at start (step 0's row), one per step.
    full = info["policy_params"] * 4
    assert weights[0] == 2 * weights[1] and weights[1] == weights[2] and full <= weights[1] <= 1.01 * full
    _assert_accounted(asyn)


@ray_test
def test_disaggregated_is_one_step_off(tmp_path):
    run = tmp_path / "dis"
    assert main(["train", *TINY, "steps=3", f"out_dir={run}", "placement=disaggregated"]) == 0
    lags = [r[rundir.STALENESS_MAX] for r in _metrics(run)]
    assert lags[0] == 0 and all(lag <= 1 for lag in lags)  # round k+1 samples while step k trains
    # the trainer takes exactly round k at step k
    assert [{i.rsplit("@", 1)[1] for i in ids} for ids in _trained(run)] == [{"0"}, {"1"}, {"2"}]
    _assert_accounted(run)
    # the rollout actor's own process peak (it holds a model copy and imports torch: above 0.2 GB), per row and run
    peaks = [r["memory/rollout_actor_peak_gb"] for r in _metrics(run) if "memory/rollout_actor_peak_gb" in r]
    assert peaks and min(peaks) > 0.2  # in the rows of the steps that received the actor's work
    assert json.loads((run / rundir.SUMMARY).read_text())["memory_peak_gb"]["rollout_actor"] > 0.2


@ray_test
def test_consumption_drops_and_requeues_what_admission_let_through(tmp_path, capsys):
    """Workers admit two versions past the bound (test hook): stale groups reach the trainer, which
    drops each one with its reason, counts it and requeues its prompt; nothing stale is trained."""
    from rollyard.placement import async_

    cfg = load_config(None, [*LONG, "steps=4", "placement=async", "max_staleness=0", f"out_dir={tmp_path / 'r'}"])
    summary = async_.train(cfg, cfg.out_dir, admission_slack=2)
    rows = _metrics(Path(cfg.out_dir))
    assert all(r[rundir.STALENESS_MAX] == 0 for r in rows)
    dropped = sum(r["staleness/dropped"] for r in rows)
    assert dropped > 0 and summary["rollout/dropped"] == dropped
    reasons = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dropped stale group")]
    assert len(reasons) == dropped and all("accepts v" in ln and "prompt requeued" in ln for ln in reasons)
    assert _ledger(Path(cfg.out_dir))["requeues"] >= dropped
    # inflight=finish (the default): nothing spans an update, nothing is aborted
    assert sum(r["staleness/mixed_samples"] for r in rows) == 0 and sum(r["rollout/aborted"] for r in rows) == 0
    _assert_accounted(Path(cfg.out_dir))


@ray_test
@pytest.mark.parametrize("policy", ["abort", "continue"])
def test_inflight_policies_under_async(tmp_path, policy):
    """``finish`` is checked in the consumption test above (it is the default)."""
    run = tmp_path / policy
    # Two sequences decode at a time, so a round (8 samples x 40 tokens) takes four waves and the
    # next round is still decoding when the weights of the step before it arrive.
    assert main(["train", *LONG, "steps=4", f"out_dir={run}", "placement=async", "max_staleness=1",
                 "rollout.max_concurrent=2", f"rollout.inflight={policy}"]) == 0
    rows = _metrics(run)
    assert all(r[rundir.STALENESS_MAX] <= 1 for r in rows)
    mixed = sum(r["staleness/mixed_samples"] for r in rows)
    aborted = sum(r["rollout/aborted"] for r in rows)
    if policy == "abort":
        assert mixed == 0 and aborted > 0
    else:
        assert mixed > 0 and aborted == 0
    _assert_accounted(run)


@ray_test
def test_killed_rollout_actor_is_replaced_and_its_prompts_requeued(tmp_path):
    run = tmp_path / "kill"
    killed = []

    def kill_when_busy():
        # The worker's pid comes from its spans; kill -9 it once the first step is written.
        while not killed:
            spans = list(rundir.read_jsonl(run / rundir.SPANS)) if (run / rundir.SPANS).exists() else []
            pids = [s["pid"] for s in spans if s.get("worker") == "rollout-0"]
            if pids and (run / rundir.METRICS).exists() and (run / rundir.METRICS).stat().st_size:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            threading.Event().wait(0.05)

    t = threading.Thread(target=kill_when_busy, daemon=True)
    t.start()
    hook = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"  # non-zero rewards: weights change
    assert main(["train", *LONG, "steps=8", f"out_dir={run}", "placement=async", "max_staleness=1", hook]) == 0
    t.join(timeout=1)
    summary = json.loads((run / rundir.SUMMARY).read_text())
    assert killed and summary["rollout/restarts"] >= 1 and summary["steps"] == 8
    assert summary["prompts"]["trained"] == 8 * 2 and _ledger(run)["requeues"] >= 1
    _assert_accounted(run)


@ray_test
def test_async_resume_loses_no_prompt_and_trains_none_twice(tmp_path):
    run = tmp_path / "res"
    assert main(["train", *TINY, "steps=2", f"out_dir={run}", "placement=async", "max_staleness=2"]) == 0
    live = {r["id"] for r in _ledger(run)["live"]}
    assert live  # the checkpoint was taken with work in flight
    assert main(["train", "--resume", str(run), "steps=4"]) == 0
    _assert_accounted(run)
    led = _ledger(run)
    assert live <= set(led["trained"]) | {r["id"] for r in led["live"]}
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3]


@ray_test
def test_async_refills_a_round_whose_prompt_was_dead_lettered(tmp_path):
    """At bound 0 only one round can be sampled at a time: a dead-lettered prompt must be replaced
    or the trainer would wait for a group that never comes."""
    data = tmp_path / "d.jsonl"
    lines = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    lines.insert(1, {"prompt": "9" * 200 + "+1=", "answer": "x"})
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = tmp_path / "r"
    assert main(["train", *TINY, "steps=3", f"data.path={data}", "data.task=arithmetic", "placement=async",
                 "max_staleness=0", "reward.hook=rollyard.reward.verifiers:exact_match", f"out_dir={run}"]) == 0
    dead = list(rundir.read_jsonl(run / rundir.DEADLETTER))
    assert any("longer than the model context" in d["reason"] for d in dead)
    assert [len(ids) for ids in _trained(run)] == [2, 2, 2]  # 7 prompts: the first epoch is drawn whole
    _assert_accounted(run)


def test_feed_samples_a_prompt_once_per_round_and_requeues_first():
    from rollyard.model.loading import char_tokenizer
    from rollyard.rollout.scheduler import PromptFeed, PromptStream
    from rollyard.tasks.base import Prompt

    led = PromptLedger()
    feed = PromptFeed(PromptStream([Prompt("a", "1+1=", {}), Prompt("b", "2+2=", {})], seed=0), led, char_tokenizer(), 2, 4, 32)
    reqs, dead = feed.take(3, 0)  # 3 draws from 2 prompts: one repeats within the round
    assert sorted(q.id for q in reqs) == ["a@0", "b@0"] and len(dead) == 1 and "twice in one round" in dead[0]["reason"]
    led.hand_out([q.id for q in reqs], "w")
    led.requeue(["b@0"])
    again, _ = feed.take(2, 1)
    assert [q.id for q in again][0] == "b@0"  # requeued prompts go first, with their id
