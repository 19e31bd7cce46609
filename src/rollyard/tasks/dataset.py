"""Prompt datasets from JSONL or Parquet files, with a field mapping.

``fields`` maps rollyard names to the file's columns, e.g. ``{"prompt": "question", "id": "uid",
"answer": "solution"}``. Defaults: ``prompt`` from column ``prompt``, ``id`` from column ``id``
(a line without one gets ``"{file stem}:{line}"``). ``demo`` (a reference completion for the SFT
warm start) is read only when mapped. Every other rollyard name in ``fields`` renames a column
into ``meta`` (``answer`` above: ``meta["answer"] = row["solution"]``), and every unmapped column
goes into ``meta`` under its own name. A mapped column may be a dotted path into a nested record:
a verl dataset's ``{ground_truth: reward_model.ground_truth}``.

A prompt is a non-empty string, or a chat message list (``[{"role": "user", "content": "..."}]``,
as TRL and verl datasets store it), rendered later by the model's chat template (``tasks/chat.py``).

A malformed line (not JSON, not an object, no prompt field, a prompt that is not a non-empty
string, a bad or duplicate id, a mapped column missing) raises :class:`DataError` naming
``file:line``, the rule, and the fix; with ``on_error="deadletter"`` it is appended to
``deadletter`` as ``{"source": "file:line", "reason": ...}`` and skipped instead. Blank lines in
JSONL are skipped. Parquet rows are numbered from 1 like lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from rollyard.tasks.base import DataError, Prompt

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
RESERVED = ("prompt", "id", "demo")


class _Bad(Exception):
    """A malformed line: ``reason`` is the rule it broke and how to fix it."""


def _rows_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, _Bad(f"line is not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8")
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, _Bad(f"line is not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                   f"JSON object, e.g. {{\"prompt\": \"...\"}}")


def _rows_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed; "
                        f"pip install 'rollyard[parquet]' (or use a .jsonl file)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); "
                        f"check the file, or use a .jsonl file") from None
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            row += 1
            yield row, rec


def load_prompts(path: str | Path, fields: dict[str, str] | None = None, on_error: str = "raise",
                 deadletter: list | None = None, key: str = "data.path") -> list[Prompt]:
    """Read prompts from a ``.jsonl`` or ``.parquet`` file (see the module docstring for the rules);
    ``key`` is the setting that named the file (``data.path`` or ``data.eval_path``), for messages."""
    path = Path(path)
    if on_error not in ("raise", "deadletter"):
        raise ValueError(f"on_error must be 'raise' or 'deadletter', got {on_error!r}")
    if on_error == "deadletter" and deadletter is None:
        raise ValueError("on_error='deadletter' needs a `deadletter` list to append rejected lines to")
    fields = dict(fields or {})
    for name, col in fields.items():
        if not isinstance(col, str) or not col:
            raise DataError(f"data.fields[{name!r}] must be a column name (a non-empty string), got {col!r}")
    prompt_col = fields.get("prompt", "prompt")
    id_col = fields.get("id", "id")
    id_mapped = "id" in fields
    demo_col = fields.get("demo")
    renames = {col: name for name, col in fields.items() if name not in RESERVED}  # column -> meta key
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows = _rows_jsonl
    elif suffix in PARQUET_SUFFIXES:
        rows = _rows_parquet
    else:
        raise DataError(f"{key}={path}: unsupported dataset format {path.suffix or '(no suffix)'!r}; "
                        f"use a .jsonl file (one JSON object per line) or a .parquet file")
    if path.exists() and not path.is_file():  # a FIFO would block the read (and a directory is no dataset)
        kind = "a directory" if path.is_dir() else "a FIFO" if path.is_fifo() else "a socket or device"
        raise DataError(f"{key}={path}: not a regular file ({kind}); point {key} at a .jsonl or .parquet file")
    if not path.is_file():
        raise DataError(f"{key}={path}: no such dataset file; check {key} (relative paths are from "
                        f"{Path.cwd()})")

    out: list[Prompt] = []
    seen: dict[str, int] = {}
    dead = 0
    for lineno, rec in rows(path):
        source = f"{path}:{lineno}"
        try:
            out.append(_parse(rec, path, lineno, prompt_col, id_col, id_mapped, demo_col, renames, fields, seen))
        except _Bad as e:
            if on_error == "raise":
                raise DataError(f"{source}: {e} (or set data.on_error=deadletter to skip such lines)") from None
            deadletter.append({"source": source, "reason": str(e)})
            dead += 1
    if not out:
        why = (f"all {dead} lines were malformed and dead-lettered, first: {deadletter[-dead]['reason']}" if dead
               else "the file has no prompts")
        raise DataError(f"{key}={path}: no usable prompts ({why}); check the file and data.fields")
    return out


def check_context(prompts: list[Prompt], tokenizer, context: int, source: str, preset: bool = True) -> None:
    """DataError when not one of ``prompts`` leaves a position free to generate in ``context`` tokens.

    A run whose every prompt is too long would only dead-letter them, step after step, training on
    nothing: it fails here, before the warm start and the first step. Stops at the first prompt
    that fits (the usual case costs one tokenization). ``preset``: model.context sets the context
    (a built-in preset), else it is the model directory's own."""
    longest = 0
    for p in prompts:
        n = len(tokenizer(p.text, add_special_tokens=p.messages is None)["input_ids"])  # as to_requests
        if n < context:
            return
        longest = max(longest, n)
    if prompts:
        fix = (f"set model.context={longest + 16} or more" if preset
               else "use a model with a longer context (max_position_embeddings)")
        raise DataError(f"{source}: every one of the {len(prompts)} prompts is at least {context} tokens "
                        f"(longest {longest}), so none fits the model's context of {context} with room to generate; "
                        f"{fix}, or shorten the prompts")


