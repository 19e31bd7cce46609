"""GKD's sequence-level KD (algo.gkd_seq_kd, TRL's seq_kd=True): the off-policy share trains on completions the
teacher samples. They equal the teacher's own greedy ``generate`` (transformers, an independent sampler) at
temperature 0, stopping at EOS and at the cap; the trainer's gradient over them equals a direct autograd of the GKD
objective; TRL 1.16's own GKDTrainer with seq_kd=True (tests/trl_oracle.py) generates the same teacher completions
and computes the same loss and gradients over them (fp32); a colocated run with lmbda=0 trains on them and review
passes; TRL's name maps to the field; the combinations that cannot work end in one line (exit 2)."""

import pytest
import torch
from test_distill import TINY, _samples
from test_gkd import T, _assert_equal, _direct, _trainer_and_oracle

from rollyard.cli import main
from rollyard.config import load_config
from rollyard.model.loading import build_preset, char_tokenizer, export
from rollyard.placement import teacher as teacher_placement
from rollyard.placement import teacher_sampler
from rollyard.placement.teacher import InlineTeacher
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer

SEQ_KD = ["algo.objective=gkd", "algo.gkd_lmbda=0.0", "algo.gkd_seq_kd=true", "teacher.model=tiny"]


def _teacher():
    """The tiny teacher (seed 11), its EOS row made to outscore token 97 (which it greedily repeats after some
    prompts), so some of its completions stop at EOS and others run to the cap."""
    tok = char_tokenizer()
    model = build_preset("tiny", tok, seed=11, max_position_embeddings=48).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.1 * model.lm_head.weight[97]
    return model, tok


def _hf_greedy(model, prompt: list[int], room: int, eos: int) -> list[int]:
    """transformers' greedy ``generate`` of the teacher: the completion, up to and including its first EOS."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=room,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_off_policy_completions_are_the_teachers_greedy_generations():
    """lmbda=0, temperature 0: every sample becomes a copy carrying the teacher's greedy completion of its prompt
    (ending at EOS, "stop", or at max_new_tokens / the context, "length"), its logprobs the trainer's, its version
    the current one; scoring the copies gives the teacher's top-k of those tokens."""
    model, tok = _teacher()
    cfg = load_config(None, [*SEQ_KD, "rollout.temperature=0", "rollout.precision=fp32", "model.context=48"])
    teacher = InlineTeacher(model, top_k=4)
    teacher.sampler = teacher_sampler.build(cfg, teacher.model, tok)
    trainer = Trainer(build_preset("tiny", tok, seed=0, max_position_embeddings=48), precision="fp32")
    samples = _samples(5)
    out = teacher_placement.with_references(teacher, trainer, samples, seed=0, lmbda=0.0, max_new_tokens=6,
                                            context=48, version=3)
    reasons = set()
    for s, o in zip(samples, out, strict=True):
        want = _hf_greedy(model, s.prompt_ids, 6, tok.eos_token_id)
        assert o.completion_ids == want and o.id == s.id and o.prompt_ids == s.prompt_ids
        assert o.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")
        assert o.versions == [3] * len(want) and o.completion_mask is None
        assert o.logprobs == pytest.approx(trainer.logprobs([o])[0].tolist(), abs=1e-6)
        reasons.add(o.finish_reason)
    assert reasons == {"stop", "length"}  # both ends of a completion are exercised
    assert any(o.completion_ids != s.completion_ids for s, o in zip(samples, out))
    short = teacher_placement.with_references(teacher, trainer, samples, 0, 0.0, 6, context=len(samples[0].prompt_ids) + 2,
                                              version=3)[0]
    assert short.completion_ids == _hf_greedy(model, samples[0].prompt_ids, 2, tok.eos_token_id)  # the context's room
    teacher.fill(trainer, out)
    assert all(len(o.teacher_top_ids) == len(o.completion_ids) for o in out)


