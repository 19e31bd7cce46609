"""On-policy distillation (algo.objective=distill | rl+distill, teacher.*): the trainer's gradient equals a direct
autograd of the stated objective (fp32), with the teacher inline and on a Ray pool; every placement runs with a
teacher; bad settings end in one line (exit 2)."""

import json
import random

import pytest
import torch

from rollyard.algo.policy_loss import LossSpec
from rollyard.cli import main
from rollyard.model.loading import build_preset, char_tokenizer, export
from rollyard.placement.teacher import InlineTeacher
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "trainer.lr=5e-2"]


def _samples(seed: int, groups: int = 3, n: int = 2, zero_adv: bool = False) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(3, 9))]
        for k in range(n):
            c = [rng.randrange(3, 40) for _ in range(rng.randint(2, 8))]
            out.append(Sample(id=f"r{g}#{k}", request_id=f"r{g}", prompt_ids=prompt, completion_ids=c,
                              logprobs=[0.0] * len(c), versions=[0] * len(c), finish_reason="stop",
                              advantage=0.0 if zero_adv else rng.uniform(-1, 1)))
    return out


def _teacher():
    return build_preset("tiny", char_tokenizer(), seed=11)


def _token_logprobs(model, s: Sample) -> torch.Tensor:
    """log pi(completion tokens) by a plain forward of the HF module (no packing, no chunking)."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(s.completion_ids)[:, None]).squeeze(-1)


def _oracle_grads(model, samples: list[Sample], reward_weight: float, coef: float, agg: str) -> dict:
    """The stated objective, differentiated directly: per token ``-reward_weight x A_seq x log pi + coef x
    (log pi - log pi_teacher)^2 / 2`` (on-policy its gradient is the per-token surrogate's with advantage
    ``reward_weight x A_seq - coef x (log pi_old - log pi_teacher)``), aggregated as ``agg``."""
    model.zero_grad(set_to_none=True)
    terms = []
    for s in samples:
        lp = _token_logprobs(model, s)
        t = torch.tensor(s.teacher_logprobs)
        terms.append(-reward_weight * s.advantage * lp + coef * 0.5 * (lp - t) ** 2)
    if agg == "token-mean":
        loss = torch.cat(terms).sum() / sum(len(t) for t in terms)
    else:  # seq-mean-token-mean
        loss = torch.stack([t.mean() for t in terms]).sum() / len(terms)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _trainer_grads(objective: str, coef: float, agg: str, fill) -> tuple[dict, dict]:
    """(the trainer's gradient, the oracle's) for ``objective`` with the teacher's logprobs filled by ``fill``."""
    torch.manual_seed(0)
    student = build_preset("tiny", char_tokenizer(), seed=0)
    weight = 0.0 if objective == "distill" else 1.0
    spec = LossSpec(agg=agg, reward_weight=weight, distill_coef=coef)
    trainer = Trainer(student, loss=spec, precision="fp32", micro_batch_tokens=40)
    samples = _samples(3)
    for s, lp in zip(samples, trainer.logprobs(samples)):  # on-policy: mu = pi_old, the IS weight is 1
        s.logprobs = lp.tolist()
    fill(trainer, samples)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate_gradients(samples)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    return got, _oracle_grads(student, samples, weight, coef, agg)


def _assert_equal(got: dict, want: dict) -> None:
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-4  # the objective moves the weights: the comparison means something
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert worst <= 1e-5 * scale + 1e-7, f"max |grad - oracle| {worst:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("objective, coef, agg", [("distill", 1.0, "token-mean"), ("distill", 0.5, "seq-mean-token-mean"),
                                                  ("rl+distill", 0.3, "token-mean")])
def test_gradient_equals_autograd_of_the_objective(objective, coef, agg):
    teacher = InlineTeacher(_teacher())
    got, want = _trainer_grads(objective, coef, agg, lambda trainer, samples: teacher.fill(trainer, samples))
    _assert_equal(got, want)


