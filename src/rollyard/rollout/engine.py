"""The rollout engine: continuous batching, shared prompt prefill, streaming, abort, weight updates.

``EngineBase`` holds the request bookkeeping every engine shares (the native/HF ``RolloutEngine``
below and ``rollout/vllm.py``'s ``VllmEngine``): submission and its rejection rule, groups of ``n``
samples, the in-flight policy of a weight update, a weight version per token, abort, and the
``step`` / ``results`` / ``generate`` loop. An engine adds how samples are admitted and decoded.

Contract (callers are written against it):

- ``submit(requests, keep=None)`` queues requests and returns those rejected with a reason (prompt +
  ``max_new_tokens`` beyond the model context or the KV-cache budget, empty prompt, n < 1,
  duplicate id). Nothing that was accepted can later fail for lack of memory. ``keep``: a group is
  complete at its first ``keep`` finished samples (a request with ``n > keep``: tail batching's
  over-provisioned short rounds); the engine aborts the rest at once and ``step()`` never returns
  them. ``surplus()`` hands over what that dropped: the aborted partials, and samples that finished
  in the same step as their group's last kept one (decoded, never trained on).
- ``step()`` runs one admit + decode step and returns the samples finished since the last call
  (an actor's loop drives it); ``results()`` loops over ``step()`` and yields each ``Sample`` the
  moment it finishes; it returns when nothing is queued or in flight. ``busy``: sequences queued
  or decoding (a ``step()`` would decode); ``idle``: not busy and nothing finished left to return.
- ``abort(ids)`` stops requests / samples (``"{request_id}#{k}"``) and returns their partial
  samples (finish reason ``"abort"``); queued ones come back with empty completions.
- ``load_weights(update, inflight)`` applies a ``WeightUpdate`` between two decode steps; in-flight
  sequences ``"finish"`` on the old weights (drained first, then yielded by ``results()``), are
  ``"abort"``-ed (returned), or ``"continue"`` under the new weights (their KV cache from the old
  weights is kept, as in partial rollouts; each token carries the version it was sampled under).
- ``sleep()`` / ``wake_up()``: give the trainer the engine's memory while it steps, and take it back;
  ``score(sample, copy_only)``: the completion logprobs of ``sample`` through what the engine samples
  with (the logprob canary, ``sync/canary.py``); ``close()``: release what the engine holds for good;
  ``drain()``: the work the engine drives beside decoding since the last call, one ``SideWork`` record
  (multi-turn tool calls, ``env/loop.py``'s ``MultiTurn``). Every engine answers all of them:
  where an engine has nothing to do, ``EngineBase``'s default is a no-op (or None, or nothing to report),
  so a caller never asks whether an engine has a method.

Scheduling. At most ``max_concurrent`` sequences decode together, one slot each. Every step first
admits queued samples into free slots (FIFO; a group may be admitted partially), then runs one
batched decode step over the slots. A finished sequence frees its slot at once; a waiting one takes
it at the next step. A group's prompt is prefilled once (prefills of the groups admitted in one
step are batched) and its KV copied to the slots of its ``n`` samples; if only some of them fit, the
prompt's KV and last logits are kept for the rest (dropped on a weight update: re-prefilled).

Memory. The fast path keeps one static cache ``[layers, 2, slots, kv_heads, width, head_dim]``
with ``slots * width <= max_cache_tokens`` (width >= the longest prompt + max_new_tokens admitted).
Admission waits while a sample does not fit; when the engine is empty any single accepted request
fits, so the queue always drains. The backends are files of their own behind one
contract (``rollout/backend.py``): ``rollout/native.py`` (the fast path above), and for other
architectures the batched HF backend (``rollout/hf.py``: one transformers cache, rows x widest prompt + max_new_tokens within the
same budget), or, for a model it cannot reproduce, the per-sequence one (prompt + max_new_tokens
per sample).

Sampling. ``logprobs[i]`` is the logprob of ``token`` under the distribution it was drawn from: the
softmax of ``logits / T`` renormalised over the top-k / top-p support (``algo/support.py``; the
trainer takes its ratio over the same support), in fp32; greedy: ``log_softmax(logits)[token]``. Draws come from one ``torch.Generator`` seeded with ``seed``: the same submissions give the
same samples.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

import torch

from rollyard.algo import support
from rollyard.model import kernels as cpu_kernels
from rollyard.rollout import hf as hf_backend
from rollyard.rollout import native
from rollyard.rollout.backend import Backend, reject_reason
from rollyard.rollout.backend import Seq as _Seq
from rollyard.sync import canary
from rollyard.sync.apply import Receiver
from rollyard.telemetry.side import SideWork
from rollyard.types import Request, Sample, WeightUpdate

INFLIGHT_POLICIES = ("finish", "abort", "continue")


@dataclass(eq=False)
class _Group:
    req: Request
    pending: deque  # sample indices k not yet admitted
    need: int  # cache positions one sample needs: prompt + max_new_tokens
    stash: object = None  # backend prompt state kept for the samples admitted later
    logits: torch.Tensor | None = None  # [V] last-prompt-position logits (with stash)


class KeepFirst:
    """The keep rule (``submit``'s ``keep``), bookkeeping on request ids: a group is complete at its first ``keep``
    finished samples; a sample of it that finishes later in the same step is surplus, and at the end of the step
    the group's other samples are aborted (``close``). One rule for the engine and for ``MultiTurn``."""

    def __init__(self):
        self.left: dict[str, int] = {}  # request id -> samples still to keep
        self.full: set[str] = set()  # complete this step: the rest to abort at its end

    def add(self, rid: str, n: int, keep: int | None) -> None:
        if keep is not None and keep < n:
            self.left[rid] = keep

    def kept(self, rid: str) -> bool:
        """A sample of ``rid`` finished: True if it is kept (False: surplus, its group is already complete)."""
        if rid in self.full:
            return False
        if rid in self.left:
            self.left[rid] -= 1
            if not self.left[rid]:
                del self.left[rid]
                self.full.add(rid)
        return True

    def drop(self, ids) -> None:
        """Groups stopped by the caller: nothing more to keep of them."""
        for rid in self.left.keys() & set(ids):
            del self.left[rid]

    def close(self, abort) -> list[Sample]:
        """End of a step: ``abort`` (the engine's) the other samples of the groups completed in it; returns them."""
        if not self.full:
            return []
        full, self.full = list(self.full), set()
        return abort(full)


@runtime_checkable
class Engine(Protocol):
    """The engine contract (the module docstring), as a rollout side drives it: ``EngineBase`` (every backend) and
    ``env/loop.py``'s ``MultiTurn`` (trajectories over an engine) implement it."""

    version: int  # the weight version new tokens are sampled under
    model: object  # the module weight updates are staged into
    generator: torch.Generator  # the sampling RNG (checkpointed by the in-process side)
    max_concurrent: int  # slots: sequences that decode together

    def submit(self, requests: list[Request], keep: int | None = None) -> list[tuple[Request, str]]: ...
    def step(self) -> list[Sample]: ...
    def results(self) -> Iterator[Sample]: ...
    def generate(self, requests: list[Request]) -> tuple[list[Sample], list[tuple[Request, str]]]: ...
    def abort(self, ids) -> list[Sample]: ...
    def surplus(self) -> list[Sample]: ...
    def load_weights(self, update: WeightUpdate, inflight: str = "finish") -> list[Sample]: ...
    @property
    def busy(self) -> bool: ...
    @property
    def idle(self) -> bool: ...
    @property
    def num_active(self) -> int: ...
    @property
    def num_queued(self) -> int: ...
    @property
    def own_copy(self) -> bool: ...
    def score(self, sample: Sample, copy_only: bool = False) -> list[float] | None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def close(self) -> None: ...
    def drain(self) -> SideWork | None: ...


# ---------------------------------------------------------------------------------------------
# The request bookkeeping every engine shares.
# ---------------------------------------------------------------------------------------------


class EngineBase(Engine):
    """Queue, groups, abort, the in-flight policy and per-token versions (the module docstring's contract).

    ``model`` is the module weight updates are staged into (``sync.apply.Receiver``). A subclass
    provides ``_step()`` (admit and decode once; finished samples go through ``_finish``) and
    ``_swap(staged)`` (take staged weights into its forward), and may override the hooks
    ``_new_group``, ``_release``, ``_stop_active``, ``_drain`` and ``_before_results``.
    """

    def __init__(self, model, *, eos_token_id: int | list[int], pad_token_id: int, temperature: float,
                 top_p: float, max_concurrent: int, max_cache_tokens: int, seed: int, version: int,
                 device: torch.device | str = "cpu", top_k: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"top_p must be in (0, 1] and top_k >= 0 (0 = off), got {top_p}, {top_k}")
        if max_concurrent < 1 or max_cache_tokens < 1:
            raise ValueError(f"max_concurrent and max_cache_tokens must be >= 1, got {max_concurrent}, "
                             f"{max_cache_tokens}")
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        # Every id that ends a sequence (a chat model's generation_config lists several).
        self.eos_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.max_concurrent, self.max_cache_tokens = int(max_concurrent), int(max_cache_tokens)
        self.version = int(version)
        self.context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.generator = torch.Generator(device=device).manual_seed(int(seed))
        self._queue: deque = deque()  # groups with samples not yet admitted, FIFO
        self._active: dict = {}  # sample id -> its sequence, admitted and unfinished
        self._done: deque[Sample] = deque()  # finished, not yet returned by step()
        self._ids: set[str] = set()  # request ids queued or in flight
        self._keep = KeepFirst()  # submit's keep: groups complete at their first keep samples
        self._surplus: list[Sample] = []  # what the keep rule dropped since the last ``surplus()``
        self._receiver = Receiver(model, self.version)  # staged apply of weight updates

    # -- hooks ---------------------------------------------------------------------------------

    def _step(self) -> None:
        raise NotImplementedError

    def _swap(self, staged) -> None:
        raise NotImplementedError

    def _new_group(self, r: Request):
        return _Group(r, deque(range(r.n)), len(r.prompt_ids) + r.max_new_tokens)

    def _release(self, s) -> None:
        """A finished sequence's resources are free again."""

    def _stop_active(self, seqs: list) -> None:
        """Stop these admitted sequences inside the forward's own engine (before they are finished here)."""

    def _drain(self, update: WeightUpdate) -> None:
        """``inflight="finish"``: run every admitted sequence to its end on the current weights."""
        while self._active:
            self._step()

    def _before_results(self) -> None:
        """Checked when work is submitted and before ``results()`` drives decoding."""

    # -- submission ----------------------------------------------------------------------------

    def _reject_reason(self, r: Request) -> str | None:
        return reject_reason(r, self.context, self.max_cache_tokens, self._ids)

    def submit(self, requests: list[Request], keep: int | None = None) -> list[tuple[Request, str]]:
        """Queue ``requests``; return the rejected ones as ``(request, reason)``. ``keep``: each group is complete
        at its first ``keep`` finished samples, the rest aborted (the module docstring)."""
        self._before_results()
        rejected = []
        for r in requests:
            why = self._reject_reason(r)
            if why:
                rejected.append((r, why))
                continue
            self._ids.add(r.id)
            self._queue.append(self._new_group(r))
            self._keep.add(r.id, r.n, keep)
        return rejected

    # -- decoding ------------------------------------------------------------------------------

    def step(self) -> list[Sample]:
        """One admit + decode step (none when idle); returns every sample finished since the last call.

        The unit an actor loop drives: between two calls it may ``submit``, ``abort`` or
        ``load_weights``. Samples a ``load_weights(inflight="finish")`` drained come out here too.
        """
        if self._queue or self._active:
            self._step()
        self._surplus += self._keep.close(self.abort)  # the groups completed in this step: their others stop now
        out = list(self._done)
        self._done.clear()
        return out

    def surplus(self) -> list[Sample]:
        """The samples the keep rule dropped since the last call (``submit``'s ``keep``): aborted partials (reason
        ``"abort"``) and samples that finished in the step their group completed in."""
        out, self._surplus = self._surplus, []
        return out

    @property
    def busy(self) -> bool:
        """Sequences queued or decoding: a ``step()`` would decode."""
        return bool(self._queue or self._active)

    @property
    def idle(self) -> bool:
        """Nothing queued, in flight or finished-but-not-returned."""
        return not (self.busy or self._done)

    def results(self) -> Iterator[Sample]:
        """Drive decoding; yield each finished sample; return when nothing is queued or in flight."""
        self._before_results()
        while not self.idle:
            yield from self.step()

    def generate(self, requests) -> tuple[list[Sample], list[tuple[Request, str]]]:
        """Submit ``requests``, drain ``results()``; samples in request order (then k)."""
        requests = list(requests)
        rejected = self.submit(requests)
        order = {r.id: i for i, r in enumerate(requests)}
        out = list(self.results())
        out.sort(key=lambda s: (order.get(s.request_id, len(order)), int(s.id.rsplit("#", 1)[1])))
        return out, rejected

    def _finish(self, s, reason: str, out: list | None = None) -> None:
        """``s`` ended (``out``: aborted, into that list); a finished sample its group no longer keeps is surplus."""
        del self._active[s.sid]
        self._release(s)
        if out is None:
            out = self._done if self._keep.kept(s.req.id) else self._surplus
        out.append(self._sample_of(s.req, s.k, s.tokens, s.logprobs, s.versions, reason))
        self._forget_if_done(s.req.id)

    def _forget_if_done(self, rid: str) -> None:
        if any(g.req.id == rid for g in self._queue):
            return
        if any(s.req.id == rid for s in self._active.values()):
            return
        self._ids.discard(rid)

    @staticmethod
    def _sample_of(req: Request, k: int, tokens, logprobs, versions, reason: str) -> Sample:
        return Sample(id=f"{req.id}#{k}", request_id=req.id, prompt_ids=list(req.prompt_ids),
                      completion_ids=list(tokens), logprobs=list(logprobs), versions=list(versions),
                      finish_reason=reason, meta=dict(req.meta))

    # -- control -------------------------------------------------------------------------------

    def abort(self, ids) -> list[Sample]:
        """Stop the given request ids and/or sample ids; return their (partial) samples, reason "abort".

        Active samples keep the tokens and logprobs generated so far; queued ones come back with
        empty completions. Ids that already finished (or are unknown) are ignored.
        """
        ids = {ids} if isinstance(ids, str) else set(ids)
        self._keep.drop(ids)

        def hit(rid: str, sid: str) -> bool:
            return rid in ids or sid in ids

        out: list[Sample] = []
        stop = [s for s in self._active.values() if hit(s.req.id, s.sid)]
        if stop:
            self._stop_active(stop)
        for s in stop:
            self._finish(s, "abort", out)
        for g in list(self._queue):
            for k in [k for k in g.pending if hit(g.req.id, f"{g.req.id}#{k}")]:
                g.pending.remove(k)
                out.append(self._sample_of(g.req, k, [], [], [], "abort"))
            if not g.pending:
                self._queue.remove(g)
                self._forget_if_done(g.req.id)
        return out

    def load_weights(self, update: WeightUpdate, inflight: str = "finish") -> list[Sample]:
        """Apply ``update`` between two decode steps; returns the samples the "abort" policy stopped.

        ``finish``: in-flight sequences run to completion on the current weights first (they come
        out of ``results()``); ``abort``: they stop now and are returned; ``continue``: they go on
        under the new weights, each token stamped with the version it was sampled under. Queued
        samples (including a partly admitted group's waiting samples) start under the new weights.
        The update is staged and verified before anything else (``sync/apply.py``): a corrupted,
        truncated or version-skipping one raises ``SyncRejected`` with weights, version and
        in-flight work untouched; the caller then publishes a full sync.
        """
        if inflight not in INFLIGHT_POLICIES:
            raise ValueError(f"inflight policy must be one of {INFLIGHT_POLICIES}, got {inflight!r}")
        # Staged beside the live weights first: a rejected update (SyncRejected) changes nothing.
        self._receiver.version = self.version
        staged = self._receiver.stage(update)
        aborted: list[Sample] = []
        if self._active:
            if inflight == "finish":
                self._drain(update)
            elif inflight == "abort":
                aborted = self.abort([s.sid for s in self._active.values()])
        self._swap(staged)
        self.version = int(update.version)
        return aborted

    # -- memory, scoring, closing: the rest of the contract (no-ops where an engine has nothing to do) --

    def sleep(self) -> None:
        """Give the trainer this engine's memory while it steps (colocated); nothing to give here."""

    def wake_up(self) -> None:
        """Take the memory back after the trainer's step; nothing to take here."""

    def close(self) -> None:
        """Release what the engine holds for good (processes, directories); nothing here."""

    def score(self, sample: Sample, copy_only: bool = False) -> list[float] | None:
        """Completion-token logprobs of ``sample`` through what this engine samples with (the logprob canary).

        Here: the engine's module (``sync.canary.score``), on the support the engine samples from
        (``algo.support.Support.of_engine``). ``copy_only``: the module is the trainer's own (mode
        inprocess), so scoring it would compare the trainer with itself: None, unless the engine samples through
        weights of its own (an override). None also when the module is not one a forward can run."""
        if copy_only or not canary.scorable(self.model):
            return None
        return canary.score(self.model, sample, support.Support.of_engine(self))

    @property
    def own_copy(self) -> bool:
        """The engine samples through weights of its own (fused copies, vLLM's), not its module's forward: what
        ``score(copy_only=True)`` can measure."""
        return False

    def drain(self) -> SideWork | None:
        """The work the engine drove beside decoding since the last call (a multi-turn engine's tool calls), as
        one :class:`SideWork` record the placements forward without reading; a bare engine has none: None."""
        return None

    # -- introspection -------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        return sum(len(g.pending) for g in self._queue)


# ---------------------------------------------------------------------------------------------
# The engine over the native and HF backends.
# ---------------------------------------------------------------------------------------------


class RolloutEngine(EngineBase):
    """Continuous-batching sampler over an HF causal LM (see the module docstring for the contract)."""

    def __init__(self, model, *, eos_token_id: int | list[int], pad_token_id: int = 0, temperature: float = 1.0,
                 top_p: float = 1.0, max_concurrent: int = 64, max_cache_tokens: int = 65536,
                 seed: int = 0, version: int = 0, top_k: int = 0, compute_dtype: torch.dtype | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # The native fast path's compute dtype (rollout.precision; None: the module's). The HF backends
        # compute in the module's dtype.
        self.compute_dtype = compute_dtype
        super().__init__(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature,
                         top_p=top_p, max_concurrent=max_concurrent, max_cache_tokens=max_cache_tokens, seed=seed,
                         version=version, device=self.device, top_k=top_k)
        # Test/bench hook: sample id -> a cap on its completion length (a "length oracle").
        self._length_cap = None
        self.backend: Backend = self._pick_backend()
        self._stamp = self._param_versions()

    # -- backend selection -------------------------------------------------------------------

    def _pick_backend(self) -> Backend:
        reason = native.unsupported_reason(self.model)
        if reason is None:
            try:
                backend = native.NativeBackend(self.model, self.max_concurrent, self.max_cache_tokens,
                                               self.compute_dtype)
                err = native.fast_path_matches(self.model, backend)
                fwd = backend.fwd
                fp32 = fwd.weight_dtype == torch.float32 and fwd.mm_dtype == torch.float32
                # (int8: mm_dtype fp32, and the reference holds the int8 copies' weights). w8a8 rounds every matmul's
                # input too, which the reference does not: 2.4-4.7e-2 on SmolLM2-135M (the rounding's noise differs
                # with the last ulp of an input, so a reference rounding its inputs alike measured no closer)
                tol = 1e-1 if fwd.a8 else 1e-4 if fp32 else 3e-2
                if err <= tol:
                    return backend
                reason = f"fast path differs from the HF forward by {err:.2e} (relative, tolerance {tol})"
            except cpu_kernels.KernelsRequired:
                raise
            except Exception as e:  # noqa: BLE001 - an unexpected variant of a supported family
                reason = f"fast path failed: {type(e).__name__}: {e}"
        why_not = hf_backend.batched_unsupported_reason(self.model)
        if why_not is None:
            warnings.warn(f"RolloutEngine: using the batched HF backend (model.generate-style batched decode over "
                          f"a transformers cache; the fast path would be faster): {reason}", stacklevel=2)
            return hf_backend.BatchedHFBackend(self.model, self.max_concurrent, self.max_cache_tokens)
        warnings.warn(f"RolloutEngine: using the per-sequence HF backend (one forward and cache per sequence, "
                      f"several times slower than model.generate): fast path: {reason}; batched HF: {why_not}",
                      stacklevel=2)
        return hf_backend.PerSeqHFBackend(self.model, self.max_concurrent, self.max_cache_tokens)

    def _use_backend(self, name: str) -> None:
        """Force ``"fast"``, ``"hf"`` (batched HF) or ``"hf-perseq"``; tests compare them. Only while idle."""
        assert not self._active, "switch backends only while idle"
        if name == "fast":
            self.backend = native.NativeBackend(self.model, self.max_concurrent, self.max_cache_tokens,
                                                self.compute_dtype)
        else:
            cls = {"hf": hf_backend.BatchedHFBackend, "hf-perseq": hf_backend.PerSeqHFBackend}[name]
            self.backend = cls(self.model, self.max_concurrent, self.max_cache_tokens)
        for g in self._queue:
            g.stash = g.logits = None

    def _param_versions(self) -> list[int]:
        return [p._version for p in self.model.parameters()]

    def _check_weights_unchanged(self) -> None:
        if self._param_versions() != self._stamp:
            raise RuntimeError(
                "the model's weights changed in place since the engine last loaded them (version "
                f"{self.version}); the engine's fused weight copies are stale. After a trainer step call "
                "engine.load_weights(WeightUpdate(version=v, mode='inprocess')) before sampling again"
            )

    # -- decoding (EngineBase hooks and the native sampler) -------------------------------------

    def _before_results(self) -> None:
        self._check_weights_unchanged()

    def sleep(self) -> None:
        """Give the trainer the engine's memory while it steps (colocated): the fast path frees its KV cache
        and fused weight copies (for SmolLM2-135M 0.79 + 0.54 GB); nothing while sequences are in flight."""
        if not self._active and isinstance(self.backend, native.NativeBackend):
            self.backend.sleep()

    def wake_up(self) -> None:
        """Nothing now: the next ``load_weights`` rebuilds the fused copies, or, if none comes, the next step
        does from the unchanged module (``_step``)."""

    @property
    def own_copy(self) -> bool:
        return isinstance(self.backend, native.NativeBackend)

    def score(self, sample: Sample, copy_only: bool = False) -> list[float] | None:
        """The fast path scores through its fused copies (rebuilt from the module at every load), the path that
        draws the samples; copies freed for the trainer's step and not rebuilt since: the module the next step
        rebuilds them from (``EngineBase.score``). The HF backends decode with the module itself."""
        if isinstance(self.backend, native.NativeBackend) and not self.backend.asleep:
            return canary.score_fast(self.backend.fwd, sample, support.Support.of_engine(self))
        return super().score(sample, copy_only)

    def _step(self, admit: bool = True) -> None:
        if getattr(self.backend, "asleep", False):  # woke without a weight load: same weights, rebuild them
            self._check_weights_unchanged()
            self.backend.refresh()
        if admit:
            self._admit()
        if self._active:
            seqs = list(self._active.values())
            logits = self.backend.decode(seqs)
            for s in seqs:
                s.length += 1
            self._append(seqs, logits)
            self.backend.maybe_compact(list(self._active.values()))

    def _admit(self) -> None:
        room = self.max_concurrent - len(self._active)
        cands: list[tuple[_Group, int]] = []
        for g in self._queue:
            for k in g.pending:
                if len(cands) == room:
                    break
                cands.append((g, k))
            if len(cands) == room:
                break
        if not cands:
            return
        slots = self.backend.reserve(list(self._active.values()), [g.need for g, _ in cands])
        cands = cands[:len(slots)]
        if not cands:
            return
        # Group the admitted samples; prefill (batched) the groups that have no stashed prompt.
        by_group: dict[int, tuple[_Group, list]] = {}
        for (g, k), slot in zip(cands, slots):
            by_group.setdefault(id(g), (g, []))[1].append((k, slot))
        fresh = [(g, ks) for g, ks in by_group.values() if g.stash is None]
        if fresh:
            logits = self.backend.prefill([g.req.prompt_ids for g, _ in fresh], [ks[0][1] for _, ks in fresh])
            src, dst = [], []
            for i, (g, ks) in enumerate(fresh):
                g.logits = logits[i]
                for _, slot in ks[1:]:
                    src.append(ks[0][1])
                    dst.append(slot)
            P = max(len(g.req.prompt_ids) for g, _ in fresh)
            self.backend.fork(src, dst, P)
            for g, ks in fresh:
                if len(g.pending) > len(ks):  # some samples wait for a slot: keep the prompt's KV
                    g.stash = self.backend.snapshot(ks[0][1], len(g.req.prompt_ids))
        fresh_ids = {id(g) for g, _ in fresh}
        for g, ks in by_group.values():
            if id(g) not in fresh_ids:
                self.backend.restore(g.stash, [slot for _, slot in ks])
        new, rows = [], []
        for g, ks in by_group.values():
            for k, slot in ks:
                g.pending.remove(k)
                cap = g.req.max_new_tokens
                sid = f"{g.req.id}#{k}"
                if self._length_cap is not None:
                    cap = max(1, min(cap, int(self._length_cap(sid))))
                s = _Seq(sid, g.req, k, cap, slot=slot, length=len(g.req.prompt_ids))
                self._active[sid] = s
                new.append(s)
                rows.append(g.logits)
            if not g.pending:
                g.stash = g.logits = None
        self._queue = deque(g for g in self._queue if g.pending)
        self._append(new, torch.stack(rows))

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        logits = logits.float()
        if self.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(dim=-1)
        else:  # top-k / top-p: draw from, and record the logprob of, the renormalised support (algo/support.py)
            scaled = logits if self.temperature == 1.0 else logits / self.temperature  # x / 1 is x, bit for bit
            r = torch.rand(scaled.shape[0], 1, generator=self.generator, device=scaled.device, dtype=torch.float64)
            if not support.active(self.top_p, self.top_k):  # the whole vocabulary: one fused pass on CPU
                drawn = cpu_kernels.softmax_draw(scaled, r.view(-1))
                if drawn is not None:
                    return drawn[0].tolist(), drawn[1].tolist()
            logp = torch.log_softmax(support.restrict(scaled, self.top_p, self.top_k), dim=-1)
            tok = self._inverse_cdf(logp.exp(), r)  # tokens outside the support have weight exactly 0
        lp = logp.gather(1, tok[:, None]).squeeze(1)
        return tok.tolist(), lp.tolist()

    @staticmethod
    def _inverse_cdf(weights: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """One draw per row of ``weights [B, V]`` (non-negative, unnormalised), with probability
        proportional to them: ``u = r * total`` per row (``r [B, 1]`` fp64 uniforms in ``[0, 1)`` from the
        engine's generator), the first index whose running sum
        exceeds ``u`` (zero-weight entries can never be picked). One uniform per row instead of
        V random numbers: at a 32k vocabulary and batch 32 on one CPU core this measured ~0.9 ms
        against ~28 ms for an exponential race or ``torch.multinomial``. The running sum is
        fp64, so tokens far below fp32's resolution of the total keep their probability. On CPU the compiled kernel
        (``model/kernels.py`` :func:`inverse_cdf`) finds the same index, bit for bit, without the fp64 copy and
        the running-sum tensor."""
        tok = cpu_kernels.inverse_cdf(weights, r.view(-1))
        if tok is not None:
            return tok
        c = weights.double().cumsum(dim=-1)
        return torch.searchsorted(c, r * c[:, -1:], right=True).squeeze(1).clamp_(max=c.shape[1] - 1)

    def _append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        toks, lps = self._sample(logits)
        v, eos = self.version, self.eos_ids
        for s, t, lp in zip(seqs, toks, lps):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(v)
            if t in eos:
                self._finish(s, "stop")
            elif len(s.tokens) >= s.max_new:
                self._finish(s, "length")

    def _release(self, s: _Seq) -> None:
        self.backend.release(s.slot)

    # -- weights (EngineBase hooks) ------------------------------------------------------------

    def _drain(self, update: WeightUpdate) -> None:
        if update.mode == "inprocess" and self._param_versions() != self._stamp:
            raise RuntimeError(
                f"load_weights(inflight='finish') with {len(self._active)} sequences in flight, but the "
                "shared module was already changed in place (mode 'inprocess'): they cannot finish on "
                "the old weights. Drain results() before the trainer steps, or use inflight='abort' / "
                "'continue'"
            )
        while self._active:
            self._step(admit=False)

    def _swap(self, staged) -> None:
        for g in self._queue:  # prompt KV from the old weights: re-prefill under the new ones
            g.stash = g.logits = None
        self._receiver.swap(staged)
        self.backend.refresh()
        self._stamp = self._param_versions()
