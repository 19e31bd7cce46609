"""CPU kernels, compiled from ``model/kernels.cc``: the decode step's attention, RMSNorm, SwiGLU and RoPE + K/V
cache write (fp32), the rollout's bf16, fp32, int8-weight and int8 x int8 matmuls, a decode layer in one call, the rollout's draw, and the training
forward's RMSNorm, SwiGLU and q|k|v split + RoPE (with their backwards).

**Attention.** A decode step's attention reads each row's cached K / V once: per (row, K/V head) a
``[G, hd] x [hd, n]`` score matmul, a softmax over ``n`` and a ``[G, n] x [n, hd]`` matmul.
torch runs these as two batched matmuls of tiny matrices plus a softmax, and at the engine's
shapes the batched-GEMM overhead per matrix, not the bytes, sets the time: for a ``small``
model at batch 32 it was ~0.8-1.9 ms of a 3.4-5.3 ms decode step on this project's 2-core
reference machine. The kernel does the three in one pass per (row, head), vectorised and
prefetched, on torch's own OpenMP threads: ~2.5x faster warm, ~2.7x with K / V in DRAM, and
generation ~1.15-1.25x faster end to end (``small``, fp32 and bf16, uniform and varied lengths).

**RMSNorm** (:func:`rms_norm`). torch's CPU ``rms_norm`` runs as six elementwise kernels; on a
decode step's 32 rows of 256 floats that is ~25 us a call, 13 calls a step: ~0.34 ms of a
~2.4 ms ``small`` step. The kernel is one pass per row.

**Decode RoPE + cache write, SwiGLU** (:func:`decode_rope_write`, :func:`swiglu`): one call in
place of ~8 small ops per layer (the rotate, the two cache copies, silu and mul); decode step
``small`` 1.08x, ``tiny`` 1.15x faster (in-process A/B).

**The rollout's draw** (:func:`inverse_cdf`): the engine draws a token as the first index whose running fp64 sum
of the weights exceeds ``u * total``; torch's way is an fp64 copy of the ``[32, V]`` weights, a cumsum and a
``searchsorted`` (~5.7 ms a decode step at SmolLM2's 49152-token vocabulary, 2 threads, a sixth of the step). The
kernel adds the same floats in the same order, eight rows' chains at a time, and re-adds one 64-wide block to find
the index: the same index bit for bit, ~0.4 ms on one thread.

**The rollout's bf16 matmuls** (:func:`pack_bf16`, :func:`gemm_bf16`): with ``rollout.precision=bf16`` on a CPU with
AVX512-BF16, each of the decode engine's fused weights is written once per weight version, cast, scaled and laid out
in one pass (layout P, ``kernels.cc``), and each matmul is one call taking fp32 activations and giving fp32 outputs
rounded as a bf16 matmul's: in place of a cast, oneDNN's bf16 matmul and a cast back. The kernel streams the next
column block's weights into L2 while it computes the current one, which oneDNN does not: at SmolLM2-135M's decode
shapes (32 rows, weights from DRAM, 2 threads) the MLP's up/gate matmul ran 193 -> 150 us, and a decode step 24.5 ->
20.3 ms at batch 32, 9.7-12.5 -> 6.9 ms at batch 1. The weight refresh (a sync) went from oneDNN's cast + reorder,
~0.07-0.12 s, to one pass of ~0.04 s. Sums run over the input in order in one fp32 chain per output (vdpbf16ps), so
the result does not depend on the thread count; it differs from oneDNN's bf16 matmul in the last bf16 place at some
outputs (oneDNN orders its sums differently). Checked against torch on a fixed case once per process. Without
AVX512-BF16 (AVX-512F, or AVX2 + FMA) the same layout runs on fp32 FMAs, each bf16 pair widened in registers and added
in vdpbf16ps' order, so the numbers are the native kernel's: the arithmetic is fp32's, the bytes streamed half.

**The rollout's fp32 matmuls** (:func:`pack_f32`, :func:`gemm_f32`): the same scheme in fp32 where the rollout runs fp32
(a CPU without native bf16, or ``rollout.precision=fp32``) on an AVX-512 or AVX2 build (layout Q: ``[N/64][K][64]`` fp32,
one fused multiply-add chain per output in input order, so neither the thread count nor the ISA changes a number; an
AVX2 build runs 4-row x 16-column tiles). SmolLM2-135M, 2 threads, against oneDNN's fp32 matmul: decode step 15.9 ->
13.6 ms at batch 1, 35.3 -> 26.3 ms at batch 32; the weight refresh 0.10 -> 0.06 s. Checked against an fp64 reference
on a fixed case once per process.

**The rollout's int8 weights** (:func:`pack_q8`, :func:`gemm_q8`; ``rollout.precision=int8``): each weight row quantized
to int8 with an fp32 scale per group of 64 inputs (``max|w| / 127``, round to nearest even: :func:`quantize_q8`),
written once per weight version into layout R (a block of 64 columns: each group's int8 weights, one 64-byte line per
input, then its 64 scales). A matmul widens ``q * s`` to fp32 a 64-input chunk at a time and runs fp32 FMAs over it, so its numbers are
:func:`gemm_f32`'s over the dequantized weights, bit for bit, on a quarter of the bytes. SmolLM2's gate|up at one row
0.33 -> 0.10 ms, at 32 rows 0.68 -> 0.45 ms (2 threads, from memory).

**int8 weights times int8 inputs** (:func:`pack_w8a8`, :func:`gemm_w8a8`; ``rollout.precision=w8a8``): the same
quantized weights in layout V (each block and group of 64 inputs in AVX512-VNNI's order, with its scales and weight
sums), and each matmul's input rows quantized per group of 64 likewise (:func:`quantize_rows`); per group the exact
int32 sum of the products, times ``sw * sx`` into an fp32 sum. Integer sums are exact, so AVX512-VNNI and AVX2 compute
the same numbers, at any row or thread count. SmolLM2's 30 layers' matmuls, 2 threads, from memory: one row 8.2 ms
(int8) -> 6.7 ms, 32 rows 29-37 -> 15 ms.

**The LM head's softmax in training** (:func:`logsumexp_at`, :func:`softmax_entropy`, :func:`softmax_grad_`, used by
``trainer/head.py``'s fp32 head): a chunk's log-partition and target log-probs in two reads of its logits, its entropy
in one, and the backward's ``-g * exp(z - logz)`` in place in one; torch took three to five passes and a
``[rows, V]`` buffer for each (SmolLM2's 236 x 49152 chunk, 2 threads: 23.8 -> 3.7, 35.2 -> 3.7 and 7.9 -> 4.4 ms).
Equal to torch's to float rounding (the exp is ``kernels.cc``'s ``vexp`` polynomial, not torch's).

**A decode layer in one call** (:func:`decode_layer`): a Llama-family layer of a decode step (norms, the four matmuls in
layout P over a bf16 cache or layout Q over an fp32 one, RoPE with the cache write, attention, SwiGLU) in the per-op
path's order on the same values, so its numbers bit for bit, without ~10 calls from Python a layer.

**Training** (:func:`train_rms_norm`, :func:`train_swiglu`, :func:`train_qkv_rope`: autograd
Functions). torch runs each of these as several elementwise kernels forward and more backward
(plus a cat, a zero-fill and slice copies for the gradients of the split halves); each kernel
here is one pass forward and one backward. Trainer step, 32 x 68 positions, 2 threads
(in-process A/B against torch's ops): ``small`` 238 -> 207 ms, ``tiny`` 55 -> 45 ms.

It is built at first use by ``torch.utils.cpp_extension.load`` (ninja and the system C++
compiler, ``$CXX`` else ``c++``; ``-O3 -march=native -fopenmp -fno-math-errno``, or the x86-64 level that
``ROLLYARD_CPU_ISA`` narrows to); the build directory ``$XDG_CACHE_HOME/rollyard/kernels/<key>`` (else
``~/.cache/...``) is keyed by the source's hash, the flags, the compiler, torch's version and the CPU
(:func:`build_key`), so two versions of rollyard on one machine never share a library. Each attention shape (query heads per K/V head,
head_dim) is checked against torch on a fixed random case once per process; RMSNorm and SwiGLU are
checked once at load (the rest by the tests). The choice never depends on timing, so two runs of
one seed on one machine compute the same numbers, loaded or not. Without a compiler, or on any
failure, it says why once on stderr and the engine and trainer keep torch's ops.
``ROLLYARD_CPU_KERNELS=0`` turns it off; ``=1`` makes an unavailable or wrong kernel an error
instead.

**The cache heals.** A build holds ``<key>/rollyard.lock`` (an ``flock``, which the kernel drops when
the holder dies, ``kill -9`` included, with the holder's pid written in it). Under it, a leftover
``lock`` file of cpp_extension's own (which it waits on forever) can only be a killed build's: it is
removed, with a line saying so. A process waiting for another's build says so after a few seconds,
names the holder, hears a stop signal, and gives up after ``BUILD_WAIT_S`` (one line, torch's ops).
A cached library that does not load (truncated, overwritten, missing a symbol) is rebuilt once,
under the lock, before any fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rollyard import signals
from rollyard.config import env_flag
from rollyard.model import cpu

BUILD_WAIT_S = 600.0  # the longest a process waits for another's build (a build takes seconds to a minute)
# a stop signal ends a wait that lasts: a short one (another process's no-op ninja check) lets the caller reach its
# own stop point (the step, the warm start's step), which says more than "waiting for the build"
STOP_GRACE_S = 10.0
SAY_AFTER_S = 30.0  # a wait this long says whose build it waits for (a build takes seconds; runs in parallel wait)
NAME = "rollyard_cpu_kernels"  # the library: <build dir>/rollyard_cpu_kernels.so
LOCK = "rollyard.lock"  # ours: an flock, released by the kernel when its holder dies
TORCH_LOCK = "lock"  # cpp_extension's FileBaton: a plain file, left behind by a build that was killed

_SOURCE = Path(__file__).with_name("kernels.cc")


class KernelsRequired(RuntimeError):
    """``ROLLYARD_CPU_KERNELS=1`` and the kernels cannot be built, or one is wrong here (never
    swallowed by a fallback: the setting asked for the kernels or nothing)."""


class BuildWaitTimeout(RuntimeError):
    """Another process held the build lock past ``BUILD_WAIT_S`` (torch's ops are used instead)."""


_STATE: dict[str, object] = {}  # "lib": the loaded library or None, "why": why not


def _cpu_signature() -> str:
    """The CPU's model name and full flag list (two machines' builds for ``-march=native`` differ)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return platform.machine() + flags


def _compiler() -> str:
    """The C++ compiler cpp_extension will use (``$CXX``, else ``c++``) and the first line of its
    ``--version``: a different compiler builds a different library."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}: {(out.splitlines() or ['unknown'])[0]}"


def build_key(cflags: list[str]) -> str:
    """The build directory's name: a hash of everything the library is built from (the source's
    bytes and path, the compiler flags, the compiler, torch's version and where that torch is installed:
    the path and torch's headers and libraries are on the build's command line) and of the CPU it is built
    for. Two checkouts, environments or installed versions on one machine get two directories, never one
    library rebuilt over the other's (a process would load a library missing its symbols; two checkouts
    of one version would each find the other's build out of date and compile it again, turn by turn)."""
    parts = [hashlib.sha256(_SOURCE.read_bytes()).hexdigest(), str(_SOURCE.resolve()), " ".join(cflags),
             _compiler(), torch.__version__, str(Path(torch.__file__).resolve().parent), _cpu_signature()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cflags() -> list[str]:
    # -fno-math-errno: std::sqrt without its errno branch, so the AdamW loops vectorize (the values are IEEE's
    # either way; nothing reads errno): 0.30 -> 0.07 s for SmolLM2-135M's bf16-moment step on 2 threads
    return ["-O3", f"-march={cpu.march()}", "-fopenmp", "-fno-math-errno"]


def cache_dir() -> Path:
    """This machine's build directory for the current source, flags, compiler, torch and CPU."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rollyard" / "kernels" / build_key(_cflags())


def _holder(lock: Path) -> str:
    try:
        pid = lock.read_text().split()[0]
    except (OSError, IndexError):
        return "another process"
    return f"pid {pid}"


def _wait_turn(t0: float, wait_s: float, say_after_s: float, said: bool, holder: str, root: Path, how: str) -> bool:
    """One turn of a wait for ``holder``'s build of the kernels in ``root`` (begun at ``t0``): a stop signal ends it
    (after ``STOP_GRACE_S``), ``wait_s`` bounds it (one line, the fix: end ``holder``, ``how``), past ``say_after_s``
    it is said once; then a short sleep. Returns whether it has been said."""
    waited = time.monotonic() - t0
    if signals.stop_requested() and waited > STOP_GRACE_S:
        raise signals.Stopped(signals.requested(), None, waiting=f"the CPU-kernel build in {root}")
    if waited > wait_s:
        raise BuildWaitTimeout(f"waited {wait_s:.0f} s for {holder}'s build of the CPU kernels in {root} to finish; "
                               f"if that process is stuck, end it {how}")
    if not said and waited > say_after_s:
        said = True
        print(f"[rollyard] waiting for {holder}'s build of the CPU kernels in {root} (at most {wait_s:.0f} s)",
              file=sys.stderr, flush=True)
    time.sleep(0.2)
    return said


@contextlib.contextmanager
def build_lock(root: Path, wait_s: float | None = None, say_after_s: float | None = None):
    """Hold ``root/rollyard.lock`` for a build (see the module docstring): waits said after
    ``SAY_AFTER_S``, bounded by ``wait_s`` (``BUILD_WAIT_S``: RuntimeError, one line), ended by a
    stop signal (:class:`signals.Stopped`); cpp_extension's stale ``lock`` file broken under it."""
    wait_s = BUILD_WAIT_S if wait_s is None else wait_s
    say_after_s = SAY_AFTER_S if say_after_s is None else say_after_s
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            said = _wait_turn(t0, wait_s, say_after_s, said, _holder(path), root, f"(or delete {root})")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _break_stale(root / TORCH_LOCK, t0, wait_s, say_after_s)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holders(path: Path) -> bool | None:
    """Whether some process has ``path`` open (its fds in /proc); None when /proc cannot tell (another user's
    processes, no /proc). cpp_extension's build keeps its lock file open from taking it to removing it."""
    try:
        st = path.stat()
    except OSError:
        return False
    unknown = not Path("/proc/self/fd").is_dir()
    for pid in os.listdir("/proc") if not unknown else ():
        if not pid.isdigit():
            continue
        try:
            fds = list(os.scandir(f"/proc/{pid}/fd"))
        except PermissionError:
            unknown = True
            continue
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                t = os.stat(fd.path)
                if (t.st_dev, t.st_ino) == (st.st_dev, st.st_ino):
                    return True
    return None if unknown else False


def _break_stale(lock: Path, t0: float, wait_s: float, say_after_s: float) -> None:
    """Under our lock, cpp_extension's ``lock`` file is a killed build's when no process holds it open (or,
    where that cannot be seen, when it is older than ``wait_s``): removed, and said. One a live process holds
    (another rollyard version's build sharing this cache) is waited for, with the same bound and word."""
    said = False
    while lock.exists():
        held = _holders(lock)
        if held is False or (held is None and time.time() - lock.stat().st_mtime > wait_s):
            time.sleep(0.5)  # a build releasing its lock closes the file, then removes it: let it
            if lock.exists():
                lock.unlink(missing_ok=True)
                print(f"[rollyard] removed a stale CPU-kernel build lock {lock} (left by a build that was killed)",
                      file=sys.stderr, flush=True)
            return
        said = _wait_turn(t0, wait_s, say_after_s, said, "another process", lock.parent, f"(it holds {lock})")


def _compile(rebuild: bool = False) -> Path:
    """The shared library, built (or found already built) by ``torch.utils.cpp_extension.load``.

    cpp_extension owns the build: ninja, the compiler (``$CXX``, else ``c++``), and a file lock so that
    concurrent ranks do not race. The build directory is :func:`build_key`'s: keyed by what the
    library is built from and the CPU (``-march=native`` binds it to this CPU; ``ROLLYARD_CPU_ISA``
    builds for a narrower x86-64 level). ``rebuild``: delete what is there first (a library that did
    not load whole)."""
    from torch.utils import cpp_extension

    cflags = _cflags()
    root = cache_dir()
    with build_lock(root):
        for so in root.glob("*.so"):
            if rebuild or (why := _cached_fault(so)):  # cpp_extension would load it as it is (ninja: up to date)
                print(f"[rollyard] the cached CPU-kernel library {so} does not load ({why if not rebuild else 'asked'}); "
                      f"rebuilding it", file=sys.stderr, flush=True)
                for f in root.iterdir():  # everything but our lock file (held): built again from the source
                    if f.name != LOCK:
                        shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        fresh = not any(root.glob("*.so"))
        # cpp_extension keeps one version per name and process: a second directory (a test's cache, then this
        # machine's) would bump it and compile <name>_v1 anew, under the lock. Each directory is built as a fresh
        # process would build it (ninja: nothing to do when it is up to date).
        versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        if versioner is not None:
            versioner.entries.pop(NAME, None)
        t = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # cpp_extension's own notes go to stderr, never the console
            path = cpp_extension.load(
                name=NAME, sources=[str(_SOURCE)], build_directory=str(root),
                extra_cflags=cflags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    if fresh:
        print(f"[rollyard] compiled rollyard's CPU kernels in {time.perf_counter() - t:.1f} s "
              f"(-march={cpu.march()}, {root})", file=sys.stderr)
    return Path(path)


def _cached_fault(so: Path) -> str | None:
    """Why a cached library must be built again (truncated, overwritten, built from another source), else None.
    Its symbols are looked for in its bytes before it is opened: a library once mapped in this process stays
    the one ``dlopen`` returns for its path, even after a rebuild."""
    try:
        data = so.read_bytes()
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    missing = [name for name in _SYMBOLS if name.encode() not in data]
    if missing:
        return f"it lacks {missing[0]}"
    try:
        ctypes.CDLL(str(so))
    except OSError as e:
        return _first_line(e)
    return None


def _first_line(e: BaseException) -> str:
    """One line for a build failure: the compiler's first ``error:`` line, else the message's first."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return f"{type(e).__name__}: {(errors or lines or ['no message'])[0][:300]}"


_SYMBOLS = ("rollyard_decode_attn_f32", "rollyard_decode_attn_supports", "rollyard_rms_norm_f32",
            "rollyard_rms_norm_bwd_f32", "rollyard_swiglu_fwd_f32", "rollyard_swiglu_bwd_f32", "rollyard_qkv_rope_fwd_f32",
            "rollyard_qkv_rope_bwd_f32", "rollyard_decode_rope_write_f32", "rollyard_adamw_bf16_state",
            "rollyard_adamw_f32_zero_grad", "rollyard_inverse_cdf_f32", "rollyard_gemm_bf16_available",
            "rollyard_pack_bf16", "rollyard_gemm_bf16", "rollyard_decode_attn_bf16kv",
            "rollyard_decode_rope_write_bf16kv", "rollyard_decode_layer_bf16", "rollyard_gemm_f32_available",
            "rollyard_pack_f32", "rollyard_gemm_f32", "rollyard_decode_layer_f32",
            "rollyard_transpose_32", "rollyard_softmax_entropy_f32", "rollyard_softmax_grad_f32",
            "rollyard_logsumexp_f32", "rollyard_sum_squares_f32", "rollyard_pack_q8", "rollyard_gemm_q8",
            "rollyard_decode_layer_q8", "rollyard_pack_w8a8", "rollyard_gemm_w8a8",
            "rollyard_decode_layer_w8a8", "rollyard_w8a8_vnni", "rollyard_softmax_draw_f32",
            "rollyard_logsumexp_bf16", "rollyard_softmax_entropy_bf16", "rollyard_logprob_grad_bf16")  # _load's


# (entry point, one declared in _load with the same C signature)
_SAME_SIGNATURES = (("decode_attn_bf16kv", "decode_attn_f32"), ("decode_rope_write_f32", "decode_rope_write_bf16kv"),
                    ("decode_layer_f32", "decode_layer_bf16"), ("pack_q8", "pack_f32"), ("gemm_q8", "gemm_f32"),
                    ("decode_layer_q8", "decode_layer_bf16"), ("pack_w8a8", "pack_f32"), ("gemm_w8a8", "gemm_f32"),
                    ("decode_layer_w8a8", "decode_layer_bf16"), ("w8a8_vnni", "gemm_f32_available"),
                    ("softmax_draw_f32", "logsumexp_f32"))


def _declare_head(lib: ctypes.CDLL) -> None:
    """The LM head's softmax row kernels' C signatures (fp32 and bf16 logits)."""
    P, I, L, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for name, args in (("softmax_entropy_f32", [P, L, L, L, P, P, I]), ("softmax_grad_f32", [P, L, L, L, P, P, I]),
                       ("logsumexp_f32", [P, L, L, L, P, P, P, I]), ("logsumexp_bf16", [P, L, L, L, F32, P, P, P, I]),
                       ("softmax_entropy_bf16", [P, L, L, L, F32, P, P, I]),
                       ("logprob_grad_bf16", [P, L, L, L, F32, P, P, P, I])):
        fn = getattr(lib, f"rollyard_{name}")
        fn.argtypes, fn.restype = args, None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.rollyard_decode_attn_f32.argtypes = [P, L, P, P, L, L, L, P, P, I, I, I, I, I, P, P, I]
    lib.rollyard_decode_attn_f32.restype = I
    lib.rollyard_decode_rope_write_bf16kv.argtypes = [P, L, I, I, I, I, P, P, P, L, P, P, P, L, L, L]
    lib.rollyard_decode_rope_write_bf16kv.restype = None
    lib.rollyard_decode_attn_supports.argtypes = [I, I]
    lib.rollyard_decode_attn_supports.restype = I
    lib.rollyard_rms_norm_f32.argtypes = [P, L, P, L, L, ctypes.c_float, P, P, I]
    lib.rollyard_rms_norm_f32.restype = None
    lib.rollyard_rms_norm_bwd_f32.argtypes = [P, P, P, P, L, L, P, P, P, I]
    lib.rollyard_rms_norm_bwd_f32.restype = None
    lib.rollyard_swiglu_fwd_f32.argtypes = [P, L, L, P, I]
    lib.rollyard_swiglu_fwd_f32.restype = None
    lib.rollyard_swiglu_bwd_f32.argtypes = [P, P, L, L, P, I]
    lib.rollyard_swiglu_bwd_f32.restype = None
    lib.rollyard_qkv_rope_fwd_f32.argtypes = [P, I, I, I, I, I, P, P, P, P, P, I]
    lib.rollyard_qkv_rope_fwd_f32.restype = None
    lib.rollyard_qkv_rope_bwd_f32.argtypes = [P, P, P, I, I, I, I, I, P, P, P, I]
    lib.rollyard_qkv_rope_bwd_f32.restype = None
    F32 = ctypes.c_float
    lib.rollyard_adamw_bf16_state.argtypes = [P, P, P, P, L, F32, F32, F32, F32, F32, F32, F32, ctypes.c_uint64, I]
    lib.rollyard_adamw_bf16_state.restype = None
    lib.rollyard_adamw_f32_zero_grad.argtypes = [P, P, P, L, F32, F32, F32, F32, F32, F32, I]
    lib.rollyard_adamw_f32_zero_grad.restype = None
    lib.rollyard_inverse_cdf_f32.argtypes = [P, L, L, P, P, P, I]
    lib.rollyard_inverse_cdf_f32.restype = None
    _declare_head(lib)
    lib.rollyard_gemm_bf16_available.argtypes = []
    lib.rollyard_gemm_bf16_available.restype = I
    lib.rollyard_pack_bf16.argtypes = [P, P, P, P, I, L, P, I]
    lib.rollyard_pack_bf16.restype = None
    lib.rollyard_gemm_bf16.argtypes = [P, L, L, L, P, L, P, P, L, P, L, I]
    lib.rollyard_gemm_bf16.restype = I
    lib.rollyard_decode_layer_bf16.argtypes = [P, L, L, P, F32, P, F32, P, P, P, P, P, L, P, P, P, P, L, I, I, I, P, P,
                                               L, L, L, P, P, I, I]
    lib.rollyard_decode_layer_bf16.restype = I
    lib.rollyard_gemm_f32_available.argtypes = []
    lib.rollyard_gemm_f32_available.restype = I
    lib.rollyard_pack_f32.argtypes = [P, P, P, I, L, P, I]
    lib.rollyard_pack_f32.restype = None
    lib.rollyard_gemm_f32.argtypes = [P, L, L, L, P, L, P, P, L, P, L, I]
    lib.rollyard_gemm_f32.restype = I
    for name, like in _SAME_SIGNATURES:
        fn, ref = getattr(lib, f"rollyard_{name}"), getattr(lib, f"rollyard_{like}")
        fn.argtypes, fn.restype = ref.argtypes, ref.restype
    lib.rollyard_sum_squares_f32.argtypes = [P, P, I, P, I]
    lib.rollyard_sum_squares_f32.restype = None
    lib.rollyard_transpose_32.argtypes = [P, L, L, L, P, I]
    lib.rollyard_transpose_32.restype = None
    return lib


def reference(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """torch's form of :func:`attend` (the engine's path without the kernel): ``[B, H * hd]``."""
    B, H, hd = q.shape
    KVH, W = K.shape[1], K.shape[2]
    s = torch.matmul(q.reshape(B, KVH, H // KVH, hd), K.transpose(-1, -2))
    if lens is not None:
        ar = torch.arange(W, device=q.device)
        s = s + torch.where(ar[None] >= lens[:, None], float("-inf"), 0.0)[:, None, None]
    return torch.matmul(torch.softmax(s, dim=-1), V).reshape(B, H * hd)


def _call(lib, q, K, V, lens, share=None) -> torch.Tensor:
    B, H, hd = q.shape
    KVH, W = K.shape[1], K.shape[2]
    threads = torch.get_num_threads()
    out = torch.empty(B, H * hd)
    scratch = torch.empty(threads * (H // KVH) * (W + 16))
    fn = lib.rollyard_decode_attn_f32 if K.dtype == torch.float32 else lib.rollyard_decode_attn_bf16kv
    rc = fn(
        q.data_ptr(), q.stride(0), K.data_ptr(), V.data_ptr(), K.stride(0), K.stride(1), K.stride(2),
        None if lens is None else lens.data_ptr(), None if share is None else share.data_ptr(), B, KVH, H // KVH, hd,
        W, out.data_ptr(), scratch.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"decode-attention kernel refused G={H // KVH}, head_dim={hd}")
    return out


def _trial(lib, G: int, hd: int) -> str | None:
    """Why the kernel must not run attention of this shape here (its result differs from torch's, over an fp32
    cache and a bf16 one), else ``None``. A fixed random case: the answer depends on the shape and this CPU, never
    on timing."""
    gen = torch.Generator().manual_seed(0)
    B, KVH, W = 32, 4, 68
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, B, KVH, W + 28, hd, generator=gen).to(dtype)
        K, V = cache[0, :, :, :W], cache[1, :, :, :W]
        q = torch.randn(B, KVH * G, hd, generator=gen) * hd ** -0.5
        lens = torch.randint(1, W + 1, (B,), generator=gen)
        for n in (None, lens):
            want, got = reference(q, K.float(), V.float(), n), _call(lib, q, K, V, n)
            err = float((got - want).abs().max())
            if not err < 1e-4:
                return f"at G={G}, head_dim={hd} ({dtype} cache) its result differs from torch's by {err:.2e}"
    return None


def _rms_norm_call(lib, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    x2 = x.reshape(rows, d) if x.dim() != 2 else x
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rollyard_rms_norm_f32(x2.data_ptr(), x2.stride(0), None if w is None else w.data_ptr(), rows, d, eps,
                              out.data_ptr(), None, torch.get_num_threads())
    return out


def _load_trial(lib) -> str | None:
    """Why the freshly loaded library must not be used (its RMSNorm or SwiGLU disagree with torch's)."""
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(7, 64, generator=gen) * 4
    out = torch.empty(7, 32)
    lib.rollyard_swiglu_fwd_f32(gu.data_ptr(), 7, 32, out.data_ptr(), 1)
    want = F.silu(gu[:, :32]) * gu[:, 32:]
    err = float((out - want).abs().max() / want.abs().max())
    if not err < 1e-5:
        return f"its swiglu differs from torch's by {err:.2e} (relative)"
    for shape in ((32, 256), (5, 3, 24), (3, 100)):
        x, w = torch.randn(*shape, generator=gen) * 3, torch.rand(shape[-1], generator=gen) + 0.5
        for weight in (w, None):
            got = _rms_norm_call(lib, x, weight, 1e-6)
            want = F.rms_norm(x, (shape[-1],), weight, 1e-6)
            err = float((got - want).abs().max() / want.abs().max())
            if not err < 1e-5:
                return f"its rms_norm differs from torch's by {err:.2e} (relative)"
    return None


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), w, eps)``, without autograd: through the kernel (once
    :func:`kernel` has loaded it) for fp32 CPU tensors with a contiguous last dim (rows may be
    strided in a 2-D ``x``), else torch's."""
    lib = _STATE.get("lib")
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1
            or (x.dim() != 2 and not x.is_contiguous()) or (w is not None and (w.dtype != torch.float32
                                                                             or not w.is_contiguous()))):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _rms_norm_call(lib, x, w, eps)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu = [gate | up]`` (last dim), without autograd: through the
    kernel (once :func:`kernel` has loaded it) for contiguous fp32 CPU ``gu`` whose half width is
    a multiple of 16, else torch's ops."""
    lib, half = _STATE.get("lib"), gu.shape[-1] // 2
    if lib is None or gu.dtype != torch.float32 or gu.device.type != "cpu" or half % 16 or not gu.is_contiguous():
        return F.silu(gu[..., :half]) * gu[..., half:]
    out = torch.empty(*gu.shape[:-1], half)
    lib.rollyard_swiglu_fwd_f32(gu.data_ptr(), gu.numel() // (2 * half), half, out.data_ptr(), torch.get_num_threads())
    return out


def decode_rope_write(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None,
                      same_pos: int, kv_layer: torch.Tensor, H: int, KVH: int) -> torch.Tensor:
    """One decode step's q|k|v rows ``y [B, (H + 2 KVH) hd]`` (rows may be strided): RoPE on q and
    k at each row's position (``pos [B]`` int64, or ``same_pos`` for all when ``pos`` is None; ``cos,
    sin``: the full ``[context, hd]`` tables, sin sign-folded), k and v written into ``kv_layer [2,
    slots, KVH, width, hd]`` (contiguous) at row b's slot b and that position; returns q ``[B, H *
    hd]``. The caller has loaded the kernels (:func:`kernel`) and checked dtypes (fp32, CPU; the cache fp32 or
    bf16: k and v rounded to bf16 as torch's cast rounds)."""
    B, hd = y.shape[0], cos.shape[-1]
    q = torch.empty(B, H * hd)
    K, V = kv_layer[0], kv_layer[1]
    lib = _STATE["lib"]
    fn = lib.rollyard_decode_rope_write_f32 if K.dtype == torch.float32 else lib.rollyard_decode_rope_write_bf16kv
    fn(
        y.data_ptr(), y.stride(0), B, H, KVH, hd, cos.data_ptr(), sin.data_ptr(),
        None if pos is None else pos.data_ptr(), same_pos, q.data_ptr(), K.data_ptr(), V.data_ptr(),
        K.stride(0), K.stride(1), K.stride(2))
    return q


def adamw_bf16_state(p: torch.Tensor, g: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor, *, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float, bc1: float, bc2: float,
                     seed: int) -> bool:
    """One AdamW update of the fp32 CPU weight ``p`` (in place) from its gradient ``g`` (None: an exactly zero one,
    not read), with bf16 moments ``m``, ``v`` read and written back stochastically rounded, in one pass
    (``kernels.cc``); ``False`` (nothing done) when the kernel is not loaded or a tensor is not contiguous CPU data
    of those dtypes."""
    lib = _STATE.get("lib")
    if (lib is None or not f32_cpu(p, *([] if g is None else [g])) or m.dtype != torch.bfloat16
            or v.dtype != torch.bfloat16 or not (m.is_contiguous() and v.is_contiguous())):
        return False
    lib.rollyard_adamw_bf16_state(p.data_ptr(), None if g is None else g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), lr, beta1,
                                  beta2, eps, weight_decay, bc1, bc2, seed & (2 ** 64 - 1), torch.get_num_threads())
    _written(p, m, v)
    return True


