"""The native rollout backend: a static slot KV cache over a model family's fast forward (routed by
``rollyard.model.families``: the Llama family, Gemma 3), the embedded default. Contract: ``rollout/backend.py``.

Memory: one cache ``[layers, 2, slots, kv_heads, width, head_dim]`` with ``slots * width <=
max_cache_tokens`` (width >= the longest prompt + max_new_tokens admitted), slots grown in powers of two
with the sequences admitted (the budget bounds the cache; it is not reserved up front).
"""

from __future__ import annotations

import heapq

import torch

from rollyard.model import families
from rollyard.rollout.backend import Seq as _Seq

unsupported_reason = families.unsupported_reason


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _copy_slots(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]], width: int) -> None:
    """``dst[:, :, d, :, :width] = src[:, :, s, :, :width]`` for each ``(d, s)`` in order, one strided copy per slot.
    Not one advanced-indexing assignment: that gathers every source slot into a new tensor first and scatters it
    back, ~10x the time of these copies (SmolLM2's 28 forked slots of a 45-token prompt: 35 ms against 3.3 ms,
    one thread)."""
    if width:
        for d, s in pairs:
            if d != s or dst is not src:
                dst[:, :, d, :, :width].copy_(src[:, :, s, :, :width])


# The shortest prompt prefix that prefill shares across prompts: below it a second forward's fixed cost (~2 ms for
# SmolLM2's 30 layers) outweighs the rows it saves.
SHARED_PREFIX = 8


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, each keeping at least its last token out (0: fewer than two prompts, or a
    prefix shorter than ``SHARED_PREFIX``)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    L = 0
    while L < n and all(p[L] == first[L] for p in prompts):
        L += 1
    return L if L >= SHARED_PREFIX else 0


