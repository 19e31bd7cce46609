"""TRL's GKD form (algo.objective=gkd, algo/gkd.py): the generalized JSD over the teacher's top-k equals TRL 1.16's
``GKDTrainer.generalized_jsd_loss`` (value and gradient, fp32) when k is the vocabulary, and a direct autograd of the
renormalised objective (written here independently) when k is smaller, both as a pure function and through the
trainer's packed path; a colocated ``rollyard train`` moves the student towards the teacher; lmbda's reference
completions; TRL's names; bad settings end in one line (exit 2)."""

import json

import pytest
import torch
from test_distill import TINY, _samples  # the tiny run's settings and random samples

from rollyard.algo import gkd
from rollyard.algo.policy_loss import LossSpec
from rollyard.cli import main
from rollyard.config import ConfigError, load_config
from rollyard.model.loading import build_preset, char_tokenizer, export, load_policy
from rollyard.placement import teacher as teacher_placement
from rollyard.placement.teacher import InlineTeacher
from rollyard.tasks import load_task
from rollyard.tasks.base import Prompt
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
TRL_JSD = trl_gkd.GKDTrainer.generalized_jsd_loss
BETAS = [0.0, 0.5, 1.0]
T = 0.7  # a temperature != 1


def _renormalised_jsd(student_logits, teacher_logits, ids, beta, temperature):
    """The stated objective, written from the definition with probabilities (not algo/gkd.py's log-space form): per
    position, p and q the student's and teacher's softmax(z / T) restricted to ``ids`` and renormalised; ``m = beta q
    + (1 - beta) p``; ``beta KL(q || m) + (1 - beta) KL(p || m)``, KL(q || p) at beta 0 and KL(p || q) at beta 1."""
    p = torch.softmax(student_logits / temperature, -1).gather(-1, ids)
    q = torch.softmax(teacher_logits.detach() / temperature, -1).gather(-1, ids)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    if beta == 0.0:
        return (q * (q.log() - p.log())).sum(-1)
    if beta == 1.0:
        return (p * (p.log() - q.log())).sum(-1)
    m = beta * q + (1 - beta) * p
    return beta * (q * (q.log() - m.log())).sum(-1) + (1 - beta) * (p * (p.log() - m.log())).sum(-1)


@pytest.mark.parametrize("beta", BETAS)
def test_full_vocabulary_equals_trls_generalized_jsd_loss(beta):
    """Top-k = the vocabulary: the same logits give TRL's loss and gradient (fp32), masked positions left out."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(3, 7, 13, generator=g, requires_grad=True)
    teacher = torch.randn(3, 7, 13, generator=g)
    labels = torch.randint(0, 13, (3, 7), generator=g)
    labels[:, :2] = -100  # a prompt's positions
    labels[1, 5:] = -100  # padding
    want = TRL_JSD(student, teacher, labels=labels, beta=beta, temperature=T)
    (want_grad,) = torch.autograd.grad(want, student)
    keep = labels != -100
    got = gkd.jsd_of_logits(student[keep], teacher[keep], beta, T).sum() / keep.sum()
    (got_grad,) = torch.autograd.grad(got, student)
    assert float(want.detach()) > 1e-3
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)
    assert float((got_grad - want_grad).abs().max()) <= 1e-5 * float(want_grad.abs().max())


@pytest.mark.parametrize("beta", BETAS)
def test_top_k_equals_autograd_of_the_renormalised_objective(beta):
    g = torch.Generator().manual_seed(2)
    student = torch.randn(11, 29, generator=g, requires_grad=True)
    teacher = torch.randn(11, 29, generator=g) * 2
    got = gkd.jsd_of_logits(student, teacher, beta, T, k=5)
    ids = (teacher / T).topk(5, -1).indices
    want = _renormalised_jsd(student, teacher, ids, beta, T)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    (gg,) = torch.autograd.grad(got.sum(), student)
    (gw,) = torch.autograd.grad(want.sum(), student)
    assert float((gg - gw).abs().max()) <= 1e-5 * float(gw.abs().max())
    assert float(gw[torch.ones_like(gw, dtype=torch.bool).scatter(-1, ids, False)].abs().max()) < 1e-6  # only S_t


def _hf_logits(model, s: Sample) -> torch.Tensor:
    """``[len(completion), V]`` logits predicting the completion, by a plain forward of the HF module."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    return model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()