def f32_cpu(*tensors: torch.Tensor) -> bool:
    """Every tensor is a plain (no subclass: a sharded DTensor is not), contiguous fp32 CPU tensor: what the fp32
    kernels take."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
               and t.is_contiguous() for t in tensors)


def adamw_zero_grad(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step_size: float, decay: float,
                    beta1: float, beta2: float, sqrt_bc2: float, eps: float) -> bool:
    """AdamW's step of the fp32 CPU weight ``p`` on an exactly zero gradient, fp32 moments ``m``, ``v`` (all in
    place, one pass, no gradient read: ``kernels.cc``); ``False`` (nothing done) when the kernel is not loaded or a
    tensor is not contiguous fp32 CPU data."""
    lib = _STATE.get("lib")
    if lib is None or not f32_cpu(p, m, v):
        return False
    lib.rollyard_adamw_f32_zero_grad(p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), step_size, decay,
                                     1.0 - beta1, beta2, sqrt_bc2, eps, torch.get_num_threads())
    _written(p, m, v)
    return True


def _written(*tensors: torch.Tensor) -> None:
    """Bump the version counters of tensors a kernel wrote through their pointers, as an in-place torch op would
    (autograd's saved-tensor checks and the trainer's bf16 copies, ``model/bf16_weights.py``, read them)."""
    torch.autograd.graph.increment_version(tensors)


def inverse_cdf(weights: torch.Tensor, r: torch.Tensor, totals: torch.Tensor | None = None) -> torch.Tensor | None:
    """One draw per row of ``weights [B, V]`` (non-negative fp32): the first index whose running fp64 sum exceeds
    ``r[b] * total`` (``r [B]`` fp64 uniforms in [0, 1)), ``V - 1`` if none; bit for bit ``searchsorted(
    weights.double().cumsum(-1), r * total, right=True).clamp(max=V - 1)`` without the fp64 copy (``kernels.cc``).
    ``totals [B]`` fp64, if given, receives each row's sum. ``None`` (nothing done) when the kernel is not loaded
    or a tensor is not contiguous CPU data of those dtypes."""
    lib = _STATE.get("lib")
    if (lib is None or not f32_cpu(weights) or weights.dim() != 2 or r.dtype != torch.float64 or not r.is_contiguous()
            or r.numel() != weights.shape[0] or r.device.type != "cpu"
            or (totals is not None and (totals.dtype != torch.float64 or not totals.is_contiguous()))):
        return None
    out = torch.empty(weights.shape[0], dtype=torch.int64)
    lib.rollyard_inverse_cdf_f32(weights.data_ptr(), weights.shape[0], weights.shape[1], r.data_ptr(), out.data_ptr(),
                                 None if totals is None else totals.data_ptr(), torch.get_num_threads())
    return out


def softmax_draw(z: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One draw per row of ``softmax(z)`` (fp32 logits ``z [B, V]``, rows may be strided; ``r [B]`` fp64 uniforms in
    ``[0, 1)``) and its log-probability: ``(tok [B] int64, lp [B] fp32)``. The draw is the inverse CDF's over the
    weights ``exp(z - max z)`` (vexp's), the first index whose running fp64 sum exceeds ``r * total``; ``lp = z[tok] -
    max z - log(total)`` (``kernels.cc``). Two reads of the logits and no ``[B, V]`` tensor written, where
    ``log_softmax``, ``exp`` and :func:`inverse_cdf` read them four times and write two. ``None`` (nothing done) when
    the kernel is not loaded or the tensors do not fit."""
    if (not _head_rows_ok(z) or r.dtype != torch.float64 or not r.is_contiguous() or r.device.type != "cpu"
            or r.shape != (z.shape[0],)):
        return None
    tok, lp = torch.empty(z.shape[0], dtype=torch.int64), torch.empty(z.shape[0])
    _STATE["lib"].rollyard_softmax_draw_f32(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), r.data_ptr(),
                                            tok.data_ptr(), lp.data_ptr(), torch.get_num_threads())
    return tok, lp


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm of all of ``grads`` together (``torch.nn.utils.get_total_norm``'s value, to float rounding: each
    tensor's squares summed in double, ``kernels.cc``), a 0-dim fp32 tensor; the same for any thread count. ``None``
    (nothing done) when the kernels are off or not built here, or a tensor is not contiguous fp32 CPU data."""
    if not grads or not f32_cpu(*grads) or (lib := kernel()) is None:
        return None
    n = len(grads)
    out = torch.empty(n, dtype=torch.float64)
    lib.rollyard_sum_squares_f32((ctypes.c_void_p * n)(*(g.data_ptr() for g in grads)),
                                 (ctypes.c_int64 * n)(*(g.numel() for g in grads)), n, out.data_ptr(),
                                 torch.get_num_threads())
    return out.sum().sqrt().float()


def _head_rows_ok(z: torch.Tensor, *more: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """CPU logits ``[rows, V]`` of ``dtype`` whose rows may be strided, and contiguous per-row fp32 vectors beside
    them."""
    return (_STATE.get("lib") is not None and type(z) is torch.Tensor and z.device.type == "cpu"
            and z.dtype == dtype and z.dim() == 2 and z.stride(1) == 1 and z.stride(0) >= z.shape[1]
            and all(f32_cpu(t) and t.shape == (z.shape[0],) for t in more))


def _targets_ok(z: torch.Tensor, targets: torch.Tensor) -> bool:
    """One contiguous int64 CPU target per row of ``z`` (each in ``[0, V)``: the caller guarantees it)."""
    return (targets.dtype == torch.int64 and targets.device.type == "cpu" and targets.is_contiguous()
            and targets.shape == (z.shape[0],))


def logsumexp_at_bf16(z: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`logsumexp_at` of ``scale * z`` for bf16 logits ``z [rows, V]`` (the bf16 head's product, ``scale`` = 1 /
    temperature > 0), each element widened to fp32 as it is read: no fp32 ``[rows, V]`` copy. ``None`` when the kernel
    is not loaded or the tensors do not fit."""
    if not (_head_rows_ok(z, dtype=torch.bfloat16) and _targets_ok(z, targets) and scale > 0):
        return None
    logz, lp = torch.empty(z.shape[0]), torch.empty(z.shape[0])
    _STATE["lib"].rollyard_logsumexp_bf16(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), scale, targets.data_ptr(),
                                          logz.data_ptr(), lp.data_ptr(), torch.get_num_threads())
    return logz, lp


