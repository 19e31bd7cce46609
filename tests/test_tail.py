"""Tail batching: short/long rounds, the deferral queue across checkpoints, the prompt ledger,
the streaming trainer's equivalence with one big step, the adaptive reward timeout, bad input."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from cli_runs import straight_and_resumed

from rollyard.accounting import PromptLedger
from rollyard.cli import main
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.reward.timeout import AnchorTimeout, adaptive_timeout
from rollyard.rollout.engine import RolloutEngine
from rollyard.rollout.plain import PlainPolicy
from rollyard.rollout.rounds import STATE_KEY, RoundBook, bubble, decode_steps, run_round
from rollyard.rollout.scheduler import PromptFeed, PromptStream
from rollyard.rollout.tail import TailPolicy, is_long_round
from rollyard.tasks import load_task
from rollyard.tasks.base import Prompt
from rollyard.telemetry import rundir
from rollyard.trainer.streaming import StreamingStep
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TOK = char_tokenizer()
LONG = {"p1", "p4", "p6", "p9", "p13"}  # prompts whose samples run to the cap (the "tail")


def _model(seed=0):
    torch.manual_seed(seed)
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=96)


def _prompts(k=16):
    return [Prompt(id=f"p{i}", text=f"{i}+{i}=", meta={"task": "t", "answer": str(2 * i)}) for i in range(k)]


def _engine(model, seed=0):
    eng = RolloutEngine(model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, seed=seed)
    # Length oracle: samples of LONG prompts run 40 tokens, the others 2 (random-init policy, cap-bound).
    eng._length_cap = lambda sid: 40 if sid.split("@")[0] in LONG else 2
    return eng


class InlineRewards:
    """The dispatcher's streaming surface (submit / poll / results), scored in-process."""

    def __init__(self):
        self.ready, self.submitted = [], 0

    def submit(self, s):
        s.reward = float(int(s.id.rsplit("#", 1)[1]) % 2)
        self.submitted += 1
        self.ready.append(s)

    def poll(self):
        out, self.ready = self.ready, []
        return out

    def results(self):
        yield from self.poll()


def _tail(stream, **kw):
    """The round book under the tail policy over ``stream`` (a fresh prompt ledger), as a run builds it."""
    args = dict(prompts=4, n=4, overprovision=1.5, extra_samples=2)
    args.update(kw)
    return RoundBook(PromptFeed(stream, PromptLedger(), TOK, args["n"], 40, 96), TailPolicy(**args))


def _round(book, eng, step, on_group=lambda g: None):
    """One in-process round, its complete prompts then trained (the ledger transition ``step.py`` makes)."""
    rnd = run_round(book, eng, InlineRewards(), step, on_group)
    complete = {s.request_id for s in rnd.samples}
    book.ledger.trained([q.id for q in rnd.requests if q.id in complete])
    return rnd


def _pid(request_id):
    return request_id.split("@")[0]


def test_short_round_stops_at_P_complete_prompts_and_defers_the_rest():
    eng, groups = _engine(_model()), []
    book = _tail(PromptStream(_prompts(), seed=0))
    rnd = _round(book, eng, 0, groups.append)
    taken = [_pid(q.id) for q in rnd.requests]
    assert rnd.kind == "short" and len(taken) == 6  # ceil(4 x 1.5)
    assert all(q.n == 6 for q in rnd.requests)  # n + extra_samples
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)  # P complete prompts, n samples each
    assert [s for g in groups for s in g] == rnd.samples
    trained = {_pid(s.request_id) for s in rnd.samples}
    deferred = {_pid(q.id) for q in rnd.deferred}
    assert trained | deferred == set(taken) and not trained & deferred
    assert deferred <= LONG and trained.isdisjoint(LONG)  # the long prompts were the ones cut
    assert list(book.long) == [q.id for q in rnd.deferred]
    assert {book.ledger.state[q.id] for q in rnd.deferred} == {"deferred"}  # in the ledger, waiting
    assert all(s.finish_reason != "abort" and len(s.completion_ids) == 2 for s in rnd.samples)
    assert rnd.wasted_tokens > 0 and eng.num_active == 0 and eng.num_queued == 0  # nothing left behind


