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

from rollyard.config import ConfigError, RunConfig
from rollyard.model.loading import load_policy
from rollyard.sync.check import weights_checksum
from rollyard.types import Sample


class InlineTeacher:
    """The frozen teacher in the trainer's process."""

    def __init__(self, model, device: str = "cpu"):
        self.model = model.to(device).eval().requires_grad_(False)
        self.params = sum(p.numel() for p in model.parameters())

    def submit(self, samples: list[Sample], step: int = 0) -> None:
        return None

    def fill(self, trainer, samples: list[Sample], step: int = 0) -> list[dict]:
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


def build(cfg: RunConfig, tokenizer, device: str = "cpu"):
    """The teacher scorer for ``cfg`` (None when the objective uses no teacher); ``device``: the trainer's."""
    if cfg.algo.objective == "rl":
        return None
    check(cfg)
    model = load(cfg, tokenizer)
    facts = {"model": cfg.teacher.model, "checksum": weights_checksum(model)}
    if cfg.teacher.placement == "pool":
        from rollyard.placement.reference_pool import ReferencePool
        scorer = ReferencePool(cfg, model, workers=cfg.teacher.workers, role="teacher", field="teacher_logprobs")
        scorer.params = sum(p.numel() for p in model.parameters())
    else:
        scorer = InlineTeacher(model, device)
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