def test_sampled_completions_are_reproducible_per_group_and_differ_within_a_group():
    """At temperature 1 the teacher's samples are its own draws: a group's samples differ from each other, and the
    same groups sample the same completions again (a resume or a streamed round), whatever ran in between."""
    model, tok = _teacher()
    cfg = load_config(None, [*SEQ_KD, "rollout.temperature=1", "rollout.precision=fp32", "model.context=48"])
    sampler = teacher_sampler.build(cfg, model, tok)
    samples = _samples(6, groups=2, n=4)
    first = sampler.complete(samples, 6, 48)
    sampler.complete(_samples(7), 6, 48)
    assert sampler.complete(samples, 6, 48) == first
    group = [first[s.id][0] for s in samples if s.request_id == "r0"]
    assert len({tuple(c) for c in group}) > 1


def test_gradient_over_teacher_samples_equals_autograd_of_the_gkd_objective():
    """The samples replaced by the teacher's (sampled at temperature T), scored by the same teacher's top-6: the
    trainer's gradient equals a direct autograd of the renormalised generalized JSD on those tokens (fp32)."""
    tok = char_tokenizer()
    cfg = load_config(None, [*SEQ_KD, f"rollout.temperature={T}", "rollout.precision=fp32", "model.context=48"])
    original = []

    def fill(trainer, samples):
        original.extend(s.completion_ids for s in samples)
        teacher = InlineTeacher(build_preset("tiny", tok, seed=11), top_k=6)  # _trainer_and_oracle's teacher
        teacher.sampler = teacher_sampler.build(cfg, teacher.model, tok)  # samples and scores with the same weights
        samples[:] = teacher_placement.with_references(teacher, trainer, samples, 0, 0.0, 6, 48, version=0)
        teacher.fill(trainer, samples)
        drawn = teacher.sampler.complete(samples, 6, 48)
        assert [s.completion_ids for s in samples] == [drawn[s.id][0] for s in samples]

    _assert_equal(*_trainer_and_oracle(0.5, 6, _direct(0.5, 6), fill=fill))
    assert original  # the fill ran, over the student's completions it replaced


# ------------------------------------------------------------------------------------ TRL as the oracle

TAU = 1e-7  # TRL's generation temperature: GKDTrainer always samples (do_sample=True), so greedy is a tiny temperature


