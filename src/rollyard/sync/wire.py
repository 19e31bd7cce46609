"""The wire form of a ``WeightUpdate``: a JSON header and one flat byte payload.

Every transport that moves bytes (``dist``, ``ray``) sends exactly this, so the bytes it reports
are ``len(header) + len(payload)`` plus its own framing (the dist transport's 16-byte length
prefix, the object store's serialization overhead). The header lists, in payload order, each
tensor's name, role (``v`` value / ``i`` index), dtype, shape and byte length.

``payload_checksum`` is sha256 over (name, role, dtype, shape, raw bytes) of every tensor in sorted
order: the publisher stamps it, the receiver recomputes it over what arrived (``stage`` in
``apply.py``), so a truncated or corrupted payload is caught before any weight is touched.
"""

from __future__ import annotations

import hashlib
import json

import torch

from rollyard.types import WeightUpdate

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)}


class SyncRejected(ValueError):
    """An update that must not be applied (truncated, corrupted, wrong base version).

    The rollout copy is untouched; the receiver asks the publisher for a full sync.
    """

    needs_full = True


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 view (CPU, contiguous)."""
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)


def _entries(update: WeightUpdate) -> list[tuple[str, str, torch.Tensor]]:
    out = [(n, "v", t) for n, t in update.tensors.items()] + [(n, "i", t) for n, t in update.indices.items()]
    return sorted(out, key=lambda e: (e[0], e[1]))


def payload_checksum(update: WeightUpdate) -> str:
    """sha256 over every tensor and index tensor of ``update`` (sorted by name, role)."""
    h = hashlib.sha256()
    for name, role, t in _entries(update):
        h.update(f"{name}|{role}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(_raw(t).numpy().tobytes())
    return h.hexdigest()


def pack(update: WeightUpdate) -> tuple[bytes, torch.Tensor]:
    """``update`` -> (UTF-8 JSON header, flat uint8 payload) in header order."""
    entries = _entries(update)
    meta = {"version": update.version, "mode": update.mode, "checksum": update.checksum,
            "base_version": update.base_version,
            "tensors": [[n, r, str(t.dtype), list(t.shape), t.numel() * t.element_size()] for n, r, t in entries]}
    payload = torch.cat([_raw(t) for _, _, t in entries]) if entries else torch.empty(0, dtype=torch.uint8)
    return json.dumps(meta, separators=(",", ":")).encode(), payload


def unpack(header: bytes, payload: torch.Tensor) -> WeightUpdate:
    """Inverse of ``pack``; raises ``SyncRejected`` when the payload is shorter or longer than declared."""
    try:
        meta = json.loads(header.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SyncRejected(f"weight update header does not parse ({e}); the update is dropped") from None
    need = sum(e[4] for e in meta["tensors"])
    if payload.numel() != need:
        raise SyncRejected(f"weight update v{meta['version']} is truncated or padded: header declares {need} payload "
                           f"bytes, {payload.numel()} arrived; the update is dropped and a full sync requested")
    upd = WeightUpdate(version=meta["version"], mode=meta["mode"], checksum=meta["checksum"],
                       base_version=meta["base_version"])
    off = 0
    for name, role, dtype, shape, nbytes in meta["tensors"]:
        t = payload[off:off + nbytes].clone().view(DTYPES[dtype]).view(shape)
        off += nbytes
        (upd.tensors if role == "v" else upd.indices)[name] = t
    return upd
