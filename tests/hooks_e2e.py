"""Reward hooks used by the end-to-end tests (loaded by file path, run in verifier workers)."""

import time


def hang_on_two(completion: str, prompt: str, meta: dict) -> float:
    """Exact match, except that the prompt whose answer is "2" hangs (a stuck verifier)."""
    if meta.get("answer") == "2":
        time.sleep(100)
    return float(completion.strip() == meta.get("answer"))
