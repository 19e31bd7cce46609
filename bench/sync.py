"""Weight sync on the wire: bytes per sync per mode x transport, against ``rollyard plan``'s prediction.

    .venv/bin/python bench/sync.py                 # small preset + a ~250M-parameter synthetic Llama
    .venv/bin/python bench/sync.py --quick         # small preset + a ~90M synthetic config (2 layers), 1 steady sync
    .venv/bin/python bench/sync.py --json bench/out/sync.json
    .venv/bin/python bench/sync.py --terms [--quick]  # the software cost of one update, term by term (sync_terms.py)

Per model: a trainer copy (fp32, random init) and, for ``lora``, a PEFT adapter (r=8 on
q/k/v/o) on another copy. Between syncs one AdamW step on random gradients at lr 1e-6 (the
realistic regime in which bf16 deltas are sparse). For each rollout dtype (bf16, fp32) and mode
(full, delta, lora) one session: a full(-like) start-up sync, then ``--repeats`` steady syncs,
each published once and moved by every transport:

- ``dist``: ``DistTransport`` (gloo, ``--bucket-mb`` buckets) to a second process that applies it
  to its own rollout copy (staged, checksum-verified); at the end of a session that process's
  weights checksum must equal the trainer's expected weights.
- ``ray``: ``RayTransport`` (``ray.put`` + ``ray.get`` through the local object store, same node),
  applied to a rollout copy in this process.
- ``inprocess``: ``InProcessTransport`` (colocated): reports 0 bytes.

Columns: ``bytes`` = steady-state bytes per sync as the transport reported them (values + indices +
framing); ``plan`` = ``rollyard.plan.bytes.predicted_sync_bytes`` for the same inputs (params, rollout
bytes per param, the tensors the update carries (the wire framing: a header entry each), the measured changed fraction for delta with index bytes per changed element of
the encoding used: 4 for int32 indices, ``1 / (8 f)`` for a bitmask, 0 when tensors go dense; and the adapter / base
parameter ratio for LoRA) -- the plan's formula, not the runtime's code; ``ratio`` = bytes / plan;
``frac`` = fraction of elements a delta carries; ``s/sync`` = publish + wire + staged apply
(mean); ``wire GB/s`` = bytes over the transport's best seconds (send until the receiver has
unpacked it); ``flat GB/s`` = a plain ``torch.distributed`` broadcast of one flat buffer of the
same size between the same two processes, run right after each sync (best of the session): the
transport's limit on this machine; ``vs flat`` = wire GB/s / flat GB/s. CPU times on a shared 2-core machine
are indicative only; the ratios are the point.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from rollyard.model.loading import attach_lora, build_preset, char_tokenizer
from rollyard.sync.apply import Receiver
from rollyard.sync.check import compare_weights, weights_checksum
from rollyard.sync.factory import make_publisher
from rollyard.sync.lora import ADAPTER_SUFFIXES
from rollyard.sync.session import rollout_copy
from rollyard.sync.transport_dist import DistTransport, broadcast_flat
from rollyard.sync.transport_inprocess import InProcessTransport

OP_STOP, OP_UPDATE, OP_FLAT, OP_CHECKSUM = 0, 1, 2, 3
LORA = {"r": 8, "alpha": 16.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}


# ---- models ---------------------------------------------------------------------------------

def synthetic_config(layers: int) -> dict:
    """A Llama-shaped config: hidden 1024, MLP 2816, 16 heads / 8 KV heads, 32k vocabulary, untied."""
    return {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 512,
            "tie_word_embeddings": False}


def build(spec: dict, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if spec.get("preset"):
        return build_preset(spec["preset"], char_tokenizer(), seed=seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(LlamaConfig(**spec["config"]), dtype=torch.float32)


def adamw_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad(set_to_none=True)


# ---- the plan's prediction (one wrapper; plan/ is reworked elsewhere) -------------------------

def plan_bytes(mode: str, params: int, bpp: float, delta_fraction: float = 0.02, index_bytes: float = 0.0,
               lora_fraction: float = 0.005, tensors: float = 0) -> float:
    """``rollyard.plan.bytes.predicted_sync_bytes``: the plan's stable entry point for this bench (values +
    the wire framing of ``tensors`` tensors)."""
    from rollyard.plan.bytes import predicted_sync_bytes

    return predicted_sync_bytes(params, bpp, mode, delta_fraction=delta_fraction, delta_index_bytes=index_bytes,
                                lora_fraction=lora_fraction, tensors=tensors)


# ---- the rollout process (dist receiver) ------------------------------------------------------

def _cmd(op: int = 0, arg: int = 0) -> tuple[int, int]:
    t = torch.tensor([op, arg], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t[0]), int(t[1])


def _is_full_like(upd) -> torch.dtype | None:
    """The rollout dtype of an update that carries every base weight (full, or a full LoRA sync)."""
    base = [t for n, t in upd.tensors.items() if not n.endswith(ADAPTER_SUFFIXES)]
    return base[0].dtype if upd.mode == "full" or (upd.mode == "lora" and base) else None


def rollout_rank(port: int, spec: dict, bucket_bytes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, False), rank=1, world_size=2)
    tx = DistTransport(bucket_bytes, src=0)
    model, rx = build(spec, seed=99).requires_grad_(False), None
    while True:
        op, arg = _cmd()
        if op == OP_STOP:
            break
        if op == OP_FLAT:
            broadcast_flat(arg)
            dist.barrier()
        elif op == OP_CHECKSUM:
            digest = torch.frombuffer(bytearray(bytes.fromhex(weights_checksum(model))), dtype=torch.uint8).clone()
            dist.broadcast(digest, src=1)
        else:
            upd = tx.recv()
            dist.barrier()  # wire done
            dtype = _is_full_like(upd)
            if dtype is not None and (rx is None or next(model.parameters()).dtype != dtype):
                model = model.to(dtype)
                rx = Receiver(model, upd.version)
            rx.apply(upd)
            dist.barrier()  # applied
    dist.destroy_process_group()


# ---- the trainer side -------------------------------------------------------------------------

class Wire:
    """Rank 0's end of the dist pair, a local Ray receiver, and the flat-broadcast baseline."""

    def __init__(self, bucket_bytes: int, use_ray: bool):
        self.dist = DistTransport(bucket_bytes, src=0)
        self.ray = None
        if use_ray:
            import ray

            from rollyard.sync.transport_ray import RayTransport
            if not ray.is_initialized():
                ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
            self.ray = RayTransport()
        self.local: Receiver | None = None

    def dist_sync(self, upd) -> tuple[int, float, float]:
        """(bytes, wire seconds, apply seconds) over dist."""
        _cmd(OP_UPDATE)
        t0 = time.perf_counter()
        nbytes = self.dist.send(upd)
        dist.barrier()
        t1 = time.perf_counter()
        dist.barrier()
        return nbytes, t1 - t0, time.perf_counter() - t1

    def flat(self, nbytes: int) -> float:
        _cmd(OP_FLAT, nbytes)
        t0 = time.perf_counter()
        broadcast_flat(nbytes)
        dist.barrier()
        return time.perf_counter() - t0

    def remote_checksum(self) -> str:
        _cmd(OP_CHECKSUM)
        digest = torch.zeros(32, dtype=torch.uint8)
        dist.broadcast(digest, src=1)
        return bytes(digest.tolist()).hex()

    def ray_sync(self, upd, model_for_local) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        nbytes = self.ray.send(upd)
        got = self.ray.recv()
        t1 = time.perf_counter()
        dtype = _is_full_like(got)
        if dtype is not None:
            self.local = Receiver(rollout_copy(model_for_local, dtype) if self.local is None
                                  else self.local.model.to(dtype), got.version)
        self.local.apply(got)
        return nbytes, t1 - t0, time.perf_counter() - t1


