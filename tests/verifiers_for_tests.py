"""Misbehaving reward hooks for tests/test_reward.py, loaded by file path in worker processes."""

import os
import time


def ok(completion, prompt, meta):
    return 1.0 if completion.strip() == str(meta.get("answer", "")).strip() else 0.0


def hang(completion, prompt, meta):
    if meta.get("hang", True):
        time.sleep(100)
    return 1.0


def boom(completion, prompt, meta):
    if meta.get("boom", True):
        raise RuntimeError("verifier exploded")
    return 1.0


def die(completion, prompt, meta):
    if meta.get("die", True):
        os._exit(3)
    return 1.0


def noisy(completion, prompt, meta):
    print("a hook that prints must not corrupt the protocol")
    return 0.5


def not_a_number(completion, prompt, meta):
    return "yes"


def two_args(completion, prompt):
    return 1.0


def pid(completion, prompt, meta):
    return float(os.getpid())


NOT_CALLABLE = 3


def torch_loaded(completion, prompt, meta):
    import sys
    return 1.0 if "torch" in sys.modules else 0.0


def echo_prompt(completion, prompt, meta):
    return 1.0 if prompt == meta.get("expect_prompt") and completion == meta.get("expect_completion") else 0.0
