"""The model layer, below every role: rollout and trainer import it; it imports neither.

- ``loading``: presets (random init + character tokenizer), loading a local HF directory, LoRA, export.
- ``families``: the table from a model to its fast forward (or the HF fallback), and the routed entry points.
- ``fast``: what every fast forward shares (decode with a slot KV cache, and training); ``llama`` (Llama, Qwen2,
  Qwen3, Mistral) and ``gemma3``: one file per family.
- ``kernels`` (+ ``kernels.cc``): CPU kernels compiled at first use through ``torch.utils.cpp_extension``.
- ``gemm``: the CPU fp32 linear-layer path (packed weights); ``memory``: allocator settings.

Only ``rollyard.config`` and ``rollyard.types`` sit below it.
"""
