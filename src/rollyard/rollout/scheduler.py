"""Which prompts a round takes: the prompt stream and the plain scheduler.

``PromptStream`` hands out prompts in a seeded order, epoch after epoch, and its ``state()`` is
the dataset cursor a checkpoint carries: a resumed run continues with exactly the prompts the
uninterrupted run would have taken next. Every prompt handed out is trained on, dead-lettered with
a reason, or (after a crash) handed out again from the checkpoint's cursor.
"""

from __future__ import annotations

from typing import Any

import torch

from rollyard.accounting import PromptLedger
from rollyard.reward.hooks import MESSAGES_KEY
from rollyard.tasks.base import Prompt
from rollyard.types import Request


class PromptStream:
    """Seeded, resumable, endless order over ``prompts`` (reshuffled every epoch; in file order without
    ``shuffle``)."""

    def __init__(self, prompts: list[Prompt], seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("the prompt set is empty: check data.path / data.task and the dead-letter file")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if self.index == len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "size": len(self.prompts), "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("size") != len(self.prompts):
            raise ValueError(
                f"cannot resume: the checkpoint's prompt set had {state.get('size')} prompts, this one "
                f"has {len(self.prompts)}; resume with the same data config the run started with"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def to_requests(prompts: list[Prompt], tokenizer, n: int, max_new_tokens: int, context: int,
                suffix: str = "", max_prompt: tuple[int | None, str] = (None, "drop")) -> tuple[list[Request], list[dict]]:
    """Tokenize prompts into requests; those that cannot fit the context are dead-lettered.

    A prompt whose length plus one generated token exceeds ``context`` cannot be sampled at all:
    it goes to the dead-letter list with its reason. Otherwise ``max_new_tokens`` is clamped so
    prompt + response fits. ``max_prompt = (tokens, how)`` (``data.max_prompt_tokens``,
    ``data.prompt_truncation``): a longer prompt is dead-lettered (``drop``) or cut to its last (``left``) or first
    (``right``) ``tokens``.
    """
    requests, dead = [], []
    limit, how = max_prompt
    for p in prompts:
        # A rendered chat template already holds the special tokens (BOS, role markers): add none.
        ids = tokenizer(p.text, add_special_tokens=p.messages is None)["input_ids"]
        if limit is not None and len(ids) > limit:
            if how == "drop":
                dead.append({"source": p.id, "reason": f"prompt is {len(ids)} tokens, over data.max_prompt_tokens="
                             f"{limit}", "prompt": p.text[:200]})
                continue
            ids = ids[-limit:] if how == "left" else ids[:limit]
        room = context - len(ids)
        if room < 1:
            dead.append({"source": p.id, "reason": f"prompt is {len(ids)} tokens, longer than the model context "
                         f"of {context} (needs at least one free position to generate)", "prompt": p.text[:200]})
            continue
        requests.append(Request(id=p.id + suffix, prompt_ids=ids, n=n, max_new_tokens=min(max_new_tokens, room),
                                meta={**p.meta, "prompt": p.text,
                                      **({MESSAGES_KEY: p.messages} if p.messages else {})}))
    return requests, dead


class PromptFeed:
    """Each round's requests, every one recorded in the prompt ledger.

    Requeued prompts (a stale drop, a dead worker, a resumed run's live prompts) go first, oldest
    first, keeping their ids; the rest come fresh from the stream with the id ``{prompt id}@{round}``.
    A prompt that cannot fit the context is dead-lettered (ledger state ``dead``) and returned in
    ``dead`` with its reason.
    """

    def __init__(self, stream: PromptStream, ledger: PromptLedger, tokenizer, n: int, max_new_tokens: int,
                 context: int, max_prompt: tuple[int | None, str] = (None, "drop")):
        self.stream, self.ledger, self.tokenizer = stream, ledger, tokenizer
        self.n, self.max_new_tokens, self.context = n, max_new_tokens, context
        self.max_prompt = max_prompt
        self.last_round = -1  # the highest round handed out (ids of later rounds are new)

    def take(self, k: int, round_: int) -> tuple[list[Request], list[dict]]:
        """Up to ``k`` queued requests (fewer when prompts are dead-lettered); they stay ``queued``."""
        self.last_round = max(self.last_round, round_)
        out = self.ledger.queued(k)
        if len(out) < k:
            fresh, dead = to_requests(self.stream.take(k - len(out)), self.tokenizer, self.n, self.max_new_tokens,
                                      self.context, suffix=f"@{round_}", max_prompt=self.max_prompt)
            seen, keep, dup = set(self.ledger.state), [], []
            for q in fresh:
                (dup if q.id in seen else keep).append(q)
                seen.add(q.id)
            fresh = keep
            dead += [{"source": q.id, "reason": "the same prompt twice in one round (prompts_per_step is larger "
                      "than the prompt set); it is sampled once"} for q in dup]
            self.ledger.add(fresh)
            out += fresh
            return out, dead
        return out, []

    def state(self) -> dict[str, Any]:
        return {**self.stream.state(), "last_round": self.last_round, "ledger": self.ledger.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.stream.restore(state)
        self.last_round = int(state.get("last_round", -1))
        self.ledger.load_state_dict(state.get("ledger", {}))
