"""Weight sync: delta == full bit for bit, LoRA merge == PEFT's, staged apply rejects bad updates,
a bucketed gloo broadcast between two processes, the equality check, the ledger, start-up errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rollyard.model.loading import attach_lora, build_preset, char_tokenizer, export
from rollyard.rollout.engine import RolloutEngine
from rollyard.sync.apply import Receiver
from rollyard.sync.check import WeightsDiffer, compare_weights, weights_checksum
from rollyard.sync.delta import DeltaPublisher, decode_indices, encode_indices
from rollyard.sync.full import FullPublisher
from rollyard.sync.lora import LoraPublisher
from rollyard.sync.session import push_pull, rollout_copy
from rollyard.sync.transport_inprocess import InProcessTransport
from rollyard.sync.wire import SyncRejected, pack, unpack
from rollyard.types import Request

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny(seed: int = 0):
    return build_preset("tiny", char_tokenizer(), seed=seed, max_position_embeddings=64)


def random_steps(model, n: int, lr: float, seed: int) -> None:
    """``n`` AdamW steps on random gradients (a stand-in for training)."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def over_wire(update):
    """What a byte transport delivers: pack, then unpack."""
    header, payload = pack(update)
    return unpack(header, payload)


def test_index_encodings_round_trip():
    g = torch.Generator().manual_seed(0)
    for frac in (0.0, 0.01, 0.03, 0.2, 1.0):
        mask = torch.rand(1001, generator=g) < frac
        enc = encode_indices(mask)
        assert enc.dtype == (torch.uint8 if (1001 + 7) // 8 < 4 * int(mask.sum()) else torch.int32)
        assert torch.equal(decode_indices(enc, 1001), mask.nonzero().view(-1))


def test_buckets_cut_the_payload_at_fixed_offsets():
    from rollyard.sync.transport_dist import buckets

    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 255, (int(n),), generator=g, dtype=torch.uint8) for n in (0, 5, 17, 1, 64, 3)]
    for limit in (1, 4, 16, 1000):
        out = list(buckets(pieces, limit))
        assert all(b.numel() == limit for b in out[:-1]) and 0 < out[-1].numel() <= limit
        assert torch.equal(torch.cat(out), torch.cat(pieces))


@pytest.mark.parametrize("dtype,lr", [(torch.float32, 1e-3), (torch.bfloat16, 1e-6)])
def test_delta_equals_full_bit_for_bit(dtype, lr):
    trainer = tiny()
    via_full, via_delta = rollout_copy(tiny(seed=1), dtype), rollout_copy(tiny(seed=2), dtype)
    full_rx, delta_rx = Receiver(via_full), Receiver(via_delta)
    full_pub, delta_pub = FullPublisher(dtype), DeltaPublisher(dtype)
    carried = []
    for version in range(5):
        if version:
            random_steps(trainer, 1, lr, seed=version)
        full_upd = full_pub.publish(trainer, version)
        full_rx.apply(over_wire(full_upd))
        upd = delta_pub.publish(trainer, version)
        assert pack(upd)[1].numel() <= pack(full_upd)[1].numel()  # a delta never costs more than a full sync
        assert upd.mode == ("full" if version == 0 else "delta")
        carried.append(sum(t.numel() for t in upd.tensors.values()))
        delta_rx.apply(over_wire(upd))
        assert weights_checksum(via_delta) == weights_checksum(via_full)
        for name, p in trainer.named_parameters():  # independent of the publishers: cast by hand
            assert torch.equal(dict(via_delta.named_parameters())[name], p.detach().to(dtype)), name
    # fp32: nearly every element changes each step; bf16 at lr 1e-6: few do
    n = sum(p.numel() for p in trainer.parameters())
    changed = [c / n for c in carried[1:]]
    assert all(f > 0.9 for f in changed) if dtype == torch.float32 else all(0 < f < 0.1 for f in changed)


def test_lora_sync_equals_peft_merge_and_export_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = attach_lora(tiny(), r=4, alpha=8.0, targets=["q_proj", "v_proj"])
    assert all(("lora_" in n) == p.requires_grad for n, p in policy.named_parameters())
    rollout = rollout_copy(tiny(seed=3), torch.float32)
    engine = RolloutEngine(rollout, eos_token_id=2, temperature=0.0, max_concurrent=4, max_cache_tokens=512)
    pub, tx = LoraPublisher(torch.float32), InProcessTransport()
    push_pull(pub, tx, policy, engine, 0, full=True)
    for version in (1, 2):
        random_steps(policy, 2, 1e-2, seed=version)
        upd = pub.publish(policy, version)
        adapter_elems = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        assert sum(t.numel() for t in upd.tensors.values()) == adapter_elems + 2 * 5  # + one scaling per module
        engine.load_weights(over_wire(upd))
    merged = copy.deepcopy(policy).merge_and_unload()
    for name, p in merged.named_parameters():
        assert torch.equal(dict(rollout.named_parameters())[name], p), name
    # the engine's fast path sees the merged weights: greedy decode equals a fresh engine on PEFT's merge
    req = [Request(id="a", prompt_ids=[5, 6, 7, 8], n=1, max_new_tokens=8)]
    fresh = RolloutEngine(merged, eos_token_id=2, temperature=0.0, max_concurrent=4, max_cache_tokens=512)
    assert engine.generate(req)[0][0].completion_ids == fresh.generate(req)[0][0].completion_ids
    export(policy, char_tokenizer(), tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    reloaded = PeftModel.from_pretrained(tiny(), tmp_path / "model" / "adapter").merge_and_unload()
    for name, p in merged.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], p), name
        assert torch.equal(dict(reloaded.named_parameters())[name], p), name