@pytest.fixture(scope="module")
def trl_pair():
    """The oracle's tiny Qwen2 student (seed 0) and teacher (seed 1; its head x 10, and its EOS row 1.05 x token 40's,
    so two of the four completions stop at EOS and two run to the cap), the BPE tokenizer, four prompts of 4 and 6
    tokens (TRL left-pads the shorter: its loss forward then runs at shifted positions, which RoPE's relative
    positions make equal up to float rounding)."""
    from trl_oracle import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    student, teacher = tiny_model(0, tok), tiny_model(1, tok)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10.0)
        teacher.lm_head.weight[tok.eos_token_id] = 1.05 * teacher.lm_head.weight[40]
    prompts = [tok(t)["input_ids"] for t in ("What is 3 plus 4?", "What is 11 plus 2?", "The answer is",
                                             "What is 7 plus 9?")]
    return student, teacher, tok, prompts


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_seq_kd_step_equals_trls_gkd_trainer(trl_pair, beta):
    """TRL 1.16's ``GKDTrainer`` with ``seq_kd=True, lmbda=0`` against rollyard's seq_kd path on the same teacher,
    student and prompts, fp32: the completions the teacher generates, the loss and every parameter's gradient.

    Why the comparison is exact. Generation: rollyard samples at ``temperature=0`` (greedy, its engine's argmax).
    TRL cannot (its generation config always samples), so it runs at temperature 1e-7; every top-1 / top-2 logit gap
    of the teacher along the generated completions is checked to be > 1e-3, so ``softmax(logits / 1e-7)`` puts
    exactly 0 (fp32 underflow: exp(-1e4)) on every other token and TRL's draw is the argmax; the same margin is far
    above the float rounding between rollyard's engine forward and transformers' ``generate``, so both argmaxes are
    the same token. The sampling rule: TRL draws once per batch (``random.random() <= lmbda``, the student on
    success, else with ``seq_kd`` the teacher), rollyard once per prompt (``algo/gkd.on_policy``); at ``lmbda=0``
    both give every sample the teacher's completion (TRL's draw fails unless ``random()`` returns exactly 0.0),
    which is the case held here. The loss: TRL's ``compute_loss`` takes the full-vocabulary generalized JSD at
    temperature 1 over the labels (up to and including the first EOS), token mean over the batch; rollyard with
    ``rollout.temperature=0`` trains at temperature 1 (``trainer/settings.py``) and ``algo.gkd_top_k`` = the
    vocabulary makes its top-k support the whole vocabulary. rollyard's settings are TRL's own names (``seq_kd``,
    ``lmbda``, ``beta``, ``temperature``, ``max_new_tokens``), mapped by ``aliases.py``."""
    import copy

    from trl_oracle import build_trl_gkd_trainer, trl_gkd_step

    from rollyard.trainer.settings import trainer_kwargs
    from rollyard.types import Sample

    student, teacher, tok, prompts = trl_pair
    trl = build_trl_gkd_trainer(copy.deepcopy(student), copy.deepcopy(teacher), tok, lmbda=0.0, beta=beta,
                                seq_kd=True, temperature=TAU, max_new_tokens=6)
    want_ids, want_loss, want_grads = trl_gkd_step(trl, prompts)

    V = len(tok)
    cfg = load_config(None, ["seq_kd=true", "lmbda=0.0", f"beta={beta}", "temperature=0", "max_new_tokens=6",
                             "teacher.model=tiny", f"algo.gkd_top_k={V}", "rollout.precision=fp32",
                             "trainer.precision=fp32", "model.context=64"])
    mine = InlineTeacher(copy.deepcopy(teacher), top_k=cfg.algo.gkd_top_k)
    mine.sampler = teacher_sampler.build(cfg, mine.model, tok)
    trainer = Trainer(copy.deepcopy(student), **trainer_kwargs(cfg), device="cpu")
    samples = [Sample(id=f"p{i}#0", request_id=f"p{i}", prompt_ids=p, completion_ids=[5], logprobs=[0.0], versions=[0],
                      finish_reason="length") for i, p in enumerate(prompts)]
    out = teacher_placement.with_references(mine, trainer, samples, cfg.seed, cfg.algo.gkd_lmbda,
                                            cfg.rollout.max_new_tokens, cfg.model.context, version=0)
    got_ids = [o.completion_ids for o in out]
    assert got_ids == want_ids
    assert {o.finish_reason for o in out} == {"stop", "length"} and all(len(c) <= 6 for c in got_ids)
    with torch.no_grad():  # the margin that makes both generations the teacher's argmax (docstring)
        gaps = [teacher(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].topk(2, -1).values
                for p, c in zip(prompts, got_ids)]
    assert min(float((g[:, 0] - g[:, 1]).min()) for g in gaps) > 1e-3

    mine.fill(trainer, out)
    trainer.optimizer.zero_grad(set_to_none=True)
    acc = trainer.accumulate_gradients(out)
    assert want_loss > 1e-2 and float(acc["loss"]) == pytest.approx(want_loss, rel=1e-5)
    got = {n: p.grad for n, p in trainer.model.named_parameters()}
    assert set(got) == set(want_grads)
    _assert_equal(got, want_grads)


# ------------------------------------------------------------------------------------ the run


@pytest.fixture(scope="module")
def eos_teacher(tmp_path_factory):
    """An exported tiny teacher whose every greedy completion is EOS alone (one token per completion)."""
    out = tmp_path_factory.mktemp("seq_kd_teacher") / "teacher"
    tok = char_tokenizer()
    teacher = build_preset("tiny", tok, seed=11, max_position_embeddings=48)
    with torch.no_grad():  # one large residual feature, read by the tied head with EOS's row twice any other's
        emb = teacher.model.embed_tokens.weight
        assert teacher.lm_head.weight is emb
        emb[:, 0] = 30.0
        emb[tok.eos_token_id, 0] = 60.0
    export(teacher, tok, out)
    return out


