"""Rollout-engine backends over a model's own Hugging Face forward (architectures the fast path does not cover).

``BatchedHFBackend`` (the default fallback) keeps ONE transformers ``DynamicCache`` whose rows are
the active sequences, laid out as ``model.generate`` lays out a left-padded batch: every row's
newest token sits in the last cache column, a row's valid entries are its last ``n[row]`` columns
(contiguous), and the columns before them are padding. So the attention mask is implied by ``n``
(``col >= C - n``), the next position id is ``n`` (what generate derives from the mask), and one
decode step is one forward over all rows: ``input_ids [R, 1]``. Because valid entries are
contiguous and right-aligned, a column distance is a token distance: sliding-window layers
(Mistral, Gemma2/3) get the right window from transformers' mask functions.

Every layer is a plain ``DynamicLayer`` that keeps all its columns (a sliding layer's own cache
drops columns by count, not per row; the memory budget counts them all) and concatenates (copies)
its K/V each step, as in ``generate``. A preallocated buffer written in place was tried: its K/V
are then strided views, and CPU SDPA on those (with GPT-2's strided q) ran ~2.5x slower than the
copy saves.

Rows join and leave between steps. A prefill runs the new prompts as one left-padded batch into a
fresh cache (a *block*); the reserved rows point into blocks (a fork or a restored stash is just
another pointer: no copy) until the next decode merges them into the live cache in reservation
order: blocks and cache are left-padded to a common width and concatenated along the batch.
Finished rows are dropped lazily (one index select per layer) and leading columns that are padding
in every row are trimmed, so the width stays the longest live row's length.

``batched_unsupported_reason`` runs the backend through a join, a leave and a trim on the model
at hand and compares every logit with the plain forward; where it differs or fails,
``PerSeqHFBackend`` is the last resort: one forward and one cache per sequence (correct for any
cache whose forward returns ``past_key_values``), several times slower than ``generate``.

Both keep the engine's backend interface (``rollout/engine.py``): ``reserve``, ``release``,
``maybe_compact``, ``prefill``, ``fork``, ``snapshot``, ``restore``, ``decode``, ``refresh``.
"""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad ``[B, H, w, D]`` with zeros along the column dim to ``width``."""
    return t if t.shape[-2] == width else F.pad(t, (0, 0, width - t.shape[-2], 0))


def _layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A ``DynamicLayer`` holding ``keys`` / ``values`` as they are (``update`` would copy them)."""
    la = DynamicLayer()
    la.lazy_initialization(keys, values)
    la.keys, la.values = keys, values
    return la


class _Block:
    """The KV of a batch of left-padded prompts: ``keys[l]`` / ``values[l]`` ``[n, H, P, D]``, ``lens[i]``
    the valid (rightmost) columns of row ``i``. Immutable once built: rows and stashes point into it."""

    __slots__ = ("keys", "values", "lens")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lens: list[int]):
        self.keys, self.values, self.lens = keys, values, lens

    def row(self, i: int) -> _Block:
        """Row ``i`` alone, trimmed to its own length (a copy: does not keep the whole block alive)."""
        L = self.lens[i]
        return _Block([k[i:i + 1, :, -L:].clone() for k in self.keys],
                      [v[i:i + 1, :, -L:].clone() for v in self.values], [L])


class _Row:
    """A reserved sequence's handle (the engine's ``slot``): until merged it points at ``(block, bi)``."""

    __slots__ = ("block", "bi", "live")

    def __init__(self):
        self.block, self.bi, self.live = None, 0, True