def test_bad_updates_are_rejected_and_old_weights_stay():
    trainer = tiny()
    engine = RolloutEngine(rollout_copy(tiny(seed=1), torch.bfloat16), eos_token_id=2, max_concurrent=4,
                           max_cache_tokens=512)
    pub, tx = DeltaPublisher(torch.bfloat16), InProcessTransport()
    push_pull(pub, tx, trainer, engine, 0, full=True)
    random_steps(trainer, 1, 1e-3, seed=1)
    update = pub.publish(trainer, 1)
    assert update.checksum is None  # in process nothing is hashed; the wire form stamps it
    header, payload = pack(update)
    assert update.checksum is not None and unpack(header, payload).checksum == update.checksum
    before = weights_checksum(engine.model)
    corrupted = payload.clone()
    corrupted[len(corrupted) // 2] ^= 0xFF
    with pytest.raises(SyncRejected, match="checksum"):
        engine.load_weights(unpack(header, corrupted))
    with pytest.raises(SyncRejected, match="truncated"):
        engine.load_weights(unpack(header, payload[:-3]))
    random_steps(trainer, 1, 1e-3, seed=2)  # v1 was lost: the v2 delta builds on a version the engine lacks
    with pytest.raises(SyncRejected, match="on top of v1"):
        engine.load_weights(over_wire(pub.publish(trainer, 2)))
    assert weights_checksum(engine.model) == before and engine.version == 0
    push_pull(pub, tx, trainer, engine, 3)  # the delta is rejected again; the full sync that follows lands
    assert engine.version == 3
    compare_weights(pub.expected(trainer), engine.model, 3)


def test_receiver_rejects_updates_that_do_not_fit_the_model():
    from rollyard.types import WeightUpdate

    rollout = tiny(seed=1)
    rx, before = Receiver(rollout), weights_checksum(rollout)
    full = FullPublisher(torch.float32).publish(tiny(), 1).tensors
    cases = [
        (WeightUpdate(1, "full", tensors={**full, "nope.weight": torch.zeros(1)}), "lacks"),
        (WeightUpdate(1, "full", tensors={**full, "model.norm.weight": torch.zeros(3)}), "shape"),
        (WeightUpdate(1, "full", tensors=dict(list(full.items())[:-1])), "lacks 1 parameters"),
        (WeightUpdate(1, "lora", tensors=LoraPublisher(torch.float32).publish(
            attach_lora(tiny(), r=2, alpha=4.0, targets=["q_proj"]), 1).tensors), "no base weight"),
    ]
    for update, why in cases:
        with pytest.raises(SyncRejected, match=why):
            rx.apply(update)
    assert weights_checksum(rollout) == before and rx.version == 0


def test_equality_check_names_a_planted_one_element_difference():
    trainer = tiny()
    rollout = rollout_copy(tiny(seed=1), torch.bfloat16)
    pub = FullPublisher(torch.bfloat16)
    Receiver(rollout).apply(pub.publish(trainer, 0))
    compare_weights(pub.expected(trainer), rollout, 0)
    w = rollout.model.layers[3].mlp.up_proj.weight
    with torch.no_grad():
        w.view(-1)[17] = w.view(-1)[17] + 0.5
    with pytest.raises(WeightsDiffer, match=r"'model\.layers\.3\.mlp\.up_proj\.weight': max \|diff\| 0\.50?[0-9]* over 1 element"):
        compare_weights(pub.expected(trainer), rollout, 0)


def _dist_worker(rank: int, port: int, out: str, store=None) -> None:
    import torch.distributed as dist

    from rollyard.sync.transport_dist import DistTransport

    torch.set_num_threads(1)
    store = store or dist.TCPStore("127.0.0.1", port, 2, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tx = DistTransport(bucket_bytes=4096, src=0)  # ~100 buckets for the tiny model
    result = {}
    if rank == 0:
        trainer, pub = tiny(), DeltaPublisher(torch.bfloat16)
        for v in range(3):
            random_steps(trainer, 1 if v else 0, 1e-6, seed=v)
            result[v] = {"sent": tx.send(pub.publish(trainer, v)), "checksum": weights_checksum(pub.expected(trainer))}
    else:
        rx = Receiver(rollout_copy(tiny(seed=7), torch.bfloat16))
        for v in range(3):
            upd = tx.recv()
            rx.apply(upd)
            result[v] = {"received": upd.nbytes, "mode": upd.mode, "checksum": weights_checksum(rx.model)}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_bucketed_gloo_broadcast_between_two_processes(tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)  # listening before the child starts
    rollout = mp.get_context("spawn").Process(target=_dist_worker, args=(1, store.port, str(tmp_path / "r")))
    rollout.start()
    _dist_worker(0, store.port, str(tmp_path / "r"), store)  # the trainer rank runs here
    rollout.join(timeout=120)
    assert rollout.exitcode == 0
    sent, got = (json.loads((tmp_path / f"r.{r}").read_text()) for r in (0, 1))
    params = sum(p.numel() for p in tiny().parameters())
    assert [got[v]["mode"] for v in "012"] == ["full", "delta", "delta"]
    for v in "012":
        assert got[v]["checksum"] == sent[v]["checksum"]
        assert got[v]["received"] == sent[v]["sent"]
    assert 2 * params < sent["0"]["sent"] < 2 * params * 1.02  # bf16 values + header + prefix
    assert sent["1"]["sent"] < sent["0"]["sent"] / 4  # a low-lr bf16 delta carries few elements


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if ray.is_initialized():  # another module's session fixture started it: share it
        yield
        return
    ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
    yield
    ray.shutdown()


def _ray_rollout(refs: list, dtype: str) -> str:
    """A Ray task: receive each update by its ref, apply it to its own rollout copy, return the checksum."""
    from rollyard.sync.transport_ray import RayTransport

    rx = Receiver(rollout_copy(tiny(seed=5), getattr(torch, dtype)))
    for ref in refs:
        rx.apply(RayTransport().recv(ref))
    return weights_checksum(rx.model)


@pytest.mark.ray
def test_ray_object_store_delivers_to_another_process(ray_session):
    import ray

    from rollyard.sync.transport_ray import RayTransport

    trainer, pub, tx, refs, sizes = tiny(), DeltaPublisher(torch.bfloat16), RayTransport(), [], []
    for v in range(3):
        random_steps(trainer, 1 if v else 0, 1e-6, seed=v)
        sizes.append(tx.send(pub.publish(trainer, v)))
        refs.append(tx.ref)
    params = sum(p.numel() for p in trainer.parameters())
    assert 2 * params < sizes[0] < 2 * params * 1.02 and 0 < sizes[1] < sizes[0] / 4  # full, then a sparse delta
    paths = os.pathsep.join([SRC, str(Path(__file__).parent)])  # the worker imports this module by name
    remote = ray.remote(_ray_rollout).options(runtime_env={"env_vars": {"PYTHONPATH": paths}})
    assert ray.get(remote.remote(refs, "bfloat16")) == weights_checksum(pub.expected(trainer))


@pytest.mark.ray
def test_ledger_weights_bytes_come_from_the_transport(tmp_path, ray_session):
    from rollyard.config import load_config
    from rollyard.placement import colocated

    cfg = load_config(None, ["sft.auto=false", "steps=3", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                             "rollout.max_new_tokens=4", "data.eval_size=4", "data.train_size=32", "progress=false", "log.plots=false",
                             "reward.num_workers=1", "sync.mode=full", "sync.transport=ray", "rollout.dtype=bf16",
                             "sync.every=2", "sync.check_every=1", f"out_dir={tmp_path}"])
    colocated.train(cfg, tmp_path)
    weights = {}
    for line in (tmp_path / "traffic.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["edge"] == "weights":
            weights[row["step"]] = row["bytes"]
    params = sum(p.numel() for p in tiny().parameters())
    one = 2 * params  # bf16 values of every parameter, the independent floor
    assert weights[2] == 0  # sync.every=2: steps 0 and 2 publish nothing of their own
    assert one < weights[1] < one * 1.02  # one full sync after step 1, framing < 2%
    assert one < weights[0] < one * 1.02  # step 0's entry is the start-up sync
    rollout_versions = [json.loads(r)["version"] for r in (tmp_path / "spans.jsonl").read_text().splitlines()
                        if json.loads(r).get("role") == "rollout"]
    assert rollout_versions == [0, 0, 2]  # samples carry the version the engine holds
    checked = [json.loads(r)["sync/checked"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert checked == [0, 1, 0]  # sync.check_every=1: the one sync (after step 1) was checked


BAD = [
    (["sync.mode=sparse"], "sync.mode='sparse' is not a sync mode"),
    (["sync.transport=nccl"], "sync.transport='nccl' is not a transport"),
    (["sync.mode=delta"], "sync.mode=delta with sync.transport=inprocess"),
    (["model.lora.r=4", "model.lora.targets=[q_proj,c_attn]"], "['c_attn'] not among this model's linear layers"),
]


@pytest.mark.parametrize("overrides,needle", BAD)
def test_bad_sync_settings_fail_at_start_up_in_one_line(tmp_path, capsys, overrides, needle):
    from rollyard.cli import main

    assert main(["train", f"out_dir={tmp_path}", "sft.auto=false", *overrides]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_bad_sync_setting_exits_2_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    res = subprocess.run([sys.executable, "-m", "rollyard.cli", "train", f"out_dir={tmp_path}", "sync.mode=delta"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "sync.mode=delta" in res.stderr, res.stderr