def test_deferred_prompts_train_in_a_long_round_and_no_prompt_is_lost_or_trained_twice():
    eng, stream = _engine(_model()), PromptStream(_prompts(), seed=0)
    book = _tail(stream, prompts=2, overprovision=2.0)
    handed_out, trained, kinds, long_samples = [], Counter(), [], []
    for step in range(8):
        before = list(book.long)
        rnd = _round(book, eng, step)
        kinds.append(rnd.kind)
        if rnd.kind == "short":
            handed_out += [_pid(q.id) for q in rnd.requests]
        else:  # a long round runs the queue's first P prompts, n samples each, to full length
            assert [q.id for q in rnd.requests] == before[:2]
            assert all(q.n == 4 for q in rnd.requests) and not rnd.deferred
            long_samples += rnd.samples
        trained.update({_pid(s.request_id) for s in rnd.samples})
    assert "long" in kinds and "short" in kinds
    assert long_samples and max(len(s.completion_ids) for s in long_samples) == 40  # run to full length
    assert all(s.finish_reason != "abort" for s in long_samples)
    assert {_pid(s.request_id) for s in long_samples} & LONG
    # Ledger: every prompt handed out is trained exactly once or still queued, never both.
    queued = Counter(_pid(i) for i in book.long)
    assert Counter(handed_out) == trained + queued
    assert max(trained.values()) == 1 and not set(trained) & set(queued)
    assert book.trained["long"] * 4 == len(long_samples)  # groups of n = 4


def test_plain_round_runs_every_prompt_to_the_end():
    eng, groups = _engine(_model()), []
    book = RoundBook(PromptFeed(PromptStream(_prompts(), seed=0), PromptLedger(), TOK, 3, 40, 96), PlainPolicy(4, 3))
    rnd = _round(book, eng, 0, groups.append)
    assert rnd.kind == "plain" and len(groups) == 4 and not rnd.deferred and rnd.wasted_tokens == 0
    assert rnd.decode_steps == 40  # the round lasts as long as its longest sample
    long = [s for s in rnd.samples if _pid(s.request_id) in LONG]
    assert long and max(len(s.completion_ids) for s in long) == 40
    assert rnd.bubble == pytest.approx(bubble([len(s.completion_ids) for s in rnd.samples], 12))


def _reference_round(book, eng, round_):
    """A round as the in-process side ran it before the engine completed groups and ``book.arrived`` closed rounds:
    the caller counted each group to n and aborted its surplus, counted complete prompts to P and cut the rest, then
    deferred them (the reference ``run_round`` is checked against)."""
    requests, dead = [], []

    def send(got, lost):
        book.ledger.hand_out([q.id for q in got], "local")
        requests.extend(got)
        dead.extend(lost)

    kind = book.issue(round_, send)
    n = book.policy.n
    need = book.policy.P if book.policy.closes_early(kind) else len(requests)
    rejected = eng.submit(requests)
    live = {q.id: q for q in requests if q.id not in {r.id for r, _ in rejected}}
    need = min(need, len(live))
    rewards, finished, scored, groups = InlineRewards(), {}, {}, []
    complete, closed, lengths, wasted = set(), set(), [], 0
    for s in eng.results():
        lengths.append(len(s.completion_ids))
        rid = s.request_id
        if rid in closed:
            wasted += len(s.completion_ids)
            continue
        finished.setdefault(rid, []).append(s)
        rewards.submit(s)
        if len(finished[rid]) == n:
            complete.add(rid)
            closed.add(rid)
            done = {x.id for x in finished[rid]}
            surplus = eng.abort([f"{rid}#{k}" for k in range(live[rid].n) if f"{rid}#{k}" not in done])
            lengths += [len(x.completion_ids) for x in surplus]
            wasted += sum(len(x.completion_ids) for x in surplus)
            if len(complete) == need:
                rest = [r for r in live if r not in closed]
                cut = eng.abort(rest)
                lengths += [len(x.completion_ids) for x in cut]
                wasted += sum(len(x.completion_ids) for x in cut)
                closed.update(rest)
        for x in rewards.poll():
            if x.request_id in closed and x.request_id not in complete:
                continue
            scored.setdefault(x.request_id, []).append(x)
            if x.request_id in complete and len(scored[x.request_id]) == n:
                groups.append(sorted(scored.pop(x.request_id), key=lambda y: int(y.id.rsplit("#", 1)[1])))
    incomplete = [r for r in live if r not in complete]
    wasted += sum(len(x.completion_ids) for r in incomplete for x in finished.get(r, []))
    slots = min(eng.max_concurrent, sum(q.n for q in live.values()))
    book.defer(incomplete)
    book.close(round_)
    book.took([g[0].request_id for g in groups])
    book.ledger.trained([g[0].request_id for g in groups])
    order = {q: i for i, q in enumerate(live)}
    groups.sort(key=lambda g: order[g[0].request_id])
    return kind, list(live), groups, incomplete, wasted, bubble(lengths, slots), decode_steps(lengths, slots)