class BatchedHFBackend:
    """Any decoder-only HF causal LM with a plain KV cache: batched decode over one transformers cache."""

    name = "hf"

    def __init__(self, model, max_concurrent: int, max_cache_tokens: int):
        self.model, self.budget = model, max_cache_tokens
        self.device = next(model.parameters()).device
        # The prefill needs only the last position's logits ([n, P, V] for nothing otherwise).
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._mask4d = _sdpa_one_mask(model)
        self.cache: DynamicCache | None = None  # the live rows (None when empty)
        self.n = torch.zeros(0, dtype=torch.long, device=self.device)  # valid columns per row
        self.rows: list[_Row] = []  # cache order
        self.pending: list[_Row] = []  # reserved, not yet merged (reservation order)
        self.padded = False  # whether any live row has fewer valid columns than the cache width
        self.live = 0  # merged rows not yet released

    def refresh(self) -> None:
        pass  # the model's own modules are the forward: nothing fused to rebuild

    # -- admission -----------------------------------------------------------------------------

    def reserve(self, active, needs: list[int]) -> list[_Row]:
        """Rows for the longest prefix of ``needs`` that keeps rows x widest need within the budget
        (the cache's width is its longest live row, which never exceeds that row's need)."""
        width = max((len(s.req.prompt_ids) + s.max_new for s in active), default=0)
        rows, out = len(active), []
        for need in needs:
            w = max(width, need)
            if (rows + 1) * w > self.budget:
                break
            width, rows = w, rows + 1
            out.append(_Row())
        self.pending.extend(out)
        return out

    def release(self, slot: _Row) -> None:
        slot.live = False  # dropped from the cache at the next decode
        if slot.block is not None:  # never merged (finished on its first token): let its block go
            slot.block = None
            return
        self.live -= 1
        if not self.live:  # the last row: free the cache now, not at the next admission
            self.cache, self.rows, self.n, self.padded = None, [], self.n[:0], False

    def maybe_compact(self, active) -> None:
        pass  # finished rows are dropped (and padding columns trimmed) before each forward

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[_Row]) -> torch.Tensor:
        P = max(len(p) for p in prompts)
        lens = [len(p) for p in prompts]
        ids = torch.tensor([[0] * (P - L) + p for p, L in zip(prompts, lens)], device=self.device)
        cols = torch.arange(P, device=self.device)
        mask = cols >= (P - torch.tensor(lens, device=self.device))[:, None]
        # Positions count the valid tokens before (as generate derives them from the mask).
        pos = (cols - (P - torch.tensor(lens, device=self.device))[:, None]).clamp_min(0)
        cache = DynamicCache()
        kw = {"logits_to_keep": 1} if self._keep_last else {}
        out = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, past_key_values=cache,
                         use_cache=True, **kw)
        layers = _plain_layers(out.past_key_values)
        block = _Block([la.keys for la in layers], [la.values for la in layers], lens)
        for i, r in enumerate(slots):
            r.block, r.bi = block, i
        return out.logits[:, -1]

    def fork(self, src: list[_Row], dst: list[_Row], P: int) -> None:
        for a, b in zip(src, dst):
            b.block, b.bi = a.block, a.bi

    def snapshot(self, slot: _Row, P: int) -> _Block:
        # The engine stashes a prompt right after prefilling it, before its row joins the cache.
        if slot.block is None:
            raise RuntimeError("snapshot of a row that already joined the cache (or finished): the batched HF "
                               "backend stashes a prompt only between its prefill and the next decode")
        return slot.block.row(slot.bi)

    def restore(self, stash: _Block, slots: list[_Row]) -> None:
        for r in slots:
            r.block, r.bi = stash, 0

    # -- cache maintenance ---------------------------------------------------------------------

    def _sync(self) -> None:
        """Drop finished rows, append the reserved ones, trim padding-only columns: at most one
        re-layout per step."""
        layers = self.cache.layers if self.cache is not None else []
        keys, values = [la.keys for la in layers], [la.values for la in layers]
        keep = [i for i, r in enumerate(self.rows) if r.live]
        changed = len(keep) < len(self.rows)
        if changed:
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.rows, self.n = [self.rows[i] for i in keep], self.n[idx]
            keys, values = ([k[idx] for k in keys], [v[idx] for v in values]) if keep else ([], [])
        new = [r for r in self.pending if r.live]  # a row finished before its first decode never joins
        self.pending = []
        if new:
            keys, values = self._append_rows(new, keys, values)
            changed = True
        if changed and self.rows:
            # Leading columns that are padding in every row (the longest row left, or a block
            # padded for a prompt whose rows did not join).
            lo = keys[0].shape[-2] - int(self.n.max())
            if lo:
                keys, values = [k[:, :, lo:] for k in keys], [v[:, :, lo:] for v in values]
        if changed:
            self._rebuild(keys, values)
        self.live = len(self.rows)

    def _append_rows(self, new: list[_Row], keys: list, values: list) -> tuple[list, list]:
        """``keys`` / ``values`` (the live rows) with the ``new`` rows appended in order, all
        left-padded to the widest."""
        blocks: dict[int, tuple[_Block, int]] = {}  # id -> (block, its first row in the concatenation)
        offset = 0
        for r in new:
            if id(r.block) not in blocks:
                blocks[id(r.block)] = (r.block, offset)
                offset += len(r.block.lens)
        order = [b for b, _ in blocks.values()]
        idx = torch.tensor([blocks[id(r.block)][1] + r.bi for r in new], device=self.device)
        lens = torch.tensor([r.block.lens[r.bi] for r in new], device=self.device)
        W = max([keys[0].shape[-2] if keys else 0] + [b.keys[0].shape[-2] for b in order])

        def stack(old: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
            parts = [_lpad(t, W) for t in parts]
            t = (torch.cat(parts) if len(parts) > 1 else parts[0]).index_select(0, idx)
            return t if old is None else torch.cat([_lpad(old, W), t])

        L = len(order[0].keys)
        out_k = [stack(keys[li] if keys else None, [b.keys[li] for b in order]) for li in range(L)]
        out_v = [stack(values[li] if values else None, [b.values[li] for b in order]) for li in range(L)]
        for r in new:
            r.block = None  # merged: the block (and a stash it came from) can be freed
        self.rows += new
        self.n = torch.cat([self.n, lens])
        return out_k, out_v

    def _rebuild(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """The live cache now holds ``keys`` / ``values`` (one ``[R, H, C, D]`` pair per layer)."""
        if not self.rows:
            self.cache, self.padded = None, False
            return
        self.cache = DynamicCache()
        self.cache.layers = [_layer(k, v) for k, v in zip(keys, values)]
        self.padded = bool((self.n < keys[0].shape[-2]).any())

    # -- decoding ------------------------------------------------------------------------------

    def _decode_mask(self, C: int) -> torch.Tensor:
        """The mask of a decode step over ``C`` columns: a row's valid columns are its last ``n + 1``."""
        valid = torch.arange(C, device=self.device) >= (C - 1 - self.n)[:, None]
        # Built by transformers from the 2D mask every step otherwise (~6% of a small model's step).
        return valid[:, None, None, :] if self._mask4d else valid.long()

    @torch.no_grad()
    def decode(self, seqs) -> torch.Tensor:
        self._sync()
        rows = self.rows
        in_order = len(seqs) == len(rows) and all(s.slot is r for s, r in zip(seqs, rows))
        if in_order:  # the engine's order: no gather either way
            ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        else:
            where = {id(r): i for i, r in enumerate(rows)}
            at = [where[id(s.slot)] for s in seqs]
            toks = [0] * len(rows)
            for s, i in zip(seqs, at):
                toks[i] = s.tokens[-1]
            ids = torch.tensor(toks, device=self.device)[:, None]
        C = self.cache.layers[0].keys.shape[-2] + 1
        # Left padding is the only padding: with none, a causal decode needs no mask at all.
        mask = self._decode_mask(C) if self.padded else None
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=self.n[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.n += 1
        logits = out.logits[:, -1]
        return logits if in_order else logits[torch.tensor(at, device=self.device)]


def _sdpa_one_mask(model) -> bool:
    """Whether a decode step may pass SDPA's own 4D boolean mask ``[R, 1, 1, C]`` (True = attend),
    which transformers uses as given: SDPA attention and every layer full attention (a sliding
    layer needs its own mask; eager attention wants an additive float mask)."""
    cfg = model.config.get_text_config(decoder=True)
    sliding = getattr(cfg, "sliding_window", None) is not None or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or [])
    return getattr(cfg, "_attn_implementation", None) == "sdpa" and not sliding


def _plain_layers(cache) -> list:
    """The cache's layers if each is a plain full-attention ``DynamicLayer`` (what the batched
    backend can re-lay out), else ``TypeError`` saying which is not."""
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"the model returned a {type(cache).__name__}, not the DynamicCache it was given")
    for i, la in enumerate(cache.layers):
        if type(la) is not DynamicLayer or not la.is_initialized:
            raise TypeError(f"cache layer {i} is a {type(la).__name__}"
                            f"{'' if la.is_initialized else ' without keys (shared KV?)'}, not a plain DynamicLayer")
    return cache.layers


@torch.no_grad()
def batched_unsupported_reason(model) -> str | None:
    """``None`` if ``BatchedHFBackend`` reproduces ``model``'s own forward, else why not.

    Checked by running it through each re-layout: one sequence is prefilled and decoded, a second
    joins the live cache (left-padded: shorter), both decode, the first leaves (trim), the second
    decodes on; every logit is compared with a plain full forward of its sequence."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder model"
    vocab = int(cfg.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(4321)
    dev = next(model.parameters()).device
    seqs = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in (7, 6)]
    got: list[dict[int, torch.Tensor]] = [{}, {}]  # sequence -> {position: logits there}
    b = BatchedHFBackend(model, 2, 1 << 20)
    rows: list[_Row] = []

    def admit(i: int, P: int) -> None:
        rows.extend(b.reserve([], [len(seqs[i])]))
        got[i][P - 1] = b.prefill([seqs[i][:P]], [rows[i]])[0]

    def decode(feed: dict[int, int]) -> None:  # sequence -> the position whose token it is fed
        fake = [SimpleNamespace(slot=rows[i], tokens=[seqs[i][t]]) for i, t in feed.items()]
        for (i, t), lg in zip(feed.items(), b.decode(fake)):
            got[i][t] = lg

    try:
        admit(0, 4)
        decode({0: 4})
        admit(1, 3)  # joins a live cache 5 columns wide with 3: left-padded
        decode({0: 5, 1: 3})
        decode({0: 6, 1: 4})
        b.release(rows[0])  # leaves: its 2 extra leading columns are trimmed
        decode({1: 5})
    except Exception as e:  # noqa: BLE001 - any failure means: not this backend
        return f"batched HF forward failed: {type(e).__name__}: {e}"
    errs = []
    for s, pos in zip(seqs, got):
        ref = model(input_ids=torch.tensor([s], device=dev)).logits[0].float()
        for t, lg in pos.items():
            errs.append((lg.float() - ref[t]).abs().max() / ref[t].abs().max().clamp_min(1e-6))
    err = float(torch.stack(errs).max())  # torch's max keeps a NaN (Python's would drop it)
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    if not err <= tol:  # NaN fails too
        return f"batched HF forward differs from the plain forward by {err:.2e} (relative, tolerance {tol})"
    return None


class _HFSlot:
    __slots__ = ("cache",)

    def __init__(self):
        self.cache = None


class PerSeqHFBackend:
    """Any HF causal LM: its own forward and one cache per sequence (correct for any cache type, slow)."""

    name = "hf-perseq"

    def __init__(self, model, max_concurrent: int, max_cache_tokens: int):
        self.model, self.budget = model, max_cache_tokens
        self.device = next(model.parameters()).device

    def refresh(self) -> None:
        pass

    def reserve(self, active, needs: list[int]) -> list[_HFSlot]:
        used = sum(len(s.req.prompt_ids) + s.max_new for s in active)
        out = []
        for n in needs:
            if used + n > self.budget:
                break
            used += n
            out.append(_HFSlot())
        return out

    def release(self, slot) -> None:
        slot.cache = None

    def maybe_compact(self, active) -> None:
        pass

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[_HFSlot]) -> torch.Tensor:
        rows = []
        for p, slot in zip(prompts, slots):
            out = self.model(input_ids=torch.tensor([p], device=self.device), use_cache=True)
            if getattr(out, "past_key_values", None) is None:  # e.g. Mamba: its state is cache_params
                raise TypeError(f"{type(self.model).__name__} returns no past_key_values: the rollout engine "
                                "cannot decode it incrementally")
            slot.cache = out.past_key_values
            rows.append(out.logits[0, -1])
        return torch.stack(rows)

    def fork(self, src: list[_HFSlot], dst: list[_HFSlot], P: int) -> None:
        for a, b in zip(src, dst):
            b.cache = copy.deepcopy(a.cache)

    def snapshot(self, slot: _HFSlot, P: int):
        return copy.deepcopy(slot.cache)

    def restore(self, stash, slots: list[_HFSlot]) -> None:
        for s in slots:
            s.cache = copy.deepcopy(stash)

    @torch.no_grad()
    def decode(self, seqs) -> torch.Tensor:
        rows = []
        for s in seqs:
            out = self.model(input_ids=torch.tensor([[s.tokens[-1]]], device=self.device),
                             past_key_values=s.slot.cache, use_cache=True)
            s.slot.cache = out.past_key_values
            rows.append(out.logits[0, -1])
        return torch.stack(rows)