def test_seq_kd_run_trains_on_the_teachers_completions_and_review_passes(tmp_path, eos_teacher):
    """algo.gkd_seq_kd with lmbda=0 end to end at temperature 0: every trained sample is the teacher's greedy
    completion of its prompt (the teacher here runs into EOS at once, the student to the 6-token cap), the
    teacher_logprobs edge counts the trained tokens, and review passes."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "algo.objective=gkd", "algo.gkd_lmbda=0.0", "algo.gkd_seq_kd=true",
                 "algo.gkd_top_k=4", "rollout.temperature=0", f"teacher.model={eos_teacher}", "steps=2",
                 f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    traffic = [t["bytes"] for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "teacher_logprobs"]
    assert [r["train/tokens"] for r in rows] == [2 * 4] * 2  # 2 prompts x 4 samples x [EOS]
    assert all(r["tokens/generated"] > 8 for r in rows)
    assert traffic == [(4 + 8 * 4) * 8] * 2
    assert all(r["train/gkd_jsd"] >= 0 and abs(r["train/logprob_diff"]) < 1e-4 for r in rows)
    assert main(["review", str(run)]) == 0


def test_seq_kd_run_records_the_teachers_sampling_as_its_own_span(tmp_path, eos_teacher, capsys):
    """lmbda=0.5 over 4 steps of 2 prompts: each step with a prompt drawn off-policy (``algo/gkd.on_policy`` of the
    step's request ids, as the train span lists them) has one ``teacher_sample`` span of non-zero duration, inside the
    step's scoring, before the ``teacher`` span, with the sequences (4 per off-policy prompt) and tokens (1 each:
    the teacher's completion is EOS) sampled; a step with none has none. It is in trace.json, in the step's
    metrics (time/teacher_sample) and in review's phase listing."""
    import json

    from rollyard.algo import gkd

    run = tmp_path / "run"
    assert main(["train", *TINY, "algo.objective=gkd", "algo.gkd_lmbda=0.5", "algo.gkd_seq_kd=true",
                 "algo.gkd_top_k=4", "rollout.temperature=0", f"teacher.model={eos_teacher}", "steps=4", "seed=1",
                 f"out_dir={run}"]) == 0
    spans = list(rundir.read_jsonl(run / rundir.SPANS))
    rows = {r["step"]: r for r in rundir.read_jsonl(run / rundir.METRICS)}
    sampled = 0
    for step in range(4):
        mine = [s for s in spans if s["step"] == step]
        (train,) = [s for s in mine if s["role"] == "train"]
        off = [q for q in train["requests"] if not gkd.on_policy(q, 1, 0.5)]
        got = [s for s in mine if s["role"] == "teacher_sample"]
        if not off:
            assert not got and "time/teacher_sample" not in rows[step]
            continue
        sampled += 1
        (span,) = got
        (teacher,) = [s for s in mine if s["role"] == "teacher"]
        (reward,) = [s for s in mine if s["role"] == "reward"]
        assert span["end"] > span["start"] >= reward["end"] and span["end"] <= teacher["start"]
        assert (span["sequences"], span["tokens"]) == (4 * len(off), 4 * len(off))
        assert rows[step]["time/teacher_sample"] == pytest.approx(span["end"] - span["start"])
    assert 0 < sampled < 4  # both kinds of step occur
    trace = json.loads((run / rundir.TRACE).read_text())["traceEvents"]
    assert sum(1 for e in trace if e.get("cat") == "teacher_sample" and e["dur"] > 0) == sampled
    capsys.readouterr()
    assert main(["review", str(run)]) == 0
    assert "teacher_sample" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ the plan and review


def test_plan_prices_the_teachers_sampling_by_the_decode_model(capsys):
    """phases.teacher_sample_share = 0.5: the teacher decodes half the step's sequences inline, serial with the trainer's
    step, by the rollout's decode model with the teacher's weights. By hand: 256 x 8 = 2048 sequences, 1024 of them
    over 8 trainer GPUs (replicas of tp 1) = 128 per replica, every completion 1000 tokens (the cap: the longest is
    the cap), 256 slots: max(1000, 128 x 1000 / 256) = 1000 decode steps. HBM at 3.35e12 B/s: the teacher's weights
    1e9 x 2 B read once per step, 2e9 x 1000 = 2e12 B; KV 196608 B per token of a mean context of 1000 / 2 tokens, per
    sequence per step: 128 x 1000 x 196608 x 500 B; FLOPs 128 x 1000 x 2 x 1e9 at 989e12 are fewer (memory-bound);
    the native engine's work per step on a GPU is 0. The colocated step and the trainer-bound disaggregated step grow
    by exactly that; the term is its own phase, term by term in --json."""
    import json

    from rollyard.plan.command import plan_main
    from rollyard.plan.inputs import load_plan
    from rollyard.plan.planner import make_plan

    base = ["phases.rollout_s=10", "phases.train_s=20", "phases.use_reference=false", "phases.teacher_params=1e9",
            "phases.teacher_s=5", "rollout.avg_tokens=1000", "tail.max_tokens=1000", "phases.teacher_sample_tokens=1000",
            "sync.receiver=none", "sync.fixed_s=0"]
    weights = 1e9 * 2 * 1000 / 3.35e12
    kv = 128 * 1000 * 196608 * 500 / 3.35e12
    assert 128 * 1000 * 2 * 1e9 / 989e12 < weights + kv
    want = weights + kv
    for placement in ("colocated", "disaggregated"):
        plain = make_plan(load_plan(None, [*base, f"placement={placement}"]))
        kd = make_plan(load_plan(None, [*base, f"placement={placement}", "phases.teacher_sample_share=0.5"]))
        assert plain.phases.teacher_sample == 0 and kd.phases.teacher_sample == pytest.approx(want, rel=1e-9)
        grown = kd.sims[placement].period_s - plain.sims[placement].period_s
        assert grown == pytest.approx(want, rel=1e-6), placement  # disaggregated: 5 + 20 + 4.35 s > 10 s rollout
        assert kd.phases.reference == plain.phases.reference and kd.phases.train == plain.phases.train
    kd = [*base, "phases.teacher_sample_share=0.5"]
    assert plan_main([*kd, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    terms = {k: v for k, v in doc["phases"]["terms"].items() if k.startswith("teacher_sample: ")}
    assert terms == pytest.approx({"teacher_sample: the teacher's weight reads (one per decode step)": weights,
                                   "teacher_sample: the teacher's KV reads": kv}, rel=1e-9)
    assert doc["phases"]["teacher_sample"] == pytest.approx(want) and doc["step_budget"]["teacher_sample"] == pytest.approx(want)
    assert "decodes 0.5 of the 2048 sequences" in doc["phases"]["source"]["teacher_sample"]
    assert plan_main(kd) == 0
    def phase_table(out: str) -> str:
        return out.split("Phase times per step")[1].split("Steps per hour")[0]

    table = phase_table(capsys.readouterr().out)
    assert "teacher_sample" in table and "the teacher's KV reads" in table
    assert plan_main(base) == 0
    assert "teacher_sample" not in phase_table(capsys.readouterr().out)  # no seq_kd: no row


@pytest.fixture(scope="module")
def sampling_run(tmp_path_factory):
    """A 4-step seq_kd run at lmbda=0.5 whose teacher (the tiny preset) samples to the 6-token cap."""
    run = tmp_path_factory.mktemp("seq_kd_review") / "run"
    assert main(["train", *TINY, "algo.objective=gkd", "algo.gkd_lmbda=0.5", "algo.gkd_seq_kd=true",
                 "rollout.temperature=0", "teacher.model=tiny", "steps=4", "seed=1", f"out_dir={run}"]) == 0
    return run


def test_review_holds_the_teachers_sampling_to_its_budget(sampling_run, tmp_path, capsys):
    """The run-implied plan reads seq_kd from the config (share 1 - lmbda = 0.5) and the measured teacher_sample
    seconds; a plan calibrated from the run budgets the phase at its measured mean and review passes; a plan that
    budgets twenty times it flags teacher_sample under budget and fails, as any phase (two-sided); the estimate (no measured
    seconds) budgets the decode model's terms, listed with the phase."""
    import json

    import yaml

    from rollyard.plan.command import plan_main, review_main
    from rollyard.plan.review import FAIL, PASS, phase_seconds, plan_from_run, read_run, review, steady

    run = read_run(sampling_run)
    per = steady(phase_seconds(run.spans))["teacher_sample"]
    measured = sum(per) / len(per)
    assert measured > 0
    implied = plan_from_run(run).phases
    assert implied.teacher_sample_share == 0.5 and implied.teacher_sample_s == pytest.approx(measured)
    assert implied.teacher_sample_tokens == 6  # the tiny teacher runs every completion to the cap

    out = tmp_path / "cal"
    assert plan_main(["--calibrate-from", str(sampling_run), "--out", str(out)]) == 0
    capsys.readouterr()
    data = yaml.safe_load((out / "plan.yaml").read_text())

    def held(phases: dict, name: str, tolerance=None):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**data, "phases": {**data["phases"], **phases}}))
        rv = review(sampling_run, path, tolerance)
        row = next(p for p in rv.phases if p["role"] == "teacher_sample")
        item = next(v for v in rv.verification if v["item"] == "Measured step breakdown matches the budget")
        return path, row, item

    path, row, item = held({}, "calibrated")
    assert row["budget_s"] == pytest.approx(measured) and not row["flag"]
    assert item["result"] == PASS, item
    assert review_main([str(sampling_run), "--plan", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip("│ ").startswith("teacher_sample"))
    assert f"{measured:.4g}" in line and "-" not in line.split("│")[6], line  # a budget in its column

    # twenty times the measured seconds: far under its budget at a 20% tolerance (the 1% noise floor is ~25 ms here)
    _, row, item = held({"teacher_sample_s": 20 * measured}, "twenty", tolerance=0.2)
    assert row["budget_s"] == pytest.approx(20 * measured)
    assert row["flag"] and row["direction"] == "under" and item["result"] == FAIL
    assert "teacher_sample" in item["evidence"] and not held({}, "tight", tolerance=0.2)[1]["flag"]

    _, row, _ = held({"teacher_sample_s": None}, "estimated")
    assert row["budget_s"] > 0 and row["budget_s"] == pytest.approx(sum(row["terms"].values()))
    assert "the teacher's engine work per decode step" in row["terms"] or "the teacher's KV reads" in row["terms"]
    assert review_main([str(sampling_run), "--plan", str(path), "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert next(p for p in doc["phases"] if p["role"] == "teacher_sample")["budget_s"] == pytest.approx(measured)


# ------------------------------------------------------------------------------------ TRL's name and bad input


@pytest.mark.parametrize("overrides, expect", [
    (["seq_kd=true", "lmbda=0.5", "teacher.model=tiny"], {"objective": "gkd", "gkd_seq_kd": True, "gkd_lmbda": 0.5}),
    (["seq_kd=false", "lmbda=0.5", "beta=0.2", "teacher.model=tiny"],
     {"objective": "gkd", "gkd_seq_kd": False, "gkd_beta": 0.2, "kl_coef": 0.0}),
    ([], {"objective": "rl", "gkd_seq_kd": False}),
])
def test_trls_seq_kd_maps_to_the_field(overrides, expect):
    algo = load_config(None, overrides).algo
    assert {k: getattr(algo, k) for k in expect} == expect


@pytest.mark.parametrize("override, needle", [
    (["seq_kd=true", "teacher.model=tiny"], "set algo.gkd_lmbda=0.5 (TRL's default) or algo.gkd_seq_kd=false"),
    (["algo.gkd_seq_kd=true", "algo.objective=distill", "teacher.model=tiny"], "set algo.objective=gkd"),
    (["seq_kd=true", "lmbda=0.5", "teacher.model=tiny", "teacher.placement=pool", "placement=async"],
     "set teacher.placement=inline or algo.gkd_seq_kd=false"),
    (["seq_kd=true", "lmbda=0.5", "teacher.model=tiny", "tools.functions=[tool_fns:add]"],
     "run without tools"),
])
def test_bad_seq_kd_settings_exit_2(tmp_path, capsys, override, needle):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