def _parse(rec: Any, path: Path, lineno: int, prompt_col: str, id_col: str, id_mapped: bool,
           demo_col: str | None, renames: dict[str, str], fields: dict[str, str], seen: dict[str, int]) -> Prompt:
    if isinstance(rec, _Bad):
        raise rec
    if not isinstance(rec, dict):
        raise _Bad(f"line is a JSON {type(rec).__name__}, not an object; each line must be one JSON object, "
                   f"e.g. {{\"{prompt_col}\": \"...\"}}")
    if prompt_col not in rec:
        mapped = " (data.fields maps prompt to it)" if "prompt" in fields else ""
        raise _Bad(f"no {prompt_col!r} field{mapped}; the line has {_keys(rec)}: set data.fields={{prompt: <column>}} "
                   f"to the column that holds the prompt")
    text, messages = rec[prompt_col], None
    if isinstance(text, (list, tuple)):
        messages, text = _messages(text, prompt_col), ""
    elif not isinstance(text, str):
        raise _Bad(f"field {prompt_col!r} must be a string or a list of chat messages, got {type(text).__name__} "
                   f"{_short(text)}; store the prompt as a string or as [{{\"role\": \"user\", \"content\": \"...\"}}]")
    elif not text:
        raise _Bad(f"field {prompt_col!r} is an empty string; every prompt needs text")
    if id_col in rec and rec[id_col] is not None:
        pid = rec[id_col]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise _Bad(f"id field {id_col!r} must be a string or an integer, got {type(pid).__name__} {_short(pid)}")
        pid = str(pid)
    elif id_mapped:
        raise _Bad(f"no {id_col!r} field (data.fields maps id to it); the line has {_keys(rec)}")
    else:
        pid = f"{path.stem}:{lineno}"
    if pid in seen:
        raise _Bad(f"duplicate id {pid!r} (first at line {seen[pid]}); ids must be unique within a file")
    demo = None
    if demo_col is not None:
        if demo_col not in rec:
            raise _Bad(f"no {demo_col!r} field (data.fields maps demo to it); the line has {_keys(rec)}")
        demo = rec[demo_col]
        if demo is not None and not isinstance(demo, str):
            raise _Bad(f"demo field {demo_col!r} must be a string, got {type(demo).__name__} {_short(demo)}")
    meta: dict[str, Any] = {}
    mapped = {}
    for col, name in renames.items():
        found, mapped[name] = _lookup(rec, col)
        if not found:
            raise _Bad(f"no {col!r} field (data.fields maps {name} to it); the line has {_keys(rec)}")
    for col, value in rec.items():
        if col not in (prompt_col, demo_col, id_col) and col not in renames:
            meta[col] = value
    meta.update(mapped)  # a mapped column wins over an unmapped one of the same name
    seen[pid] = lineno
    return Prompt(id=pid, text=text, meta=meta, demo=demo, messages=messages)


def _lookup(rec: dict, col: str) -> tuple[bool, Any]:
    """``(found, value)`` of column ``col``, or of a dotted path into nested records (``a.b``)."""
    if col in rec:
        return True, rec[col]
    node: Any = rec
    for part in col.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _messages(value: Any, col: str) -> list[dict[str, Any]]:
    """A chat prompt checked: a non-empty list of ``{"role": str, "content": str}``."""
    if not value:
        raise _Bad(f"field {col!r} is an empty message list; a chat prompt needs at least one message")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad(f"field {col!r}: message {i} is {_short(m)}, expected {{\"role\": str, \"content\": str}}; "
                       f"write each message as {{\"role\": \"user\", \"content\": \"...\"}}")
    return [dict(m) for m in value]


def _keys(rec: dict) -> str:
    keys = list(rec)
    shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    return f"fields [{shown}]" if keys else "no fields"


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."