@pytest.mark.parametrize("policy", ["plain", "tail"])
def test_run_round_gives_the_rounds_the_caller_side_bookkeeping_gave(policy):
    """The engine completing groups (``submit(keep=n)``) and ``book.arrived`` closing rounds change no number: the
    same rounds, samples (tokens, logprobs, rewards), cuts, wasted tokens, bubble and book state as the reference
    (``_reference_round``), round after round, from one seed."""
    def book():
        stream = PromptStream(_prompts(), seed=0)
        if policy == "plain":
            return RoundBook(PromptFeed(stream, PromptLedger(), TOK, 3, 40, 96), PlainPolicy(3, 3))
        return _tail(stream, prompts=2, overprovision=2.0)

    ref_book, new_book, ref_eng, new_eng = book(), book(), _engine(_model(), seed=3), _engine(_model(), seed=3)
    kinds, cuts = [], 0
    for step in range(4 if policy == "tail" else 2):
        kind, ids, groups, cut, wasted, idle, steps = _reference_round(ref_book, ref_eng, step)
        kinds.append(kind)
        cuts += len(cut)
        rnd = _round(new_book, new_eng, step)
        assert (rnd.kind, [q.id for q in rnd.requests], [q.id for q in rnd.deferred]) == (kind, ids, cut)
        assert [(s.id, s.completion_ids, s.logprobs, s.reward) for s in rnd.samples] == \
            [(s.id, s.completion_ids, s.logprobs, s.reward) for g in groups for s in g]
        assert (rnd.wasted_tokens, rnd.bubble, rnd.decode_steps) == (wasted, idle, steps)
        assert new_book.state() == ref_book.state() and list(new_book.long) == list(ref_book.long)
    assert kinds == (["short", "long", "short", "long"] if policy == "tail" else ["plain", "plain"])
    assert cuts > 0 or policy == "plain"  # the tail rounds did cut (and the engine drop surplus samples)


def test_bubble():
    assert bubble([10, 10, 10], 3) == 0.0
    assert bubble([10, 1, 1], 3) == pytest.approx(1 - 12 / 30)
    assert bubble([4, 4, 4, 4], 2) == 0.0  # more samples than slots: full slots, no idle
    assert bubble([], 4) == 0.0


def test_is_long_round():
    assert is_long_round(4, 4, 0, 0) and not is_long_round(3, 4, 0, 0)
    assert is_long_round(1, 4, 2, 3) and not is_long_round(1, 4, 1, 3) and not is_long_round(0, 4, 2, 3)


def test_queue_survives_checkpoint_and_resume():
    def run(split_at=None):
        eng = _engine(_model())
        book = _tail(PromptStream(_prompts(), seed=0), prompts=2, overprovision=2.0)
        seen = []
        for step in range(6):
            if step == split_at:  # checkpoint: the feed's cursor (stream + ledger) + the book, through JSON
                saved = json.loads(json.dumps({"cursor": book.feed.state(), "extra": {STATE_KEY: book.state()}}))
                book = _tail(PromptStream(_prompts(), seed=0), prompts=2, overprovision=2.0)
                book.feed.restore(saved["cursor"])
                book.restore(saved["extra"], step)
            rnd = _round(book, eng, step)
            seen.append((rnd.kind, sorted({_pid(s.request_id) for s in rnd.samples}), list(book.long)))
        return seen

    straight, resumed = run(), run(split_at=3)
    assert straight == resumed
    assert any(q for _, _, q in straight[:3])  # the checkpoint did carry a non-empty queue


def test_a_colocated_tail_checkpoint_written_before_the_round_book_resumes():
    """Before the round book, colocated's tail scheduler kept its queue as prompts outside the ledger, under
    "tail": a resumed run enters them in the ledger, deferred, and runs them in its next long round."""
    from dataclasses import asdict
    queued = [p for p in _prompts() if p.id in ("p1", "p4")]
    extra = {"tail": {"queue": [asdict(p) for p in queued], "rounds": 3, "trained": {"short": 16, "long": 8}}}  # samples
    book = _tail(PromptStream(_prompts(), seed=0), prompts=2, overprovision=2.0)
    book.restore(extra, step=3)
    assert "tail" not in extra and book.rounds == 3 and book.trained == {"short": 4, "long": 2}  # groups of n = 4
    assert [book.ledger.requests[i].meta["prompt"] for i in book.long] == ["1+1=", "4+4="]
    assert {book.ledger.state[i] for i in book.long} == {"deferred"}
    rnd = _round(book, _engine(_model()), 3)
    assert rnd.kind == "long" and {_pid(s.request_id) for s in rnd.samples} == {"p1", "p4"} and not book.long
    assert max(len(s.completion_ids) for s in rnd.samples) == 40  # run to full length


