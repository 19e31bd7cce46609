"""``reference.placement=pool``: Ray actors hold the frozen reference and score groups as they finish.

A rollout worker (``rollout_actor.py``) that has the pool's handles sends the finished groups of each
queue item it ships to a reference actor in one call (one packed pass; round-robin over the actors,
item by item), and the item carries the result's ``ObjectRef`` for each of its groups. So the reference's forward
runs on its own CPU while the rest of the round decodes and while the trainer trains the previous
step; ``fill`` (the step's ``reference`` span: the only reference time on the critical path)
waits for results that are not in yet. A group without a result (its worker died and took the
result's owner with it, or it came from elsewhere) is scored from the driver through the same
actors. The actors' own compute time is recorded as spans of role ``reference_pool``.

Each actor scores through ``Trainer.logprobs``, the trainer's packed path with the trainer's
settings, on a copy of the initial policy (a LoRA policy merged: the adapter starts as zero), so
the KL term equals the inline one within float tolerance (micro-batches are packed per queue item
here, per step inline).

A distillation teacher (``placement/teacher.py``) is a reference with other weights: the same pool, built with
``role="teacher"`` (actors ``teacher-<i>``, spans ``teacher_pool``, metrics ``teacher/...``) over the teacher's model,
filling ``field="teacher_logprobs"``; under ``algo.objective=gkd`` (``top_k`` > 0) each actor also returns its top-k ids
and log-probs per completion position from the same forward (``Trainer.top_k_logprobs``), filling
``teacher_top_ids`` / ``teacher_top_logprobs``.
"""

from __future__ import annotations

import copy
import itertools
import os
import time

import ray
import torch
from ray.exceptions import RayError

from rollyard import waits
from rollyard.config import RunConfig
from rollyard.types import Sample

SPAN_ROLE = "reference_pool"  # the actors' compute (off the critical path); "reference" is the driver's wait
START_S = 1200.0  # an actor's start-up: scheduled on a free CPU, the model copy unpickled (a large model: minutes)
SCORE_S = 600.0  # one call scores a queue item's or a step's groups: one packed forward, seconds to a few minutes


class ReferenceWorker:
    """One reference actor: a frozen copy of the initial policy and a trainer's packed logprob path."""

    def __init__(self, cfg: dict, model, name: str, role: str = SPAN_ROLE, top_k: int = 0):
        from rollyard.trainer.settings import trainer_kwargs
        from rollyard.trainer.trainer import Trainer

        torch.set_num_threads(1)
        self.name, self.role, self.top_k = name, role, top_k
        # The Trainer builds its AdamW over trainable parameters (an empty list is refused); AdamW allocates
        # no state before a step, and this one never steps: the copy is frozen right after.
        model.requires_grad_(True)
        self.trainer = Trainer(model, **trainer_kwargs(RunConfig.model_validate(cfg)), device="cpu")
        model.eval().requires_grad_(False)

    def score(self, samples: list[Sample], step: int) -> dict:
        """``{"logprobs": {sample id: [fp32 per completion token]}, "span": the compute's span}``; with ``top_k``,
        ``"top": {sample id: ([[k ids] per token], [[k fp32 log-probs] per token])}`` too."""
        start = time.time()
        out: dict = {}
        if self.top_k:
            scored = self.trainer.top_k_logprobs(samples, self.trainer.model, self.top_k)
            lps = [lp for lp, _, _ in scored]
            out["top"] = {s.id: (ids.tolist(), top.tolist()) for s, (_, ids, top) in zip(samples, scored)}
        else:
            lps = self.trainer.logprobs(samples)
        span = {"role": self.role, "step": step, "worker": self.name, "pid": os.getpid(), "start": start,
                "end": time.time(), "samples": len(samples)}
        return {"logprobs": {s.id: lp.tolist() for s, lp in zip(samples, lps)}, "span": span, **out}

    def info(self) -> dict:
        return {"pid": os.getpid(), "time": time.time()}


def score_group(actors: list, samples: list[Sample], step: int, index: int):
    """Send groups to one actor (round-robin by ``index``) for one packed pass; returns the result's ``ObjectRef``."""
    return actors[index % len(actors)].score.remote(samples, step)