def session(policy, mode: str, dtype: torch.dtype, wire: Wire, repeats: int, seed: int, plain) -> list[dict]:
    """One start-up sync + ``repeats`` steady syncs of ``mode``; rows per transport (steady state)."""
    pub = make_publisher(mode, dtype)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6)
    acc = {t: {"bytes": 0, "wire": 0.0, "apply": 0.0, "best": float("inf")} for t in ("dist", "ray", "inprocess")}
    best_flat = float("inf")
    publish_s, carried, tensors = 0.0, 0, 0
    params = sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    for rep in range(repeats + 1):
        if rep:
            adamw_step(policy, opt, seed + rep)
        t0 = time.perf_counter()
        upd = pub.publish(policy, rep, full=rep == 0)
        t_pub = time.perf_counter() - t0
        results = {"dist": wire.dist_sync(upd)}
        if wire.ray is not None:
            results["ray"] = wire.ray_sync(upd, plain)
        results["inprocess"] = (InProcessTransport().send(upd), 0.0, 0.0)
        if rep:  # steady state only
            publish_s += t_pub
            carried += sum(t.numel() for n, t in upd.tensors.items() if not n.endswith(".scaling"))
            tensors += len(upd.tensors)
            for t, (b, w, a) in results.items():
                acc[t]["bytes"] += b
                acc[t]["wire"] += w
                acc[t]["apply"] += a
                acc[t]["best"] = min(acc[t]["best"], w)
            best_flat = min(best_flat, wire.flat(results["dist"][0]))  # right after, under the same load
    expected = pub.expected(policy)
    if wire.remote_checksum() != weights_checksum(expected):
        raise SystemExit(f"bench: the dist receiver's weights differ from the trainer's after {mode} {dtype}")
    if wire.ray is not None:
        compare_weights(expected, wire.local.model, repeats)
    bpp = torch.empty(0, dtype=dtype).element_size()
    frac = carried / repeats / params
    # index bytes per changed element of the encoding delta.py picks: int32, bitmask, or dense (none)
    index_bytes = 4.0 if frac < 1 / 32 else (1 / (8 * frac) if bpp * (1 - frac) > 1 / 8 else 0.0)
    predicted = plan_bytes(mode, params, bpp, delta_fraction=frac, index_bytes=index_bytes,
                           lora_fraction=adapter / params if adapter else 0.005, tensors=tensors / repeats)
    rows = []
    for t, a in acc.items():
        if t == "ray" and wire.ray is None:
            continue
        nbytes = a["bytes"] / repeats
        wire_s = a["wire"] / repeats
        row = {"mode": mode, "dtype": str(dtype).removeprefix("torch."), "transport": t, "bytes": nbytes,
               "plan": 0.0 if t == "inprocess" else predicted, "frac": frac if mode == "delta" else None,
               "sync_s": publish_s / repeats + wire_s + a["apply"] / repeats, "wire_s": wire_s}
        if t == "dist" and nbytes:
            row.update(flat_gbs=nbytes / best_flat / 1e9, wire_gbs=nbytes / a["best"] / 1e9)
        elif t == "ray" and nbytes:
            row.update(wire_gbs=nbytes / a["best"] / 1e9)
        rows.append(row)
    return rows


