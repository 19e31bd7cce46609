"""The software cost of one weight update on this machine, term by term (``bench/sync.py --terms``).

Each term of the plan's sync model (``rollyard.plan.mechanisms.sync_time``) measured through
rollyard's own code, for the native engine and the vLLM engine:

- trainer side: ``FullPublisher.publish`` (copy / cast into the rollout dtype) + ``wire.pack_pieces``
  (header, sha256 payload checksum), per tensor and per byte;
- per bucket: ``DistTransport`` (gloo) between two processes, one 32 MB update cut into buckets of
  32 MB, 1 MB and 64 kB: seconds per extra bucket; and the same transport's seconds per byte;
- engine side: ``wire.unpack`` + the engine's ``load_weights(update)`` -- native: ``Receiver`` stage
  (checksum verified) + copy into the engine's tensors; vLLM: the same on the mirror, then
  ``collective_rpc(reload_weights)`` of the whole model in the in-process vLLM worker -- per
  tensor, per byte, and the rest, paid once per update (``pause_s``: the step-boundary pause,
  bookkeeping, the RPC and reload set-up).

Per tensor vs per byte: each term is timed on three Llama-shaped models (``CONFIGS``): two with the
same bytes in 867 vs 12 tensors (many small vs few big) and one with the same 12 tensors in about
4x the bytes; ``t = once + per_tensor x tensors + per_byte x bytes`` is solved from the differences
(``split``), each time the fastest of ``repeats`` after a warm-up (on a shared machine other
processes only add time). The cast: the trainer side for an fp32 rollout copy (a copy, the CPU
default) and for bf16 (a cast), as bytes read + written per second.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollyard.sync.full import FullPublisher
from rollyard.sync.transport_dist import DistTransport
from rollyard.sync.wire import pack_pieces, unpack
from rollyard.types import WeightUpdate

# name -> (layers, hidden, intermediate); head_dim 64 (vLLM's CPU kernels), one KV head, 512 tokens, untied.
# many-small and wide hold the same bytes in 867 vs 12 tensors (per tensor); wide and wide-x4 the same 12
# tensors in 4x the bytes (per byte).
CONFIGS = {
    "many-small": (96, 64, 128),  # 867 tensors, 4.0M parameters
    "wide": (1, 576, 1536),  # 12 tensors, 4.0M parameters
    "wide-x4": (1, 1152, 3072),  # 12 tensors, 14.6M parameters
}
BUCKETS = (32_000_000, 1_000_000, 64_000)  # bytes per bucket for the per-bucket term
PAYLOAD = 32_000_000


def llama(layers: int, hidden: int, inter: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    conf = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=1, vocab_size=512,
                       max_position_embeddings=128, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(conf, dtype=torch.float32).requires_grad_(False)


def best_s(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timings after a warm-up: on a shared machine other processes only
    ever add time, so the minimum is the least disturbed figure."""
    fn()  # warm-up: allocator, first-call paths
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def split(t: dict[str, float], sizes: dict[str, tuple[int, int]]) -> tuple[float, float, float]:
    """(once, per tensor, per unit of size) from the three models: per tensor from many-small vs wide
    (equal bytes), per unit from wide-x4 vs wide (equal tensors), once what wide leaves over."""
    (n_m, x_m), (n_w, x_w), x_4 = sizes["many-small"], sizes["wide"], sizes["wide-x4"][1]
    per_x = (t["wide-x4"] - t["wide"]) / (x_4 - x_w)
    per_n = (t["many-small"] - t["wide"] - per_x * (x_m - x_w)) / (n_m - n_w)
    return t["wide"] - per_n * n_w - per_x * x_w, per_n, per_x


# ---- trainer side ---------------------------------------------------------------------------

def trainer_side(model, dtype: torch.dtype, repeats: int) -> float:
    pub = FullPublisher(dtype)
    state = {"v": 0}

    def once():
        state["v"] += 1
        pack_pieces(pub.publish(model, state["v"]))
    return best_s(once, repeats)