def test_zero_reward_advantage_is_trained_under_distillation():
    """Useful-work skipping leaves out zero-advantage samples under rl, never under a distillation objective."""
    samples = _samples(4, zero_adv=True)
    rl = Trainer(build_preset("tiny", char_tokenizer(), seed=0), loss=LossSpec())
    assert not any(rl.moves_weights(s) for s in samples)
    kd = Trainer(build_preset("tiny", char_tokenizer(), seed=0), loss=LossSpec(reward_weight=0.0, distill_coef=1.0))
    assert all(kd.moves_weights(s) for s in samples)
    InlineTeacher(_teacher()).fill(kd, samples)
    for s, lp in zip(samples, kd.logprobs(samples)):
        s.logprobs = lp.tolist()
    m = kd.step(samples)
    assert m["skipped_frac"] == 0.0 and m["grad_norm"] > 0 and m["distill_kl"] != 0


def test_missing_teacher_logprobs_is_refused():
    kd = Trainer(build_preset("tiny", char_tokenizer(), seed=0), loss=LossSpec(reward_weight=0.0, distill_coef=1.0))
    with pytest.raises(ValueError, match="teacher_logprobs for every completion token"):
        kd.step(_samples(5))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny model directory (another init than the student's), as a run's exported model/ is."""
    out = tmp_path_factory.mktemp("teacher") / "model"
    tok = char_tokenizer()
    export(build_preset("tiny", tok, seed=11, max_position_embeddings=48), tok, out)
    return out


def test_other_tokenizer_exit_2(tmp_path, capsys):
    tok = char_tokenizer()
    model = build_preset("tiny", tok, seed=11, max_position_embeddings=48)
    tok.add_tokens(["<extra>"])
    export(model, tok, tmp_path / "other")
    capsys.readouterr()  # the export's progress
    assert main(["train", *TINY, "algo.objective=distill", f"teacher.model={tmp_path / 'other'}",
                 f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizes differently from the student" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("override, needle", [
    (["algo.objective=distill"], "teacher.model is not set"),
    (["teacher.model=tiny"], "algo.objective=rl uses no teacher"),
    (["algo.objective=distill", "teacher.model=tiny", "teacher.placement=pool"], "placement=colocated runs one process"),
    (["algo.objective=rl+distill", "teacher.model=tiny", "algo.dynamic_sampling=true"], "every sampled token carries"),
    (["algo.objective=distill", "teacher.model=/nonexistent/teacher"], "teacher.model="),
])
def test_bad_teacher_settings_exit_2(tmp_path, capsys, override, needle):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def _rows(run) -> list[dict]:
    return list(rundir.read_jsonl(run / rundir.METRICS))


def _check_distill_run(run, placement: str = "inline") -> None:
    rows = _rows(run)
    assert all(r["train/skipped_frac"] == 0.0 and "train/distill_kl" in r for r in rows)
    traffic = [t for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "teacher_logprobs"]
    assert [t["bytes"] for t in traffic] == [4 * r["tokens/generated"] for r in rows]  # 4 B per completion token
    spans = {s["role"] for s in rundir.read_jsonl(run / rundir.SPANS)}
    assert "teacher" in spans and (placement != "pool" or "teacher_pool" in spans)
    info = json.loads((run / rundir.RUN_INFO).read_text())
    assert info["teacher_params"] > 0 and len(info["teacher"]["checksum"]) >= 16


def test_colocated_distill_run_and_resume(tmp_path, teacher_dir, capsys):
    """A colocated run distils (teacher inline, edges, spans, review); a resume with the same teacher continues and
    one whose teacher changed is refused in one line."""
    run = tmp_path / "kd"
    args = ["train", *TINY, "algo.objective=distill", f"teacher.model={teacher_dir}", f"out_dir={run}",
            "checkpoint_every=2"]
    assert main([*args, "steps=2"]) == 0
    _check_distill_run(run)
    assert main(["review", str(run)]) == 0
    assert main(["train", "--resume", str(run), "steps=3"]) == 0
    assert len(_rows(run)) == 3
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "steps=4", "teacher.model=tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "this run was trained with teacher" in err and len(err.splitlines()) == 1, err


def test_plan_prices_the_teacher(capsys):
    """The teacher's forward is its own phase, teacher: 2 x P_teacher x tokens on the trainer GPUs, every sample
    scored (the samples the trainer skips too), on the critical path inline and colocated, off it on a pool in a
    split placement (as the reference's pool is); its log-probs are 4 B per completion token on the ledger. By hand:
    64 x 8 = 512 sequences of 200 prompt + 1000 completion tokens = 614,400 tokens; 2 x 1e9 x 614,400 FLOPs at
    4e14 FLOP/s on each of 8 trainer GPUs = 0.384 s. The colocated step (R + W + F + T + reload) and the trainer-bound
    disaggregated step (20 s train + teacher > 10 s rollout) grow by exactly that."""
    import json

    from rollyard.plan.command import plan_main
    from rollyard.plan.inputs import load_plan
    from rollyard.plan.planner import make_plan

    base = ["phases.rollout_s=10", "phases.train_s=20", "phases.use_reference=false", "rollout.prompts=64",
            "rollout.samples=8", "rollout.prompt_tokens=200", "rollout.avg_tokens=1000", "trainer.dp=8",
            "trainer.flops_per_gpu=4e14", "trainer.zero_advantage_share=0.25", "sync.receiver=none", "sync.fixed_s=0"]
    want = 2 * 1e9 * (64 * 8 * (200 + 1000)) / (4e14 * 8)
    assert want == pytest.approx(0.384)
    for placement in ("colocated", "disaggregated"):
        plain = make_plan(load_plan(None, [*base, f"placement={placement}"]))
        kd = make_plan(load_plan(None, [*base, f"placement={placement}", "phases.teacher_params=1e9"]))
        assert plain.phases.teacher == 0 and kd.phases.teacher == pytest.approx(want, rel=1e-9)
        assert kd.phases.reference == plain.phases.reference == 0  # no longer inside the reference phase
        grown = kd.sims[placement].period_s - plain.sims[placement].period_s
        assert grown == pytest.approx(want, rel=1e-6), placement
        pool = make_plan(load_plan(None, [*base, f"placement={placement}", "phases.teacher_params=1e9",
                                          "phases.teacher_placement=pool"]))
        off = pool.sims[placement].period_s - plain.sims[placement].period_s
        # colocated keeps the teacher inline; a split placement's pool scores overlapped, off the trainer's path
        assert off == pytest.approx(want if placement == "colocated" else 0.0, rel=1e-6, abs=1e-9), placement
        assert kd.step_budget()["teacher"] == pool.step_budget()["teacher"] == pytest.approx(want)
    big = make_plan(load_plan(None, [*base, "phases.teacher_params=4e9"]))
    assert big.phases.teacher == pytest.approx(4 * want)  # the teacher's own size
    # measured: a 15 s teacher inline puts the trainer's side at 15 + 20 = 35 s, over rollout's 10; on a pool it
    # leaves the trainer's path
    split = ["placement=disaggregated", "phases.teacher_params=4e9", "phases.teacher_s=15"]
    period = {w: make_plan(load_plan(None, [*base, *split, f"phases.teacher_placement={w}"])).sims["disaggregated"]
              for w in ("inline", "pool")}
    sync = period["inline"].period_s - 35.0  # the weights' transfer, the same either way
    assert 0 <= sync < 1 and period["pool"].period_s == pytest.approx(20.0 + sync)  # off the path: the 20 s train
    edges = {e.name: e for e in big.edges}
    assert edges["teacher_logprobs"].bytes_per_step == pytest.approx(4 * big.bytes.rollout_tokens)
    plain = make_plan(load_plan(None, base))
    assert {e.name: e for e in plain.edges}["teacher_logprobs"].bytes_per_step == 0
    pool = make_plan(load_plan(None, [*base, *split[:2], "phases.teacher_placement=pool"]))
    assert big.memory.reference_per_gpu > 0 and pool.memory.reference_per_gpu == 0

    # the phase table and --json list it term by term, like every estimated phase; a plan without a teacher has no row
    term = "teacher: forward (2 x P_teacher x tokens)"
    capsys.readouterr()
    assert plan_main([*base, "phases.teacher_params=1e9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["phases"]["teacher"] == pytest.approx(want) and doc["step_budget"]["teacher"] == pytest.approx(want)
    assert {k: v for k, v in doc["phases"]["terms"].items() if k.startswith("teacher")} == pytest.approx({term: want})
    assert not any("teacher" in k for k in doc["phases"]["terms"] if k.startswith("reference"))
    assert "2 x 1e+09 x 6.14e+05 tokens" in doc["phases"]["source"]["teacher"]

    def phase_rows(out: str) -> list[str]:
        table = out.split("Phase times per step")[1].split("Steps per hour")[0]
        return [ln.strip("│ ") for ln in table.splitlines()]

    assert plan_main([*base, "phases.teacher_params=1e9"]) == 0
    rows = phase_rows(capsys.readouterr().out)
    row = next(i for i, ln in enumerate(rows) if ln.startswith("teacher "))
    below = " ".join(rows[row:next(i for i, ln in enumerate(rows) if ln.startswith("algorithm "))])
    assert "0.38" in rows[row] and "0.38 │   forward (2 x P_teacher x tokens)" in below, below
    assert plan_main(base) == 0
    assert not any(ln.startswith("teacher") for ln in phase_rows(capsys.readouterr().out))  # no teacher: no row


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, teacher_dir):
    """A 3-step colocated distillation run with no reference (algo.kl_coef 0): the teacher's forward is the
    trainer's only scoring, spanned as teacher, and no reference span."""
    run = tmp_path_factory.mktemp("distill_review") / "run"
    assert main(["train", *TINY, "algo.objective=distill", f"teacher.model={teacher_dir}", "steps=3", "seed=1",
                 f"out_dir={run}"]) == 0
    return run


def test_review_holds_the_teacher_to_its_budget(distill_run, tmp_path, capsys):
    """The run-implied plan carries the measured teacher seconds (phases.teacher_s) and a plan calibrated from the
    run budgets the teacher phase at that mean, with no reference budget: review --plan shows the budget and passes.
    The same plan with teacher_s twenty times the measured seconds flags the teacher under budget, at a twentieth
    over, and fails, at a tight tolerance (two-sided, as every phase)."""
    import yaml

    from rollyard.plan.command import plan_main, review_main
    from rollyard.plan.review import FAIL, PASS, phase_seconds, plan_from_run, read_run, review, steady

    run = read_run(distill_run)
    per = steady(phase_seconds(run.spans))
    assert "reference" not in per and per["teacher"]
    measured = sum(per["teacher"]) / len(per["teacher"])
    implied = plan_from_run(run).phases
    assert implied.teacher_s == pytest.approx(measured) and implied.teacher_params > 0 and not implied.use_reference

    out = tmp_path / "cal"
    assert plan_main(["--calibrate-from", str(distill_run), "--out", str(out)]) == 0
    capsys.readouterr()
    data = yaml.safe_load((out / "plan.yaml").read_text())
    assert data["phases"]["teacher_s"] == pytest.approx(measured)

    def held(scale: float, tolerance=None):
        path = tmp_path / f"x{scale}.yaml"
        path.write_text(yaml.safe_dump({**data, "phases": {**data["phases"], "teacher_s": scale * measured}}))
        rv = review(distill_run, path, tolerance)
        row = next(p for p in rv.phases if p["role"] == "teacher")
        item = next(v for v in rv.verification if v["item"] == "Measured step breakdown matches the budget")
        return path, rv, row, item

    path, rv, row, item = held(1.0)
    assert row["budget_s"] == pytest.approx(measured) and not row["flag"], row
    assert rv.plan.step_budget()["reference"] == 0  # the teacher's seconds are not in the reference's budget
    assert item["result"] == PASS, item
    assert review_main([str(distill_run), "--plan", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip("│ ").startswith("teacher "))
    assert f"{measured:.4g}" in line.split("│")[6], line  # a budget in its column, not "-"

    tight = 0.2
    floor = 0.01 * sum(rv.plan.step_budget().values())  # review's noise floor, 1% of the planned step
    assert measured * (1 - 0.05 * (1 + tight)) > 2 * floor, (measured, floor)  # the over case is not noise
    for scale, direction in ((20.0, "under"), (0.05, "over")):
        _, _, row, item = held(scale, tolerance=tight)
        assert row["budget_s"] == pytest.approx(scale * measured)
        assert row["flag"] and row["direction"] == direction and item["result"] == FAIL, (scale, row, item)
        assert f"teacher {measured:.3g} s vs {scale * measured:.3g} s" in item["evidence"], item
        path = held(scale, tolerance=tight)[0]
        capsys.readouterr()
        review_main([str(distill_run), "--plan", str(path), "--tolerance", str(tight)])
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip("│ ").startswith("teacher "))
        assert line.split("│")[8].strip() == direction.upper(), line  # the table's flag says which way
    assert not held(1.0, tolerance=tight)[2]["flag"]


def ray_test(fn):
    return pytest.mark.ray(pytest.mark.slow(pytest.mark.usefixtures("ray_session")(fn)))


@ray_test
def test_pool_teacher_gradient_equals_autograd_of_the_objective():
    """The teacher on its Ray actors (reference_pool's machinery, role teacher): the same log-probs as inline, and
    the trainer's gradient over them equals the direct autograd of the objective."""
    from rollyard.config import RunConfig
    from rollyard.placement.reference_pool import ReferencePool

    cfg = RunConfig.model_validate({"algo": {"objective": "distill"}, "teacher": {"model": "tiny", "placement": "pool"},
                                    "trainer": {"precision": "fp32", "micro_batch_tokens": 40}})
    pool = ReferencePool(cfg, _teacher(), workers=2, role="teacher", field="teacher_logprobs")
    try:
        def fill(trainer, samples):
            pool.submit(samples[:2], step=0)  # one group sent ahead, as a rollout worker does; the rest at fill
            spans = pool.fill(trainer, samples, step=0)
            assert {s["role"] for s in spans} == {"teacher_pool"}
            inline = [list(s.teacher_logprobs) for s in samples]
            InlineTeacher(_teacher()).fill(trainer, samples)
            assert max(abs(a - b) for x, y in zip(inline, samples) for a, b in zip(x, y.teacher_logprobs)) < 1e-5
        got, want = _trainer_grads("distill", 1.0, "token-mean", fill)
        _assert_equal(got, want)
        assert set(pool.metrics()) == {"teacher/ready_frac", "teacher/rescored"}
    finally:
        pool.stop()


@ray_test
def test_async_pool_teacher_run_matches_colocated_inline_run(tmp_path, teacher_dir):
    """Async at bound 0 trains on exactly colocated's samples; with the teacher on its pool (scored as each group
    ships) the loss and the reverse KL equal the inline teacher's, step by step."""
    colo, asyn = tmp_path / "colo", tmp_path / "async"
    kd = ["algo.objective=rl+distill", "algo.distill_coef=0.5", f"teacher.model={teacher_dir}", "steps=3"]
    assert main(["train", *TINY, *kd, f"out_dir={colo}"]) == 0
    assert main(["train", *TINY, *kd, f"out_dir={asyn}", "placement=async", "max_staleness=0",
                 "teacher.placement=pool"]) == 0
    a, c = _rows(asyn), _rows(colo)
    for ra, rc in zip(a, c, strict=True):
        assert ra["tokens/generated"] == rc["tokens/generated"]
        assert ra["train/distill_kl"] == pytest.approx(rc["train/distill_kl"], abs=1e-5)
        assert ra["loss"] == pytest.approx(rc["loss"], abs=1e-5)
    assert sum(r["teacher/ready_frac"] for r in a) > 0  # some groups were scored before the trainer asked
    _check_distill_run(asyn, "pool")


@ray_test
def test_disaggregated_pool_teacher_run(tmp_path, teacher_dir):
    """Disaggregated with the teacher on a pool: every sample distilled, its edge and spans, and review passes."""
    run = tmp_path / "dis"
    assert main(["train", *TINY, "algo.objective=distill", f"teacher.model={teacher_dir}", "steps=3",
                 f"out_dir={run}", "placement=disaggregated", "teacher.placement=pool"]) == 0
    _check_distill_run(run, "pool")
    assert main(["review", str(run)]) == 0


@pytest.mark.slow
def test_vllm_backend_distills(tmp_path):
    """rollout.backend=vllm (preset tiny64: a head_dim vLLM's CPU attention takes) with an inline teacher: the
    teacher scores on the trainer's side, over the support vLLM sampled from."""
    pytest.importorskip("vllm")
    tok = char_tokenizer()
    export(build_preset("tiny64", tok, seed=11, max_position_embeddings=48), tok, tmp_path / "teacher")
    run = tmp_path / "vllm"
    assert main(["train", *TINY, "model.name=tiny64", "rollout.backend=vllm", "algo.objective=rl+distill",
                 f"teacher.model={tmp_path / 'teacher'}", "steps=2", f"out_dir={run}"]) == 0
    _check_distill_run(run)