class NativeBackend:
    """Fast path: a static slot cache and the model family's fast forward."""

    name = "fast"

    def __init__(self, model, max_concurrent: int, max_cache_tokens: int, compute_dtype: torch.dtype | None = None):
        self.fwd = families.fast_forward(model, compute_dtype)
        self.max_concurrent, self.budget = max_concurrent, max_cache_tokens
        self.context = self.fwd.context
        self.R = self.W = 0
        self.kv = None
        self.free: list[int] = []
        # Which slots hold a bitwise copy of another's first positions (a forked prompt), for the attention to read one
        # copy per group: slot -> (source slot, positions), while both are live and nothing moved; each slot's
        # prompt length, for fork to know how far its copy matches. Dropped, never wrong: a slot falls back to its own.
        self._share: dict[int, tuple[int, int]] = {}
        self._plen: dict[int, int] = {}

    def refresh(self) -> None:
        self.fwd.refresh()

    @property
    def asleep(self) -> bool:
        return self.fwd.released

    def sleep(self) -> None:
        """Free the KV cache and the fused weight copies (only while no sequence is active); the next
        ``reserve`` lays out a new cache, ``refresh`` rebuilds the weights."""
        self.kv, self.R, self.W, self.free = None, 0, 0, []
        self._forget()
        self.fwd.release()

    def _forget(self) -> None:
        """Drop every sharing note (slots moved or were freed)."""
        self._share, self._plen = {}, {}

    def _note(self, dst: int, src: int, P: int) -> None:
        """Slot ``dst``'s first ``P`` positions are a bitwise copy of slot ``src``'s."""
        if P > 0 and dst != src:
            self._share[dst] = (src, P)

    def _width_for(self, need: int) -> int:
        w = max(need, min(_round_up(need, 16), self.context, self.budget))
        # Prefer the width at which all max_concurrent slots still fit: no re-layout later.
        return max(w, min(self.context, self.budget // self.max_concurrent))

    def _relayout(self, R: int, W: int, active: list[_Seq]) -> None:
        """New cache of R slots x W positions; active sequences move (compacted) to slots 0..a-1."""
        new = self.fwd.new_cache(R, W)
        self._forget()
        if active:
            wc = min(W, self.W, max(s.length for s in active))
            _copy_slots(new, self.kv, [(i, s.slot) for i, s in enumerate(active)], wc)
            for i, s in enumerate(active):
                s.slot = i
        self.kv, self.R, self.W = new, R, W
        self.free = list(range(len(active), R))
        heapq.heapify(self.free)

    def reserve(self, active: list[_Seq], needs: list[int]) -> list[int]:
        """Slots for the longest prefix of ``needs`` that fits (re-laying out the cache if that admits more)."""
        k = 0
        while k < len(needs) and k < len(self.free) and needs[k] <= self.W:
            k += 1
        if k < len(needs):
            base = max([s.req.prompt_ids.__len__() + s.max_new for s in active], default=0)
            for m in range(len(needs), k, -1):
                W = self._width_for(max(base, max(needs[:m])))
                R = min(self.max_concurrent, self.budget // W, self._slots_for(len(active) + m, W))
                if len(active) + m <= R:
                    if (R, W) != (self.R, self.W) or len(self.free) < m:
                        self._relayout(R, W, active)
                    k = m
                    break
        return [heapq.heappop(self.free) for _ in range(k)]

    def _slots_for(self, n: int, W: int) -> int:
        """Slots to lay out for ``n`` sequences: the next power of two (at least 8), never fewer than the
        current layout's at the same width (no shrinking re-layout). The budget is an upper bound, not a
        size: SmolLM2-135M's auto budget (32 sequences x 536 tokens) laid out at its 80-token width held
        214 slots, 0.79 GB of fp32 cache, for 32 sequences (0.12 GB)."""
        return max(1 << max(n - 1, 7).bit_length(), self.R if W == self.W else 0)

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)
        self._plen.pop(slot, None)
        if self._share:  # its own notes, and those of the slots that read their prompt from it (they read theirs)
            self._share = {d: (s, P) for d, (s, P) in self._share.items() if slot not in (d, s)}

    def maybe_compact(self, active: list[_Seq]) -> None:
        # Decode runs over slots 0..hi-1, holes left by finished sequences included. Once the holes
        # outnumber a quarter of the survivors (+2), move the survivors down: one copy of their K/V
        # against a step's attention over every hole for the rest of the batch (measured on a
        # varlen GRPO batch, small preset: generate 0-11% faster than waiting for 2x survivors + 8).
        if active:
            hi = max(s.slot for s in active) + 1
            if hi > len(active) + len(active) // 4 + 2:
                self._compact(sorted(active, key=lambda s: s.slot))

    def _compact(self, active: list[_Seq]) -> None:
        """Move the active sequences to slots 0..a-1 within the same cache (no new allocation).

        Slot by slot in ascending order: survivor i moves from slot ``s_i >= i`` (the slots are sorted), and no
        later survivor's source is an earlier destination (``s_j > s_i >= i`` for ``j > i``), so nothing is
        overwritten before it is read; the slots left behind keep stale (finite) entries, masked out like any
        garbage."""
        _copy_slots(self.kv, self.kv, [(i, s.slot) for i, s in enumerate(active)], max(s.length for s in active))
        self._forget()
        for i, s in enumerate(active):
            s.slot = i
        self.free = list(range(len(active), self.R))
        heapq.heapify(self.free)

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Logits [G, V] at each prompt's last token, its K/V written at its slot. A prefix all the prompts share
        (a chat template's system prompt: 27 of SmolLM2's 45 tokens in the example) of at least ``SHARED_PREFIX``
        tokens is run once, in the first slot, and copied to the others; the rest of each prompt attends to it."""
        dev = self.fwd.device
        L = shared_prefix(prompts)
        if L:
            self.fwd.prefill(torch.tensor([prompts[0][:L]], device=dev), self.kv, torch.tensor(slots[:1], device=dev),
                             torch.tensor([L - 1], device=dev))
            _copy_slots(self.kv, self.kv, [(d, slots[0]) for d in slots[1:]], L)
            for d in slots[1:]:
                self._note(d, slots[0], L)
        for p, s in zip(prompts, slots):
            self._plen[s] = len(p)
        P = max(len(p) for p in prompts) - L
        toks = torch.tensor([p[L:] + [0] * (P + L - len(p)) for p in prompts], device=dev)
        last = torch.tensor([len(p) - 1 - L for p in prompts], device=dev)
        return self.fwd.prefill(toks, self.kv, torch.tensor(slots, device=dev), last, start=L)

    def fork(self, src: list[int], dst: list[int], P: int) -> None:
        _copy_slots(self.kv, self.kv, list(zip(dst, src)), P)
        for s, d in zip(src, dst):  # the copy matches the source's prompt (past it: each row's own tokens)
            n = min(self._plen.get(s, 0), P)
            self._plen[d] = n
            self._note(d, s, n)

    def snapshot(self, slot: int, P: int):
        return self.kv[:, :, slot, :, :P].clone()

    def restore(self, stash, slots: list[int]) -> None:
        P = stash.shape[-2]
        for s in slots:
            self.kv[:, :, s, :, :P] = stash
            self._plen[s] = P
            self._note(s, slots[0], P)

    def _share_for(self, hi: int) -> torch.Tensor | None:
        """Decode's ``share`` for slots ``0..hi-1`` (``FastForward.decode``): ``(src, P)`` per row, ``(row, 0)`` for
        a row with no note; None where no slot has one."""
        if not self._share:
            return None
        rows = [[b, 0] for b in range(hi)]
        for d, (s, P) in self._share.items():
            if d < hi:
                rows[d] = [s, P]
        return torch.tensor(rows, dtype=torch.int64)

    # inference_mode, not no_grad: no view or version-counter bookkeeping on the ~100 small ops
    # of a step (3-14% of a tiny decode step). The cache is made outside it (reserve, relayout),
    # so it stays a normal tensor that compaction, fork and restore may write to.
    @torch.inference_mode()
    def decode(self, seqs: list[_Seq]) -> torch.Tensor:
        hi = max(s.slot for s in seqs) + 1
        toks, pos = [0] * hi, [0] * hi
        for s in seqs:
            toks[s.slot], pos[s.slot] = s.tokens[-1], s.length
        dev = self.fwd.device
        # Every active sequence at one position (GRPO's samples of equal-length prompts): no mask,
        # plain-slice K/V writes. Holes left by finished sequences ride along as token 0 at that
        # position: their rows are dropped below, and what they write lands in free slots, which
        # are prefilled, forked or restored before anyone reads them.
        p0 = seqs[0].length
        share = self._share_for(hi)
        if all(s.length == p0 for s in seqs):
            logits = self.fwd.decode(torch.tensor(toks, device=dev), None, self.kv, p0 + 1, same_pos=p0, share=share)
        else:
            logits = self.fwd.decode(torch.tensor(toks, device=dev), torch.tensor(pos, device=dev), self.kv,
                                     max(pos) + 1, share=share)
        if len(seqs) == hi and all(s.slot == i for i, s in enumerate(seqs)):
            return logits
        return logits[torch.tensor([s.slot for s in seqs], device=dev)]


@torch.no_grad()
def fast_path_matches(model, backend: NativeBackend) -> float:
    """Max |logit difference| between the fast path and the HF forward on a short random sequence (relative to the
    largest logit); with int8 weights (rollout.precision=int8 or w8a8), the HF forward over the weights those hold
    (w8a8 also rounds each matmul's input, which that forward does not)."""
    fwd = backend.fwd
    vocab = fwd.embed.shape[0]
    T = min(8, fwd.context)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, T), generator=g).to(fwd.device)
    held = fwd.dequantized()
    if held:  # (tie_weights=False: a tied embedding keeps the module's table, as the fast path reads it)
        ref = torch.func.functional_call(model, held, (), {"input_ids": ids}, tie_weights=False).logits[0].float()
    else:
        ref = model(input_ids=ids).logits[0].float()
    kv = fwd.new_cache(1, T)
    out = [fwd.prefill(ids[:, :T // 2], kv, torch.tensor([0], device=fwd.device),
                       torch.tensor([T // 2 - 1], device=fwd.device))[0]]
    for t in range(T // 2, T):
        out.append(fwd.decode(ids[:, t], torch.tensor([t], device=fwd.device), kv, t + 1)[0])
    got = torch.stack(out).float()
    return float((got - ref[T // 2 - 1:]).abs().max() / ref.abs().max().clamp_min(1e-6))