def fmt(row: dict) -> str:
    b, p = row["bytes"], row["plan"]
    ratio = f"{b / p:6.3f}" if p else ("   0=0" if b == 0 else "  inf")
    frac = f"{row['frac']:7.2%}" if row["frac"] is not None else "      -"
    gbs = f"{row['wire_gbs']:8.3f}" if "wire_gbs" in row else "       -"
    flat = f"{row['flat_gbs']:8.3f}" if "flat_gbs" in row else "       -"
    vs = f"{row['wire_gbs'] / row['flat_gbs']:6.2f}" if "flat_gbs" in row else "     -"
    secs = f"{row['sync_s']:7.3f}" if row["transport"] != "inprocess" else "      -"
    return (f"{row['mode']:5} {row['dtype']:8} {row['transport']:9} {b / 1e6:10.3f} {p / 1e6:10.3f} {ratio} "
            f"{frac} {secs} {gbs} {flat} {vs}")


HEADER = ("mode  dtype    transport   bytes MB    plan MB  ratio    frac  s/sync wireGB/s flatGB/s vsflat")


def bench_model(name: str, spec: dict, args) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)  # listening before the child starts
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=rollout_rank, args=(store.port, spec, int(args.bucket_mb * 1e6)))
    child.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    rows = []
    try:
        trainer = build(spec, seed=0)
        n = sum(p.numel() for p in trainer.parameters())
        print(f"\n== {name}: {n / 1e6:.1f}M parameters ({args.repeats} steady syncs per session, "
              f"buckets of {args.bucket_mb:g} MB) ==\n{HEADER}", flush=True)
        wire = Wire(int(args.bucket_mb * 1e6), use_ray=not args.no_ray)
        lora_policy = attach_lora(copy.deepcopy(trainer), **LORA)
        for dtype in (torch.bfloat16, torch.float32):
            for mode in ("full", "delta", "lora"):
                policy = lora_policy if mode == "lora" else trainer
                wire.local = None
                for row in session(policy, mode, dtype, wire, args.repeats, seed=17, plain=trainer):
                    row["model"], row["params"] = name, n
                    rows.append(row)
                    print(fmt(row), flush=True)
        _cmd(OP_STOP)
    finally:
        dist.destroy_process_group()
        child.join(timeout=60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~90M synthetic config and 1 steady sync per session")
    ap.add_argument("--layers", type=int, default=None, help="synthetic config layers (default 16: ~250M parameters; --quick 2: ~90M)")
    ap.add_argument("--repeats", type=int, default=None, help="steady syncs per session (default 2; --quick 1)")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="dist transport bucket size")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray object-store transport")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--terms", action="store_true", help="measure the software cost of one update term by term "
                    "(trainer side, per bucket, engine load native and vLLM; bench/sync_terms.py) instead of bytes")
    ap.add_argument("--backends", default="native,vllm", help="--terms: engines to measure (native,vllm)")
    args = ap.parse_args()
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    if args.terms:
        backends = tuple(b for b in args.backends.split(",") if b)
        if not backends or set(backends) - {"native", "vllm"}:
            ap.exit(2, f"{ap.prog}: error: --backends takes native and/or vllm, got {args.backends!r}; "
                       f"fix: e.g. --backends native,vllm\n")
        from sync_terms import main as terms_main

        terms_main(args.quick, args.json, args.threads, backends)
        return
    args.layers = args.layers or (2 if args.quick else 16)
    args.repeats = args.repeats or (1 if args.quick else 2)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = []
    for name, spec in (("small", {"preset": "small"}),
                       (f"synthetic-{args.layers}L", {"config": synthetic_config(args.layers)})):
        rows += bench_model(name, spec, args)
    worst = max((abs(r["bytes"] / r["plan"] - 1) for r in rows if r["plan"]), default=0.0)
    print(f"\nlargest |measured / plan - 1| over byte-moving transports: {worst:.2%} (target: within 5%)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
