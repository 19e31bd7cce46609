"""Reward functions as TRL and verl users write them (imported by name in the reward workers).

Standard library only, so a worker starts fast. Each checks the arguments it is called with, so a
call in the wrong shape is an error the tests see (``reward/errors``), not a silent 0.
"""


def says_answer(prompts, completions, answer, **kwargs):
    """TRL batched form, chat data: prompts are message lists, completions assistant messages.
    ``None`` for rows whose answer is "skip" (this function does not apply to them)."""
    assert len(prompts) == len(completions) == len(answer), (len(prompts), len(completions), len(answer))
    out = []
    for prompt, completion, ans in zip(prompts, completions, answer):
        assert prompt[-1]["role"] == "user", prompt
        assert completion[0]["role"] == "assistant", completion
        out.append(None if ans == "skip" else float(ans in completion[0]["content"]))
    return out


def brevity(completions, answer, **kwargs):
    """TRL form without ``prompts``: shorter is better; also silent on "skip" rows."""
    return [None if a == "skip" else 1.0 - min(len(c[0]["content"]), 50) / 50 for c, a in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl form: called once per sample with the verl dataset's fields."""
    assert data_source == "toy/arith", data_source
    assert isinstance(extra_info, dict) and extra_info["split"] == "train", extra_info
    assert isinstance(solution_str, str) and isinstance(ground_truth, str)
    return {"score": float(ground_truth in solution_str) + 0.1 * (len(solution_str) % 3), "acc": 0.0}


def group_size(prompts, completions, completion_ids, **kwargs):
    """TRL form, plain-text data: the size of the batch it was called with (shows the batching)."""
    assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
    assert [len(ids) for ids in completion_ids] == [len(c) for c in completions]  # one char per id, no EOS
    return [float(len(completions))] * len(completions)


def length(completion, prompt, meta):
    """Per-sample form."""
    return float(len(completion))


def fails_on_b(prompts, completions, **kwargs):
    """TRL form that raises when a batch holds the completion "b"."""
    if "b" in completions:
        raise ValueError("saw b")
    return [1.0] * len(completions)


def step_seen(completions, trainer_state, **kwargs):
    """TRL form that takes ``trainer_state`` (as TRL passes it): the step it was called at."""
    return [float(trainer_state.global_step)] * len(completions)


def needs_solution(prompts, completions, solution, **kwargs):
    """TRL form that needs a ``solution`` column the test datasets do not have."""
    return [1.0] * len(completions)