def _trainer_and_oracle(beta: float, k: int, oracle, top_p: float = 1.0, fill=None) -> tuple[dict, dict]:
    """(the trainer's gradient of algo.objective=gkd over samples the teacher filled with its top-k (inline, or by
    ``fill(trainer, samples)``), the gradient of ``oracle(student_logits, teacher_logits, samples)`` over the plain
    HF forward)."""
    torch.manual_seed(0)
    student = build_preset("tiny", char_tokenizer(), seed=0)
    teacher_model = build_preset("tiny", char_tokenizer(), seed=11)
    trainer = Trainer(student, loss=LossSpec(reward_weight=0.0, gkd_beta=beta), precision="fp32",
                      micro_batch_tokens=40, temperature=T, top_p=top_p)
    samples = _samples(3)
    for s, lp in zip(samples, trainer.logprobs(samples)):  # on-policy: mu = pi_old
        s.logprobs = lp.tolist()
    (fill or InlineTeacher(teacher_model, top_k=k).fill)(trainer, samples)
    assert all(len(s.teacher_top_ids) == len(s.completion_ids) and len(s.teacher_top_ids[0]) == k for s in samples)
    plain = trainer.logprobs(samples, model=teacher_model)  # the sampled tokens' log-probs, as without GKD
    assert max(float((torch.tensor(s.teacher_logprobs) - lp).abs().max()) for s, lp in zip(samples, plain)) < 1e-5
    trainer.optimizer.zero_grad(set_to_none=True)
    acc = trainer.accumulate_gradients(samples)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad(set_to_none=True)
    with torch.no_grad():
        teach = [_hf_logits(teacher_model, s) for s in samples]
    loss = oracle([_hf_logits(student, s) for s in samples], teach, samples)
    loss.backward()
    assert float(acc["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    return got, {n: p.grad.clone() for n, p in student.named_parameters()}


def _assert_equal(got: dict, want: dict) -> None:
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-5  # the objective moves the weights: the comparison means something
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert worst <= 1e-5 * scale + 1e-8, f"max |grad - oracle| {worst:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("beta", BETAS)
def test_trainer_gradient_equals_trls_loss_at_full_vocabulary(beta):
    """The trainer's packed path (teacher top-k = 98, the vocabulary) against TRL's loss on the HF logits, padded
    into TRL's [batch, length, vocab] with -100 labels, at temperature 0.7."""
    def trl(student, teacher, samples):
        L = max(len(x) for x in student)
        pad = [torch.nn.functional.pad(x, (0, 0, 0, L - len(x))) for x in student]
        tpad = [torch.nn.functional.pad(x, (0, 0, 0, L - len(x))) for x in teacher]
        labels = torch.full((len(samples), L), -100)
        for i, s in enumerate(samples):
            labels[i, :len(s.completion_ids)] = torch.tensor(s.completion_ids)
        return TRL_JSD(torch.stack(pad), torch.stack(tpad), labels=labels, beta=beta, temperature=T)
    _assert_equal(*_trainer_and_oracle(beta, 98, trl))


def _direct(beta: float, k: int):
    def direct(student, teacher, samples):
        terms = [_renormalised_jsd(s, t, (t / T).topk(k, -1).indices, beta, T) for s, t in zip(student, teacher)]
        return torch.cat(terms).sum() / sum(len(x) for x in terms)
    return direct


@pytest.mark.parametrize("beta, top_p", [(0.0, 1.0), (0.3, 1.0), (1.0, 1.0), (0.3, 0.9)])
def test_trainer_gradient_equals_autograd_at_top_k(beta, top_p):
    """Top-k = 6 of 98 through the trainer: the renormalised objective, token-mean over the batch's tokens. With the
    rollout's top-p < 1 the sampled tokens' log-probs take their own pass over the head; the GKD support stays the
    teacher's top-k of the whole distribution."""
    _assert_equal(*_trainer_and_oracle(beta, 6, _direct(beta, 6), top_p))


def ray_test(fn):
    return pytest.mark.ray(pytest.mark.slow(pytest.mark.usefixtures("ray_session")(fn)))


@ray_test
def test_pool_teacher_top_k_gradient_equals_autograd():
    """The teacher on its Ray actors (teacher.placement=pool): the same top-k ids and log-probs as inline, a group
    whose completions changed (forget) scored again, and the trainer's gradient over them equals the direct autograd."""
    from rollyard.config import RunConfig
    from rollyard.placement.reference_pool import ReferencePool

    cfg = RunConfig.model_validate({"algo": {"objective": "gkd", "gkd_top_k": 6}, "rollout": {"temperature": T},
                                    "teacher": {"model": "tiny", "placement": "pool"},
                                    "trainer": {"precision": "fp32", "micro_batch_tokens": 40}})
    pool = ReferencePool(cfg, build_preset("tiny", char_tokenizer(), seed=11), workers=2, role="teacher",
                         field="teacher_logprobs", top_k=6)
    try:
        def fill(trainer, samples):
            stale = [Sample(**{**s.__dict__, "completion_ids": s.completion_ids[:1], "logprobs": s.logprobs[:1],
                               "versions": s.versions[:1]}) for s in samples[:2]]
            pool.submit(stale, step=0)  # scored ahead for completions that then changed
            pool.forget({s.request_id for s in stale})
            pool.submit(samples[2:4], step=0)  # one group sent ahead, as a rollout worker does; the rest at fill
            assert {s["role"] for s in pool.fill(trainer, samples, step=0)} == {"teacher_pool"}
            got = [(s.teacher_logprobs, s.teacher_top_ids, s.teacher_top_logprobs) for s in samples]
            InlineTeacher(build_preset("tiny", char_tokenizer(), seed=11), top_k=6).fill(trainer, samples)
            for (lp, ids, top), s in zip(got, samples):
                assert ids == s.teacher_top_ids
                assert torch.allclose(torch.tensor(top), torch.tensor(s.teacher_top_logprobs), atol=1e-5)
                assert torch.allclose(torch.tensor(lp), torch.tensor(s.teacher_logprobs), atol=1e-5)
        _assert_equal(*_trainer_and_oracle(0.5, 6, _direct(0.5, 6), fill=fill))
    finally:
        pool.stop()


# ------------------------------------------------------------------------------------ the run


def test_dp2_gkd_steps_equal_dp1():
    """trainer.dp=2 (two real gloo ranks) under algo.objective=gkd: the teacher's top-k filled through the dp handle
    equals a single trainer's, and two steps give the single rank's loss, JSD, gradient norm and weights (fp32)."""
    import copy

    from rollyard import roles
    from rollyard.trainer.dp import DataParallelTrainer

    cfg = load_config(None, ["trainer.dp=2", "model.context=64", "trainer.micro_batch_tokens=40", "algo.gkd_top_k=6",
                             "algo.objective=gkd", "algo.gkd_beta=0.3", "teacher.model=tiny", "trainer.lr=5e-4",
                             f"rollout.temperature={T}"])
    model, _, _ = roles.policy(cfg, "cpu")
    start = copy.deepcopy(model)
    single = Trainer(copy.deepcopy(model), **roles.trainer_kwargs(cfg), device="cpu")
    dp = DataParallelTrainer(cfg, model, "cpu")
    teacher = InlineTeacher(build_preset("tiny", char_tokenizer(), seed=11), top_k=6)
    try:
        for step in range(2):
            a, b = _samples(40 + step, groups=4), _samples(40 + step, groups=4)
            teacher.fill(single, a)
            teacher.fill(dp, b)
            assert [s.teacher_top_ids for s in a] == [s.teacher_top_ids for s in b]
            m1, m2 = single.step(a), dp.step(b)
            assert m1["gkd_jsd"] > 1e-3 and m1["grad_norm"] > 1e-4
            for key in ("loss", "grad_norm", "gkd_jsd", "tokens", "entropy"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
            with torch.no_grad():
                worst = max(float((x - y).abs().max()) for x, y in zip(dp.model.parameters(), single.model.parameters()))
                moved = max(float((x - y).abs().max()) for x, y in zip(dp.model.parameters(), start.parameters()))
            assert worst < 2e-5 and moved > 4e-4 * (step + 1), (worst, moved)  # Adam moves each weight ~lr a step
    finally:
        dp.close()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gkd_teacher") / "model"
    tok = char_tokenizer()
    export(build_preset("tiny", tok, seed=11, max_position_embeddings=48), tok, out)
    return out


def _jsd_to(student, teacher, seqs: list[list[int]], beta: float = 0.5) -> float:
    """Mean full-vocabulary generalized JSD of ``student`` to ``teacher`` over every position of ``seqs``."""
    with torch.no_grad():
        per = [gkd.jsd_of_logits(student(input_ids=torch.tensor([x])).logits[0],
                                 teacher(input_ids=torch.tensor([x])).logits[0], beta) for x in seqs]
    return float(torch.cat(per).mean())


def test_colocated_gkd_run_moves_the_student_towards_the_teacher(tmp_path, teacher_dir):
    """Two steps of algo.objective=gkd (top-8): the student's JSD to the teacher, measured on the task's training
    prompts, falls; every sample is trained, the teacher_logprobs edge carries (4 + 8 x 8) B per completion token,
    and review passes."""
    run = tmp_path / "gkd"
    tok = char_tokenizer()
    assert main(["train", *TINY, "trainer.lr=1e-3", "algo.objective=gkd", "algo.gkd_top_k=8", "algo.gkd_beta=0.5",
                 f"teacher.model={teacher_dir}", "steps=2", f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert len(rows) == 2 and all(r["train/skipped_frac"] == 0.0 and r["train/gkd_jsd"] > 0 for r in rows)
    traffic = [t["bytes"] for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "teacher_logprobs"]
    assert traffic == [(4 + 8 * 8) * r["tokens/generated"] for r in rows]
    assert main(["review", str(run)]) == 0
    cfg = load_config(None, TINY)
    seqs = [tok(p.text)["input_ids"] for p in load_task(cfg.data.task, "train", 32, cfg.data.seed)]
    teacher = load_policy(str(teacher_dir))[0].eval()
    before = build_preset("tiny", tok, seed=cfg.model.seed, max_position_embeddings=48).eval()
    after = load_policy(str(run / rundir.MODEL))[0].eval()
    b, a = _jsd_to(before, teacher, seqs), _jsd_to(after, teacher, seqs)
    assert a < 0.95 * b, f"JSD to the teacher {b:.4g} -> {a:.4g}"


def test_dp2_gkd_run_matches_dp1_run(tmp_path, teacher_dir):
    """``rollyard train`` at trainer.dp=2 with lmbda=0.5 (the teacher's top-k and the reference copies' log-probs
    through the dp handle): the same samples, loss and JSD as at dp=1, step by step, and review passes."""
    kd = ["algo.objective=gkd", "algo.gkd_top_k=5", "algo.gkd_lmbda=0.5", f"teacher.model={teacher_dir}", "steps=2",
          "trainer.lr=1e-3", "rollout.prompts_per_step=4"]
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    assert main(["train", *TINY, *kd, f"out_dir={one}"]) == 0
    assert main(["train", *TINY, *kd, f"out_dir={two}", "trainer.dp=2"]) == 0
    a, b = list(rundir.read_jsonl(one / rundir.METRICS)), list(rundir.read_jsonl(two / rundir.METRICS))
    for r1, r2 in zip(a, b, strict=True):
        assert (r1["tokens/generated"], r1["train/tokens"]) == (r2["tokens/generated"], r2["train/tokens"])
        for key in ("loss", "train/gkd_jsd", "grad_norm"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key
    assert all(r["train/gkd_jsd"] > 0 for r in b) and any(r["train/tokens"] != r["tokens/generated"] for r in b)
    assert main(["review", str(two)]) == 0


@ray_test
def test_async_pool_teacher_gkd_run_matches_colocated_inline_run(tmp_path, teacher_dir):
    """Async at bound 0 trains on exactly colocated's samples; with the teacher on its pool (groups scored as they
    ship, the reference-completion groups of lmbda=0.5 scored again) the loss and the JSD equal the inline teacher's,
    step by step, and review passes."""
    colo, asyn = tmp_path / "colo", tmp_path / "async"
    kd = ["algo.objective=gkd", "algo.gkd_top_k=5", "algo.gkd_lmbda=0.5", f"teacher.model={teacher_dir}", "steps=3",
          "rollout.prompts_per_step=4"]
    assert main(["train", *TINY, *kd, f"out_dir={colo}"]) == 0
    assert main(["train", *TINY, *kd, f"out_dir={asyn}", "placement=async", "max_staleness=0",
                 "teacher.placement=pool"]) == 0
    a, c = list(rundir.read_jsonl(asyn / rundir.METRICS)), list(rundir.read_jsonl(colo / rundir.METRICS))
    for ra, rc in zip(a, c, strict=True):
        assert (ra["tokens/generated"], ra["train/tokens"]) == (rc["tokens/generated"], rc["train/tokens"])
        assert ra["train/gkd_jsd"] == pytest.approx(rc["train/gkd_jsd"], abs=1e-5)
        assert ra["loss"] == pytest.approx(rc["loss"], abs=1e-5)
    assert any(r["train/tokens"] != r["tokens/generated"] for r in c)  # some groups trained on the answers
    assert main(["review", str(asyn)]) == 0


@pytest.mark.slow
def test_vllm_backend_gkd(tmp_path):
    """rollout.backend=vllm (preset tiny64) with an inline GKD teacher and lmbda=0.5: the teacher's top-k is taken on
    the trainer's side, whatever engine sampled."""
    pytest.importorskip("vllm")
    tok = char_tokenizer()
    export(build_preset("tiny64", tok, seed=11, max_position_embeddings=48), tok, tmp_path / "teacher")
    run = tmp_path / "vllm"
    assert main(["train", *TINY, "model.name=tiny64", "rollout.backend=vllm", "algo.objective=gkd", "algo.gkd_top_k=5",
                 "algo.gkd_lmbda=0.5", f"teacher.model={tmp_path / 'teacher'}", "steps=2", f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    traffic = [t["bytes"] for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "teacher_logprobs"]
    assert all(r["train/gkd_jsd"] > 0 for r in rows) and traffic == [(4 + 8 * 5) * r["train/tokens"] for r in rows]


# ------------------------------------------------------------------------------------ lmbda


def _group(rid: str, n: int = 3) -> list[Sample]:
    return [Sample(id=f"{rid}#{k}", request_id=rid, prompt_ids=[5, 6, 7], completion_ids=[8, 9], logprobs=[0.0, 0.0],
                   versions=[0, 0], finish_reason="stop", reward=1.0) for k in range(n)]


def test_lmbda_trains_a_share_of_groups_on_the_reference_completion():
    """Each group is drawn on-policy with probability lmbda (fixed by seed and request id); an off-policy group's
    every sample carries the reference completion (ids + EOS, cut at max_new_tokens), the trainer's log-probs as its
    rollout's, the current version; on-policy samples are the same objects."""
    tok = char_tokenizer()
    cfg = load_config(None, ["algo.objective=gkd", "algo.gkd_lmbda=0.5", "teacher.model=tiny"])
    prompts = [Prompt(id=f"t/train/{i}", text=f"{i}+1=", meta={"answer": str(i + 1)}) for i in range(40)]
    refs = teacher_placement.reference_completions(cfg, tok, prompts)
    assert refs["t/train/12"][0] == tok("13", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    teacher = InlineTeacher(build_preset("tiny", tok, seed=11))
    teacher.references = refs
    trainer = Trainer(build_preset("tiny", tok, seed=0), precision="fp32")
    samples = [s for i in range(40) for s in _group(f"t/train/{i}@3")]
    out = teacher_placement.with_references(teacher, trainer, samples, seed=7, lmbda=0.5, max_new_tokens=2,
                                            context=48, version=4)
    on = [a is b for a, b in zip(out, samples)]
    assert 0.25 < sum(on) / len(on) < 0.75  # about lmbda of the groups, whole groups only
    assert all(len(set(on[i:i + 3])) == 1 for i in range(0, len(on), 3))
    for s, o, kept in zip(samples, out, on):
        assert kept == gkd.on_policy(s.request_id, 7, 0.5)
        if not kept:
            full = refs[s.request_id.split("@")[0]][0]
            assert o.completion_ids == full[:2] and o.versions == [4, 4] and o.id == s.id
            assert o.finish_reason == ("length" if len(full) > 2 else "stop")
            assert o.logprobs == pytest.approx(trainer.logprobs([o])[0].tolist())
    again = teacher_placement.with_references(teacher, trainer, samples, 7, 0.5, 2, 48, 4)
    assert [a is b for a, b in zip(again, samples)] == on  # the same draw (a resume, a streamed round)
    assert teacher_placement.with_references(teacher, trainer, samples, 7, 1.0, 2, 48, 4) == samples


def test_lmbda_zero_run_trains_on_reference_completions(tmp_path, teacher_dir):
    """algo.gkd_lmbda=0 end to end: every group trains on the task's answer + EOS (at most 3 digits + EOS here, while
    the random student runs to the 6-token cap), and the teacher scores (and the ledger counts) those tokens."""
    run = tmp_path / "ref"
    assert main(["train", *TINY, "algo.objective=gkd", "algo.gkd_lmbda=0.0", "algo.gkd_top_k=4",
                 f"teacher.model={teacher_dir}", "steps=2", f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    traffic = [t["bytes"] for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "teacher_logprobs"]
    assert traffic == [(4 + 8 * 4) * r["train/tokens"] for r in rows]
    assert all(0 < r["train/tokens"] <= 2 * 4 * 4 < r["tokens/generated"] for r in rows)
    assert all(abs(r["train/logprob_diff"]) < 1e-4 for r in rows)  # the copies' rollout log-probs: the trainer's
    assert main(["review", str(run)]) == 0  # it prices the edge from the trained tokens, not the generated ones


def test_lmbda_below_one_without_reference_completions_is_one_line():
    cfg = load_config(None, ["algo.objective=gkd", "algo.gkd_lmbda=0.5", "teacher.model=tiny"])
    prompts = [Prompt(id="d:1", text="hi", meta={"answer": 3}), Prompt(id="d:2", text="yo", meta={})]
    with pytest.raises(ConfigError, match=r"lmbda=0.5 < 1 .* 2 of 2 training prompts have none \(first: d:1"):
        teacher_placement.reference_completions(cfg, char_tokenizer(), prompts)


def test_lmbda_below_one_on_a_dataset_without_references_exits_2(tmp_path, teacher_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": {i + 1}}}\n' for i in range(4)))  # answers not strings
    args = ["train", f"data.path={data}", "reward.hook=rollyard.reward.verifiers:exact_match", "model.context=48",
            "data.eval_size=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "sft.auto=false",
            "progress=false", "log.plots=false", "reward.num_workers=1", "algo.objective=gkd", f"teacher.model={teacher_dir}",
            "steps=1", f"out_dir={tmp_path / 'r'}"]
    capsys.readouterr()
    assert main([*args, "algo.gkd_lmbda=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "algo.gkd_lmbda=0.5 < 1" in err and "set algo.gkd_lmbda=1.0" in err and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------------------------ TRL's names and bad input


@pytest.mark.parametrize("overrides, expect", [
    (["lmbda=0.25", "beta=0.1", "teacher.model=tiny"],
     {"objective": "gkd", "gkd_lmbda": 0.25, "gkd_beta": 0.1, "kl_coef": 0.0}),
    (["algo.objective=gkd", "beta=0.9", "teacher.model=tiny", "seq_kd=false"], {"gkd_beta": 0.9, "kl_coef": 0.0}),
    (["lmbda=1.0", "teacher_model_name_or_path=tiny"], {"objective": "gkd", "gkd_lmbda": 1.0, "gkd_beta": 0.5}),
    (["beta=0.04"], {"objective": "rl", "kl_coef": 0.04}),  # GRPOConfig's beta outside a GKD context
])
def test_trls_gkd_names(overrides, expect):
    algo = load_config(None, overrides).algo
    assert {k: getattr(algo, k) for k in expect} == expect


def test_trls_temperature_and_max_new_tokens():
    cfg = load_config(None, ["lmbda=1.0", "teacher.model=tiny", "temperature=0.9", "max_new_tokens=7"])
    assert (cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.teacher.model) == (0.9, 7, "tiny")


@pytest.mark.parametrize("override, needle", [
    (["algo.objective=gkd", "teacher.model=tiny", "algo.gkd_beta=1.5"], "gkd_beta"),
    (["algo.objective=gkd"], "teacher.model is not set"),
])
def test_bad_gkd_settings_exit_2(tmp_path, capsys, override, needle):
    assert main(["train", *TINY, *override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_plan_prices_the_top_k():
    """The plan's teacher_logprobs edge: (4 + 8k) B per completion token with phases.teacher_top_k = k."""
    from rollyard.plan.inputs import load_plan
    from rollyard.plan.planner import make_plan

    base = ["placement=disaggregated", "phases.rollout_s=30", "phases.train_s=20", "phases.use_reference=false",
            "sync.receiver=none", "sync.fixed_s=0", "phases.teacher_params=1e9"]
    plain = {e.name: e for e in make_plan(load_plan(None, base)).edges}["teacher_logprobs"]
    top = make_plan(load_plan(None, [*base, "phases.teacher_top_k=20"]))
    edge = {e.name: e for e in top.edges}["teacher_logprobs"]
    assert edge.bytes_per_step == pytest.approx((4 + 8 * 20) * top.bytes.rollout_tokens)
    assert edge.bytes_per_step == pytest.approx(41 * plain.bytes_per_step)


def test_run_json_config_names_the_objective(tmp_path, teacher_dir):
    """A resumable record: config.yaml holds rollyard's names for what TRL's set (lmbda -> algo.gkd_lmbda)."""
    run = tmp_path / "trl"
    assert main(["train", *TINY, "lmbda=1.0", "beta=0.2", f"teacher.model={teacher_dir}", "algo.gkd_top_k=4",
                 "steps=1", f"out_dir={run}"]) == 0
    import yaml
    algo = yaml.safe_load((run / rundir.CONFIG).read_text())["algo"]
    assert (algo["objective"], algo["gkd_lmbda"], algo["gkd_beta"], algo["gkd_top_k"]) == ("gkd", 1.0, 0.2, 4)
    assert json.loads((run / rundir.RUN_INFO).read_text())["teacher_params"] > 0
