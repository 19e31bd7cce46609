"""A TRL-form reward whose batch at one step makes the loss non-finite, so that optimizer step is skipped.

At ``global_step == SKIP_AT`` the samples get +-3e38 in turn (finite in float32, so the verifier
accepts them; with ``algo.normalize_std=false`` the advantages are +-3e38 and the summed loss
overflows to a non-finite value: the trainer skips the step). Every other step: the share of digits.
"""

SKIP_AT = 2


def huge_at_step_2(prompts, completions, trainer_state, **kwargs):
    if trainer_state.global_step == SKIP_AT:
        return [3e38 if i % 2 == 0 else -3e38 for i in range(len(completions))]
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]
