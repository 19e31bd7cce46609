"""The wire form of a ``WeightUpdate``: a JSON header and one flat byte payload.

Every transport that moves bytes (``dist``, ``ray``) sends exactly this, so the bytes it reports
are ``len(header) + len(payload)`` plus its own framing (the dist transport's 16-byte length
prefix, the object store's serialization overhead). The header lists, in payload order, each
tensor's name, role (``v`` value / ``i`` index), dtype, shape and byte length; each tensor is
padded to 8 bytes so the receiver views the payload in place.

``payload_checksum`` is sha256 over (name, role, dtype, shape, raw bytes) of every tensor in sorted
order: ``pack`` stamps it into the header when the update goes on a wire, the receiver
recomputes it over what arrived (``stage`` in ``apply.py``), so a truncated or corrupted payload
is caught before any weight is touched. An update handed over in-process (the colocated
placement's ``inprocess`` transport) crosses no wire and carries none: hashing it twice cost
~10 ms a sync at 4M parameters, more than the cast itself.
"""

from __future__ import annotations

import hashlib
import json

import torch

from rollyard.types import WeightUpdate

ALIGN = 8  # bytes; every tensor starts at a multiple of this in the payload
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


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_pieces(update: WeightUpdate) -> tuple[bytes, list[torch.Tensor]]:
    """``update`` -> (UTF-8 JSON header, the payload as flat uint8 pieces, views where possible).

    Each tensor starts at a multiple of ``ALIGN`` bytes (zero padding between), so the receiver
    can view the payload as typed tensors without copying.
    """
    entries = _entries(update)
    if update.checksum is None:
        update.checksum = payload_checksum(update)
    meta = {"version": update.version, "mode": update.mode, "checksum": update.checksum,
            "base_version": update.base_version,
            "tensors": [[n, r, str(t.dtype), list(t.shape), t.numel() * t.element_size()] for n, r, t in entries]}
    pieces = []
    for _, _, t in entries:
        raw = _raw(t)
        pieces.append(raw)
        if _aligned(raw.numel()) != raw.numel():
            pieces.append(torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8))
    return json.dumps(meta, separators=(",", ":")).encode(), pieces


def pack(update: WeightUpdate) -> tuple[bytes, torch.Tensor]:
    """``update`` -> (UTF-8 JSON header, flat uint8 payload) in header order."""
    header, pieces = pack_pieces(update)
    return header, torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def unpack(header: bytes, payload: torch.Tensor) -> WeightUpdate:
    """Inverse of ``pack``; raises ``SyncRejected`` when the payload is shorter or longer than declared."""
    try:
        meta = json.loads(header.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SyncRejected(f"weight update header does not parse ({e}); the update is dropped") from None
    need = sum(_aligned(e[4]) for e in meta["tensors"])
    if payload.numel() != need:
        raise SyncRejected(f"weight update v{meta['version']} is truncated or padded: header declares {need} payload "
                           f"bytes, {payload.numel()} arrived; the update is dropped and a full sync requested")
    upd = WeightUpdate(version=meta["version"], mode=meta["mode"], checksum=meta["checksum"],
                       base_version=meta["base_version"])
    off = 0
    for name, role, dtype, shape, nbytes in meta["tensors"]:
        t = payload[off:off + nbytes].view(DTYPES[dtype]).view(shape)  # a view: the update owns the payload
        off += _aligned(nbytes)
        (upd.tensors if role == "v" else upd.indices)[name] = t
    return upd
