"""Tools and environments: multi-turn rollouts token-in/token-out (TRL's ``tools`` / ``environment_factory``).

A rollout-side package (below ``placement``, beside ``rollout``), one module per part:

- ``tools.py``: tool functions and environment classes named by import path, their JSON schemas
  (type hints + docstrings, as TRL builds them), every start-up check;
- ``template.py``: the chat template's side: the prompt with the tools, ``<tool_call>`` parsing,
  the tool turn's token ids (the template's own suffix; the model's tokens are never re-tokenized);
- ``worker.py`` + ``executor.py``: tool calls in isolated worker processes (the verifier pool),
  per-call timeout, memory and CPU limits, one environment instance per sample;
- ``loop.py``: the multi-turn driver over the rollout engine's public interface (``submit`` /
  ``step``), producing one ``Sample`` per trajectory whose ``completion_mask`` keeps the tool
  tokens out of the loss.
"""
