"""The matmul precision of the trainer (``trainer.precision``) and of the native rollout engine
(``rollout.precision``): ``auto``'s choice, one rule for both, and the words the start-up line says it with."""

from __future__ import annotations

import torch

from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels

PRECISIONS = ("auto", "fp32", "bf16")


# bench/precision.py on this 2-core AVX512-BF16 CPU (30 layers, SmolLM2's 49152 vocabulary, one 32 x 64-token
# batch), bf16 / fp32 step time: width 256 (22.6M decoder matmul parameters) 0.81, width 576 (119M) 0.64; with
# 4 layers (3M and 16M, the lm_head dominating) 1.17 and 1.14. Below this size bf16 autocast's casts cost more
# than its matmuls save: the tiny presets (0.3-4.5M) stay fp32.
BF16_MIN_DECODER_PARAMS = 20_000_000


def decoder_matmul_params(model) -> int:
    """Parameters of the decoder layers' matrices (embeddings and lm_head left out): what bf16 speeds up."""
    return sum(p.numel() for n, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in n and "lm_head" not in n)


def auto_precision(model, device: torch.device) -> str:
    """``trainer.precision=auto``: bf16 on a GPU, and on a CPU that multiplies bf16 natively (AVX512-BF16, AMX)
    once the decoder's matrices are large enough to repay the casts; fp32 otherwise."""
    if device.type == "cuda":
        return "bf16"
    if device.type == "cpu" and cpu_gemm.cpu_has_native_bf16() and decoder_matmul_params(model) >= BF16_MIN_DECODER_PARAMS:
        return "bf16"
    return "fp32"


def precision_choice(setting: str, model, device: torch.device, key: str = "trainer.precision") -> tuple[str, str]:
    """``(the precision the Trainer runs, why)`` for ``trainer.precision=setting`` (``key`` names the setting in
    the words): the start-up line and run.json say it. The choice is :func:`auto_precision`'s (the Trainer's own); this only words it. An explicit bf16 on
    a CPU without native bf16 says that it is emulated there and slower than fp32."""
    cpu = device.type == "cpu"
    native = cpu and cpu_gemm.cpu_has_native_bf16()
    if setting != "auto":
        why = f"set by {key}={setting}"
        if setting == "bf16" and cpu and not native:
            why += ("; this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 is emulated and slower than fp32 "
                    "(a trainer step measured 12-40x fp32's on such a CPU, 2026-11-27; bench/precision.py measures this "
                    f"one); {key}=fp32 or auto is faster here")
        return setting, why
    chosen = auto_precision(model, device)
    if not cpu:
        return chosen, f"auto: {chosen} on {device.type}"
    if not native:
        return chosen, "auto: fp32, this CPU has no native bf16 (no AVX512-BF16 or AMX)"
    n = decoder_matmul_params(model)
    side = ">=" if n >= BF16_MIN_DECODER_PARAMS else "<"
    return chosen, (f"auto: {chosen}, native bf16 on this CPU and {n / 1e6:.1f}M decoder matrix parameters {side} "
                    f"{BF16_MIN_DECODER_PARAMS / 1e6:.0f}M (below it bf16's casts cost more than its matmuls save)")


def rollout_precision(setting: str, model, device: torch.device) -> tuple[str | None, str]:
    """``(the native engine's compute precision, why)`` for ``rollout.precision=setting``; ``None``: the rollout
    copy's own dtype. ``int8`` and ``w8a8`` only where :func:`_int8_reason` finds the CPU kernels (else ``ConfigError``). ``auto`` takes :func:`auto_precision`'s bf16 on a CPU (native bf16, a large enough decoder:
    the trainer's rule, so sampler and trainer run alike); elsewhere, and on a GPU, the copy's dtype. An explicit
    bf16 on a CPU without native bf16 runs on the compiled kernels' widening bf16 matmul where they are built (not
    the emulation the trainer's words warn of), and says so."""
    if setting in ("int8", "w8a8"):
        return setting, _int8_reason(device, setting)
    if setting == "bf16" and device.type == "cpu" and not cpu_gemm.cpu_has_native_bf16() and cpu_kernels.bf16_packs(64, 32):
        return setting, ("set by rollout.precision=bf16; this CPU has no native bf16 (no AVX512-BF16 or AMX): the "
                         "engine's matmuls widen the bf16 weights to fp32 in registers (fp32 arithmetic on half the "
                         "bytes fp32 weights stream; model/kernels.cc)")
    if setting != "auto":
        return precision_choice(setting, model, device, key="rollout.precision")
    if device.type == "cpu":
        chosen, why = precision_choice("auto", model, device, key="rollout.precision")
        if chosen == "bf16":
            return chosen, why
        return None, "auto: the rollout copy's dtype" + why.removeprefix("auto: fp32")
    return None, f"auto: the rollout copy's dtype on {device.type}"


def _int8_reason(device: torch.device, setting: str = "int8") -> str:
    """Why ``rollout.precision=int8`` (or ``w8a8``) runs here; ``ConfigError`` (one line, with the fix) where it
    cannot: it is the CPU kernels' int8-weight matmul (``model/kernels.cc`` layout R; w8a8: layout V), on a CPU with
    them built."""
    from rollyard.config import ConfigError

    if device.type != "cpu":
        raise ConfigError(f"rollout.precision={setting} runs on the CPU kernels' int8-weight matmul, but the rollout engine "
                          f"is on {device.type}; set rollout.precision=auto (or bf16)")
    if not cpu_kernels.q8_packs(64, 16):
        why = cpu_kernels._STATE.get("why") or "the kernels are off (ROLLYARD_CPU_KERNELS=0) or this CPU has no AVX2"
        raise ConfigError(f"rollout.precision={setting} needs rollyard's compiled CPU kernels (AVX-512 or AVX2 + FMA), which "
                          f"are unavailable here ({why}); set rollout.precision=fp32 (or auto)")
    if setting == "w8a8":
        return ("set by rollout.precision=w8a8: the engine's matmul weights as int8 with an fp32 scale per row and 64 "
                "inputs (max|w| / 127), and each matmul's input quantized per row and 64 inputs likewise at every call: "
                "exact int32 dot products (" + ("AVX512-VNNI" if cpu_kernels.vnni() else "AVX2") + "), fp32 scales; the "
                "sampler's numbers differ from the trainer's by both roundings, which the canary measures and truncated "
                "IS corrects")
    return ("set by rollout.precision=int8: the engine's matmul weights as int8 with an fp32 scale per row and 64 "
            "inputs (max|w| / 127), fp32 arithmetic on a quarter of the bytes fp32 weights stream; the sampler's numbers "
            "differ from the trainer's by the quantization, which the canary measures and truncated IS corrects")


def engine_dtype(chosen: str | None) -> torch.dtype | None:
    """The native engine's ``compute_dtype`` for :func:`rollout_precision`'s choice (``None``: the copy's own;
    ``torch.int8``: int8 weights, fp32 arithmetic; ``torch.qint8``: int8 weights and inputs, int32 dot products)."""
    return None if chosen is None else {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                                        "w8a8": torch.qint8}[chosen]