class ReferencePool:
    """The driver's side: start the actors, take the results rollout workers requested, fill samples."""

    def __init__(self, cfg: RunConfig, model, workers: int | None = None, role: str = "reference",
                 field: str = "ref_logprobs", top_k: int = 0):
        """``model``: the weights the actors score with (the initial policy, or a teacher); ``workers`` (default
        ``reference.workers``) actors named ``<role>-<i>``; ``field``: the Sample attribute ``fill`` sets; ``top_k``
        (a GKD teacher): the actors' top-k per position too."""
        self.role, self.field = role, field
        plain = copy.deepcopy(model)
        if hasattr(plain, "merge_and_unload"):  # a PEFT policy: its adapter is the identity at start
            plain = plain.merge_and_unload()
        weights = ray.put(plain.eval().requires_grad_(False))
        del plain
        actor = ray.remote(num_cpus=1)(ReferenceWorker)
        cfg_json = cfg.model_dump(mode="json")
        n = cfg.reference.workers if workers is None else workers
        self.actors = [actor.remote(cfg_json, weights, f"{role}-{i}", f"{role}_pool", top_k) for i in range(n)]
        self.offsets: dict[str, float] = {}
        for i, h in enumerate(self.actors):
            t0 = time.time()
            info = waits.get(h.info.remote(), f"{role} actor {role}-{i}", "its start-up (scheduling, model copy)",
                             START_S, "see its error above or in the Ray logs; an actor is started once a CPU is "
                             "free (ray status), then start the run again")  # then measures the clock offset
            self.offsets[f"{role}-{i}"] = info["time"] - (t0 + time.time()) / 2
        self.pending: dict[str, object] = {}  # request id -> ObjectRef of its group's result
        self.order = itertools.count()
        self.stats = {"early": 0, "late": 0, "rescored": 0}

    def adopt(self, refs: dict[str, object]) -> None:
        """Results a rollout worker requested for the groups it shipped (request id -> ObjectRef)."""
        self.pending.update(refs)

    def forget(self, request_ids) -> None:
        """Drop the results requested for these groups: their completions changed since (GKD's reference
        completions, ``placement/teacher.with_references``), so ``fill`` scores them again."""
        for rid in request_ids:
            self.pending.pop(rid, None)

    def submit(self, samples: list[Sample], step: int = 0) -> None:
        """Score now, in one call, the groups of ``samples`` no rollout worker sent already."""
        missing = [s for s in samples if s.request_id not in self.pending]
        if missing:
            ref = score_group(self.actors, missing, step, next(self.order))
            self.pending.update(dict.fromkeys((s.request_id for s in missing), ref))

    def fill(self, trainer, samples: list[Sample], step: int = 0) -> list[dict]:
        """Set ``ref_logprobs`` (``field``) on ``samples``, waiting for what is not scored yet (``trainer``: unused, the
        actors hold their own path). Returns the actors' spans, on this process's clock."""
        rids = list(dict.fromkeys(s.request_id for s in samples))
        asked = list({self.pending[r] for r in rids if r in self.pending})
        ready = set(ray.wait(asked, num_returns=len(asked), timeout=0)[0]) if asked else set()
        early = sum(self.pending.get(r) in ready for r in rids)
        self.stats["early"] += early
        self.stats["late"] += len(rids) - early
        self.submit(samples, step)
        refs = {rid: self.pending.pop(rid) for rid in rids}
        results: dict = {}  # ObjectRef -> its result (one call may hold several groups)
        spans = []
        for ref in dict.fromkeys(refs.values()):
            try:
                results[ref] = self._get(ref, step)
            except RayError:  # the worker that asked for it died, and its result with it: score again
                self.stats["rescored"] += 1
                again = [s for s in samples if refs[s.request_id] == ref]
                results[ref] = self._get(score_group(self.actors, again, step, next(self.order)), step)
            if ref in self.pending.values():  # a later step trains the call's other groups: its span goes there
                continue
            span = results[ref]["span"]
            off = self.offsets.get(span["worker"], 0.0)
            spans.append({**span, "step": step, "start": span["start"] - off, "end": span["end"] - off})
        for s in samples:  # from its own group's call (another call may hold an older copy of it: forget)
            res = results[refs[s.request_id]]
            setattr(s, self.field, res["logprobs"][s.id])
            if "top" in res:
                s.teacher_top_ids, s.teacher_top_logprobs = res["top"][s.id]
        return spans

    def _get(self, ref, step: int) -> dict:
        """One scoring call's result, bounded by ``SCORE_S`` (``waits.NoAnswer``, one line); part of the step: a
        first stop signal lets it finish, a second ends it at once."""
        return waits.get(ref, f"the {self.role} pool's actors ({self.role}-0..{len(self.actors) - 1})",
                         f"the scoring of step {step}'s groups", SCORE_S, "an actor alive but not answering is "
                         "stuck: see the Ray logs; the run stops (resume with --resume)",
                         stop_grace_s=None)  # part of the step: a first signal lets it finish

    def metrics(self) -> dict:
        """Groups whose reference was scored before the trainer asked (``early``), and rescored ones (reset)."""
        s, self.stats = self.stats, {"early": 0, "late": 0, "rescored": 0}
        total = max(s["early"] + s["late"], 1)
        return {f"{self.role}/ready_frac": s["early"] / total, f"{self.role}/rescored": s["rescored"]}

    def stop(self) -> None:
        for h in self.actors:
            ray.kill(h)
        self.pending.clear()

    close = stop  # a refused start closes what it started (placement/run.py)