def _samples(n_groups=3, per=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_groups):
        prompt = torch.randint(4, len(TOK), (3 + i,), generator=g).tolist()
        for k in range(per):
            comp = torch.randint(4, len(TOK), (1 + (3 * k + i) % 7,), generator=g).tolist()
            out.append(Sample(id=f"r{i}#{k}", request_id=f"r{i}", prompt_ids=prompt, completion_ids=comp,
                              logprobs=(-torch.rand(len(comp), generator=g) * 3).tolist(),
                              versions=[0] * len(comp), finish_reason="stop",
                              advantage=float(torch.randn((), generator=g))))
    return out


@pytest.mark.parametrize("agg, min_tokens", [("token-mean", 1), ("seq-mean", 1), ("token-mean", 40)])
def test_streaming_trainer_equals_one_step(agg, min_tokens):
    samples = _samples()
    kw = dict(lr=1e-2, loss_agg=agg, clip_low=0.2, clip_high=0.28, tis_cap=1.5, max_grad_norm=0.1)
    a, b = _model(1), _model(1)
    ta, tb = Trainer(a, micro_batch_tokens=64, **kw), Trainer(b, micro_batch_tokens=24, **kw)
    for t in (ta, tb):  # SGD: the update is the clipped gradient itself (Adam's first step is ~sign(g))
        t.optimizer = torch.optim.SGD(t.params, lr=1.0)
        t.base_lr = 1.0  # the rate the trainer sets before each step (its schedule's base)
    ma = ta.step(samples)
    stream = StreamingStep(tb, min_tokens=min_tokens)  # 1: every group its own backward; 40: groups buffered
    for i in (2, 0, 1):  # groups arrive in completion order, not request order
        stream.add([s for s in samples if s.request_id == f"r{i}"])
    mb = stream.finish()
    assert ma["grad_norm"] > 0.1  # clipping is active: the scale must be right before the clip
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)
    for key in ("loss", "pg_loss", "clip_frac", "entropy", "tokens", "logprob_diff"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    moved = 0.0
    for (name, pa), pb, p0 in zip(a.named_parameters(), b.parameters(), _model(1).parameters()):
        assert torch.allclose(pa, pb, atol=1e-6, rtol=1e-5), name
        moved = max(moved, float((pa - p0).detach().abs().max()))
    assert moved > 1e-4  # the step did something


def test_adaptive_timeout_function_and_anchor():
    assert adaptive_timeout(0.5, 3.0, None, 10.0) == 10.0  # no anchor yet: T_max
    assert adaptive_timeout(0.5, 3.0, 0.01, 10.0) == 0.5  # floor
    assert adaptive_timeout(0.5, 3.0, 1.0, 10.0) == 3.0
    assert adaptive_timeout(0.5, 3.0, 5.0, 10.0) == 10.0  # ceiling
    t = AnchorTimeout(0.5, 2.0, 10.0, window=3)
    for x in (1.0, 9.0, 2.0, 3.0):  # window keeps the last 3: median(9, 2, 3) = 3
        t.observe({"task": "a"}, x)
    t.observe({"task": "b"}, 0.1)
    assert t.anchor("a") == 3.0 and t.timeout({"task": "a"}) == 6.0
    assert t.timeout({"task": "b"}) == 0.5 and t.timeout({"task": "c"}) == 10.0
    with pytest.raises(ValueError):
        AnchorTimeout(2.0, 1.0, 1.0)


def test_dispatcher_cuts_a_call_far_slower_than_the_task_anchor():
    hook = str(Path(__file__).with_name("verifiers_for_tests.py")) + ":hang"
    policy = AnchorTimeout(t_min=0.3, lam=3.0, t_max=60.0)
    with RewardDispatcher(hook, num_workers=1, timeout_s=60.0, decode=lambda ids: "x", timeout_policy=policy) as rw:
        fast = [Sample(id=f"f#{k}", request_id="f", prompt_ids=[1], completion_ids=[5], logprobs=[0.0], versions=[0],
                       finish_reason="stop", meta={"task": "t", "hang": False}) for k in range(4)]
        rw.score(fast)
        assert all(s.reward == 1.0 and s.reward_flag is None for s in fast)
        assert policy.anchor("t") is not None and policy.timeout({"task": "t"}) < 60.0
        slow = Sample(id="s#0", request_id="s", prompt_ids=[1], completion_ids=[5], logprobs=[0.0], versions=[0],
                      finish_reason="stop", meta={"task": "t", "hang": True})  # sleeps 100 s
        rw.submit(slow)
        (out,) = list(rw.results())
    assert out is slow and slow.reward_flag == "timeout" and slow.reward == 0.0


def test_countdown_task_is_long_tailed_with_a_held_out_split():
    train = load_task("countdown", "train", 2000, 0)
    held = load_task("countdown", "eval", 50, 0)
    assert not {p.text for p in train} & {p.text for p in held}
    lengths = sorted(len(TOK(p.demo)["input_ids"]) for p in train)
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * (len(lengths) - 1))]
    assert p99 >= 4 * p50
    from rollyard.reward.verifiers import countdown
    p = train[0]
    assert countdown(p.demo, p.text, p.meta) == 1.0 and countdown(p.demo + " 1", p.text, p.meta) == 0.0


