"""The teacher of on-policy distillation (``teacher.*``, ``algo.objective=distill | rl+distill``): a frozen model
that scores every token the student sampled.

A teacher is a reference with other weights: it answers the reference's calls (``placement/reference.py``:
``submit``, ``fill(trainer, samples, step) -> spans``, ``metrics``, ``stop``) and fills ``Sample.teacher_logprobs``
instead of ``ref_logprobs``, through the trainer's packed path (``Trainer.logprobs(samples, model=teacher)``), so
under the trainer's temperature and over the support the rollout sampled from (``algo/support.py``).

``inline`` (here): the teacher in the trainer's process, scored after the rewards; on the step's critical path and
one more model in the trainer's memory. ``pool``: ``reference_pool.py``'s Ray actors holding the teacher (role
``teacher``); each rollout worker sends a finished group to them as it ships, so the teacher's forward overlaps the
rest of the round's decoding and the previous step's training.

The teacher is loaded as ``model.name`` is (``model/loading.py``: preset, model directory, GGUF, ``pkg:``), and must
tokenize as the student does: its log-probabilities are of the student's token ids.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

from rollyard import sft
from rollyard.algo import gkd
from rollyard.config import ConfigError, RunConfig
from rollyard.model.loading import load_policy
from rollyard.placement import teacher_sampler
from rollyard.sync.check import weights_checksum
from rollyard.types import Sample


class InlineTeacher:
    """The frozen teacher in the trainer's process. ``top_k`` > 0 (``algo.objective=gkd``): it also fills each
    sample's ``teacher_top_ids`` / ``teacher_top_logprobs``, its ``top_k`` most likely tokens per completion position
    over the whole vocabulary (``algo/gkd.py``), from the same forward."""

    def __init__(self, model, device: str = "cpu", top_k: int = 0):
        self.model = model.to(device).eval().requires_grad_(False)
        self.params = sum(p.numel() for p in model.parameters())
        self.top_k = top_k
        self.references: dict[str, tuple[list[int], list[int]]] = {}  # GKD's lmbda < 1 (with_references)
        self.sampler = None  # algo.gkd_seq_kd: the off-policy share sampled by the teacher (teacher_sampler.py)

    def submit(self, samples: list[Sample], step: int = 0) -> None:
        return None

    def fill(self, trainer, samples: list[Sample], step: int = 0) -> list[dict]:
        if self.top_k:
            for s, (lp, ids, top) in zip(samples, trainer.top_k_logprobs(samples, self.model, self.top_k)):
                s.teacher_logprobs, s.teacher_top_ids, s.teacher_top_logprobs = lp.tolist(), ids.tolist(), top.tolist()
            return []
        for s, lp in zip(samples, trainer.logprobs(samples, model=self.model)):
            s.teacher_logprobs = lp.tolist()
        return []

    def metrics(self) -> dict:
        return {}

    def stop(self) -> None:
        return None


def check(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` (one line, with the fix) for a teacher placement that cannot work."""
    if cfg.teacher.placement == "pool" and cfg.placement == "colocated":
        raise ConfigError("teacher.placement=pool runs the teacher on Ray actors beside the Ray rollout workers, but "
                          "placement=colocated runs one process without Ray; set placement=disaggregated or async, "
                          "or teacher.placement=inline")


def load(cfg: RunConfig, tokenizer):
    """The teacher model of ``cfg`` (frozen, fp32, on the CPU); ConfigError (one line) when it does not load or does
    not tokenize as the student's ``tokenizer`` does."""
    name = cfg.teacher.model
    try:
        model, theirs = load_policy(name, seed=cfg.model.seed, max_position_embeddings=cfg.model.context)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.name=", "teacher.model=")) from None
    if (why := tokenizer_differs(tokenizer, theirs)) is not None:
        raise ConfigError(f"teacher.model={name} tokenizes differently from the student (model.name={cfg.model.name}): "
                          f"{why}; its log-probabilities would be of other tokens. Distil from a teacher with the "
                          f"student's tokenizer (the same family, or a model trained from the student)")
    return model.eval().requires_grad_(False)


def tokenizer_differs(mine, theirs) -> str | None:
    """What differs between two tokenizers' vocabularies and end token (None: the same token ids)."""
    a, b = mine.get_vocab(), theirs.get_vocab()
    if len(a) != len(b):
        return f"a vocabulary of {len(b)} tokens, the student's {len(a)}"
    if a != b:
        tok = next(t for t in sorted(a) if a[t] != b.get(t))
        return f"token {tok!r} is id {b.get(tok)} there, {a[tok]} in the student's"
    if mine.eos_token_id != theirs.eos_token_id:
        return f"end token id {theirs.eos_token_id}, the student's {mine.eos_token_id}"
    return None


def build(cfg: RunConfig, tokenizer, device: str = "cpu", prompts: list | None = None):
    """The teacher scorer for ``cfg`` (None when the objective uses no teacher); ``device``: the trainer's;
    ``prompts``: the training prompts (GKD's reference completions when ``algo.gkd_lmbda`` < 1)."""
    if cfg.algo.objective == "rl":
        return None
    check(cfg)
    references = reference_completions(cfg, tokenizer, prompts or [])
    top_k = cfg.algo.gkd_top_k if cfg.algo.objective == "gkd" else 0
    model = load(cfg, tokenizer)
    facts = {"model": cfg.teacher.model, "checksum": weights_checksum(model)}
    if cfg.teacher.placement == "pool":
        from rollyard.placement.reference_pool import ReferencePool
        scorer = ReferencePool(cfg, model, workers=cfg.teacher.workers, role="teacher", field="teacher_logprobs",
                               top_k=top_k)
        scorer.params = sum(p.numel() for p in model.parameters())
    else:
        scorer = InlineTeacher(model, device, top_k=top_k)
        if cfg.algo.gkd_seq_kd:
            scorer.sampler = teacher_sampler.build(cfg, scorer.model, tokenizer)
    scorer.references = references
    scorer.facts = facts  # run.json's "teacher": what a resume must find again
    return scorer


