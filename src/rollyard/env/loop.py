"""The multi-turn rollout: model turns and tool turns over the engine's public interface.

:class:`MultiTurn` wraps a rollout engine and implements its contract (``rollout.engine.Engine``), so a
placement or a rollout actor drives it where it drove the engine: the trajectory methods are its own, the
rest (weights, memory, scoring, the sampling RNG) are the engine's, each delegated by name. It uses only the engine's public interface (token ids in; token ids, logprobs and versions
out; ``abort``; ``load_weights``): no engine internals, so it runs over any backend that keeps that
contract (native, vLLM). :func:`generate` is the one-call form.

One trajectory per sample, token-in/token-out:

    prompt_ids | model turn 1 | tool turn 1 | model turn 2 | ... | last model turn
                 mask 1         mask 0        mask 1                 mask 1

``completion_ids`` is every token after the prompt exactly as it was fed to the model: model tokens
as the engine sampled them, tool tokens as the chat template renders the tool messages
(``template.turn_tokens``); nothing is re-tokenized. ``completion_mask`` marks the model's tokens;
``logprobs`` / ``versions`` are per token (the tool tokens carry 0.0 and the version of the model token
before them). A model turn that ends with end-of-turn and holds ``<tool_call>`` blocks is followed by a
tool turn holding each call's output as TRL's loop sends it (``str(value)``, a list of content blocks as
it is, ``{'error': ...}`` for a call that raised, timed out or was malformed: ``tools/errors``,
``tools/format_errors``) (at most ``max_iterations`` tool turns); the next model turn is one engine request whose
prompt is the whole context so far, with the rest of the ``max_new_tokens`` budget (which counts
model and tool tokens, as TRL's ``max_completion_length`` does).

While tools run, the engine keeps decoding the other samples; the wall time the rollout spent with
nothing to decode, waiting on tools, is ``tools/wait_s``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from rollyard.env import template
from rollyard.env.executor import Job, ToolExecutor
from rollyard.env.rewards import ENV_REWARD_KEY
from rollyard.env.tools import error_content
from rollyard.reward.hooks import MESSAGES_KEY, PROMPT_KEY
from rollyard.rollout.engine import Engine, KeepFirst
from rollyard.telemetry.side import SideWork, latency_metrics
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


def _text(content) -> str:
    """A tool message's content as text, for counting its bytes (a list of content blocks as JSON)."""
    return content if isinstance(content, str) else json.dumps(content, default=str)


TOOL_ROLE, TOOL_NAME = "tool", "tools"  # the timeline role of the calls, the prefix of their metrics and traffic edge


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