# ---- engine side ----------------------------------------------------------------------------

def engine_of(backend: str, model):
    if backend == "vllm":
        from rollyard.rollout.vllm import VllmEngine
        return VllmEngine(model, eos_token_id=1, max_concurrent=4, max_cache_tokens=512)
    from rollyard.rollout.engine import RolloutEngine
    return RolloutEngine(model, eos_token_id=1, max_concurrent=4, max_cache_tokens=512)


def engine_side(engine, trainer, repeats: int) -> float:
    """unpack + load_weights of full fp32 updates (each a new version, checksum stamped as on a wire)."""
    pub = FullPublisher(torch.float32)
    wires = []
    for v in range(repeats + 1):
        upd = pub.publish(trainer, engine.version + 1 + v)
        header, pieces = pack_pieces(upd)
        wires.append((header, torch.cat(pieces)))
    it = iter(wires)

    def once():
        header, payload = next(it)
        engine.load_weights(unpack(header, payload))
    return best_s(once, repeats)


# ---- per bucket (two processes, gloo) --------------------------------------------------------

def _receiver(port: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, False), rank=1, world_size=2)
    for _ in range(rounds):
        spec = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(spec, src=0)
        DistTransport(int(spec), src=0).recv()
        dist.barrier()
    dist.destroy_process_group()