def softmax_entropy_bf16(z: torch.Tensor, logz: torch.Tensor, scale: float) -> torch.Tensor | None:
    """:func:`softmax_entropy` of ``scale * z`` for bf16 logits ``z`` (as :func:`logsumexp_at_bf16`)."""
    if not _head_rows_ok(z, logz, dtype=torch.bfloat16):
        return None
    out = torch.empty(z.shape[0], dtype=torch.float32)
    _STATE["lib"].rollyard_softmax_entropy_bf16(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), scale,
                                                logz.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def logprob_grad_bf16_(z: torch.Tensor, logz: torch.Tensor, g: torch.Tensor, targets: torch.Tensor,
                       scale: float) -> torch.Tensor | None:
    """bf16 logits ``z [rows, V]`` overwritten with ``d (sum_r g_r logp_r) / dz = (1[v = y_r] - softmax(scale z)_rv)
    g_r scale`` (``logp = log_softmax(scale z)`` at ``targets``, ``logz`` its log-partition), rounded to bf16, in one
    pass; ``None`` (``z`` untouched) when the kernel is not loaded or the tensors do not fit."""
    if not (_head_rows_ok(z, logz, g, dtype=torch.bfloat16) and _targets_ok(z, targets)):
        return None
    _STATE["lib"].rollyard_logprob_grad_bf16(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), scale, logz.data_ptr(),
                                             g.data_ptr(), targets.data_ptr(), torch.get_num_threads())
    return z


