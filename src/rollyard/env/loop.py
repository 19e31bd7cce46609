"""The multi-turn rollout: model turns and tool turns over the engine's public interface.

``generate(engine, requests, toolbox)`` has the contract of ``RolloutEngine.generate`` (samples in
request order, then k; the rejected requests with their reasons), so a placement swaps one call for
the other. It drives only ``engine.submit`` and ``engine.step`` (token ids in; token ids, logprobs and
versions out): no engine internals, so it runs over any backend that keeps that contract.

One trajectory per sample, token-in/token-out:

    prompt_ids | model turn 1 | tool turn 1 | model turn 2 | ... | last model turn
                 mask 1         mask 0        mask 1                 mask 1

``completion_ids`` is every token after the prompt exactly as it was fed to the model: model tokens
as the engine sampled them, tool tokens as the chat template renders the tool messages
(``template.turn_tokens``); nothing is re-tokenized. ``completion_mask`` marks the model's tokens;
``logprobs`` / ``versions`` are per token (the tool tokens carry 0.0 and the version of the model token
before them). A model turn that ends with end-of-turn and holds ``<tool_call>`` blocks is followed by a
tool turn (at most ``max_iterations`` tool turns); the next model turn is one engine request whose
prompt is the whole context so far, with the rest of the ``max_new_tokens`` budget (which counts
model and tool tokens, as TRL's ``max_completion_length`` does).

While tools run, the engine keeps decoding the other samples; the wall time the rollout spent with
nothing to decode, waiting on tools, is ``tools/wait_s``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from rollyard.env import template
from rollyard.env.executor import Job, ToolExecutor
from rollyard.env.rewards import ENV_REWARD_KEY
from rollyard.reward.hooks import MESSAGES_KEY, PROMPT_KEY
from rollyard.types import Request, Sample


@dataclass
class Toolbox:
    """What a multi-turn rollout needs besides the engine (built by ``env.setup.toolbox``)."""

    tokenizer: object
    schemas: list[dict]
    executor: ToolExecutor
    max_iterations: int
    environment: str | None = None  # the environment class's name (its reward is logged under it)
    env_reward: bool = False  # the environment has get_reward()


@dataclass
class _Traj:
    sid: str
    req: Request
    prompt: list[int]
    comp: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0  # tool turns done
    calls: list = field(default_factory=list)  # this turn's parsed calls (Call) while tools run
    results: dict = field(default_factory=dict)  # call index -> output text
    finish: str | None = None
    meta: dict = field(default_factory=dict)

    def sample(self) -> Sample:
        return Sample(id=self.sid, request_id=self.req.id, prompt_ids=list(self.prompt), completion_ids=self.comp,
                      logprobs=self.logprobs, versions=self.versions, finish_reason=self.finish or "stop",
                      meta={**self.req.meta, **self.meta}, completion_mask=self.mask)


def _row(meta: dict) -> dict:
    """The dataset row's columns an environment's ``reset(**row)`` gets (TRL passes the row)."""
    return {k: v for k, v in meta.items() if k not in (PROMPT_KEY, MESSAGES_KEY) and k.isidentifier()}


def _prompt(req: Request, box: Toolbox, observation: str | None) -> list[int]:
    """The request's prompt with the tools rendered in (chat prompts), plus ``reset()``'s observation."""
    messages = req.meta.get(MESSAGES_KEY)
    if not messages:
        if observation:
            return list(req.prompt_ids) + box.tokenizer(observation, add_special_tokens=False)["input_ids"]
        return list(req.prompt_ids)
    if observation:  # appended to the last user message, as TRL does with reset()'s return value
        messages = [dict(m) for m in messages]
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages[last]["content"] = f"{messages[last]['content']}\n\n{observation}"
    return template.prompt_with_tools(box.tokenizer, messages, box.schemas)


class Turns(NamedTuple):
    """What :func:`generate` returns: ``engine.generate``'s pair, the ``tools/*`` metrics, and the wall-clock
    intervals ``(start, end)`` (``time.time()``) during which at least one tool call ran (the ``tool`` role)."""

    samples: list[Sample]
    rejected: list[tuple[Request, str]]
    metrics: dict[str, float]
    busy: list[tuple[float, float]]


def busy_intervals(jobs: list[Job]) -> list[tuple[float, float]]:
    """The union of the jobs' ``[started, started + seconds]`` intervals, merged and sorted."""
    out: list[list[float]] = []
    for a, b in sorted((j.started, j.started + j.seconds) for j in jobs if j.started):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def generate(engine, requests: list[Request], box: Toolbox) -> Turns:
    """Multi-turn ``engine.generate``; see the module docstring."""
    ex, tok = box.executor, box.tokenizer
    stats = {"format_errors": 0, "truncated": 0, "wait_s": 0.0, "bytes": 0}
    calls0 = dict(ex.stats)
    n_lat = len(ex.seconds)
    trajs: dict[str, _Traj] = {}
    by_engine_request: dict[str, str] = {}  # engine request id (turns after the first) -> sid
    rejected: list[tuple[Request, str]] = []
    finished: list[Job] = []  # every job run, for the tool role's intervals

    def submit(t: _Traj) -> None:
        budget = t.req.max_new_tokens - len(t.comp)
        rid = f"{t.sid}@{t.turns}"
        bad = engine.submit([Request(rid, t.prompt + t.comp, 1, budget, t.req.meta)])
        if bad:  # the context no longer fits: the trajectory ends here
            t.finish = "length"
        else:
            by_engine_request[rid] = t.sid

    # Environments first: one instance per sample, reset with the dataset row.
    observations: dict[str, str | None] = {}
    if box.environment:
        jobs = [Job(f"{r.id}#{k}", "reset", f"{r.id}#{k}", args=_row(r.meta)) for r in requests for k in range(r.n)]
        t0 = time.monotonic()
        for j in ex.run(jobs):
            finished.append(j)
            observations[j.sid] = j.value if j.status == "ok" else None
            if j.status != "ok":
                stats.setdefault("reset_errors", 0)
                stats["reset_errors"] += 1
        stats["wait_s"] += time.monotonic() - t0
    for r in requests:
        sids = [f"{r.id}#{k}" for k in range(r.n)]
        per_sample = any(observations.get(s) for s in sids)
        base = _prompt(r, box, None)
        if per_sample:
            for s in sids:
                trajs[s] = _Traj(s, r, _prompt(r, box, observations.get(s)))
                submit(trajs[s])
            continue
        for s in sids:
            trajs[s] = _Traj(s, r, base)
        bad = engine.submit([Request(r.id, base, r.n, r.max_new_tokens, r.meta)])
        if bad:
            rejected.extend(bad)
            for s in sids:
                trajs.pop(s)

    def model_turn(s: Sample) -> None:
        sid = by_engine_request.pop(s.request_id, s.id)
        t = trajs[sid]
        t.comp += s.completion_ids
        t.mask += [1] * len(s.completion_ids)
        t.logprobs += s.logprobs
        t.versions += s.versions
        text = tok.decode(s.completion_ids, skip_special_tokens=False)
        calls = template.parse_calls(text) if s.finish_reason == "stop" else []
        if not calls or len(t.comp) >= t.req.max_new_tokens:
            t.finish = s.finish_reason
            return
        if t.turns >= box.max_iterations:
            stats["truncated"] += 1
            t.finish = "stop"
            return
        t.calls, t.results = calls, {}
        for i, c in enumerate(calls):
            if c.error:
                stats["format_errors"] += 1
                t.results[i] = f"error: {c.error}"
            else:
                stats["bytes"] += len(c.name) + len(str(c.arguments))
                ex.submit(Job((sid, i), "call", sid, c.name, c.arguments))
        if len(t.results) == len(calls):
            tool_turn(t, s)

    def tool_turn(t: _Traj, last: Sample | None = None) -> None:
        outs = [(c.name or "error", t.results[i]) for i, c in enumerate(t.calls)]
        stats["bytes"] += sum(len(o.encode()) for _, o in outs)
        eot = tok.decode(t.comp[-1:], skip_special_tokens=False) if t.comp else ""
        ids = template.turn_tokens(tok, outs, eot)
        t.turns += 1
        t.calls, t.results = [], {}
        room = t.req.max_new_tokens - len(t.comp)
        v = t.versions[-1] if t.versions else engine.version
        ids = ids[:room]
        t.comp += ids
        t.mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.versions += [v] * len(ids)
        if len(t.comp) >= t.req.max_new_tokens:
            t.finish = "length"
            return
        submit(t)

    while True:
        for s in engine.step():
            model_turn(s)
        busy = not engine.idle
        if not (busy or ex.busy):
            break
        t0 = time.monotonic()
        for j in ex.poll(0.0 if busy else 0.5):
            finished.append(j)
            sid, i = j.key
            t = trajs[sid]
            t.results[i] = j.value if j.status == "ok" else f"error: {j.value}"
            if len(t.results) == len(t.calls):
                tool_turn(t)
        if not busy:
            stats["wait_s"] += time.monotonic() - t0

    if box.environment:  # the environments' rewards (get_reward), then the instances are dropped
        op = "reward" if box.env_reward else "drop"
        for j in ex.run([Job(sid, op, sid) for sid in trajs]):
            finished.append(j)
            if op == "reward":
                trajs[j.sid].meta[ENV_REWARD_KEY] = j.value if j.status == "ok" else f"error: {j.value}"

    order = {r.id: i for i, r in enumerate(requests)}
    samples = [t.sample() for t in trajs.values()]
    samples.sort(key=lambda s: (order.get(s.request_id, len(order)), int(s.id.rsplit("#", 1)[1])))
    lat = sorted(ex.seconds[n_lat:])
    metrics = {f"tools/{k}": float(ex.stats[k] - calls0[k]) for k in ("calls", "errors", "timeouts", "crashes")}
    metrics.update({"tools/format_errors": float(stats["format_errors"]), "tools/truncated": float(stats["truncated"]),
                    "tools/wait_s": stats["wait_s"], "tools/bytes": float(stats["bytes"]),
                    "tools/turns_mean": statistics.fmean(t.turns for t in trajs.values()) if trajs else 0.0,
                    "tools/latency_p50_s": lat[len(lat) // 2] if lat else 0.0,
                    "tools/latency_max_s": lat[-1] if lat else 0.0})
    if "reset_errors" in stats:
        metrics["tools/reset_errors"] = float(stats["reset_errors"])
    return Turns(samples, rejected, metrics, busy_intervals(finished))