def per_bucket(repeats: int) -> dict:
    """Seconds of one update over gloo at each (payload, bucket size): per bucket and per byte."""
    plan = [(PAYLOAD, b) for b in BUCKETS] + [(PAYLOAD // 4, BUCKETS[0])]
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)  # listening before the child starts
    child = mp.get_context("spawn").Process(target=_receiver, args=(store.port, len(plan) * (repeats + 1)))
    child.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    rows = []
    try:
        for nbytes, bucket in plan:
            upd = WeightUpdate(version=1, mode="full", tensors={"w": torch.zeros(nbytes // 4)})
            tx = DistTransport(bucket, src=0)

            def once(tx=tx, upd=upd, bucket=bucket):
                dist.broadcast(torch.tensor([bucket], dtype=torch.int64), src=0)
                tx.send(upd)
                dist.barrier()
            rows.append({"bytes": nbytes, "bucket_bytes": bucket, "buckets": -(-nbytes // bucket),
                         "s": best_s(once, repeats)})
    finally:
        dist.destroy_process_group()
        child.join(timeout=60)
    full = [r for r in rows if r["bytes"] == PAYLOAD]
    few, many = full[0], full[-1]
    per_b = (many["s"] - few["s"]) / (many["buckets"] - few["buckets"])
    small = rows[-1]
    per_byte = (few["s"] - small["s"]) / (few["bytes"] - small["bytes"])
    return {"rows": rows, "per_bucket_s": per_b, "wire_bytes_per_s": 1 / per_byte if per_byte > 0 else None}


# ---- the whole table --------------------------------------------------------------------------

def measure(quick: bool, backends: tuple[str, ...] = ("native", "vllm")) -> dict:
    repeats = 3 if quick else 15
    configs = {n: llama(*shape) for n, shape in CONFIGS.items()}
    sizes = {n: (sum(1 for _ in m.parameters()), sum(p.numel() for p in m.parameters())) for n, m in configs.items()}
    out: dict = {"repeats": repeats, "configs": {n: {"layers": CONFIGS[n][0], "hidden": CONFIGS[n][1],
                                                      "tensors": sizes[n][0], "params": sizes[n][1]}
                                                  for n in configs}}
    # trainer side: fp32 master weights -> an fp32 rollout copy (a copy) and a bf16 one (a cast)
    for dtype, bpp in ((torch.float32, 4), (torch.bfloat16, 2)):
        t = {n: trainer_side(m, dtype, repeats) for n, m in configs.items()}
        once, per_tensor, per_param = split(t, sizes)
        key = "trainer_" + str(dtype).removeprefix("torch.")
        out[key] = {"seconds": t, "once_s": once, "per_tensor_s": per_tensor,
                    "cast_bw": (4 + bpp) / per_param if per_param > 0 else None}
    out["bucket"] = per_bucket(repeats)
    for backend in backends:
        t = {}
        for n, m in configs.items():
            eng = engine_of(backend, llama(*CONFIGS[n]))
            try:
                t[n] = engine_side(eng, m, repeats)
            finally:
                if hasattr(eng, "close"):
                    eng.close()
        once, per_tensor, per_param = split(t, sizes)
        out["engine_" + backend] = {"seconds": t, "once_s": once, "per_tensor_s": per_tensor,
                                    "load_bw": 2 * 4 / per_param if per_param > 0 else None}
    out["cpu_sync"] = cpu_sync(out, backends)
    return out


def cpu_sync(m: dict, backends) -> dict:
    """The plan's ``inputs.CPU_SYNC`` from the measurements (fp32 rollout copy: the CPU default)."""
    tr = m["trainer_float32"]
    return {b: {"pause_s": max(0.0, m[f"engine_{b}"]["once_s"]) + max(0.0, tr["once_s"]),
                "send_per_tensor_s": max(0.0, tr["per_tensor_s"]),
                "load_per_tensor_s": max(0.0, m[f"engine_{b}"]["per_tensor_s"]),
                "per_bucket_s": max(0.0, m["bucket"]["per_bucket_s"]),
                "cast_bw": tr["cast_bw"], "load_bw": m[f"engine_{b}"]["load_bw"]} for b in backends}


def us(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e6:9.1f} us"


def gbs(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:7.2f} GB/s"


def report(m: dict) -> list[str]:
    lines = ["models (Llama-shaped, fp32): " + ", ".join(f"{n} {c['tensors']} tensors / {4 * c['params'] / 1e6:.0f} MB"
                                                         for n, c in m["configs"].items()),
             f"{'term':44} {'once':>12} {'per tensor':>12} {'per byte (as a rate)':>22}"]
    for key, what in (("trainer_float32", "trainer: publish fp32 + pack (copy)"),
                      ("trainer_bfloat16", "trainer: publish bf16 + pack (cast)")):
        t = m[key]
        lines.append(f"{what:44} {us(t['once_s']):>12} {us(t['per_tensor_s']):>12} "
                     f"{gbs(t['cast_bw']):>14} (r+w)")
    b = m["bucket"]
    lines.append(f"{'dist (gloo) transport, per bucket':44} {'':>12} {'':>12} {gbs(b['wire_bytes_per_s']):>14} "
                 f"+ {b['per_bucket_s'] * 1e6:.0f} us/bucket")
    for backend in ("native", "vllm"):
        e = m.get("engine_" + backend)
        if e:
            lines.append(f"{'engine ' + backend + ': unpack + load_weights':44} {us(e['once_s']):>12} "
                         f"{us(e['per_tensor_s']):>12} {gbs(e['load_bw']):>14} (2 x bytes)")
    lines.append("seconds per update by model: " + json.dumps(
        {k: {n: round(x, 6) for n, x in v["seconds"].items()} for k, v in m.items()
         if isinstance(v, dict) and "seconds" in v}))
    lines.append("plan constants (inputs.CPU_SYNC): " + json.dumps(m["cpu_sync"], default=float))
    return lines


def main(quick: bool, json_path: str | None, threads: int, backends: tuple[str, ...]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    m = measure(quick, backends)
    m["wall_s"] = time.perf_counter() - t0
    m["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    m["threads"] = threads
    for line in report(m):
        print(line, flush=True)
    print(f"({m['wall_s']:.0f} s, {threads} thread(s), fastest of {m['repeats']} per figure)")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(m, indent=1, default=float))
