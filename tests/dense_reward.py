"""A reward a random tiny model earns some of: the share of digits in the completion.

Its spread within a group is almost never zero, so advantages are non-zero and every optimizer
step changes the weights (tests of weight sync and restarts need weights that really move)."""


def digits(completion: str, prompt: str, meta: dict) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def first_is_digit(completion: str, prompt: str, meta: dict) -> float:
    """1 when the completion starts with a digit: a random tiny model's groups are often all 0 or all 1 (no signal),
    sometimes mixed: what dynamic sampling filters."""
    return float(completion[:1].isdigit())
