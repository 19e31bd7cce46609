"""The model layer, below every role: rollout and trainer import it; it imports neither.

- ``loading``: presets (random init + character tokenizer), loading a local HF directory, LoRA, export.
- ``llama``: the fast functional Llama-family forward (decode with a slot KV cache, and training).
- ``kernels`` (+ ``kernels.cc``): CPU kernels compiled at first use through ``torch.utils.cpp_extension``.
- ``gemm``: the CPU fp32 linear-layer path (packed weights); ``memory``: allocator settings.

Only ``rollyard.config`` and ``rollyard.types`` sit below it.
"""