class MultiTurn(Engine):
    """The engine contract (``rollout.engine.Engine``) over multi-turn trajectories: what a placement drives
    instead of the bare engine.

    ``step()`` runs one engine step and collects the tool calls that finished (without blocking while
    the engine has work; up to ``wait_s`` when only tools are running) and returns the trajectories
    that ended; ``submit``'s ``keep`` counts ended trajectories (a group's others are aborted, ``surplus()``).
    ``load_weights`` passes through; with ``inflight="abort"`` every trajectory in progress
    (decoding or waiting on a tool) ends with reason ``"abort"`` and is returned, the engine's partial
    turn included. Weights, memory, scoring and the sampling RNG are the engine's (the delegates below).
    """

    def __init__(self, engine: Engine, box: Toolbox, wait_s: float = 0.05):
        self.engine, self.box, self.wait_s = engine, box, wait_s
        self._trajs: dict[str, _Traj] = {}
        self._by_engine: dict[str, list[str]] = {}  # engine request id -> the trajectories it carries
        self._ended: list[_Traj] = []  # finished; waiting for get_reward / the drop of their environment
        self._out: list[Sample] = []
        self._keep = KeepFirst()  # submit's keep, over trajectories
        self._surplus: list[Sample] = []  # what the keep rule dropped since the last surplus()
        self._jobs: list[Job] = []  # finished jobs since the last drain() (the tool role's intervals)
        self._stats = {"format_errors": 0, "truncated": 0, "wait_s": 0.0, "bytes": 0}
        self._calls0, self._lat0, self._turns = dict(box.executor.stats), len(box.executor.seconds), []

    # ------------------------------------------------------------------------------ the engine's, delegated
    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def model(self):
        return self.engine.model

    @property
    def generator(self):
        return self.engine.generator

    @property
    def max_concurrent(self) -> int:
        return self.engine.max_concurrent

    @property
    def own_copy(self) -> bool:
        return self.engine.own_copy

    def score(self, sample: Sample, copy_only: bool = False) -> list[float] | None:
        return self.engine.score(sample, copy_only)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    # ------------------------------------------------------------------------------ the contract
    @property
    def busy(self) -> bool:
        """Trajectories in progress: decoding, waiting on a tool or on their environment's reward."""
        return self.engine.busy or bool(self._trajs or self._ended)

    @property
    def idle(self) -> bool:
        return self.engine.idle and not self._trajs and not self._out and not self.box.executor.busy

    @property
    def num_active(self) -> int:
        """Trajectories in progress (decoding, or waiting on a tool or on their environment's reward)."""
        return len(self._trajs) + len(self._ended)

    @property
    def num_queued(self) -> int:
        return self.engine.num_queued

    def submit(self, requests: list[Request], keep: int | None = None) -> list[tuple[Request, str]]:
        """Start a trajectory per sample of ``requests``; the rejected requests with the engine's reason.
        With an environment, each sample's instance is reset first (a blocking call per request batch).
        ``keep``: a group is complete at its first ``keep`` ended trajectories, the others aborted."""
        box, ex = self.box, self.box.executor
        observations: dict[str, str | None] = {}
        if box.environment:
            jobs = [Job(f"{r.id}#{k}", "reset", f"{r.id}#{k}", args=_row(r.meta)) for r in requests for k in range(r.n)]
            t0 = time.monotonic()
            for j in ex.run(jobs):
                self._jobs.append(j)
                observations[j.sid] = j.value if j.status == "ok" else None
                if j.status != "ok":
                    self._stats["reset_errors"] = self._stats.get("reset_errors", 0) + 1
            self._stats["wait_s"] += time.monotonic() - t0
        rejected = []
        for r in requests:
            sids = [f"{r.id}#{k}" for k in range(r.n)]
            if any(observations.get(s) for s in sids):  # per-sample prompts: one engine request each
                for s in sids:
                    t = self._trajs[s] = _Traj(s, r, _prompt(r, box, observations.get(s)))
                    self._continue(t)
                    if t.finish:
                        self._end(t)
                continue
            base = _prompt(r, box, None)
            bad = self.engine.submit([Request(r.id, base, r.n, r.max_new_tokens, r.meta)])
            if bad:
                rejected.append((r, bad[0][1]))
                for s in sids:
                    if box.environment:
                        ex.submit(Job(s, "drop", s))
                continue
            for s in sids:
                self._trajs[s] = _Traj(s, r, base)
            self._by_engine[r.id] = sids
        refused = {q.id for q, _ in rejected}
        for r in requests:
            if r.id not in refused:
                self._keep.add(r.id, r.n, keep)
        return rejected

    def step(self) -> list[Sample]:
        for s in self.engine.step():
            self._model_turn(s)
        busy = not self.engine.idle
        t0 = time.monotonic()
        for j in self.box.executor.poll(0.0 if busy else self.wait_s):
            self._on_job(j)
        if not busy:
            self._stats["wait_s"] += time.monotonic() - t0
        self._surplus += self._keep.close(self.abort)  # the groups completed in this step: their others stop now
        out, self._out = self._out, []
        return out

    def surplus(self) -> list[Sample]:
        """The trajectories the keep rule dropped since the last call (``submit``'s ``keep``)."""
        out, self._surplus = self._surplus, []
        return out

    def results(self):
        while not self.idle:
            yield from self.step()

    def generate(self, requests: list[Request]) -> tuple[list[Sample], list[tuple[Request, str]]]:
        """``RolloutEngine.generate``'s contract: samples in request order (then k), and the rejected."""
        rejected = self.submit(list(requests))
        order = {r.id: i for i, r in enumerate(requests)}
        out = list(self.results())
        out.sort(key=lambda s: (order.get(s.request_id, len(order)), int(s.id.rsplit("#", 1)[1])))
        return out, rejected

    def abort(self, ids) -> list[Sample]:
        """End the trajectories of the given request / sample ids (reason ``"abort"``); return them."""
        ids = {ids} if isinstance(ids, str) else set(ids)
        self._keep.drop(ids)
        hit = [t for t in self._trajs.values() if t.sid in ids or t.req.id in ids]
        return self._abort(hit)

    def load_weights(self, update, inflight: str = "finish") -> list[Sample]:
        partial = self.engine.load_weights(update, inflight)
        if inflight != "abort":
            for s in partial:
                self._model_turn(s)
            out, self._out = self._out, []
            return out
        for s in partial:
            self._absorb(s)
        return self._abort(list(self._trajs.values()))

    def metrics(self) -> dict[str, float]:
        """The ``tools/*`` metrics since the last drain (counts, latency percentiles, waits, bytes, turns)."""
        return metrics(self.drain())

    def drain(self) -> SideWork:
        """The engine contract's ``drain``: the tool calls since the last drain, as one ``SideWork`` of role
        ``tool`` and name ``tools``: the ``tools/*`` counts and ``turns_mean``, every call's wall seconds (a Ray
        rollout worker ships them; the driver takes percentiles over all workers' calls) and the tool role's
        wall-clock intervals."""
        ex = self.box.executor
        seconds = list(ex.seconds[self._lat0:])
        m = {f"tools/{k}": float(ex.stats[k] - self._calls0[k]) for k in ("calls", "errors", "timeouts", "crashes", "cut")}
        m.update({f"tools/{k}": float(v) for k, v in self._stats.items()})
        m["tools/turns_mean"] = statistics.fmean(self._turns) if self._turns else 0.0
        self._calls0, self._lat0, self._turns = dict(ex.stats), len(ex.seconds), []
        self._stats = {"format_errors": 0, "truncated": 0, "wait_s": 0.0, "bytes": 0}
        jobs, self._jobs = self._jobs, []
        return SideWork(TOOL_ROLE, TOOL_NAME, m, seconds, busy_intervals(jobs))

    def close(self) -> None:
        """The engine contract's ``close``: the tool executor's processes, then the engine's own."""
        self.box.executor.close()
        self.engine.close()

    # ------------------------------------------------------------------------------ trajectories
    def _absorb(self, s: Sample) -> _Traj | None:
        """Append an engine sample (one model turn) to its trajectory."""
        sids = self._by_engine.get(s.request_id)
        if not sids:
            return None
        sid = s.id if len(sids) > 1 or s.id in sids else sids[0]
        sids.remove(sid)
        if not sids:
            del self._by_engine[s.request_id]
        t = self._trajs.get(sid)
        if t is None:
            return None
        t.comp += s.completion_ids
        t.mask += [1] * len(s.completion_ids)
        t.logprobs += s.logprobs
        t.versions += s.versions
        return t

    def _model_turn(self, s: Sample) -> None:
        t = self._absorb(s)
        if t is None:
            return
        text = self.box.tokenizer.decode(s.completion_ids, skip_special_tokens=False)
        calls = template.parse_calls(text) if s.finish_reason == "stop" else []
        if not calls or len(t.comp) >= t.req.max_new_tokens:
            t.finish = s.finish_reason
            return self._end(t)
        if t.turns >= self.box.max_iterations:
            self._stats["truncated"] += 1
            t.finish = "stop"
            return self._end(t)
        t.calls, t.results = calls, {}
        for i, c in enumerate(calls):
            if c.error:
                self._stats["format_errors"] += 1
                t.results[i] = str({"error": c.error})  # TRL's form of a failed call's turn
            else:
                self._stats["bytes"] += len(c.name.encode()) + len(json.dumps(c.arguments).encode())  # the call, out
                self.box.executor.submit(Job((t.sid, i), "call", t.sid, c.name, c.arguments))
        if len(t.results) == len(calls):
            self._tool_turn(t)

    def _on_job(self, j: Job) -> None:
        self._jobs.append(j)
        if j.op in ("reward", "drop"):
            t = next((t for t in self._ended if t.sid == j.sid), None)
            if t is not None:
                self._ended.remove(t)
                if j.op == "reward":
                    t.meta[ENV_REWARD_KEY] = j.value if j.status == "ok" else f"error: {j.value}"
                (self._out if self._keep.kept(t.req.id) else self._surplus).append(t.sample())
            return
        sid, i = j.key
        t = self._trajs.get(sid)
        if t is None or t.finish:  # aborted while its tool ran
            return
        t.results[i] = j.value if j.status == "ok" else error_content(j.value)
        if len(t.results) == len(t.calls):
            self._tool_turn(t)

    def _tool_turn(self, t: _Traj) -> None:
        tok = self.box.tokenizer
        outs = [(c.name or "error", t.results[i]) for i, c in enumerate(t.calls)]
        self._stats["bytes"] += sum(len(_text(o).encode()) for _, o in outs)  # the outputs, back in
        eot = tok.decode(t.comp[-1:], skip_special_tokens=False) if t.comp else ""
        ids = template.turn_tokens(tok, outs, eot)[:t.req.max_new_tokens - len(t.comp)]
        t.turns += 1
        t.calls, t.results = [], {}
        v = t.versions[-1] if t.versions else self.engine.version
        t.comp += ids
        t.mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.versions += [v] * len(ids)
        if len(t.comp) >= t.req.max_new_tokens:
            t.finish = "length"
            return self._end(t)
        self._continue(t)
        if t.finish:
            self._end(t)

    def _continue(self, t: _Traj) -> None:
        """The next model turn: one engine request over the whole context, with the rest of the budget."""
        rid = f"{t.sid}@{t.turns}"
        bad = self.engine.submit([Request(rid, t.prompt + t.comp, 1, t.req.max_new_tokens - len(t.comp), t.req.meta)])
        if bad:  # the context no longer fits: the trajectory ends here
            t.finish = "length"
        else:
            self._by_engine[rid] = [t.sid]

    def _end(self, t: _Traj) -> None:
        self._trajs.pop(t.sid, None)
        self._turns.append(t.turns)
        if not self.box.environment:
            (self._out if self._keep.kept(t.req.id) else self._surplus).append(t.sample())
            return
        self._ended.append(t)
        self.box.executor.submit(Job(t.sid, "reward" if self.box.env_reward else "drop", t.sid))

    def _abort(self, trajs: list[_Traj]) -> list[Sample]:
        engine_ids = [rid for rid, sids in self._by_engine.items() if any(s in {t.sid for t in trajs} for s in sids)]
        for s in self.engine.abort(engine_ids) if engine_ids else []:
            self._absorb(s)
        out = []
        for t in trajs:
            self._trajs.pop(t.sid, None)
            t.finish = "abort"
            if self.box.environment:
                self.box.executor.submit(Job(t.sid, "drop", t.sid))
            out.append(t.sample())
        return out


def metrics(side: SideWork) -> dict[str, float]:
    """The ``tools/*`` metrics of a drain: its counts and its calls' latency percentiles (``tools/latency_p50_s``...)."""
    return {**side.counts, **latency_metrics(side.seconds, f"{side.name}/latency_")}


def generate(engine, requests: list[Request], box: Toolbox) -> Turns:
    """Multi-turn ``engine.generate`` in one call: the samples, the rejected, metrics and the tool intervals."""
    turns = MultiTurn(engine, box)
    samples, rejected = turns.generate(requests)
    side = turns.drain()
    return Turns(samples, rejected, metrics(side), side.intervals)
