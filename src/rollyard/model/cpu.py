"""The CPU's instruction-set features: one set that every CPU-specific choice reads.

Every choice that depends on the CPU (oneDNN instead of MKL for fp32 linear layers, prepacked bf16
weights, bf16 autocast in the trainer, the ``-march`` the compiled kernels are built for) asks
:func:`has` about this one set, never ``/proc/cpuinfo`` itself. ``ROLLYARD_CPU_ISA`` narrows it:

- ``native`` (the default): what the CPU reports;
- ``avx512``: at most AVX-512 F/BW/VL/DQ (no AVX512-BF16, AMX or AVX-NE-CONVERT);
- ``avx2``: at most AVX2 and FMA, so an AVX-512 machine chooses as an AVX2 one would (and builds its
  kernels for x86-64-v3);
- ``generic``: no vector extension beyond the architecture's baseline.

Narrowing never adds a feature the CPU lacks (``avx512`` on an AVX2 machine is AVX2). On a CPU whose
features cannot be read (no ``/proc/cpuinfo``) the set is empty: every choice takes its fallback.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from rollyard.config import env_flag

# The features any choice in rollyard asks about (x86 flag names as /proc/cpuinfo spells them; aarch64's
# "asimd" and "bf16"). Others are not kept: the set is what decides, so it stays small and printable.
KNOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16",
         "avx_ne_convert", "asimd", "bf16", "sve")
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
# What each ROLLYARD_CPU_ISA level lets through (None: everything the CPU has).
LEVELS: dict[str, set[str] | None] = {
    "native": None,
    "avx512": {"avx2", "fma", *_AVX512, "asimd"},
    "avx2": {"avx2", "fma", "asimd"},
    "generic": set(),
}


@functools.cache
def _cpuinfo() -> list[str]:
    """The lines of Linux ``/proc/cpuinfo``; none where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


@functools.cache
def reported() -> frozenset[str]:
    """The :data:`KNOWN` features this CPU reports (Linux ``/proc/cpuinfo``: x86 ``flags``, aarch64
    ``Features``); empty where they cannot be read."""
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            return frozenset(f for f in line.split(":", 1)[-1].split() if f in KNOWN)
    return frozenset()


@functools.cache
def vendor() -> str:
    """The CPU's ``vendor_id`` (Linux ``/proc/cpuinfo``: ``GenuineIntel``, ``AuthenticAMD``), empty where unknown."""
    for line in _cpuinfo():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[-1].strip()
    return ""


def level() -> str:
    """The ``ROLLYARD_CPU_ISA`` setting (``ValueError`` with its one-line rule when invalid)."""
    return env_flag("ROLLYARD_CPU_ISA")


def features() -> frozenset[str]:
    """The features choices may use: what the CPU reports, narrowed by ``ROLLYARD_CPU_ISA``."""
    allowed = LEVELS[level()]
    return reported() if allowed is None else reported() & frozenset(allowed)


def has(*names: str) -> bool:
    """Whether every feature in ``names`` is in :func:`features`."""
    return set(names) <= features()


def avx512() -> bool:
    """AVX-512 F/BW/VL/DQ: oneDNN's fp32 matmul measured ~2x MKL, and its bf16 weight packing runs."""
    return has(*_AVX512)


def native_bf16() -> bool:
    """bf16 multiplies in hardware (AVX512-BF16 or AMX-BF16); without it bf16 on a CPU is emulated and
    slower than fp32."""
    return has("avx512_bf16") or has("amx_bf16")


def onednn_bf16() -> bool:
    """oneDNN can reorder and multiply bf16 weights here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    on an AVX2-only CPU it refuses with 'bf16 path needs the cpu support ...')."""
    return avx512() or has("avx_ne_convert")


def cpu_class() -> str:
    """One word for the class of CPU the choices were made for, as printed and written in ``run.json``:
    ``avx512-bf16``, ``avx512``, ``avx2``, ``x86-64`` (none of those), or the machine name elsewhere
    (``aarch64``); ``(narrowed by ROLLYARD_CPU_ISA=...)`` appended when the setting removed features."""
    if native_bf16() and avx512():
        name = "avx512-bf16"
    elif avx512():
        name = "avx512"
    elif has("avx2", "fma"):
        name = "avx2"
    else:
        name = "x86-64" if platform.machine() in ("x86_64", "AMD64") else (platform.machine() or "unknown")
    if features() != reported():
        name += f" (narrowed by ROLLYARD_CPU_ISA={level()})"
    return name


def march() -> str:
    """The compiler's ``-march`` for the compiled kernels: ``native`` unless ``ROLLYARD_CPU_ISA``
    narrowed the set on x86, then the x86-64 micro-architecture level of the narrowed set."""
    if features() == reported() or platform.machine() not in ("x86_64", "AMD64"):
        return "native"
    if avx512():
        return "x86-64-v4"
    return "x86-64-v3" if has("avx2", "fma") else "x86-64-v2"
