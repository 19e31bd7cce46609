"""A reward a random tiny model earns some of: the share of digits in the completion.

Its spread within a group is almost never zero, so advantages are non-zero and every optimizer
step changes the weights (tests of weight sync and restarts need weights that really move)."""


def digits(completion: str, prompt: str, meta: dict) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