@pytest.mark.parametrize("override, words", [
    ("tail.overprovision=0.9", ["tail.overprovision", ">= 1", "0.9", "tail.overprovision=1.25"]),
    ("tail.extra_samples=-1", ["tail.extra_samples", ">= 0", "-1", "tail.extra_samples=2"]),
    ("rollout.samples_per_prompt=1", ["rollout.scheduler=tail", "samples_per_prompt >= 2", "got 1"]),
])
def test_bad_tail_input_exit_2(override, words, capsys):
    assert main(["train", "rollout.scheduler=tail", override, "progress=false"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err


TINY = ["model.context=64", "data.task=countdown", "data.train_size=64", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=3", "rollout.max_new_tokens=12", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "rollout.scheduler=tail", "tail.overprovision=2.0", "tail.extra_samples=1"]


@pytest.mark.slow
def test_colocated_tail_run_resumes_with_its_queue(tmp_path):
    straight, split = straight_and_resumed(TINY, tmp_path, stop_at=2, steps=4)
    keys = ("tail/long_round", "tail/deferred", "tail/queue", "tail/long_share", "reward", "tokens/generated")
    a = [tuple(r[k] for k in keys) for r in rundir.read_jsonl(straight / rundir.METRICS)]
    b = [tuple(r[k] for k in keys) for r in rundir.read_jsonl(split / rundir.METRICS)]
    assert a == b and len(a) == 4
    rows = list(rundir.read_jsonl(straight / rundir.METRICS))
    assert all(0.0 <= r["tail/bubble"] < 1.0 and r["train/tokens"] > 0 for r in rows)
    ckpt = json.loads((split / rundir.CHECKPOINTS / "step_000002" / "state.json").read_text())
    assert "long" in ckpt["extra"][STATE_KEY] and "tail" not in ckpt["extra"]  # one key: the round book's


@pytest.mark.parametrize("override, words", [
    ("trainer.dp=2", "trainer.dp=2"),
])
def test_tail_refuses_what_it_does_not_drive(override, words):
    from rollyard.config import ConfigError, load_config
    from rollyard.placement import check
    cfg = load_config(None, ["rollout.scheduler=tail", override])
    with pytest.raises(ConfigError, match=words):
        check(cfg)


def test_a_colocated_tail_step_scores_through_the_steps_scoring_with_its_spans(tmp_path):
    """Each complete group of a streamed round goes through ``step.score_rewarded`` (settle, reference, advantages,
    with their spans) and the step's edges once: the same timeline roles and ledger edges as a plain step."""
    args = ["model.context=64", "data.task=countdown", "data.train_size=32", "data.eval_size=2",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
            "sft.auto=false", "progress=false", "reward.num_workers=1", "algo.kl_coef=0.1", "log.plots=false"]
    runs = {}
    for scheduler in ("plain", "tail"):
        out = tmp_path / scheduler
        assert main(["train", *args, f"rollout.scheduler={scheduler}", "steps=2", f"out_dir={out}"]) == 0
        runs[scheduler] = out
    for scheduler, out in runs.items():
        roles = {(s["step"], s["role"]) for s in rundir.read_jsonl(out / rundir.SPANS)}
        assert {(k, r) for k in (0, 1) for r in ("reference", "algorithm", "train")} <= roles, scheduler
        edges = [(t["step"], t["edge"]) for t in rundir.read_jsonl(out / rundir.TRAFFIC)]
        for k in (0, 1):  # one row per edge and step, a reference logprob per trained completion token
            assert edges.count((k, "rewards")) == 1 and edges.count((k, "ref_logprobs")) == 1, scheduler
        rows = list(rundir.read_jsonl(out / rundir.METRICS))
        assert all(r["time/reference"] > 0 and "time/algorithm" in r for r in rows), scheduler