def check_resume(before: dict | None, teacher) -> None:
    """A resumed run distils from the teacher it started with: ``before`` is the run's run.json (None: a new run)."""
    was = (before or {}).get("teacher")
    now = None if teacher is None else teacher.facts
    if was is None and now is None:
        return
    if was is None or now is None or was.get("checksum") != now["checksum"]:
        said = "no teacher" if was is None else f"teacher {was.get('model')} (weights {str(was.get('checksum'))[:12]})"
        got = "no teacher" if now is None else f"teacher {now['model']} (weights {now['checksum'][:12]})"
        raise ConfigError(f"this run was trained with {said}, but the resume loads {got}: its scores would change "
                          f"mid-run; resume with the same teacher.model and algo.objective, or start a new out_dir")


def reference_completions(cfg: RunConfig, tokenizer, prompts: list) -> dict[str, tuple[list[int], list[int]]]:
    """GKD's off-policy share (``algo.gkd_lmbda`` < 1): prompt id -> (the dataset's reference completion's ids + EOS,
    its loss mask), tokenized as the SFT warm start's demonstrations are (``sft.demos``: a ``demo``, else a string
    ``answer``; a tool turn masked). Empty when every completion is the student's; ConfigError (one line) when a
    training prompt has none."""
    a = cfg.algo
    if a.objective != "gkd" or a.gkd_lmbda >= 1.0 or a.gkd_seq_kd:  # (seq_kd: the teacher samples that share)
        return {}
    tools = sft.tool_demos(cfg, tokenizer)
    out = {}
    for p in prompts:
        got = sft.demos([p], tokenizer, tools)
        if got:
            out[p.id] = (got[0][1], got[0][2])
    if len(out) < len(prompts) or not prompts:
        missing = next((p.id for p in prompts if p.id not in out), None)
        raise ConfigError(f"algo.gkd_lmbda={a.gkd_lmbda} < 1 trains {1 - a.gkd_lmbda:.0%} of prompts on the dataset's "
                          f"reference completion, but {len(prompts) - len(out)} of {len(prompts)} training prompts have "
                          f"none (first: {missing}; a reference is a `demo` or a string `answer`); set "
                          f"algo.gkd_lmbda=1.0 or map a reference column (data.fields={{demo: <column>}})")
    return out


def with_references(teacher, trainer, samples: list[Sample], seed: int, lmbda: float, max_new_tokens: int,
                    context: int, version: int, telemetry=None, step: int = 0) -> list[Sample]:
    """GKD's ``lmbda``: ``samples`` with each group drawn off-policy (``algo/gkd.on_policy``) trained on the dataset's
    reference completion instead of the student's samples (every sample of the group becomes a copy with that
    completion, so a prompt weighs the same either way), or with ``algo.gkd_seq_kd`` (``teacher.sampler`` set) on
    the teacher's own samples, one per sample of the group (``teacher_sampler.py``); cut to ``max_new_tokens`` and
    the context. The copies' rollout log-probs are the trainer's own (one no-grad pass: no importance-sampling gap,
    none of their tokens was the student's sample), their version ``version``. The scored samples (their rewards, the
    step's metrics) are left as sampled. With ``telemetry``, the teacher's sampling (when any sample is off-policy)
    is its span ``teacher_sample`` of ``step`` (fields: ``sequences`` sampled, ``tokens`` generated)."""
    if lmbda >= 1.0:
        return samples
    off = [s for s in samples if not gkd.on_policy(s.request_id, seed, lmbda)]
    room = {s.id: max(1, min(max_new_tokens, context - len(s.prompt_ids))) for s in off}
    sampler = getattr(teacher, "sampler", None)
    if sampler is None:
        got = _references(teacher, off, room)
    elif not off:
        got = {}
    else:  # the teacher decodes in this process, on the step's critical path: its own span
        span = telemetry.span("teacher_sample", step, sequences=len(off)) if telemetry is not None else nullcontext({})
        with span as fields:
            got = sampler.complete(off, max_new_tokens, context)
            fields["tokens"] = sum(len(ids) for ids, _, _ in got.values())
    out, fresh = [], []
    for s in samples:
        if s.id not in got:
            out.append(s)
            continue
        ids, mask, reason = got[s.id]
        copy = replace(s, completion_ids=list(ids), logprobs=[0.0] * len(ids), versions=[version] * len(ids),
                       finish_reason=reason, completion_mask=None if mask is None or all(mask) else list(mask),
                       meta={**s.meta, "gkd_reference": True})
        out.append(copy)
        fresh.append(copy)
    if fresh:
        for s, lp in zip(fresh, trainer.logprobs(fresh)):
            s.logprobs = lp.tolist()
        if hasattr(teacher, "forget"):  # a pool's results for these groups are of the student's completions
            teacher.forget({s.request_id for s in fresh})
    return out


def _references(teacher, off: list[Sample], room: dict[str, int]) -> dict[str, tuple[list[int], list[int], str]]:
    """Per off-policy sample id: its prompt's reference completion ``(ids, loss mask, finish_reason)``, cut to
    ``room[id]`` tokens (``"length"`` when cut)."""
    out = {}
    for s in off:
        ids, mask = teacher.references[s.request_id.rsplit("@", 1)[0]]
        n = room[s.id]
        out[s.id] = (ids[:n], mask[:n], "length" if len(ids) > n else "stop")
    return out
