"""One streamed step (rollout.scheduler = tail): round, streaming rewards and trainer, one optimizer step.

The colocated rollout side calls ``streamed_step`` over the run's round book (``rollout/rounds.py``)
in place of its plain round; ``step.py`` then skips its own scoring and training for that step. Scoring is the step's own
(``step.score_rewarded``: settle, reference, GRPO advantages, with their spans), applied per complete group, and
its edges (``step.edges``) once per step.
Why this path trains inside the round: RollPacker's stream-based training overlaps the trainer's
forward/backward of finished groups with the decoding of the rest (the long tail), so each
complete group's gradient is accumulated while the engine keeps decoding; only the optimizer step
waits for the round to end. Moved after the round, the overlap -- the point of tail batching --
would be gone. The book's state is written into ``state.extra`` (``rounds.STATE_KEY``) after every
step, so every checkpoint carries it.
"""

from __future__ import annotations

import time

from rollyard.placement.step import edges, score_rewarded
from rollyard.rollout.rounds import STATE_KEY, RoundBook, run_round
from rollyard.trainer.streaming import StreamingStep
from rollyard.types import Request, Sample


def streamed_step(ctx, roles, engine, step: int, book: RoundBook
                  ) -> tuple[list[Request], list[Sample], dict[str, float], dict[str, float]]:
    """Run one round and its optimizer step; returns ``(requests, samples, train_metrics, round_metrics)``
    (``requests``: the round's complete ones, trained now; ``samples``: every scored sample, as ``step.score()``
    returns them, failed verifier calls included). ``ctx``: the run record; ``roles``: the driver's role
    handles; ``engine``: the local rollout engine."""
    tel = ctx.telemetry
    stream = StreamingStep(roles.trainer)
    in_round = {"train_s": 0.0}
    trained: list[Sample] = []
    scored: list[Sample] = []  # every scored sample, failed verifier calls included: the step's metrics count them

    def on_group(group: list[Sample]) -> None:
        t0 = time.perf_counter()
        # the step's own scoring and spans, per complete group (failed verifier calls: the step row shows the last)
        group, kept = score_rewarded(ctx, roles, step, group)
        scored.extend(group)
        trained.extend(kept)
        if not kept:
            return
        stream.add(kept)
        in_round["train_s"] += time.perf_counter() - t0

    with tel.span("rollout", step, version=engine.version):
        rnd = run_round(book, engine, roles.rewards, step, on_group)
    ctx.dead_letter(rnd.dead, step)
    tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in rnd.requests))
    tel.traffic(step, "samples", sum(s.payload_bytes() for s in rnd.samples))
    edges(ctx, roles, step, scored, trained)
    with tel.span("train", step):
        train_metrics = stream.finish()
    ctx.state.extra[STATE_KEY] = book.state()
    book.metrics()  # the pool's per-step counters; this round's own follow
    round_metrics = {
        "tail/long_round": float(rnd.kind == "long"), "tail/deferred": float(len(rnd.deferred)),
        "tail/queue": float(len(book.long)), "tail/bubble": rnd.bubble,
        "tail/wasted_tokens": float(rnd.wasted_tokens), "tail/decode_steps": float(rnd.decode_steps),
        "tail/train_in_round_s": in_round["train_s"], "tail/long_share": book.long_share(),
    }
    complete = {s.request_id for s in rnd.samples}  # the cut ones wait, deferred, for a long round
    return [q for q in rnd.requests if q.id in complete], scored, train_metrics, round_metrics