def logsumexp_at(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(logz, lp)`` per row of fp32 logits ``z [rows, V]`` (rows may be strided): ``logz = logsumexp(z, -1)``
    (the row's max, then the log of its sum of ``exp(z - max)``: two reads, no ``[rows, V]`` buffer) and ``lp =
    z[row, targets[row]] - logz``; ``None`` when the kernel is not loaded or the tensors do not fit (``targets``:
    contiguous int64 CPU, one per row, each in ``[0, V)``, which the caller guarantees)."""
    if (not _head_rows_ok(z) or targets.dtype != torch.int64 or targets.device.type != "cpu"
            or not targets.is_contiguous() or targets.shape != (z.shape[0],)):
        return None
    logz, lp = torch.empty(z.shape[0]), torch.empty(z.shape[0])
    _STATE["lib"].rollyard_logsumexp_f32(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), targets.data_ptr(),
                                         logz.data_ptr(), lp.data_ptr(), torch.get_num_threads())
    return logz, lp


def softmax_entropy(z: torch.Tensor, logz: torch.Tensor) -> torch.Tensor | None:
    """The entropy of ``softmax(z)`` per row of fp32 logits ``z [rows, V]`` (rows may be strided) given their
    ``logz = logsumexp(z, -1)``: ``logz - sum(exp(z - logz) * z)`` in one read of ``z`` and no ``[rows, V]``
    buffer (``kernels.cc``); ``None`` (nothing done) when the kernel is not loaded or the tensors do not fit."""
    if not _head_rows_ok(z, logz):
        return None
    out = torch.empty(z.shape[0], dtype=torch.float32)
    _STATE["lib"].rollyard_softmax_entropy_f32(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), logz.data_ptr(),
                                               out.data_ptr(), torch.get_num_threads())
    return out


def softmax_grad_(z: torch.Tensor, logz: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """``z`` overwritten with ``-g[:, None] * exp(z - logz[:, None])`` (the softmax part of ``d (g * logp) / dz``)
    in one pass (``kernels.cc``); ``None`` (``z`` untouched) when the kernel is not loaded or the tensors do not
    fit."""
    if not _head_rows_ok(z, logz, g):
        return None
    _STATE["lib"].rollyard_softmax_grad_f32(z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), logz.data_ptr(),
                                            g.data_ptr(), torch.get_num_threads())
    return z


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` for a 2-D fp32 CPU tensor whose rows are contiguous (``kernels.cc``
    ``rollyard_transpose_32``: 16 x 16 blocks through registers, 3-5x torch's copy of a transposed matrix on the
    trainer's shapes); torch's copy where the kernel is not loaded. The same values either way (a copy)."""
    lib = kernel()
    if lib is None or t.dim() != 2 or t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(1) != 1:
        return t.t().contiguous()
    rows, cols = t.shape
    out = torch.empty(cols, rows)
    lib.rollyard_transpose_32(t.data_ptr(), rows, cols, t.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


# ---- the rollout's bf16 matmuls (kernels.cc: layout P, one call per matmul) -------------------------------------


def bf16_packs(n: int, k: int) -> bool:
    """Whether a weight ``[n, k]`` can be packed for :func:`gemm_bf16` here: the library is loaded, built with
    AVX512-BF16 (vdpbf16ps), or else AVX-512F or AVX2 + FMA (the same numbers on fp32 FMAs), agreed with torch's bf16 matmul on a fixed
    case once per process (:func:`_gemm_trial`), and ``n % 64 == 0``, ``k % 32 == 0``. Deterministic: by the CPU's
    features, the settings and the shape, never by timing."""
    lib = kernel()
    if lib is None or n % 64 or k % 32 or n <= 0 or k <= 0 or not lib.rollyard_gemm_bf16_available():
        return False
    return _trusted("gemm_bf16", "bf16", _gemm_trial)


def _trusted(key: str, what: str, trial) -> bool:
    """Whether the ``what`` matmul kernel passed its ``trial`` here (run once per process, the verdict kept in
    ``_STATE[key]``); a failed trial says so once on stderr, or raises under ``ROLLYARD_CPU_KERNELS=1``."""
    if key not in _STATE:
        why = trial()
        if why and env_flag("ROLLYARD_CPU_KERNELS") == "1":
            raise KernelsRequired(f"ROLLYARD_CPU_KERNELS=1 but the CPU {what} matmul kernel is wrong here: {why}; "
                                  f"unset it (or set 0) and report this machine")
        if why:
            print(f"[rollyard] CPU {what} matmul kernel not used ({why}); torch's instead", file=sys.stderr)
        _STATE[key] = why is None
    return bool(_STATE[key])


def pack_bf16(parts: list[tuple[torch.Tensor, float]], empty=torch.empty) -> torch.Tensor:
    """The rows of ``parts`` (fp32 or bf16 ``[rows_i, k]`` CPU tensors, each times its scale) stacked and cast to
    bf16 as ``torch.mul(t, scale).to(torch.bfloat16)`` rounds, written in one pass into layout P (``kernels.cc``):
    a ``[n / 64, k / 32, 16, 64, 2]`` bf16 tensor for :func:`gemm_bf16`, from ``empty(shape, dtype)`` (a
    ``hugepages.Arena``'s, say). The caller checks :func:`bf16_packs`."""
    k = parts[0][0].shape[1]
    n = sum(t.shape[0] for t, _ in parts)
    ts = [t.detach().contiguous() for t, _ in parts]
    assert all(t.dtype in (torch.float32, torch.bfloat16) and t.dim() == 2 and t.shape[1] == k for t in ts)
    out = empty((n // 64, k // 32, 16, 64, 2), dtype=torch.bfloat16)
    srcs = (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))
    rows = (ctypes.c_int64 * len(ts))(*(t.shape[0] for t in ts))
    scales = (ctypes.c_float * len(ts))(*(float(sc) for _, sc in parts))
    kinds = (ctypes.c_int * len(ts))(*(int(t.dtype == torch.bfloat16) for t in ts))
    _STATE["lib"].rollyard_pack_bf16(srcs, rows, scales, kinds, len(ts), k, out.data_ptr(), torch.get_num_threads())
    return out


def is_packed_bf16(p: torch.Tensor) -> bool:
    """Whether ``p`` is a weight in layout P (:func:`pack_bf16`)."""
    return p.dim() == 5 and p.dtype == torch.bfloat16 and p.shape[2:] == (16, 64, 2)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _gemm_operands(x: torch.Tensor, n: int, k: int, b: torch.Tensor | None, add: torch.Tensor | None):
    """A matmul kernel's operands: ``x`` as 2-D fp32 rows with unit column stride (strided rows kept), the output
    ``[..., n]``, ``add`` as ``[rows, n]`` fp32 rows and the bias in fp32."""
    x2 = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(1) != 1:
        x2 = x2.float().contiguous()
    y = torch.empty(*x.shape[:-1], n)
    if add is not None:
        add = add.reshape(x2.shape[0], n)
        if add.dtype != torch.float32 or add.stride(1) != 1:
            add = add.float().contiguous()
    return x2, y, add, _f32(b)


def _gemm_call(fn, x: torch.Tensor, p: torch.Tensor, n: int, k: int, b: torch.Tensor | None, add: torch.Tensor | None,
               missing: str) -> torch.Tensor:
    """``fn`` (a ``rollyard_gemm_*`` kernel) over ``x [..., k]`` and the packed weight ``p`` (``n`` outputs), with
    :func:`_gemm_operands`; ``RuntimeError(missing)`` where this build has no such kernel."""
    x2, y, add, bias = _gemm_operands(x, n, k, b, add)
    rc = fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, p.data_ptr(), n, None if bias is None else bias.data_ptr(),
            None if add is None else add.data_ptr(), 0 if add is None else add.stride(0), y.data_ptr(), n,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(missing)
    return y


def unpack_bf16(p: torch.Tensor) -> torch.Tensor:
    """The weight ``[n, k]`` (bf16) that :func:`pack_bf16` wrote into layout P."""
    return p.permute(0, 3, 1, 2, 4).reshape(p.shape[0] * 64, p.shape[1] * 32)


def gemm_bf16(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None = None,
              add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + F.linear(x.bfloat16(), w, b).float()`` for ``p = pack_bf16(w)``: fp32 ``x [..., k]`` (rows may be
    strided in 2-D), fp32 bias and ``add`` (shaped like the output), fp32 result; the product's bf16 rounding is
    the bf16 matmul's, so the numbers are those of the cast, oneDNN's bf16 matmul and the cast back, in one call."""
    n, k = p.shape[0] * 64, p.shape[1] * 32
    return _gemm_call(_STATE["lib"].rollyard_gemm_bf16, x, p, n, k, b, add, "the CPU bf16 matmul kernel was called in a build without AVX512-BF16, AVX-512F or AVX2")


def f32_packs(n: int, k: int) -> bool:
    """Whether a weight ``[n, k]`` can be packed for :func:`gemm_f32` here: the library is loaded, built with AVX-512 or
    AVX2 + FMA, agreed with an fp64 reference on a fixed case once per process (:func:`_gemm_f32_trial`), and
    ``n % 64 == 0``, ``k % 16 == 0``. Deterministic: by the CPU's features, the settings and the shape, never by
    timing."""
    lib = kernel()
    if lib is None or n % 64 or k % 16 or n <= 0 or k <= 0 or not lib.rollyard_gemm_f32_available():
        return False
    return _trusted("gemm_f32", "fp32", _gemm_f32_trial)


def pack_f32(parts: list[tuple[torch.Tensor, float]], empty=torch.empty) -> torch.Tensor:
    """The rows of ``parts`` (fp32 ``[rows_i, k]`` CPU tensors, each times its scale, as ``torch.mul(t, scale)``)
    stacked and written in one pass into layout Q (``kernels.cc``): a ``[n / 64, k, 64]`` fp32 tensor for
    :func:`gemm_f32`, from ``empty(shape, dtype)``. The caller checks :func:`f32_packs`."""
    assert all(t.dtype == torch.float32 for t, _ in parts)
    k = parts[0][0].shape[1]
    out = empty((sum(t.shape[0] for t, _ in parts) // 64, k, 64), dtype=torch.float32)
    return _pack_fp32_parts(_STATE["lib"].rollyard_pack_f32, parts, out)


def _pack_fp32_parts(fn, parts: list[tuple[torch.Tensor, float]], out: torch.Tensor) -> torch.Tensor:
    """``fn(srcs, rows, scales, nparts, k, out, threads)`` (``rollyard_pack_f32`` / ``_q8``) over ``parts`` as fp32
    rows ``[rows_i, k]``: ``out``."""
    k = parts[0][0].shape[1]
    ts = [t.detach().float().contiguous() for t, _ in parts]
    assert all(t.dim() == 2 and t.shape[1] == k for t in ts)
    srcs = (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))
    rows = (ctypes.c_int64 * len(ts))(*(t.shape[0] for t in ts))
    scales = (ctypes.c_float * len(ts))(*(float(sc) for _, sc in parts))
    fn(srcs, rows, scales, len(ts), k, out.data_ptr(), torch.get_num_threads())
    return out


def is_packed_f32(p: torch.Tensor) -> bool:
    """Whether ``p`` is a weight in layout Q (:func:`pack_f32`)."""
    return p.dim() == 3 and p.dtype == torch.float32 and p.shape[2] == 64


def unpack_f32(p: torch.Tensor) -> torch.Tensor:
    """The weight ``[n, k]`` that :func:`pack_f32` wrote into layout Q."""
    return p.permute(0, 2, 1).reshape(p.shape[0] * 64, p.shape[1])


def gemm_f32(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None = None,
             add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + F.linear(x, w, b)`` for ``p = pack_f32(w)``, fp32 throughout (``x [..., k]``, rows may be strided in
    2-D; ``add`` shaped like the output): each output one fused multiply-add chain over the input in order, then the
    bias, then ``add``, whatever the thread count or the ISA (AVX-512 and AVX2 compute the same numbers)."""
    n, k = p.shape[0] * 64, p.shape[1]
    return _gemm_call(_STATE["lib"].rollyard_gemm_f32, x, p, n, k, b, add, "the CPU fp32 matmul kernel was called in a build without AVX-512 or AVX2 + FMA")


def _gemm_f32_trial() -> str | None:
    """Why :func:`gemm_f32` must not run here (its result differs from torch's fp32 matmul beyond fp32 rounding on a
    fixed random case: rows 1, 7 and 32, two parts, a scale, a bias, an add), else ``None``."""
    gen = torch.Generator().manual_seed(0)
    a, c = torch.randn(128, 96, generator=gen) / 8, torch.randn(64, 96, generator=gen)
    bias, scale = torch.randn(192, generator=gen), 0.3
    w = torch.cat((torch.mul(a, scale), c)).double()
    p = pack_f32([(a, scale), (c, 1.0)])
    for M in (1, 7, 32):
        x = torch.randn(M, 96, generator=gen)
        add = torch.randn(M, 192, generator=gen)
        want = F.linear(x.double(), w, bias.double()) + add.double()
        got = gemm_f32(x, p, bias, add)
        err = float((got.double() - want).abs().max() / want.abs().max())
        if not err < 1e-5:
            return f"at {M} rows its result differs from an fp64 reference by {err:.2e} (relative)"
    return None


# ---- the rollout's int8 weights (kernels.cc: layout R; rollout.precision=int8) --------------------------------------


def q8_packs(n: int, k: int) -> bool:
    """Whether a weight ``[n, k]`` can be packed for :func:`gemm_q8` here: as :func:`f32_packs` (layout R's matmul
    widens each block to fp32 and runs layout Q's tiles)."""
    return f32_packs(n, k)


Q8_GROUP = 64  # inputs sharing a scale (kernels.cc Q8_GROUP)


def _q8_rows(k: int) -> int:
    """Layout R's rows a block for ``k`` inputs: each group's weights, then its 64 scales (4 rows of bytes)."""
    return k + 4 * -(-k // Q8_GROUP)


def _q8_k(rows: int) -> int:
    """The inputs ``k`` of a block of ``rows`` rows (:func:`_q8_rows` inverted)."""
    full, rest = divmod(rows, Q8_GROUP + 4)
    return Q8_GROUP * full + (rest - 4 if rest else 0)


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``w [n, k]`` (fp32) as int8 ``q`` times a scale ``s [n, ceil(k / 64)]`` per row and group of
    :data:`Q8_GROUP` inputs: ``s = max|w[i, group]| / 127``, ``q = round(w / s)`` (half to even; 0 where ``s`` is
    0). What :func:`pack_q8` stores, in torch's ops (its reference)."""
    s = _group_scales(w)
    wide = s.repeat_interleave(Q8_GROUP, dim=1)[:, :w.shape[1]]
    q = torch.where(wide > 0, torch.round(w / torch.where(wide > 0, wide, 1)), 0).clamp(-127, 127)
    return q.to(torch.int8), s


def _group_scales(w: torch.Tensor) -> torch.Tensor:
    """``max|w[i, group]| / 127`` per row and group of :data:`Q8_GROUP` inputs of ``w [n, k]`` (the last may be short)."""
    n, k = w.shape
    groups = -(-k // Q8_GROUP)
    return F.pad(w, (0, groups * Q8_GROUP - k)).view(n, groups, Q8_GROUP).abs().amax(dim=2) / 127


def dequantize_q8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``q * s`` that a layout-R matmul computes with (one rounding per weight)."""
    return q.float() * s.repeat_interleave(Q8_GROUP, dim=1)[:, :q.shape[1]]


def pack_q8(parts: list[tuple[torch.Tensor, float]], empty=torch.empty) -> torch.Tensor:
    """The rows of ``parts`` (fp32 ``[rows_i, k]`` CPU tensors, each times its scale, as ``torch.mul(t, scale)``)
    stacked, quantized as :func:`quantize_q8` and written in one pass into layout R (``kernels.cc``): a
    ``[n / 64, k + 4 * ceil(k / 64), 64]`` int8 tensor (each group's 64 fp32 scales after its weights) for
    :func:`gemm_q8`, from ``empty(shape, dtype)``. The caller checks :func:`q8_packs`."""
    out = empty((sum(t.shape[0] for t, _ in parts) // 64, _q8_rows(parts[0][0].shape[1]), 64), dtype=torch.int8)
    return _pack_fp32_parts(_STATE["lib"].rollyard_pack_q8, parts, out)


def is_packed_q8(p: torch.Tensor) -> bool:
    """Whether ``p`` is a weight in layout R (:func:`pack_q8`)."""
    return p.dim() == 3 and p.dtype == torch.int8 and p.shape[2] == 64


def unpack_q8(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [n, k] int8, s [n, ceil(k / 64)] fp32)`` that :func:`pack_q8` wrote into layout R."""
    k = _q8_k(p.shape[1])
    qs, ss = [], []
    for k0 in range(0, k, Q8_GROUP):
        at, kg = k0 + 4 * (k0 // Q8_GROUP), min(Q8_GROUP, k - k0)
        qs.append(p[:, at:at + kg])
        ss.append(p[:, at + kg:at + kg + 4].contiguous().view(torch.float32).reshape(-1))
    q = torch.cat(qs, dim=1).permute(0, 2, 1).reshape(p.shape[0] * 64, k)
    return q, torch.stack(ss, dim=1)


def gemm_q8(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + F.linear(x, dequantize_q8(*quantize_q8(w)), b)`` for ``p = pack_q8(w)``: :func:`gemm_f32`'s numbers
    over the dequantized weight, bit for bit, on a quarter of its bytes (and a scale per 64)."""
    n, k = p.shape[0] * 64, _q8_k(p.shape[1])
    return _gemm_call(_STATE["lib"].rollyard_gemm_q8, x, p, n, k, b, add, "the CPU int8-weight matmul kernel was called in a build without AVX-512 or AVX2 + FMA")


V_GROUP_BYTES = 4096 + 256 + 256  # layout V's bytes a block and group (kernels.cc)


def pack_w8a8(parts: list[tuple[torch.Tensor, float]], empty=torch.empty) -> torch.Tensor:
    """The rows of ``parts`` (as :func:`pack_q8`'s) quantized as :func:`quantize_q8` and written into layout V
    (``kernels.cc``: each block and group of 64 inputs in vpdpbusd's order, its 64 scales and weight sums): a
    ``[n / 64, ceil(k / 64), V_GROUP_BYTES]`` int8 tensor for :func:`gemm_w8a8`, from ``empty(shape, dtype)``. The
    caller checks :func:`q8_packs`."""
    k = parts[0][0].shape[1]
    out = empty((sum(t.shape[0] for t, _ in parts) // 64, -(-k // Q8_GROUP), V_GROUP_BYTES), dtype=torch.int8)
    return _pack_fp32_parts(_STATE["lib"].rollyard_pack_w8a8, parts, out)


def vnni() -> bool:
    """Whether :func:`gemm_w8a8` runs on AVX512-VNNI here (else AVX2's byte multiplies: the same numbers)."""
    return kernel() is not None and bool(_STATE["lib"].rollyard_w8a8_vnni())


def is_packed_w8a8(p: torch.Tensor) -> bool:
    """Whether ``p`` is a weight in layout V (:func:`pack_w8a8`)."""
    return p.dim() == 3 and p.dtype == torch.int8 and p.shape[2] == V_GROUP_BYTES


def unpack_w8a8(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [n, k] int8, s [n, ceil(k / 64)] fp32)`` that :func:`pack_w8a8` wrote into layout V."""
    nb, G = p.shape[:2]
    q = p[:, :, :4096].reshape(nb, G, 16, 4, 16, 4).permute(0, 3, 4, 1, 2, 5).reshape(nb * 64, G * 64)[:, :k]
    s = p[:, :, 4096:4352].contiguous().view(torch.float32).permute(0, 2, 1).reshape(nb * 64, G)
    return q, s


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, sx)``: the rows of ``x [m, k]`` as :func:`gemm_w8a8` quantizes them, per group of :data:`Q8_GROUP`
    inputs: ``sx = max|x| / 127``, ``xq = round(x * (1 / sx))`` (half to even; 0 where ``sx`` is 0)."""
    sx = _group_scales(x)
    inv = torch.where(sx > 0, 1 / torch.where(sx > 0, sx, 1), 0).repeat_interleave(Q8_GROUP, dim=1)[:, :x.shape[1]]
    return torch.round(x * inv).clamp(-127, 127).to(torch.int8), sx


def gemm_w8a8(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None = None,
              add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + (x @ W^T + b)`` for ``p = pack_w8a8(w)``, with ``x``'s rows quantized too (:func:`quantize_rows`):
    per group of 64 inputs the exact integer sum of ``xq * q``, times ``sw * sx`` (one fused multiply-add into the
    running sum, groups in order), then the bias, then ``add``: the same numbers on every ISA and row count."""
    n, k = p.shape[0] * 64, x.shape[-1]
    if -(-k // Q8_GROUP) != p.shape[1]:
        raise ValueError(f"gemm_w8a8: x has {k} inputs, the weight's groups {p.shape[1]} (of {Q8_GROUP})")
    return _gemm_call(_STATE["lib"].rollyard_gemm_w8a8, x, p, n, k, b, add, "the CPU int8 x int8 matmul kernel was called in a build without AVX-512 or AVX2 + FMA")


def decode_layer(x: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None,
                 same_pos: int, kv: torch.Tensor, layer: int, H: int, KVH: int, lens: torch.Tensor | None,
                 width: int, share: torch.Tensor | None = None) -> None:
    """One Llama-family layer of a decode step over ``x [B, D]`` (contiguous fp32, updated in place) in one call
    (``kernels.cc`` ``rollyard_decode_layer_bf16`` / ``_f32``): the per-op path's kernels in its order, so its numbers
    bit for bit. ``w``: the layer's fused weights (``model/fast.py``; matmuls in layout P over a bf16 cache, or in layout R (int8) or
    layout Q over an fp32 cache), ``cos, sin``: the full RoPE tables, ``pos`` / ``same_pos``: as
    :func:`decode_rope_write`, ``kv [L, 2, slots, KVH, W, hd]`` (contiguous) and the ``layer`` whose K / V this is,
    ``lens``: each row's visible positions (None: ``width`` for every row), ``share``: :func:`attend`'s. The caller
    checks the shapes (``LlamaFast``)."""
    B, D = x.shape
    st = kv.stride()  # the layer's K and V addressed from the cache's own strides: no tensor indexing per layer
    size = kv.element_size()
    k_ptr = kv.data_ptr() + layer * st[0] * size
    (w_in, eps_in), (w_post, eps_post) = w["input_layernorm"], w["post_attention_layernorm"]
    bqkv, bo = _f32(w["bqkv"]), _f32(w["bo"])
    hd = cos.shape[-1]
    bf16 = kv.dtype == torch.bfloat16
    I = w["wgu"].shape[0] * 32  # any layout: [2 I / 64, ...] (64 columns a block)
    lib = _STATE["lib"]
    fn = (lib.rollyard_decode_layer_bf16 if bf16 else lib.rollyard_decode_layer_q8 if is_packed_q8(w["wqkv"]) else
          lib.rollyard_decode_layer_w8a8 if is_packed_w8a8(w["wqkv"]) else lib.rollyard_decode_layer_f32)
    rc = fn(x.data_ptr(), B, D, w_in.data_ptr(), eps_in, w_post.data_ptr(), eps_post, w["wqkv"].data_ptr(),
            None if bqkv is None else bqkv.data_ptr(), w["wo"].data_ptr(), None if bo is None else bo.data_ptr(),
            w["wgu"].data_ptr(), I, w["wd"].data_ptr(), cos.data_ptr(), sin.data_ptr(),
            None if pos is None else pos.data_ptr(), same_pos, H, KVH, hd, k_ptr, k_ptr + st[1] * size, st[2], st[3],
            st[4], None if lens is None else lens.data_ptr(), None if share is None else share.data_ptr(), width,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the fused decode layer refused its shapes (code {rc}): H={H}, KVH={KVH}, head_dim={hd}")


def _gemm_trial() -> str | None:
    """Why :func:`gemm_bf16` must not run here (its result differs from torch's cast, bf16 matmul and cast back on a
    fixed random case: rows 1, 7 and 32, two parts, a scale, a bias, an add), else ``None``."""
    gen = torch.Generator().manual_seed(0)
    a, c = torch.randn(128, 96, generator=gen) / 8, torch.randn(64, 96, generator=gen).bfloat16()
    bias, scale = torch.randn(192, generator=gen), 0.125
    w = torch.cat((torch.mul(a, scale).bfloat16(), c))
    p = pack_bf16([(a, scale), (c, 1.0)])
    for M in (1, 7, 32):
        x = torch.randn(M, 96, generator=gen)
        add = torch.randn(M, 192, generator=gen)
        want = F.linear(x.bfloat16(), w, bias.bfloat16()).float() + add
        got = gemm_bf16(x, p, bias.bfloat16(), add)
        err = float((got - want).abs().max() / want.abs().max())
        if not err < 1e-2:
            return f"at {M} rows its result differs from torch's by {err:.2e} (relative)"
    return None


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` (off, or it cannot be built or is wrong here: said
    once on stderr).

    ``ValueError`` for a bad ``ROLLYARD_CPU_KERNELS``; :class:`KernelsRequired` when it is ``1``
    and the kernels cannot be had."""
    flag = env_flag("ROLLYARD_CPU_KERNELS")
    if flag == "0":
        return None
    if "lib" not in _STATE:
        lib, why = _build_and_load()
        if why:
            lib = None
            if flag != "1":  # with 1 the error below says it
                print(f"[rollyard] CPU kernels not used ({why}); torch's ops instead"
                      + ("" if compiler_found() else f" (no C++ compiler: {_cxx()} is not installed; install g++ to "
                                                     f"build them)"), file=sys.stderr)
        _STATE.update(lib=lib, why=why)
    if _STATE["lib"] is None and flag == "1":
        fix = ("install a C++ compiler with OpenMP (g++; $CXX names it) or unset it" if not compiler_found() else
               "unset it (or set 0) and report this machine")
        raise KernelsRequired(f"ROLLYARD_CPU_KERNELS=1 but rollyard's CPU kernels are unavailable: "
                              f"{_STATE['why']}; {fix}")
    return _STATE["lib"]


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def compiler_found() -> bool:
    """Whether the C++ compiler cpp_extension would use (``$CXX``, else ``c++``) is there to run."""
    return shutil.which(_cxx()) is not None


def _build_and_load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not). A cached library that does not load whole (truncated, overwritten,
    a missing symbol) is rebuilt once, under the lock, and said (:func:`_compile`) before anything falls back."""
    try:
        try:
            lib = _load(_compile())
        except AttributeError:  # missing a symbol all the same (its bytes named it): rebuilt, never half-loaded
            lib = _load(_compile(rebuild=True))
        return lib, _load_trial(lib)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError, AttributeError) as e:
        return None, _first_line(e)


def attention_supported(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel is on and runs this attention shape: ``G = q_heads / kv_heads`` in 1..8,
    ``head_dim`` in 8, 16, 24, 32, 40, 64, 128, 256, checked once per shape against torch. Deterministic: it
    depends on the shape and the CPU, not on timing (timed comparisons live in ``bench/engine.py``)."""
    lib = kernel()
    if lib is None or q_heads % kv_heads or not lib.rollyard_decode_attn_supports(q_heads // kv_heads, head_dim):
        return False
    shape = (q_heads // kv_heads, head_dim)
    if shape not in _STATE:
        why = _trial(lib, shape[0], head_dim)
        if why and env_flag("ROLLYARD_CPU_KERNELS") == "1":
            raise KernelsRequired(f"ROLLYARD_CPU_KERNELS=1 but the CPU decode-attention kernel is wrong here: {why}; "
                               f"unset it (or set 0) and report this machine")
        if why:
            print(f"[rollyard] CPU decode-attention kernel not used ({why}); torch's attention instead",
                  file=sys.stderr)
        _STATE[shape] = why is None
    return bool(_STATE[shape])


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, lens: torch.Tensor | None,
           share: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query position per row: ``q [B, H, hd]`` (heads contiguous, any row
    stride, fp32, already scaled) over ``K, V [B, KVH, W, hd]`` (strided views, last dim
    contiguous, fp32 or bf16: widened exactly, the arithmetic fp32), each row over its first ``lens[b]`` positions (int64 ``[B]``; ``None``: all
    ``W``). ``share``: ``None``, or int64 ``[B, 2]`` rows ``(src, P)``: row ``b``'s first ``P`` positions are read from
    row ``src``'s K / V, which the caller guarantees hold the same values there (a forked prompt's copies): the
    result is reading its own, bit for bit, with the rows of a group reading one copy. Returns ``[B, H * hd]``. The
    caller checks :func:`attention_supported` first."""
    assert q.dtype == torch.float32 and K.dtype == V.dtype in (torch.float32, torch.bfloat16), (q.dtype, K.dtype)
    assert q.device.type == "cpu"
    assert q.stride(2) == 1 and q.stride(1) == q.shape[2] and K.stride(3) == 1 and K.stride() == V.stride()
    assert lens is None or (lens.dtype == torch.int64 and lens.is_contiguous())
    assert share is None or (share.dtype == torch.int64 and share.is_contiguous() and share.shape == (q.shape[0], 2))
    return _call(kernel(), q, K, V, lens, share)


# ---- training (with autograd) ----------------------------------------------------------------


def _train_lib(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when every tensor is fp32 on CPU and no autocast would change the dtype."""
    if torch.is_autocast_enabled("cpu") or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return kernel()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        lib, d = _STATE["lib"], x.shape[-1]
        x = x.contiguous()
        rows = x.numel() // d
        out, rinv = torch.empty_like(x), torch.empty(rows)
        lib.rollyard_rms_norm_f32(x.data_ptr(), d, w.data_ptr(), rows, d, eps, out.data_ptr(), rinv.data_ptr(),
                                  torch.get_num_threads())
        ctx.save_for_backward(x, w, rinv)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, rinv = ctx.saved_tensors
        dy = dy.contiguous()
        d, threads = x.shape[-1], torch.get_num_threads()
        dx, dw, partial = torch.empty_like(x), torch.empty_like(w), torch.empty(threads, d)
        _STATE["lib"].rollyard_rms_norm_bwd_f32(x.data_ptr(), w.data_ptr(), rinv.data_ptr(), dy.data_ptr(),
                                                x.numel() // d, d, dx.data_ptr(), dw.data_ptr(), partial.data_ptr(),
                                                threads)
        return dx, dw, None


def train_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), w, eps)`` with autograd: forward and backward each one
    pass per row through the kernel for fp32 CPU tensors outside autocast (torch's decomposed
    rms_norm is ~1.8 ms forward + backward at 2144 x 256 on 2 threads, 13 calls a ``small``
    training step), else torch's."""
    if _train_lib(x, w) is None or not w.is_contiguous():
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _RMSNorm.apply(x, w, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        I2 = gu.shape[-1]
        out = torch.empty(*gu.shape[:-1], I2 // 2)
        _STATE["lib"].rollyard_swiglu_fwd_f32(gu.data_ptr(), gu.numel() // I2, I2 // 2, out.data_ptr(),
                                             torch.get_num_threads())
        ctx.save_for_backward(gu)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (gu,) = ctx.saved_tensors
        dout = dout.contiguous()
        dgu = torch.empty_like(gu)
        I2 = gu.shape[-1]
        _STATE["lib"].rollyard_swiglu_bwd_f32(gu.data_ptr(), dout.data_ptr(), gu.numel() // I2, I2 // 2,
                                             dgu.data_ptr(), torch.get_num_threads())
        return dgu


def train_swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu = [gate | up]`` (last dim), with autograd: the backward writes
    the gradient of ``gu`` in one pass (torch: silu, mul and their backwards, then a cat of the
    two halves' gradients). Through the kernel for fp32 CPU tensors outside autocast whose half
    width is a multiple of 16, else torch's ops."""
    half = gu.shape[-1] // 2
    if _train_lib(gu) is None or half % 16:
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(gu)


class _QKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int):
        y = y.contiguous()
        B, T, n = y.shape
        hd = n // (H + 2 * KVH)
        q, k, v = torch.empty(B, KVH, H // KVH * T, hd), torch.empty(B, KVH, T, hd), torch.empty(B, KVH, T, hd)
        _STATE["lib"].rollyard_qkv_rope_fwd_f32(y.data_ptr(), B, T, H, KVH, hd, cos.data_ptr(), sin.data_ptr(),
                                               q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, n, H, KVH, hd)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        B, T, n, H, KVH, hd = ctx.shape
        dq, dk, dv = (torch.zeros(B, KVH, s, hd) if g is None else g.contiguous()
                      for g, s in ((dq, H // KVH * T), (dk, T), (dv, T)))
        dy = torch.empty(B, T, n)
        _STATE["lib"].rollyard_qkv_rope_bwd_f32(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), B, T, H, KVH, hd,
                                               cos.data_ptr(), sin.data_ptr(), dy.data_ptr(), torch.get_num_threads())
        return dy, None, None, None, None


def train_qkv_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int):
    """Split a fused q|k|v projection ``y [B, T, (H + 2 KVH) hd]`` and apply RoPE (``cos, sin
    [T, hd]``, sin with rotate_half's sign folded in), straight into attention's layouts: ``q [B,
    KVH, G T, hd]`` (the ``G = H / KVH`` query heads of each K/V head stacked along the query
    axis), ``k, v [B, KVH, T, hd]``, contiguous. With autograd: the backward writes ``dy`` in one
    pass. ``None`` where the kernel cannot run (not fp32 CPU, autocast, no library): the caller
    takes torch's ops."""
    if _train_lib(y, cos, sin) is None or H % KVH or y.dim() != 3 or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    return _QKVRope.apply(y, cos, sin, H, KVH)


def choices() -> dict:
    """The numerics-relevant choices of the compiled kernels this process has made: whether they are in use (or why
    not), each decode-attention shape's verdict, whether the rollout's bf16 / fp32 matmuls ran on the kernel, and the
    CPU's features. Deterministic by shape, CPU features and settings. ``run.json`` records these with oneDNN's
    (:func:`rollyard.model.choices.choices`)."""
    lib = _STATE.get("lib", "not loaded")
    off = env_flag("ROLLYARD_CPU_KERNELS") == "0"
    out = {"cpu_kernels": "off: ROLLYARD_CPU_KERNELS=0" if off else "not loaded" if lib == "not loaded" else
           ("on" if lib is not None else f"off: {_STATE.get('why')}"),
           "cpu_kernels_setting": env_flag("ROLLYARD_CPU_KERNELS"),
           "decode_attention": {f"G={k[0]},head_dim={k[1]}": bool(v) for k, v in _STATE.items() if isinstance(k, tuple)},
           "bf16_matmul": ("oneDNN (no bf16 rollout here, or no AVX-512F / AVX2 in this build)" if "gemm_bf16" not in _STATE
                           else "oneDNN: the kernel disagreed with torch here" if not _STATE["gemm_bf16"]
                           else "kernel (vdpbf16ps)" if lib.rollyard_gemm_bf16_available() == 2
                           else "kernel (bf16 weights widened to fp32 in registers: fp32 arithmetic)"),
           "f32_matmul": ("oneDNN or MKL (no fp32 rollout here, or no AVX2 + FMA in this build)" if "gemm_f32" not in _STATE else
                          "kernel" if _STATE["gemm_f32"] else "oneDNN: the kernel disagreed with torch here"),
           "cpu_avx512": cpu.avx512(), "cpu_class": cpu.cpu_class(),
           "cpu_features": sorted(cpu.features()), "cpu_isa_setting": cpu.level(), "kernels_march": cpu.march()}
    return out
