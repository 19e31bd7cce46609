"""`rollyard plan`: the runbook's figures exactly, other configurations against hand-worked values,
the placement simulator, the decision tree, the what-ifs, and bad input."""

import json
import math
from pathlib import Path

import pytest

from rollyard.plan import hardware as H
from rollyard.plan import mechanisms as M
from rollyard.plan.bytes import predicted_sync_bytes
from rollyard.plan.command import plan_main
from rollyard.plan.inputs import PlanError, load_plan
from rollyard.plan.planner import make_plan, predicted_steps_per_hour
from rollyard.plan.simulate import simulate, steady_state, timeline_text
from rollyard.plan.whatif import TailWhatIf, bound_by_floor, budget_whatif, tail_whatif

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plan_runbook.toml"
GB = 1e9

RUNBOOK_LINES = [
    "weight sync per step : full bf16 28.00 GB | delta (2%) 0.56 GB | LoRA (0.5%) 0.14 GB",
    "rollout payload      : 8.4M tokens = 0.067 GB (ids + logprobs)",
    "gradient all-reduce  : 49.00 GB/rank/step at DP=8 (ring)",
    "per hour at 60 syncs: full 1.68 TB | delta 33.6 GB | LoRA 8.4 GB",
]


def run_plan(capsys, *argv):
    code = plan_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv", [[], [str(EXAMPLE)]])
def test_runbook_defaults_print_the_runbook_figures(capsys, argv):
    code, out, _ = run_plan(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    for line in RUNBOOK_LINES:
        assert line in lines


def test_runbook_defaults_json_values(capsys):
    code, out, _ = run_plan(capsys, str(EXAMPLE), "--json")
    assert code == 0
    doc = json.loads(out)
    b, h = doc["bytes"], doc["per_hour"]
    assert b["full_sync"] == pytest.approx(28.00 * GB)
    assert b["delta_sync"] == pytest.approx(0.56 * GB)
    assert b["lora_sync"] == pytest.approx(0.14 * GB)
    assert b["rollout_tokens"] == 256 * 8 * 4096 and round(b["rollout_tokens"] / 1e6, 1) == 8.4
    assert round(b["rollout_payload"] / GB, 3) == 0.067
    assert b["gradient_per_rank"] == pytest.approx(49.00 * GB)
    assert h["full_sync"] == pytest.approx(1.68e12)
    assert h["delta_sync"] == pytest.approx(33.6 * GB)
    assert h["lora_sync"] == pytest.approx(8.4 * GB)
    # The runbook's ratios: 50x delta, 200x LoRA; rollout payload is noise next to the weights.
    assert b["full_sync"] / b["delta_sync"] == pytest.approx(50) and b["full_sync"] / b["lora_sync"] == pytest.approx(200)
    assert b["rollout_payload"] < 0.005 * b["full_sync"]
    # Each sync mode's time on each tier: one link (rollout.tp = 1), 28 buckets of 1 GB, pipelined, so
    # the wire sets it, plus the other sides' share of one bucket: the trainer's copy into the send
    # buffer (14e9 x (2 + 2) B / 3.35e12 = 16.7 ms; DDP: nothing to gather) and the engine's copy
    # (2 x 28e9 / 3.35e12 = 16.7 ms), each / 28; once per sync the native engine's pause at a step
    # boundary (5.8 ms, the receiver rule "copy"; the runbook gives no tensor count, so no per-tensor term).
    # No cross-node control: that floor (0.542 s) is NeMo-RL's anchor of a collective into load_weights, and the
    # native engine's copy publishes none (v5: the floor only where the mechanism has one; v4 added 0.542 s).
    copy, pause = 56e9 / 3.35e12, 5.8e-3
    assert doc["sync_times"]["full"]["rdma"] == pytest.approx(28e9 / 50e9 + 2 * copy / 28 + pause)
    # A delta (0.56 GB: one bucket, so the sides add) adds its export/compare on the 8 trainer GPUs:
    # 3 x 28e9 / (8 x 3.35e12) = 3.13 ms; its copies are 2% of the full sync's.
    assert doc["sync_times"]["delta"]["commodity"] == pytest.approx(0.56e9 / 1.25e9 + 3 * 28e9 / (8 * 3.35e12)
                                                                    + 0.02 * 2 * copy + pause)
    edges = {e["name"]: e for e in doc["edges"]}
    assert set(edges) == {"prompts", "samples", "rewards", "ref_logprobs", "teacher_logprobs", "weights", "gradients", "gather", "tools"}
    assert edges["samples"]["bytes_per_step"] == pytest.approx(67_108_864)
    assert "# Decision record" in doc["decision_record"]


def test_other_configuration_hand_worked(capsys):
    # 7B bf16, LoRA 1%, delta 3%, DP 4, 64 x 4 x 1024 tokens, 30 syncs/h:
    #   full 14 GB, delta 0.42 GB, LoRA 0.14 GB, rollout 262,144 tokens x 8 B = 2,097,152 B,
    #   gradient 2 x 3/4 x 14 GB = 21 GB, per hour 420 GB / 12.6 GB / 4.2 GB, gradient 630 GB/h.
    code, out, _ = run_plan(capsys, "policy.params=7e9", "policy.lora_fraction=0.01", "policy.delta_fraction=0.03",
                            "trainer.dp=4", "rollout.prompts=64", "rollout.samples=4", "rollout.avg_tokens=1024",
                            "--set", "sync.per_hour=30", "--json")
    assert code == 0
    doc = json.loads(out)
    b, h = doc["bytes"], doc["per_hour"]
    assert b["full_sync"] == pytest.approx(14e9) and b["delta_sync"] == pytest.approx(0.42e9)
    assert b["lora_sync"] == pytest.approx(0.14e9) and b["rollout_payload"] == 2_097_152
    assert b["gradient_per_rank"] == pytest.approx(21e9)
    assert h["full_sync"] == pytest.approx(420e9) and h["delta_sync"] == pytest.approx(12.6e9)
    assert h["lora_sync"] == pytest.approx(4.2e9) and h["gradient_per_rank"] == pytest.approx(630e9)
    code, out, _ = run_plan(capsys, "policy.params=7e9", "policy.lora_fraction=0.01", "policy.delta_fraction=0.03",
                            "trainer.dp=4", "rollout.prompts=64", "rollout.samples=4", "rollout.avg_tokens=1024",
                            "sync.per_hour=30")
    assert "weight sync per step : full bf16 14.00 GB | delta (3%) 0.42 GB | LoRA (1%) 0.14 GB" in out
    assert "gradient all-reduce  : 21.00 GB/rank/step at DP=4 (ring)" in out
    assert "per hour at 30 syncs: full 420.00 GB | delta 12.6 GB | LoRA 4.2 GB" in out


def test_fp8_70b_with_delta_indexes_and_dp1():
    # 70B at 1 byte: full 70 GB; delta 2% with 8-byte int64 indexes: 70e9 x 0.02 x (1 + 8) = 12.6 GB;
    # DP=1 has no gradient all-reduce.
    plan = make_plan(load_plan(None, ["policy.params=70e9", "policy.bytes_per_param=1", "policy.delta_index_bytes=8",
                                      "trainer.dp=1"]))
    assert plan.bytes.full_sync == pytest.approx(70e9)
    assert plan.bytes.delta_sync == pytest.approx(12.6e9)
    assert plan.bytes.gradient_per_rank == 0
    # Prompts edge: 256 prompts x 512 tokens x 4 B.
    plan = make_plan(load_plan(None, ["rollout.prompt_tokens=512"]))
    assert {e.name: e.bytes_per_step for e in plan.edges}["prompts"] == 256 * 512 * 4


def test_estimated_phase_times_hand_worked():
    # train = 6 x P x tokens / (FLOP/s x GPUs): 6 x 1e9 x (10 x 2 x (100 + 400)) / (1e14 x 2) = 0.3 s
    # reference = a third of that; rollout = tokens x bytes/token / (bandwidth x GPUs):
    #   8000 tokens x 1e9 B / (1e12 B/s x 4) = 2 s
    plan = make_plan(load_plan(None, ["policy.params=1e9", "trainer.dp=2", "trainer.flops_per_gpu=1e14",
                                      "rollout.prompts=10", "rollout.samples=2", "rollout.avg_tokens=400",
                                      "rollout.prompt_tokens=100", "rollout.bytes_per_decoded_token=1e9",
                                      "rollout.mem_bandwidth=1e12", "rollout.gpus=4"]))
    assert plan.phases.train == pytest.approx(0.3)
    assert plan.phases.reference == pytest.approx(0.1)
    assert plan.phases.rollout == pytest.approx(2.0)


def test_a_colocated_cpu_native_sync_is_the_in_process_refresh_hand_worked():
    """A colocated CPU run's native engine reads the trainer's module: its sync is one cast-and-layout pass, nothing
    sent, paused or loaded per tensor. 134.5M fp32 parameters read and written: 1.076 GB at 21 GB/s = 0.0512 s (the
    bench's fp32 copy after a release measured 0.051-0.054 s); at sync.cast_bw=42e9 half. vLLM's and a LoRA policy's
    colocated syncs keep the full sync's terms (the engine takes tensors there)."""
    from rollyard.plan.bytes import colocated_breakdown
    cpu = ["rollout.device=cpu", "rollout.backend=native", "policy.params=134.5e6", "policy.bytes_per_param=4",
           "policy.weight_tensors=272"]
    t = colocated_breakdown(load_plan(None, cpu))
    assert t.total == pytest.approx(134.5e6 * 8 / 21e9) and t.cast_s == t.total
    assert t.pause_s == t.load_tensor_s == t.copy_s == t.wire_s == 0.0
    assert colocated_breakdown(load_plan(None, [*cpu, "sync.cast_bw=42e9"])).total == pytest.approx(t.total / 2)
    for other in (["rollout.backend=vllm"], ["policy.lora=true"]):
        full = colocated_breakdown(load_plan(None, [*cpu, *other]))
        assert full.pause_s > 0 and full.total > 5 * t.total  # a pause and per-tensor loads on top of the copies


@pytest.mark.parametrize("R, T", [(60, 30), (30, 60)])
def test_simulator_steps_per_hour_hand_worked(R, T):
    # The lesson's model: colocated R + T, disaggregated max(R, T) + sync, async max(R, T).
    assert simulate("colocated", R, T, 0).steps_per_hour == pytest.approx(3600 / 90)  # 40
    dis = simulate("disaggregated", R, T, 5)
    assert dis.period_s == pytest.approx(65) and dis.steps_per_hour == pytest.approx(3600 / 65)  # 55.38
    asy = simulate("async", R, T, 5)
    assert asy.steps_per_hour == pytest.approx(60)
    assert dis.max_staleness == 1 and asy.max_staleness == 1
    assert simulate("colocated", R, T, 0).max_staleness == 0


def test_simulator_reward_reference_bound_and_cadence():
    # Colocated serializes everything: 30 + 3 + 10 + 60 = 103 s.
    assert simulate("colocated", 30, 60, 0, reward=3, reference=10).period_s == pytest.approx(103)
    # Disaggregated: the trainer's reference + train (70 s) is the long side: 70 + 5 = 75 s.
    assert simulate("disaggregated", 30, 60, 5, reward=3, reference=10).period_s == pytest.approx(75)
    # Async with bound 0 is on-policy: rollout waits for train + sync every step: 60 + 30 + 5 = 95 s.
    on = simulate("async", 60, 30, 5, staleness_bound=0, steps=8)
    assert on.period_s == pytest.approx(95) and on.max_staleness == 0
    # Disaggregated with a sync every 2 steps and lag up to 2: one 5 s sync per two 60 s steps -> 62.5 s/step.
    sparse = simulate("disaggregated", 60, 30, 5, sync_every=2, staleness_bound=2, steps=8)
    assert sparse.period_s == pytest.approx(62.5) and sparse.max_staleness == 2
    # With lag 1 the odd versions never ship, so every other batch waits for train + sync:
    # two steps per 60 + 60 + 30 + 5 = 155 s.
    tight = simulate("disaggregated", 60, 30, 5, sync_every=2, staleness_bound=1, steps=8)
    assert tight.period_s == pytest.approx(77.5) and tight.max_staleness == 1
    # Deterministic and drawable.
    assert simulate("async", 60, 30, 5).events == simulate("async", 60, 30, 5).events
    lines = timeline_text(simulate("disaggregated", 60, 30, 5), width=40)
    assert lines[0].startswith("  rollout ") and "0" in lines[0] and "." in lines[1]


def test_decision_tree_paths():
    small = make_plan(load_plan(None, ["policy.params=1.5e9"]))
    assert small.placement == "colocated" and small.edges[4].bytes_per_step == 0  # IPC handle, no weight bytes
    assert small.decision.tree[0].answer == "yes"
    # Rollout-dominated (rollout 300 s vs train 60 s) with lag allowed -> async.
    ro = make_plan(load_plan(None, ["phases.rollout_s=300", "phases.train_s=60", "phases.reference_s=0"]))
    assert ro.placement == "async"
    assert ("rollout", "sync") in {(a, b) for a, b, _ in ro.decision.overlaps}
    # Same, but on-policy (bound 0): not async; the model fits one node, so equal hardware decides,
    # and on-policy split pools only take turns (R + T + sync on fewer GPUs each): colocated.
    onp = make_plan(load_plan(None, ["phases.rollout_s=300", "phases.train_s=60", "phases.reference_s=0",
                                     "sync.staleness_bound=0"]))
    assert onp.placement == "colocated"
    assert onp.equal["disaggregated"]["best"].step_s > onp.equal["colocated"]["best"].step_s
    # Forced placement keeps the tree's recommendation in the record.
    # The runbook workload fits one node (252 GB of training state < 640 GB) and is no prototype,
    # rollout is not dominant: no branch says yes, so equal hardware decides among what bound 1
    # allows: async 234.9 s < disaggregated 281.8 s < colocated 346.8 s on 16 GPUs.
    forced = make_plan(load_plan(None, ["placement=colocated"]))
    assert forced.placement == "colocated" and forced.decision.recommended == "async"
    assert make_plan(load_plan(None, ["sync.staleness_bound=0"])).decision.recommended in ("colocated", "disaggregated")


def test_sync_mode_choice_follows_the_fabric():
    # 28 GB over commodity (1.25 GB/s) = 22.4 s, over 5% of a ~294 s step -> delta.
    assert make_plan(load_plan(None, ["network.sync_link=commodity"])).decision.sync_mode == "delta"
    assert make_plan(load_plan(None, [])).decision.sync_mode == "full"  # 0.56 s over RDMA
    assert make_plan(load_plan(None, ["policy.lora=true"])).decision.sync_mode == "lora"
    custom = make_plan(load_plan(None, ["network.custom={slow: 1e8}", "network.sync_link=slow", "sync.receiver=none", "sync.fixed_s=0"]))
    assert custom.sync_times["full"]["slow"] == pytest.approx(280.0 + 2 * (56e9 / 3.35e12) / 28)  # + fill/drain


def test_budget_whatif_hand_worked():
    shares = {"rollout": 0.7, "train": 0.2, "reference": 0.05, "sync": 0.03, "algorithm": 0.02}
    w = budget_whatif(shares, 100.0, ["prefix_caching"])  # rollout 70 s / 3
    assert w.after["rollout"] == pytest.approx(70 / 3)
    assert w.new_step_s == pytest.approx(30 + 70 / 3) and w.win == pytest.approx(100 / (30 + 70 / 3))
    w = budget_whatif(shares, 100.0, ["prefix_caching", "continuous_batching", "sync_overlap"], {"prefix_caching": 5})
    assert w.after["rollout"] == pytest.approx(7.0) and w.after["sync"] == 0
    assert w.new_step_s == pytest.approx(7 + 20 + 5 + 2)
    with pytest.raises(PlanError, match="did you mean 'prefix_caching'"):
        budget_whatif(shares, 100.0, ["prefix_cache"])


def test_tail_batching_whatif():
    kw = {"prompts": 8, "samples": 2, "overprovision": 0.25, "steps": 40, "seed": 0, "cap": 1000, "rollout_s": 10.0}
    flat = tail_whatif(lengths=[100], **kw)
    assert flat.speedup == pytest.approx(1.0) and flat.plain_bubble == pytest.approx(0.0)
    assert flat.plain_rollout_s == pytest.approx(10.0)
    # 5% of responses are 10x longer: a plain round almost always waits for one; tail batching
    # defers those prompts to long rounds (one per 4 short rounds at 25% over-provisioning).
    skew = tail_whatif(lengths=[100] * 19 + [1000], **kw)
    assert skew.long_rounds >= 1 and skew.short_rounds > skew.long_rounds
    assert skew.tail_round_tokens < skew.plain_round_tokens and skew.speedup > 1.5
    assert skew.tail_bubble < skew.plain_bubble
    assert tail_whatif(lengths=[100] * 19 + [1000], **kw) == skew  # deterministic


def test_out_dir_files_and_png(tmp_path, capsys):
    out = tmp_path / "plan"
    code, text, _ = run_plan(capsys, str(EXAMPLE), "--out", str(out))
    assert code == 0 and "wrote" in text
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = (out / "decision_record.md").read_text()
    for section in ("## Placement", "## Sync mode", "## Staleness bound", "## Overlaps that must hold",
                    "## Rate matching"):
        assert section in record
    assert "28.00 GB" in record and "560.00 MB" in record
    assert "disaggregated" in (out / "timeline.txt").read_text()
    assert json.loads((out / "plan.json").read_text())["bytes"]["full_sync"] == pytest.approx(28e9)
    # The resolved inputs load back as a plan file (review --plan accepts them).
    assert load_plan(out / "plan.yaml").policy.params == 14e9


def test_lengths_from_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "lengths.jsonl").write_text("".join(json.dumps({"step": s, "response_lengths": [5, 9, 40, 6]}) + "\n"
                                               for s in range(3)))
    code, out, _ = run_plan(capsys, "--lengths-from", str(run), "--json")
    assert code == 0
    tail = json.loads(out)["tail_whatif"]
    assert tail["max_length"] == 40 and "12 responses" in tail["source"]


def test_yaml_plan_and_overrides_beat_the_file(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("policy:\n  params: 7e9\ntrainer:\n  dp: 2\n")
    p = load_plan(f, ["trainer.dp=4"])
    assert p.policy.params == 7e9 and p.trainer.dp == 4


@pytest.mark.parametrize("argv, words", [
    (["policy.parms=1e9"], ["unknown plan field 'policy.parms'", "did you mean 'policy.params'"]),
    (["rollout.sample=4"], ["'rollout.sample'", "'rollout.samples'"]),
    (["trainer.dp=0"], ["trainer.dp", "greater than or equal to 1"]),
    (["network.sync_link=infiniband"], ["network.sync_link = 'infiniband' is not a tier", "rdma"]),
    (["sync.every_steps=4", "sync.staleness_bound=1"], ["sync.every_steps = 4", "staleness_bound = 1"]),
    (["budget.optimizations=[prefix_cache]"], ["unknown optimization 'prefix_cache'", "prefix_caching"]),
    (["/nonexistent/plan.toml"], ["plan file /nonexistent/plan.toml does not exist"]),
    (["--lengths-from", "/nonexistent/run"], ["does not exist"]),
])
def test_bad_input_is_one_clear_error(capsys, argv, words):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("rollyard plan: error:") and "Traceback" not in err
    for w in words:
        assert w in err


def test_unknown_field_in_a_plan_file(tmp_path, capsys):
    f = tmp_path / "p.toml"
    f.write_text("[rollout]\nbytes_per_tok = 8\n")
    code, _, err = run_plan(capsys, str(f))
    assert code == 2 and "'rollout.bytes_per_token'" in err


def test_fields_listing_documents_every_field(capsys):
    code, out, _ = run_plan(capsys, "--fields")
    assert code == 0
    lines = out.splitlines()
    assert any(l.startswith("policy.params = 14000000000.0 [> 0") and "[count]" in l for l in lines)
    assert all("#" in l and l.split("#", 1)[1].strip() for l in lines)


def test_cli_dispatch(capsys):
    from rollyard.cli import main
    assert main(["plan", "--json"]) == 0
    assert math.isclose(json.loads(capsys.readouterr().out)["bytes"]["full_sync"], 28e9)


@pytest.mark.parametrize("example", sorted(EXAMPLE.parent.glob("plan_*.toml")), ids=lambda p: p.name)
def test_every_example_plan_prices(example, capsys):
    code, out, err = run_plan(capsys, str(example), "--json")
    assert code == 0, err
    doc = json.loads(out)  # strict JSON: no Infinity anywhere
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in the plan"))
    assert doc["decision"]["placement"] in ("colocated", "disaggregated", "async")


def test_lora_crosssite_example_hand_worked(capsys):
    # 8e9 x 0.005 x 2 B = 80 MB per LoRA sync; over 1.25 GB/s = 64 ms (full would be 12.8 s).
    doc = json.loads(run_plan(capsys, str(EXAMPLE.parent / "plan_lora_crosssite.toml"), "--json")[1])
    assert doc["decision"]["sync_mode"] == "lora"
    assert doc["bytes"]["lora_sync"] == pytest.approx(80e6)
    # One bucket: wire + the trainer's and the engine's copies (2 x 80e6 B / 3.35e12 each) add, + the native
    # engine's pause at a step boundary (5.8 ms, receiver rule "copy"; no tensor count given); no cross-node
    # control floor: the copy mechanism publishes none (v4 added 0.542 s).
    once = 5.8e-3
    assert doc["sync_times"]["lora"]["commodity"] == pytest.approx(0.064 + 2 * 160e6 / 3.35e12 + once)
    assert doc["sync_times"]["full"]["commodity"] == pytest.approx(12.8 + 2 * 32e9 / 3.35e12 / 16 + once)  # 16 buckets
    assert {"a": "rollout", "b": "reward", "why": "reward scoring is streamed while decode continues"} \
        in doc["decision"]["overlaps"]
    assert doc["budget_whatif"]["after"]["reward"] == 0  # verifier dispatcher: off the critical path


# ---- v2: mechanisms against hand-worked values ----


Z90 = 1.2815515655446004  # standard normal 0.9 quantile (table value)


def test_expected_longest_is_the_order_statistic_quantile():
    # 9 responses: the 1 - 1/10 = 0.9 quantile. Lognormal with mean 100, sigma 0.5:
    # mu = ln 100 - 0.5^2 / 2 = 4.48017, so exp(4.48017 + 0.5 x 1.28155) = 167.5 tokens.
    assert M.expected_longest(9, mean=100, sigma=0.5, cap=1e9) == pytest.approx(math.exp(4.605170186 - 0.125 + 0.5 * Z90))
    assert M.expected_longest(9, mean=100, sigma=0.5, cap=150) == 150  # the engine's cap clips it
    # Measured lengths 1..8, 3 responses: the 0.75 quantile is the 7th of 8 sorted values.
    assert M.expected_longest(3, mean=1, sigma=1, cap=100, lengths=[8, 1, 2, 3, 4, 5, 6, 7]) == 7


def test_decode_round_floor_and_bubble_hand_worked():
    # 40 sequences on 8 GPUs at tp 2: 4 replicas of 10. Weights 1e9 B over 2 x 1e12 B/s = 0.5 ms a step.
    # KV: 1e7 B/token x mean context (50 prompt + 100/2) = 1e9 B per sequence per step;
    # 10 x 100 tokens x 1e9 B / 2e12 B/s = 0.5 s of KV reads in any schedule.
    d = M.replica_decode(sequences_total=40, gpus=8, tp=2, mean_len=100, longest=400, concurrency=100,
                         weight_bytes=1e9, kv_bytes_per_token=1e7, prompt_tokens=50, mem_bw=1e12)
    assert d.sequences == 10 and d.weight_step_s == pytest.approx(0.5e-3) and d.kv_s == pytest.approx(0.5)
    assert M.synchronous_round_s(d) == pytest.approx(400 * 0.5e-3 + 0.5)  # the longest response's 400 steps
    assert M.continuous_s(d) == pytest.approx(10 * 100 / 100 * 0.5e-3 + 0.5)  # 10 full-batch steps
    assert M.balanced_round_s(d) == pytest.approx(100 * 0.5e-3 + 0.5)  # every response 100 tokens
    assert M.bubble_fraction(d) == pytest.approx(1 - 0.505 / 0.7)


def test_sync_time_terms_and_the_bucketing_rule():
    # 100 GB in 1000 tensors over 4 streams of 50 GB/s: wire 0.5 s; each stream cuts 25 GB into 25 buckets.
    # Trainer side per stream: gather 25 GB x 7/8 (8 FSDP shards) / 200 GB/s = 0.109 s; cast of 50e9
    # params / 4 from fp32 to bf16, 6 B each at 1 TB/s = 0.075 s; 250 tensors x 0.1 ms = 0.025 s.
    # Engine: 1000 tensors x 0.2 ms = 0.2 s; copy 2 x 100 GB / (4 x 1 TB/s) = 0.05 s. Handshakes: 25 x 2 ms.
    kw = {"link_bw": 50e9, "links": 4, "gather_bw": 200e9, "load_bw": 1e12, "receivers": 4, "fixed_s": 0.5,
          "pause_s": 0.1, "tensors": 1000, "send_per_tensor_s": 1e-4, "load_per_tensor_s": 2e-4,
          "per_bucket_s": 2e-3, "bucket_bytes": 1e9, "shards": 8, "params": 50e9, "source_bpp": 4, "dest_bpp": 2,
          "cast_bw": 1e12}
    s = M.sync_time(100e9, **kw)
    trainer = 25e9 * 7 / 8 / 200e9 + 0.075 + 0.025
    assert (s.buckets, s.trainer_s, s.wire_s, s.engine_s) == (25, pytest.approx(trainer), 0.5, pytest.approx(0.25))
    # Pipelined: the slowest side (the wire) + the other sides' share of one bucket, + the handshakes;
    # once: fixed + pause.
    assert s.total == pytest.approx(0.6 + 0.5 + (trainer + 0.25) / 25 + 0.05)
    assert M.sync_time(100e9, **kw, overlap=False).total == pytest.approx(0.6 + trainer + 0.5 + 0.25 + 0.05)
    # One bucket: nothing to pipeline, the sides add.
    one = M.sync_time(100e9, **{**kw, "bucket_bytes": 1e12})
    assert one.buckets == 1 and one.total == pytest.approx(0.6 + 0.5 + 0.25 + trainer + 2e-3)
    # An engine that reloads its whole model loads every tensor and byte, not just the update's.
    whole = M.sync_time(1e9, **{**kw, "load_tensors": 1000, "load_bytes": 100e9, "tensors": 10})
    assert whole.load_tensor_s == pytest.approx(0.2) and whole.copy_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="link_bw must be > 0"):
        M.sync_time(1e9, **{**kw, "link_bw": 0})
    # Delta export/compare on 8 trainer GPUs: 3 HBM passes over 28 GB at 3.35 TB/s each.
    assert M.delta_compare_s(28e9, 8, 3.35e12) == pytest.approx(84e9 / 26.8e12)
    # Colocated reload: one read + one write of 28 GB on one GPU = 16.7 ms, not free.
    assert M.copy_s(28e9, 1, 3.35e12) == pytest.approx(0.0167164, rel=1e-4)


def test_fsdp_traffic_and_memory_findings():
    # FSDP over 8 ranks, 28 GB of bf16: reduce-scatter 7/8 x 28 + two all-gathers 2 x 7/8 x 28 = 73.5 GB.
    assert M.fsdp_bytes_per_rank(28e9, 28e9, 8) == pytest.approx(73.5e9)
    plan = make_plan(load_plan(None, ["trainer.sharding=fsdp"]))
    assert plan.bytes.gradient_per_rank == pytest.approx(73.5e9)
    # The runbook workload (DDP): 18 B x 14e9 = 252 GB of training state per GPU, and a KV cache of
    # 256 sequences x 4096 tokens x 196,608 B = 206 GB per GPU: neither fits 80 GB.
    rb = make_plan(load_plan(None, []))
    assert rb.memory.trainer_per_gpu == pytest.approx(252e9)
    assert rb.memory.kv_per_gpu == pytest.approx(256 * 4096 * 196608)
    assert any(f.startswith("trainer does not fit") for f in rb.findings)
    assert any(f.startswith("rollout does not fit") for f in rb.findings)
    assert "## Findings" in __import__("rollyard.plan.record", fromlist=["x"]).decision_record(rb)
    # Sharded over 8 GPUs: 252 / 8 = 31.5 GB fits.
    assert make_plan(load_plan(None, ["trainer.sharding=fsdp"])).memory.trainer_per_gpu == pytest.approx(31.5e9)


def test_moe_active_params_for_flops_total_for_sync():
    # 14e9 total, 1e9 active: train = 6 x 1e9 x 8,388,608 tokens / (4e14 x 8) = 15.73 s; sync stays 28 GB.
    plan = make_plan(load_plan(None, ["policy.active_params=1e9", "trainer.flops_per_gpu=4e14"]))
    assert plan.phases.train == pytest.approx(6 * 1e9 * 8388608 / 3.2e15)
    # Unstated, the sustained rate is peak x MFU by architecture: a MoE (active < total) at Megatron-Bridge's
    # published BF16 MoE row on H100 (GPT-OSS 120B on 64 GPUs: 158 model TFLOP/s per GPU), a dense model at
    # fms-fsdp's 0.31 of the 989 TFLOP/s datasheet peak.
    mfu = make_plan(load_plan(None, ["policy.active_params=1e9"]))
    assert mfu.phases.train == pytest.approx(6 * 1e9 * 8388608 / (8 * 158e12))
    dense = make_plan(load_plan(None, []))
    assert dense.phases.train == pytest.approx(6 * 14e9 * 8388608 / (8 * 989e12 * 0.31))
    # A MoE trainer takes 0.31 / 0.160 = 1.94x as long as a dense one of the same active parameters.
    assert mfu.phases.train / make_plan(load_plan(None, ["policy.active_params=1e9", "trainer.mfu=0.31"])).phases.train \
        == pytest.approx(0.31 * 989 / 158)
    assert plan.bytes.full_sync == pytest.approx(28e9)


EQUAL = ["policy.params=1e9", "rollout.prompts=8", "rollout.samples=1", "rollout.concurrency=2",
         "rollout.kv_bytes_per_token=0", "rollout.mem_bandwidth=1e12", "rollout.gpus=2", "trainer.dp=2",
         "cluster.gpus=4", "phases.train_s=2.0", "phases.use_reference=false", "tail.lengths=[100, 1000]",
         "sync.receiver=none", "sync.fixed_s=0", "trainer.serial_fraction=0"]  # FLOP-bound trainer: 4 / g s


def test_equal_hardware_best_split_hand_worked():
    # Weights 2e9 B over 1 TB/s: 2 ms per decode step; no KV term. Lengths {100, 1000}: mean 550,
    # longest of 8 = 1000. Trainer: 2 s on 2 GPUs, FLOP-bound, so 4 / g seconds on g GPUs.
    # Synchronous round on g GPUs (ceil(8/g) sequences, 2 slots): max(1000, n x 550 / 2) steps.
    #   g=4: 1000 steps = 2.0 s. Colocated: 2.0 + 1.0 + reload 6 ms -> 3.006 s (the trainer's copy into
    #   buffers 1e9 x 4 B / 1e12 = 4 ms and the engine's 2 x 2e9 / 1e12 = 4 ms, pipelined over 2 buckets).
    # Async (bubble-free: n x 550 / 2 steps): 1:3 -> max(4.4, 1.33) = 4.4; 2:2 -> max(2.2, 2.0) = 2.2;
    #   3:1 -> max(1.65, 4.0) = 4.0. Best 2:2 at 2.2 s: 3.006 / 2.2 = 1.366x colocated.
    # Disaggregated (synchronous rounds): 2:2 -> max(max(1000, 1100) x 2 ms, 2.0) + sync 0.04 = 2.24 s.
    plan = make_plan(load_plan(None, EQUAL + ["placement=async"]))
    eq = plan.equal_hardware()
    assert eq["colocated"]["step_s"] == pytest.approx(3.006)
    assert [s["step_s"] for s in eq["async"]["splits"]] == pytest.approx([4.4, 2.2, 4.0])
    assert (eq["async"]["rollout_gpus"], eq["async"]["trainer_gpus"]) == (2, 2)
    assert eq["async"]["vs_colocated"] == pytest.approx(3.006 / 2.2)
    # One full sync: 2 GB over one 50 GB/s link = 40 ms in 2 buckets, plus the other sides' share of one
    # bucket: the trainer's copy (4 ms) and the engine's (4 ms), / 2.
    sync = 0.04 + (0.004 + 0.004) / 2
    assert eq["disaggregated"]["step_s"] == pytest.approx(2.2 + sync)
    assert plan.rate.balanced == (2, 2)
    # On-policy (bound 0) the pools cannot decouple: 2:2 -> 2.2 + 2.0 + 0.04 s; best is still 2:2.
    onp = make_plan(load_plan(None, [*EQUAL, "placement=async", "sync.staleness_bound=0"])).equal_hardware()
    assert onp["async"]["step_s"] == pytest.approx(2.2 + 2.0 + sync)
    # ... and the disaggregated pools take turns: best 3:1 -> round(3) 2.0 + 4.0 + 0.04 vs 2:2 -> 2.2 + 2.0 + 0.04.
    assert onp["disaggregated"]["step_s"] == pytest.approx(2.2 + 2.0 + sync)
    # Streaming the trainer over 4 mini-batches (still on-policy): a two-stage pipeline,
    # 2:2 -> max(2.2, 2.0) + min(2.2, 2.0) / 4 + 0.04 = 2.74 s.
    st = make_plan(load_plan(None, [*EQUAL, "placement=disaggregated", "sync.staleness_bound=0",
                                    "phases.train_streamed=true", "trainer.minibatches=4"]))
    assert st.equal_hardware()["disaggregated"]["step_s"] == pytest.approx(2.2 + 2.0 / 4 + sync)
    assert ("rollout", "train") in {(a, b) for a, b, _ in st.decision.overlaps}
    # At equal GPUs a split without bubble removal never beats colocated's R + T by more than the bubble.
    assert json.loads(json.dumps(plan.as_dict()))["equal_hardware"]["gpus"] == 4


def test_measured_trainer_times_win_over_flop_scaling():
    # Measured 2.0 s on 2 GPUs (the plan's train_s), 3.0 s on 1 GPU and 1.2 s on 4: a 1-GPU pool takes
    # 3.0 s (FLOP scaling would say 4.0); 3 GPUs lie between 2 and 4: 2.0 + (1.2 - 2.0) x 1/2 = 1.6 s;
    # 8 GPUs scale FLOP-bound from the 4-GPU measurement: 1.2 x 4 / 8 = 0.6 s.
    plan = make_plan(load_plan(None, [*EQUAL, "placement=async", "phases.train_s_measured={1: 3.0, 4: 1.2}"]))
    assert H.train_s(plan.inputs, 1) == pytest.approx(3.0)
    assert H.train_s(plan.inputs, 2) == pytest.approx(2.0)
    assert H.train_s(plan.inputs, 3) == pytest.approx(1.6)
    assert H.train_s(plan.inputs, 8) == pytest.approx(0.6)
    with pytest.raises(PlanError, match="train_s_measured"):
        load_plan(None, ["phases.train_s_measured={0: 1.0}"])


def test_decode_is_compute_bound_past_the_knee():
    # A 1e9-parameter model: weights 2e9 B over 1 TB/s = 2 ms per step; 2e9 FLOPs per token at 1e14 FLOP/s
    # = 20 us per sequence in flight. The knee: 2 ms / 20 us = 100 sequences. Below it a step is the weight
    # read whatever the batch; past it the step grows with the batch (a memory-only model stays at 2 ms).
    step = [M.decode_step_s(2e9, b, 0.0, 1, 1e12, flops_per_token=2e9, peak_flops=1e14) for b in (10, 100, 400, 800)]
    assert step == pytest.approx([2e-3, 2e-3, 8e-3, 16e-3])
    assert M.decode_step_s(2e9, 800, 0.0, 1, 1e12, 2e9, 1e14, overhead_s=1e-3) == pytest.approx(17e-3)

    # A round of n sequences of 100 tokens (longest 100), all in flight: 100 steps. Memory: 100 x 2 ms = 0.2 s;
    # FLOPs: n x 100 x 2e9 / 1e14 = n x 2 ms. A small pool that holds 400 or 800 sequences per replica takes
    # 0.8 s and 1.6 s (compute-bound, in proportion to its tokens); 50 sequences take the 0.2 s weight reads.
    def round_s(n: int, overhead: float = 0.0) -> float:
        d = M.replica_decode(sequences_total=n, gpus=1, tp=1, mean_len=100, longest=100, concurrency=1000,
                             weight_bytes=2e9, kv_bytes_per_token=0.0, prompt_tokens=0, mem_bw=1e12,
                             flops_per_token=2e9, peak_flops=1e14, step_overhead_s=overhead)
        return M.synchronous_round_s(d)

    assert [round_s(n) for n in (50, 400, 800)] == pytest.approx([0.2, 0.8, 1.6])
    assert round_s(800, overhead=1e-3) == pytest.approx(1.6 + 100 * 1e-3)  # the engine's work, once per step
    # Through the plan: rollout.peak_flops (null = trainer.peak_flops) sets the bound; twice the peak halves a
    # compute-bound round. 64 prompts x 16 samples of 1000 tokens of a 7.6e9 model on one 148-TFLOP/s GPU:
    # 1024 x 1000 x 15.2e9 / 1.48e14 = 105.2 s of FLOPs over 16,000 steps x (15.2e9 / 4e12) = 60.8 s of weights.
    base = ["policy.params=7.6e9", "rollout.prompts=64", "rollout.samples=16", "rollout.avg_tokens=1000",
            "rollout.kv_bytes_per_token=0", "rollout.mem_bandwidth=4e12", "rollout.gpus=1", "rollout.concurrency=64",
            "tail.lengths=[1000]", "trainer.peak_flops=1.48e14"]
    assert H.rollout_s(load_plan(None, base), 1) == pytest.approx(105.17, abs=0.01)
    assert H.rollout_s(load_plan(None, [*base, "rollout.peak_flops=2.96e14"]), 1) == pytest.approx(60.8)


def test_trainer_time_scales_by_amdahls_law():
    # The arithmetic of the rule at s = 0.0165 (the fit on verl's table before its 2025-12 correction):
    #   32: 269.80 x (0.0165 + 0.9835/32) / (0.0165 + 0.9835/16) = 269.80 x 0.0472344 / 0.0779688 = 163.45 s
    #   64: 269.80 x (0.0165 + 0.9835/64) / 0.0779688 = 269.80 x 0.0318672 / 0.0779688 = 110.27 s
    # each within 5% of verl's; time x GPUs constant would say 134.9 and 67.5 s (14% and 40% short).
    assert M.amdahl_s(269.80, 16, 32, 0.0165) == pytest.approx(163.45, abs=0.01)
    assert M.amdahl_s(269.80, 16, 64, 0.0165) == pytest.approx(110.27, abs=0.01)
    assert abs(M.amdahl_s(269.80, 16, 32, 0.0165) / 156.98 - 1) < 0.05
    assert abs(M.amdahl_s(269.80, 16, 64, 0.0165) / 113.16 - 1) < 0.05
    assert M.amdahl_s(269.80, 16, 64, 0.0) == pytest.approx(67.45)
    # verl's corrected table (after 2025-12): the fully-async trainer rows' update_actor is 313.81 s on 16 GPUs,
    # 156.98 on 32, 113.16 on 64; their least-squares fit is the default serial fraction 0.0079. From
    # the 16-GPU row, through the plan (a trainer and reference time measured on 16 GPUs, on a pool of 32):
    #   32: 313.81 x (0.0079 + 0.9921/32) / (0.0079 + 0.9921/16) = 313.81 x 0.038903125 / 0.06990625 = 174.64 s
    # (verl: 156.98, 11% over; time x GPUs constant would say 156.91).
    argv = ["phases.gpus=16", "phases.train_s=313.81", "phases.reference_s=100", "trainer.dp=32"]
    p = load_plan(None, argv)
    assert p.trainer.serial_fraction == 0.0079
    assert H.train_s(p, 32) == pytest.approx(174.64, abs=0.01)
    assert abs(H.train_s(p, 32) / 156.98 - 1) < 0.12
    assert H.train_s(p, 64) == pytest.approx(313.81 * 0.0234015625 / 0.06990625)  # 105.05 s, verl 113.16
    assert H.reference_s(p, 32) == pytest.approx(100 * 0.038903125 / 0.06990625, rel=1e-6)
    assert H.train_s(load_plan(None, [*argv, "trainer.serial_fraction=0"]), 32) == pytest.approx(156.905)
    # Beyond the measured sizes the nearest measurement scales the same way: 1.2 s on 4 GPUs, on 8 at s = 0.5:
    # 1.2 x (0.5 + 0.5/8) / (0.5 + 0.5/4) = 1.2 x 0.5625 / 0.625 = 1.08 s.
    q = load_plan(None, [*EQUAL, "trainer.serial_fraction=0.5", "phases.train_s_measured={1: 3.0, 4: 1.2}"])
    assert H.train_s(q, 8) == pytest.approx(1.08)
    with pytest.raises(ValueError, match="serial fraction"):
        M.amdahl_s(1.0, 1, 2, 1.5)


def test_a_measured_round_sets_the_engine_work_per_step():
    # 8 sequences of lengths {100, 1000} (mean 550, longest 1000), 2 slots per replica; weights 2 ms a step,
    # KV 1e6 B/token x 275 tokens of mean context = 2.75e8 B per sequence per step (0.15125 s per sequence's 550
    # tokens at 1 TB/s). On 2 GPUs (2 replicas of 4): max(1000, 4 x 550 / 2) = 1100 steps x 2 ms + 4 x 0.15125 s
    # = 2.805 s of HBM reads (FLOPs: 2,200 tokens x 2e9 / 989e12 = 4.4 ms). Measured 13.805 s there: the engine
    # takes (13.805 - 2.805) / 1100 = 10 ms per decode step beyond the roofline.
    # On 4 GPUs (4 replicas of 2): 1000 steps x 2 ms + 2 x 0.15125 = 2.3025 s, + 1000 x 10 ms = 12.3025 s
    # (scaling the measurement by the roofline's ratio would say 13.805 x 2.3025 / 2.805 = 11.33 s).
    argv = [*EQUAL, "rollout.kv_bytes_per_token=1e6", "phases.rollout_s=13.805", "phases.gpus=2"]
    p, L = load_plan(None, argv), [100, 1000]  # the lengths make_plan passes from tail.lengths
    assert H.measured_step_overhead(p, L) == pytest.approx(10e-3)
    assert H.rollout_s(p, 4, lengths=L) == pytest.approx(12.3025)
    assert H.rollout_s(p, 2, lengths=L) == pytest.approx(13.805)
    # Continuous batching on 2 GPUs: 4 x 550 / 2 = 1100 steps, the same as the round here.
    assert H.rollout_s(p, 2, continuous=True, lengths=L) == pytest.approx(13.805)
    # A measurement faster than the roofline (the stated rates are too low): the roofline scaled to it.
    q = load_plan(None, [*EQUAL, "rollout.kv_bytes_per_token=1e6", "phases.rollout_s=1.4025", "phases.gpus=2"])
    assert H.measured_step_overhead(q, L) is None
    assert H.rollout_s(q, 4, lengths=L) == pytest.approx(1.4025 * 2.3025 / 2.805)
    assert "10 ms per decode step" in make_plan(load_plan(None, [*argv, "rollout.gpus=4", "cluster.gpus=8"])).phases.source["rollout"]


def test_a_stated_mean_is_bounded_by_the_measured_phases(capsys):
    # 10 x 10 = 100 sequences of 100 prompt tokens, a 1e9-parameter policy (2e9 FLOP per token forward, 6e9
    # forward + backward), 1e14 FLOP/s per GPU, phases measured on 2 GPUs. At peak: the reference forward of
    # 10 s does 2e15 FLOPs = 1e6 tokens = 10,000 per sequence, 9,900 of them generated; the train step of 60 s
    # 1.2e16 FLOPs = 2e6 tokens, 19,900 generated; the rollout round of 100 s 1e7 tokens = 100,000 generated.
    base = ["policy.params=1e9", "trainer.peak_flops=1e14", "rollout.prompts=10", "rollout.samples=10",
            "rollout.prompt_tokens=100", "rollout.avg_tokens=20000", "tail.max_tokens=30000", "phases.gpus=2",
            "phases.reference_s=10", "phases.train_s=60", "phases.rollout_s=100"]
    assert M.tokens_at_peak(10, 2, 1e14, 2e9) == pytest.approx(1e6)
    p = load_plan(None, base)
    assert [round(b) for _, b in H.mean_bounds(p)] == [100000, 9900, 19900]
    plan = make_plan(p)
    assert plan.inputs.rollout.avg_tokens == pytest.approx(9900)
    assert "rollout.avg_tokens = 20000 is more than the measured phases allow" in plan.findings[0]
    assert "phases.reference_s = 10 s on 2 GPUs" in plan.findings[0] and "9900" in plan.findings[0]
    # A faster train step binds instead: 20 s -> 4e15 / 6e9 = 666,667 tokens, 6,566.7 generated per sequence;
    # a faster round binds on generated tokens alone (no prompt): 3 s -> 3e5 tokens = 3,000 per sequence.
    assert make_plan(load_plan(None, [*base, "phases.train_s=20"])).inputs.rollout.avg_tokens == pytest.approx(
        6566.667, abs=1e-3)
    assert make_plan(load_plan(None, [*base, "phases.rollout_s=3"])).inputs.rollout.avg_tokens == pytest.approx(3000)
    # Without a reference forward its time bounds nothing; a mean within every bound, or measured lengths,
    # are priced as given (no finding).
    q = make_plan(load_plan(None, [*base, "phases.use_reference=false"]))
    assert q.inputs.rollout.avg_tokens == pytest.approx(19900)
    for extra, mean in ((["rollout.avg_tokens=5000"], 5000), (["tail.lengths=[20000, 20000]"], 20000)):
        r = make_plan(load_plan(None, [*base, *extra]))
        assert r.inputs.rollout.avg_tokens == mean
        assert not any("measured phases allow" in f for f in r.findings)
    # A time too short for even the prompts is a bad input: one line, exit 2.
    code, out, err = run_plan(capsys, *base, "phases.reference_s=0.01")
    assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1
    assert "phases.reference_s = 0.01 s on 2 GPUs" in err and "no GPU runs above its peak" in err and "fix" in err


def test_steady_state_horizon_and_sync_bound():
    # A 100 s sync on a 60 s / 30 s pipeline: the link carries one version per 100 s, so async runs
    # at 100 s/step and disaggregated (the sync holds both pools) at 60 + 100 = 160 s/step.
    asy = steady_state("async", 60, 30, 100)
    assert asy.period_s == pytest.approx(100) and asy.horizon_steps >= 16
    assert steady_state("disaggregated", 60, 30, 100).period_s == pytest.approx(160)
    assert predicted_steps_per_hour("disaggregated", rollout_s=60, train_s=30, sync_s=5) == pytest.approx(3600 / 65)
    with pytest.raises(ValueError, match="unknown placement"):
        predicted_steps_per_hour("split", rollout_s=1, train_s=1)


def test_sparse_cadence_with_its_minimum_bound_is_not_slower():
    # Syncing every 2 steps needs a bound of 2 (a version serves 2 batches, one batch ahead); with it
    # one 5 s sync per two 60 s steps: 62.5 s/step, faster than syncing every step (65 s).
    every1 = steady_state("disaggregated", 60, 30, 5)
    every2 = steady_state("disaggregated", 60, 30, 5, sync_every=2, staleness_bound=2)
    assert every2.period_s == pytest.approx(62.5) and every1.period_s == pytest.approx(65)
    with pytest.raises(PlanError, match="needs sync.staleness_bound >= 2"):
        load_plan(None, ["sync.every_steps=2", "sync.staleness_bound=1"])


def test_decision_tree_answers_from_evidence():
    # 70B: 18 B x 70e9 = 1.26 TB of training state > one node's 640 GB -> step 2 says yes.
    big = make_plan(load_plan(None, ["policy.params=70e9", "phases.rollout_s=100", "phases.train_s=100",
                                     "phases.reference_s=0"]))
    assert big.placement == "disaggregated" and big.decision.tree[2].answer == "yes"
    # 10B fits one node (180 GB) but is no prototype and rollout is not dominant: no branch says yes,
    # so equal hardware decides, and the record says so.
    mid = make_plan(load_plan(None, ["policy.params=10e9", "phases.rollout_s=100", "phases.train_s=100",
                                     "phases.reference_s=0"]))
    assert mid.decision.tree[2].answer == "no" and "equal hardware decides" in mid.decision.tree[-1].question
    # Reward time counts on the rollout side: 100 s rollout + 150 s unstreamed reward vs 100 s train.
    rew = make_plan(load_plan(None, ["policy.params=10e9", "phases.rollout_s=100", "phases.reward_s=150",
                                     "phases.train_s=100", "phases.reference_s=0"]))
    assert rew.placement == "async"


def test_budget_whatif_on_the_critical_path():
    # Disaggregated, rollout 300 s, train 100 s, one 0.5612 s sync (test_runbook_defaults_json_values):
    # the step is max(300, 100) + 0.5612.
    base = ["placement=disaggregated", "phases.rollout_s=300", "phases.train_s=100", "phases.use_reference=false",
            "sync.receiver=none", "sync.fixed_s=0"]
    w = make_plan(load_plan(None, base + ["budget.optimizations=[prefix_caching]"])).budget
    sync = 0.56 + 2 * (56e9 / 3.35e12) / 28
    assert w.placement_step_s == pytest.approx(300 + sync)
    assert w.placement_new_step_s == pytest.approx(100 + sync)  # rollout 300 / 3 = 100 = train
    assert w.placement_win == pytest.approx((300 + sync) / (100 + sync))
    assert w.win == pytest.approx((400 + sync) / (200 + sync))  # the serialized sum says something else
    # Speeding up the trainer of a rollout-bound placement gains nothing on its critical path.
    w = make_plan(load_plan(None, base + ["budget.optimizations=[packed_varlen]"])).budget
    assert w.placement_win == pytest.approx(1.0) and w.win > 1.05


def test_tail_whatif_is_bounded_by_the_floor():
    t = TailWhatIf("x", 1, 1, 1, 1, 100, 20, 0.5, 0.1, 4, 1, 0.1, 10.0, 5.0, 2.0)
    b = bound_by_floor(t, 8.0)  # tail batching said 5 s, but no schedule beats 8 s
    assert b.bounded and b.tail_rollout_s == 8.0 and b.speedup == pytest.approx(10 / 8)
    assert not bound_by_floor(t, 4.0).bounded
    plan = make_plan(load_plan(None, []))
    assert plan.tail.tail_rollout_s >= plan.tail.floor_rollout_s > 0


def test_stable_entry_points_for_benches():
    assert predicted_sync_bytes(14e9, 2, "full") == pytest.approx(28e9)
    assert predicted_sync_bytes(14e9, 2, "delta", delta_fraction=0.02, delta_index_bytes=8) == pytest.approx(2.8e9)
    assert predicted_sync_bytes(14e9, 2, "lora", lora_fraction=0.005) == pytest.approx(0.14e9)
    assert predicted_sync_bytes(14e9, 2, "inprocess") == 0
    with pytest.raises(ValueError, match="unknown sync mode"):
        predicted_sync_bytes(1, 2, "zip")


@pytest.mark.parametrize("argv, words", [
    (["phases.train_s=0"], ["phases.train_s", "greater than 0"]),
    (["phases.rollout_s=-3"], ["phases.rollout_s", "greater than 0"]),
    (["network.custom={slow: 0}", "network.sync_link=slow"], ["network.custom.slow = 0", "> 0"]),
    (["network.custom={slow: -5e9}", "network.sync_link=slow"], ["network.custom.slow", "> 0"]),
    (["rollout.mem_bandwidth=-1"], ["rollout.mem_bandwidth", "greater than 0"]),
    (["rollout.mem_bandwidth=.inf"], ["rollout.mem_bandwidth", "finite"]),
    (["rollout.mem_bandwidth=inf"], ["rollout.mem_bandwidth", "finite"]),
    (["policy.params=.nan"], ["policy.params", "finite"]),
    (["trainer.flops_per_gpu=.inf"], ["trainer.flops_per_gpu", "finite"]),
    (["policy.lora=true", "policy.lora_fraction=0"], ["lora_fraction = 0 with policy.lora = true"]),
    (["policy.active_params=2e10"], ["active_params", "exceeds"]),
    (["phases.reference_s=1e-6"], ["phases.reference_s = 1e-06 s on 8 GPUs", "no GPU runs above its peak"]),
])
def test_bad_numbers_are_one_line_errors(capsys, argv, words):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "fix" in err  # one line, with the fix
    for w in words:
        assert w in err


def test_lora_fraction_zero_is_fine_with_lora_off(capsys):
    code, out, _ = run_plan(capsys, "policy.lora_fraction=0", "--json")
    assert code == 0 and json.loads(out)["bytes"]["lora_sync"] == 0


def test_empty_plan_file_needs_defaults(tmp_path, capsys):
    f = tmp_path / "empty.toml"
    f.write_text("# nothing here\n")
    code, _, err = run_plan(capsys, str(f))
    assert code == 2 and "is empty" in err and "--defaults" in err and err.count("\n") == 1
    code, out, _ = run_plan(capsys, str(f), "--defaults", "--json")
    assert code == 0 and json.loads(out)["bytes"]["full_sync"] == pytest.approx(28e9)


def test_calibration_rows_hold_their_figures(capsys):
    # The figures docs/calibration.md quotes, so the table cannot drift from the code.
    def doc(name, *extra):
        code, out, err = run_plan(capsys, str(EXAMPLE.parent / name), *extra, "--json")
        assert code == 0, err
        return json.loads(out)

    # Weight sync on the defaults, every published row of bench/calibration_rows.py (no software constant per
    # row: the receiver rule's defaults). A few worked by hand: checkpoint-engine's 8 x H800 row is engine-bound
    # (36,945 tensors x 127 us = 4.69 s + vLLM's pause 0.14 s, fixed 0: GatherMetas is timed apart); the H20
    # rows wire-bound (1,029 GB / 50 GB/s = 20.6 s); TRL's 0.6B row is vLLM's pause + 310 x 127 us + 1.5 GB of
    # NVLink (in one node: no cross-node control).
    import importlib.util
    spec = importlib.util.spec_from_file_location("calibration_rows", EXAMPLE.parent.parent / "bench" / "calibration_rows.py")
    rows = importlib.util.module_from_spec(spec)
    import sys
    sys.modules.setdefault(spec.name, rows)  # dataclasses look their module up by name
    spec.loader.exec_module(rows)
    table = {r["id"]: r for r in rows.table()}
    # v5 moved S4e-S4h (the P2P rule: a CPU reshard per peer layout and pinned-host staging, the rows now
    # stating the published trainer GPUs) and S6 (no cross-node floor for the transfer alone); R1-R3 (direct
    # writes) and P1-P2 (a sparse refit's codec and round trips) are new rows.
    # Plan v6 splits load_weights' 127 us per tensor into 108 us per tensor and 3.2 ms per bucket (the same blog
    # profile): every load_weights row moves by (3.2 ms x buckets) - (19 us x tensors); the same 21 rows hold.
    figures = {"S1b": 1.402, "S1c": 2.049, "S2": 1.658, "S3a": 4.716, "S3b": 2.376, "S3c": 21.338, "S3d": 21.235,
               "S3e": 14.388, "S3f": 14.307, "S4a": 2.810, "S4b": 5.626, "S4c": 11.464, "S4d": 24.435, "S4e": 2.550,
               "S4f": 0.764, "S4g": 2.511, "S4h": 2.374, "S5": 5.741, "S6": 1.227, "S7a": 2.097, "S7b": 2.095,
               "S7c": 2.235, "S7d": 0.262, "S8a": 0.183, "S8b": 2.214, "R1": 1.632, "R2": 0.327, "R3": 0.228,
               "P1": 21.282, "P2": 13.164}
    assert set(table) == set(figures)
    for rid, figure in figures.items():
        assert table[rid]["plan_s"] == pytest.approx(figure, abs=5e-3), rid
    s3a = rows.plan_sync(next(r for r in rows.ROWS if r.id == "S3a"))  # its buckets as filed
    assert table["S3a"]["plan_s"] == pytest.approx(36945 * 17e-3 / 157 + s3a.buckets * 3.2e-3 + 0.14, abs=0.06)
    assert table["S8a"]["plan_s"] == pytest.approx(0.14 + 310 * 17e-3 / 157 + 3.2e-3 + 1.5e9 / 450e9, abs=0.005)
    out = [r for r in table.values() if r["sample"] == "out"]
    assert (sum(r["within_2x"] for r in table.values()), len(table)) == (21, 30)
    assert (sum(r["within_2x"] for r in out), len(out)) == (6, 9)
    assert {r["id"]: r["mechanism"] for r in table.values()}["R1"] == "direct_write"
    eq = doc("plan_verl_async_128.toml")["equal_hardware"]
    # The trainer on 64 of 128 GPUs by Amdahl's law at serial fraction 0.0079 (verl's corrected fully-async rows):
    # 113.81 x (0.0079 + 0.9921/64) / (0.0079 + 0.9921/128) = 113.81 x 0.0234016 / 0.0156508 = 170.17 s.
    assert eq["async"]["configured"]["trainer_s"] == pytest.approx(170.17, abs=0.01)
    # Colocated on 128: the measured 177.85 + 53.92 + 113.81 s plus the reload of 15.2 GB, each of a replica's
    # 4 GPUs its quarter in 4 buckets, pipelined: the trainer's side (gather 63/64 of it over NVLink, copy
    # 7.6e9 / 4 x 4 B at 4 TB/s) + the engine's copy (2 x 15.2e9 / (4 x 4e12)) / 4 buckets.
    trainer = 15.2e9 / 4 * 63 / 64 / 600e9 + 7.6e9 / 4 * 4 / 4.0e12
    # + vLLM's pause (0.14 s; verl rolls out with vLLM; no tensor count in the file, so no per-tensor term).
    # + 4 buckets x 3.2 ms (load_weights' per-bucket IPC open and close, serial)
    assert eq["colocated"]["step_s"] == pytest.approx(345.58 + trainer + 2 * 15.2e9 / 16e12 / 4 + 0.14 + 4 * 3.2e-3)
    assert eq["async"]["configured"]["vs_colocated"] == pytest.approx(2.03, abs=0.005)  # published 2.37x
    # the best split: 2.34x at 48:80 (v5 2.61x at 32:96: an async replica then held more sequences than exist)
    assert eq["async"]["vs_colocated"] == pytest.approx(2.34, abs=0.005)
    assert doc("plan_verl_async_64.toml")["equal_hardware"]["async"]["configured"]["vs_colocated"] == pytest.approx(
        1.60, abs=0.005)  # published 1.93x
    assert doc("plan_verl_async_32.toml")["equal_hardware"]["async"]["configured"]["vs_colocated"] == pytest.approx(
        1.52, abs=0.005)  # published 2.68x: Amdahl's law makes the 32-GPU colocated 269.80 s 484.8 s on 16 GPUs,
    # where verl's async trainer took 313.81 s (row 9b below gives the plan that measurement)
    eq = doc("plan_verl_async_128.toml", "phases.train_s_measured={64: 133.41}")["equal_hardware"]["async"]
    assert eq["configured"]["trainer_s"] == pytest.approx(133.41)
    assert eq["configured"]["vs_colocated"] == pytest.approx(2.59, abs=0.005)
    eq = doc("plan_verl_async_32.toml", "phases.train_s_measured={16: 313.81}")["equal_hardware"]["async"]
    assert (eq["configured"]["trainer_s"], eq["configured"]["vs_colocated"]) == pytest.approx((313.81, 2.34), abs=0.005)
    assert doc("plan_rollpacker_tail.toml")["tail_whatif"]["step_speedup"] == pytest.approx(1.39, abs=0.005)
    # verl one-step-off (A5), 4 rollout GPUs (one TP-4 replica of 8,192 sequences): the measured 16-GPU round
    # (321 s) is 5.16 ms per decode step beyond its roofline (4 replicas of 2,048: 20,480 steps; FLOPs
    # 2,048 x 4,096 x 15.2e9 / (4 x 1.48e14) = 215.4 s over HBM 88.8 s), and the 4-GPU pool is compute-bound:
    # 861.6 s of FLOPs + 32,768 steps x 5.16 ms = 1030.5 s (measured 458 s; the file's 4,096-token mean is
    # an ASSUMPTION the published time rules out: docs/calibration.md).
    # The file's 4,096-token mean is an ASSUMPTION its own colocated old_log_prob rules out: 88 s on 16 H20 at
    # 1.48e14 FLOP/s is at most 2.0838e17 / 1.52e10 = 1.3709e7 tokens = 1,673.5 per sequence, 1,417.5 generated
    # (hardware.bounded_mean). At that mean the longest of 8,192 is 10,697 tokens, and the 16-GPU round (321 s)
    # is 23.0 ms per decode step beyond its roofline (FLOPs 2,048 x 1,417.5 x 15.2e9 / 5.92e14 = 74.5 s). The
    # 4-GPU pool: 8,192 x 1,417.5 / 1,024 = 11,340 steps x 23.0 ms + 298.2 s of FLOPs = 559.4 s (measured 458).
    one = doc("plan_verl_one_step_off_16.toml")
    assert one["inputs"]["rollout"]["avg_tokens"] == pytest.approx(1417.52, abs=0.01)
    assert one["findings"][0].startswith("rollout.avg_tokens = 4096 is more than the measured phases allow")
    one = one["equal_hardware"]["disaggregated"]
    assert one["configured"]["rollout_s"] == pytest.approx(559.4, abs=0.5)
    assert one["configured"]["vs_colocated"] == pytest.approx(1.24, abs=0.005)  # published 1.44x
    # bench/calibration_rows.py's speed-up table: 3 of the 4 within 25% at the published split.
    speed = {r["id"]: r for r in rows.speedup_table()}
    assert [k for k, r in speed.items() if r["within_25"]] == ["7", "8", "A5", "N1"]
    assert [round(r["mean_tokens"]) for r in speed.values()] == [4096, 3127, 3165, 1418, 2947, 5457, 441]
    # NeMo-RL v0.6's rows publish no phase: the plan prices them from stated phases and says so first.
    assert [k for k, r in speed.items() if r["stated_phases"]] == ["N1", "N2", "N3"]
    # Plan v6 reads NeMo-RL's 1-step off as async (in-flight weight updates): N2 and N3 now over-predict the gain
    # (1.67, 1.47; v5 0.76, 0.58 as disaggregated): the colocated step is still short of the published one.
    # The expert all-to-all (DeepEP's rates) and the engine's sleep (vLLM level 1 over the host link) lengthen the
    # colocated step (the async one stays rollout-bound): 0.89, 1.67, 1.47 before those two terms.
    assert [round(speed[k]["ratio"], 2) for k in ("N1", "N2", "N3")] == [0.85, 1.77, 1.55]


def _numeric_fields():
    from rollyard.plan.inputs import describe
    return [line.split(" = ")[0] for line in describe()
            if any(t in line for t in ("[>", "[>=", "[<", "<=")) and "list" not in line]


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_no_numeric_field_takes_inf_or_nan(capsys, value):
    fields = _numeric_fields()
    assert len(fields) > 30
    for key in fields:
        code, out, err = run_plan(capsys, f"{key}={value}")
        assert code == 2 and out == "" and err.count("\n") == 1 and key in err, (key, err)


def test_the_overflow_guard_names_the_figure():
    # Bounds keep every input finite and physical; should a product still overflow, `plan` names
    # the first non-finite figure instead of printing invalid JSON.
    from rollyard.plan.command import _non_finite
    assert _non_finite({"a": [1.0, {"b": float("inf")}]}) == "a.1.b"
    assert _non_finite({"a": [1.0, 2]}) is None


def test_cpu_defaults_come_from_the_backend_and_every_term_is_printed(capsys):
    # rollout.device = cpu: the software terms measured by bench/sync.py --terms, per backend; a plan's own
    # figure beats the default.
    from rollyard.plan.bytes import sync_costs
    from rollyard.plan.inputs import CPU_SYNC
    for backend in ("native", "vllm"):
        c = sync_costs(load_plan(None, ["rollout.device=cpu", f"rollout.backend={backend}"]))
        assert (c.load_per_tensor_s, c.load_bw, c.pause_s) == tuple(CPU_SYNC[backend][k] for k in
                                                                    ("load_per_tensor_s", "load_bw", "pause_s"))
        assert c.reload_whole_model == (backend == "vllm")
    gpu = sync_costs(load_plan(None, ["rollout.backend=vllm"]))
    assert (gpu.load_per_tensor_s, gpu.pause_s, gpu.load_bw) == pytest.approx((17e-3 / 157, 0.14, 3.35e12))
    assert sync_costs(load_plan(None, ["rollout.device=cpu", "sync.load_per_tensor_s=1e-3"])).load_per_tensor_s == 1e-3
    # vLLM reloads the whole model on every update: a LoRA sync's engine side loads all 100 tensors.
    argv = ["placement=disaggregated", "policy.lora=true", "policy.weight_tensors=100", "policy.lora_tensors=12",
            "rollout.device=cpu"]
    native = make_plan(load_plan(None, argv)).sync_detail
    vllm = make_plan(load_plan(None, [*argv, "rollout.backend=vllm"])).sync_detail
    assert native.load_tensor_s == pytest.approx(12 * CPU_SYNC["native"]["load_per_tensor_s"])
    assert vllm.load_tensor_s == pytest.approx(100 * CPU_SYNC["vllm"]["load_per_tensor_s"])
    code, out, _ = run_plan(capsys, *argv, "rollout.backend=vllm")
    assert code == 0
    line = out[out.index("Sync (lora"):]
    for term in ("fixed", "pause/resume", "compare", "gather", "cast/copy", "per tensor", "per bucket", "wire",
                 "load per tensor", "whole model reloaded", "copy", "pipelined over"):
        assert term in line, term
    code, out, _ = run_plan(capsys, *argv, "--json")
    assert set(json.loads(out)["sync_breakdown"]) >= {"pause_s", "send_tensor_s", "bucket_s", "load_tensor_s",
                                                      "cast_s", "copy_s", "buckets", "total"}


@pytest.mark.parametrize("r,dtype", [(4, "float32"), (4, "bfloat16"), (1, "bfloat16")])
def test_predicted_sync_bytes_counts_the_wire_framing(r, dtype):
    # The LoRA sync of a tiny model, packed by sync/wire.py, against the plan's count from the format:
    # values + the 16 B prefix + the JSON header + one entry per tensor (and the fp32 scaling scalars).
    # Without the framing the plan is 9-70% short here; with it, within 1%.
    import torch

    from rollyard.model.loading import attach_lora, build_preset, char_tokenizer
    from rollyard.plan.bytes import predicted_sync_bytes
    from rollyard.sync.lora import LoraPublisher
    from rollyard.sync.wire import pack_pieces
    m = attach_lora(build_preset("tiny", char_tokenizer(), seed=0), r=r, alpha=16.0, targets=["q_proj", "v_proj"])
    header, pieces = pack_pieces(LoraPublisher(getattr(torch, dtype)).publish(m, 1))
    moved = 16 + len(header) + sum(p.numel() for p in pieces)
    base = sum(p.numel() for n, p in m.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for n, p in m.named_parameters() if "lora_" in n)
    tensors = 3 * sum(1 for n, _ in m.named_parameters() if n.endswith("lora_A.default.weight"))
    bpp = getattr(torch, dtype).itemsize
    values = predicted_sync_bytes(base, bpp, "lora", lora_fraction=adapter / base)
    framed = predicted_sync_bytes(base, bpp, "lora", lora_fraction=adapter / base, tensors=tensors)
    assert moved / values - 1 > 0.05 and abs(moved / framed - 1) < 0.01


def test_memory_per_role_says_before_a_run_what_fits():
    # Qwen2.5-14B's shape, FSDP over 8 GPUs, 16384 tokens per micro-batch.
    shape = ["policy.layers=48", "policy.hidden=5120", "policy.vocab=152064"]
    assert make_plan(load_plan(None, ["trainer.sharding=fsdp"])).memory.activations_per_gpu == 0  # no shape: not priced
    on = make_plan(load_plan(None, ["trainer.sharding=fsdp", *shape]))
    m = on.memory
    assert m.trainer_model_per_gpu == pytest.approx(14e9 * 2 / 8)  # bf16 weights, sharded
    assert m.trainer_optimizer_per_gpu == pytest.approx(14e9 * 16 / 8)  # grads + fp32 master + Adam
    assert m.reference_per_gpu == pytest.approx(14e9 * 2 / 8)  # GRPO with KL keeps a reference
    # Checkpointing keeps 2 B x hidden per token per layer (16384 x 48 x 5120 x 2 = 8.05 GB), plus the fp32
    # logits of the micro-batch (16384 x 152064 x 4 = 9.97 GB); without it ~34 B x hidden (137 GB).
    assert m.activations_ckpt_per_gpu == pytest.approx(8_053_063_680 + 9_965_666_304)
    assert m.activations_full_per_gpu == pytest.approx(136_902_082_560 + 9_965_666_304)
    assert not any(f.startswith("trainer does not fit") for f in on.findings)
    off = make_plan(load_plan(None, ["trainer.sharding=fsdp", "trainer.activation_checkpointing=false", *shape]))
    finding = next(f for f in off.findings if f.startswith("trainer does not fit"))
    assert "turn on activation checkpointing" in finding and "activations 146.87 GB" in finding
    # A chunked log-softmax holds one chunk of logits, and a smaller micro-batch fits without checkpointing.
    small = make_plan(load_plan(None, ["trainer.sharding=fsdp", "trainer.activation_checkpointing=false",
                                       "trainer.micro_batch_tokens=4096", "trainer.logits_tokens=1024", *shape]))
    assert small.memory.activations_per_gpu == pytest.approx(4096 * 48 * 5120 * 34 + 1024 * 152064 * 4)
    assert not any(f.startswith("trainer does not fit") for f in small.findings)


@pytest.mark.parametrize("argv, want", [
    # vLLM and SGLang run load_weights per tensor (the slime blog's 127 us); vLLM pauses 0.14 s (TRL #5892),
    # SGLang's pause is not published (0); rollyard's native engine copies (34 us, 5.8 ms: bench/sync.py --terms).
    (["rollout.backend=vllm"], {"load_per_tensor_s": 17e-3 / 157, "per_bucket_s": 3.2e-3, "send_per_tensor_s": 0.0,
                                "pause_s": 0.14}),
    # load_weights: the slime blog's SGLang profile split into its parts, rebuild 5 ms + load_weights 12 ms per
    # bucket of ~157 tensors per tensor, IPC open 3 ms + close 0.2 ms per bucket
    (["rollout.backend=sglang"], {"load_per_tensor_s": 17e-3 / 157, "per_bucket_s": 3.2e-3, "send_per_tensor_s": 0.0,
                                  "pause_s": 0.0}),
    ([], {"load_per_tensor_s": 34e-6, "send_per_tensor_s": 0.0, "pause_s": 5.8e-3}),
    # RDMA from pinned host memory: nothing per tensor on the receiver, the reshard on the sender, no pause priced.
    (["rollout.backend=sglang", "sync.receiver=rdma_pinned"], {"load_per_tensor_s": 0.0, "send_per_tensor_s": 127e-6,
                                                               "pause_s": 0.0}),
    # direct writes and a reshard on the receiver: load_weights' per-tensor cost (for the misc tensors only, in
    # direct writes), vLLM's pause; no floor for direct writes between nodes, the anchor's 0.542 s for a reshard.
    (["rollout.backend=vllm", "sync.receiver=direct_write"], {"load_per_tensor_s": 127e-6, "pause_s": 0.14,
                                                              "fixed_s": 0.0}),
    (["rollout.backend=vllm", "sync.receiver=receiver_reshard"], {"load_per_tensor_s": 17e-3 / 157, "pause_s": 0.14,
                                                                  "per_bucket_s": 3.2e-3, "fixed_s": 0.542}),
    (["rollout.backend=vllm", "sync.receiver=none"], {"load_per_tensor_s": 0.0, "send_per_tensor_s": 0.0, "pause_s": 0.0}),
    (["rollout.backend=vllm", "sync.load_per_tensor_s=1e-3"], {"load_per_tensor_s": 1e-3, "pause_s": 0.14}),
])
def test_gpu_defaults_follow_the_receiver_rule(argv, want):
    from rollyard.plan.bytes import sync_costs
    c = sync_costs(load_plan(None, argv))
    for k, v in want.items():
        assert getattr(c, k) == pytest.approx(v, abs=1e-3 if k == "fixed_s" else 1e-12), (k, argv)


def test_cross_node_control_is_paid_between_nodes_only():
    # 28 GB full sync of the runbook into vLLM's load_weights: over RDMA (between nodes) the update's control
    # (0.84 - 0.158 - 0.14 s from NeMo-RL's 63.2 GB anchor, a collective into load_weights) is paid once; over
    # NVLink, colocated, or a stated fixed_s, it is not.
    lw = ["rollout.backend=vllm", "sync.receiver=load_weights"]
    rdma = make_plan(load_plan(None, lw)).sync_times["full"]
    assert rdma["rdma"] - rdma["nvlink"] == pytest.approx(28e9 / 50e9 - 28e9 / 600e9 + 0.542, abs=2e-3)
    stated = make_plan(load_plan(None, [*lw, "sync.fixed_s=0"])).sync_times["full"]
    assert rdma["rdma"] - stated["rdma"] == pytest.approx(0.542, abs=1e-3)
    # The floor belongs to that mechanism only: direct writes, P2P from host memory, rollyard's copy
    # and the transfer alone pay none between nodes.
    for rule in ("direct_write", "rdma_pinned", "copy", "none"):
        d = make_plan(load_plan(None, ["rollout.backend=vllm", f"sync.receiver={rule}"])).sync_detail
        assert d.fixed_s == 0 and d.mechanism == rule, rule


def test_p2p_from_pinned_host_memory_prices_the_senders_cpu_reshard_per_layout():
    # miles P2P, Qwen3-30B-A3B: 16 trainer GPUs in one pipeline stage serve SGLang TP8: each source one TP layout,
    # so it reshards its stage's 18,867 tensors once (127 us each on the CPU) and stages that layout's shard,
    # 61.0e9 / 8 B, device -> pinned host at 64 GB/s; nothing runs or is copied on the receiver.
    f = EXAMPLE.parent / "plan_miles_p2p_qwen30b.toml"
    p2p = make_plan(load_plan(f)).sync_detail
    assert p2p.mechanism == "rdma_pinned"
    assert p2p.send_tensor_s == pytest.approx(18867 * 127e-6) and p2p.copy_s == 0 and p2p.load_tensor_s == 0
    assert p2p.stage_s == pytest.approx(30.5e9 * 2 / 8 / 64e9, rel=1e-4)  # (+ the wire framing's 0.003%)
    # Two stages: each source reshards its stage's half of the tensors (8 sources per stage, still 1 layout each).
    two = make_plan(load_plan(f, ["trainer.pp=2"])).sync_detail
    assert two.send_tensor_s == pytest.approx(18867 * 127e-6 / 2)
    # Fewer sources than the engine's TP ranks: 4 sources per stage serve 8 layouts, 2 each, each its own CPU
    # reshard and its own staged shard (the per-peer cost that makes P2P slower than a broadcast at small scale).
    few = make_plan(load_plan(f, ["trainer.gpus=4", "trainer.dp=4"])).sync_detail
    assert few.send_tensor_s == pytest.approx(2 * 18867 * 127e-6)
    assert few.stage_s == pytest.approx(2 * 30.5e9 * 2 / 8 / 64e9, rel=1e-4)


def test_direct_writes_price_the_misc_path_only(capsys):
    # Qwen3-4B (dense, 4.0e9 x 2 B = 8 GB, 399 tensors, 36 layers) DP8 -> vLLM TP8 over 50 GB/s per GPU, by
    # hand: the bulk (2/3 of the bytes: SwiGLU FFN against attention) goes shard to shard, 5.333e9 / (8 x 50e9)
    # = 13.3 ms; the misc third, 2.667e9 B, is broadcast whole to every GPU, 53.3 ms: wire 66.7 ms. Engine:
    # 36 x 9 + 3 = 327 misc tensors x 127 us = 41.5 ms, plus the copies: the bulk 2 x 5.333e9 / (8 x 3.35e12) =
    # 0.40 ms, the misc read whole and its slice written, (2.667e9 + 2.667e9 / 8) / 3.35e12 = 0.90 ms.
    argv = ["policy.params=4.0e9", "policy.active_params=4.0e9", "policy.weight_tensors=399", "policy.layers=36",
            "trainer.dp=8", "trainer.gpus=8", "trainer.pp=1", "trainer.ep=1", "rollout.gpus=8", "rollout.tp=8",
            "cluster.gpus=16"]
    d = make_plan(load_plan(EXAMPLE.parent / "plan_nemo_reshard_dsv3.toml", argv)).sync_detail
    assert d.mechanism == "direct_write" and d.fixed_s == 0 and d.gather_s == 0
    assert d.wire_s == pytest.approx(8e9 * 2 / 3 / 400e9 + 8e9 / 3 / 50e9, rel=1e-4)  # + the wire framing
    assert d.load_tensor_s == pytest.approx(327 * 127e-6)
    assert d.copy_s == pytest.approx(2 * 8e9 * 2 / 3 / 8 / 3.35e12 + (8e9 / 3) * (1 + 1 / 8) / 3.35e12, rel=1e-4)
    # With policy.layers unknown every tensor is priced through load_weights (and the output says so).
    code, out, _ = run_plan(capsys, str(EXAMPLE.parent / "plan_nemo_reshard_dsv3.toml"), *argv, "policy.layers=null")
    assert code == 0 and "every tensor (policy.layers not given)" in out
    # The output names the mechanism in words next to its numbers.
    code, out, _ = run_plan(capsys, str(EXAMPLE.parent / "plan_nemo_reshard_dsv3.toml"), *argv)
    assert "receive path direct_write: bulk bytes written straight into the engine's buffers" in out
    assert "engine" in out and "[direct_write]" in out and "(direct_write publishes no floor)" in out


def test_a_sparse_refit_prices_its_codec_and_round_trips():
    # NeMo-RL's S3 sparse refit of 247.2 GB at 5%: 123.6e9 x 0.05 x (2 B value + 2 B index) = 24.72 GB. Each of
    # the 32 producers encodes 1/32 at zstd -1's 510 MB/s: 1.515 s; each replica downloads all of it through one
    # S3 client at 1.25 GB/s, 19.78 s, and decodes it in one stream at 1580 MB/s, 15.65 s; 47 payloads of 512 MiB
    # over 32 producers: 2 round trips of 0.15 s each.
    d = make_plan(load_plan(EXAMPLE.parent / "plan_nemo_sparse_247.toml")).sync_detail
    nbytes = 123.6e9 * 0.05 * 4
    assert d.encode_s == pytest.approx(nbytes / 32 / 510e6)
    assert d.decode_s == pytest.approx(nbytes / 1580e6)
    assert d.wire_s == pytest.approx(nbytes / 1.25e9)
    assert d.buckets == 47 and d.round_trip_s == pytest.approx(2 * 0.15)
    # The download (19.78 s) is the slowest side, so encode and decode add their share of one payload (the
    # pipeline's fill and drain, (1.515 + 15.65) / 47) and the round trips add serially: without them the update
    # is 0.665 s shorter.
    raw = make_plan(load_plan(EXAMPLE.parent / "plan_nemo_sparse_247.toml", ["sync.codec=none", "sync.round_trip_s=0"]))
    assert raw.sync_detail.encode_s == raw.sync_detail.decode_s == 0
    assert d.total - raw.sync_detail.total == pytest.approx((nbytes / 32 / 510e6 + nbytes / 1580e6) / 47 + 0.3)
    with pytest.raises(ValueError, match="round trips need"):
        M.round_trips_s(10, 0, 0.1)


def test_first_finding_says_when_speedups_rest_on_stated_phases():
    # The runbook states no phase time: every speed-up rests on the decode model and FLOPs at an MFU, and the
    # first finding says so, naming each stated phase and where its figure came from.
    plan = make_plan(load_plan(EXAMPLE))
    first = plan.findings[0]
    assert first.startswith("the placement speed-ups rest on stated, not measured, phases: rollout (estimated")
    assert "train (estimated: 6 x" in first and "reference (estimated" in first
    # verl's measured colocated phases: no such finding (the first is rule 4's bound on the stated mean).
    one = make_plan(load_plan(EXAMPLE.parent / "plan_verl_one_step_off_16.toml"))
    assert not any("rest on stated" in f for f in one.findings)
    # Measured train and reference but a modelled rollout: only the rollout is named.
    part = make_plan(load_plan(EXAMPLE, ["phases.train_s=100", "phases.reference_s=10"]))
    assert part.findings[0].startswith("the placement speed-ups rest on stated, not measured, phases: rollout (")
    assert "train (" not in part.findings[0]


def test_decode_step_overhead_defaults_to_the_backends_published_figure():
    # vLLM on a GPU: a single-request decode of Llama-3.1-8B on an H100 (vLLM 0.21.0) took 6.48 ms per token, its
    # weight read 16.06e9 / 3.35e12 = 4.794 ms: 1.686 ms of engine work per step. SGLang and the native engine
    # publish none (0); a CPU plan prices none; a stated figure wins.
    assert H.step_overhead(load_plan(None, ["rollout.backend=vllm"])) == pytest.approx(6.48e-3 - 16.06e9 / 3.35e12)
    assert H.step_overhead(load_plan(None, ["rollout.backend=sglang"])) == 0
    assert H.step_overhead(load_plan(None, ["rollout.backend=vllm", "rollout.device=cpu"])) == 0
    assert H.step_overhead(load_plan(None, ["rollout.backend=vllm", "rollout.step_overhead_s=0.01"])) == 0.01
    # It is paid once per decode step: the runbook's round of 16,384 steps (its longest response) grows by
    # 16,384 x 1.686 ms = 27.6 s under vLLM against a stated 0.
    a = H.rollout_s(load_plan(EXAMPLE, ["rollout.backend=vllm"]), 8)
    b = H.rollout_s(load_plan(EXAMPLE, ["rollout.backend=vllm", "rollout.step_overhead_s=0"]), 8)
    steps = M.round_steps(H.decode_on(load_plan(EXAMPLE), 8))
    assert a - b == pytest.approx(steps * (6.48e-3 - 16.06e9 / 3.35e12))


@pytest.mark.parametrize("name, rule", [("plan_nemo_offpolicy_qwen30b.toml", "load_weights"),
                                        ("plan_nemo_reshard_dsv3.toml", "direct_write"),
                                        ("plan_miles_p2p_qwen30b.toml", "rdma_pinned"),
                                        ("plan_runbook.toml", "copy")])
def test_every_sync_figure_names_its_receive_path(capsys, name, rule):
    # The mechanism the plan assumed, in words, next to every sync number. The decision record (plain
    # markdown, no wrapping): every line with a sync time in seconds names the receive path.
    import re

    from rollyard.plan.record import decision_record

    plan = make_plan(load_plan(EXAMPLE.parent / name))
    record = decision_record(plan)
    timed = [ln for ln in record.splitlines() if re.search(r"\bsync\b[^.;]*?\d+(\.\d+)? (m?s)\b", ln)]
    assert timed and all(rule in ln for ln in timed), [ln for ln in timed if rule not in ln]
    assert f"Receive path of every sync time here: {rule}: {M.RECEIVE_WORDS[rule]}" in record
    # The printed plan: the phase table's sync row, the equal-hardware sync column, the budget's sync row and the
    # transfer table each carry it (a colocated plan's phase row names the reload's path instead).
    assert plan.phases.source["sync"].endswith(f"receive path {rule}: {M.RECEIVE_WORDS[rule]}")
    import io

    from rich.console import Console

    from rollyard.plan.render import print_plan

    buf = io.StringIO()
    print_plan(plan, Console(file=buf, width=400, highlight=False))
    out = buf.getvalue()
    assert f"[{rule}]" in out and f"sync [{rule}]" in out and f"full sync ({rule})" in out
    assert f"sync s: receive path {rule}: " in out


def _calibration_rows():
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("calibration_rows", EXAMPLE.parent.parent / "bench" / "calibration_rows.py")
    rows = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, rows)  # dataclasses look their module up by name
    spec.loader.exec_module(rows)
    return rows


def test_new_published_figures_checked_out_of_sample():
    # Figures gathered 2026-11-27 after the v5 rules, none in the repository before, the rules not
    # changed after reading them. The expected values are the published step times (NeMo-RL's performance summary:
    # v0.6 GB200 table and v0.4 H100 table), written here from the source, never from the plan: each ratio is the
    # plan's speed-up over the published one; docs/calibration.md quotes these ratios and the count.
    rows = _calibration_rows()
    published = {"G1": (98.7, 61.7), "G2": (345, 278), "V1": (97.7, 74.6), "V2": (225, 244)}
    new = {r["id"]: r for r in rows.new_speedup_table()}
    assert set(new) == set(published)
    for rid, (on_policy, one_off) in published.items():
        assert new[rid]["published_x"] == pytest.approx(on_policy / one_off)
        assert new[rid]["ratio"] == pytest.approx(new[rid]["plan_x"] / (on_policy / one_off))
        assert new[rid]["published_colocated_s"] == on_policy
    # (v6 + the expert all-to-all and the engine's sleep; v6 alone: G1 2.08, G2 1.96, V1 0.64, V2 1.23)
    assert {k: round(r["ratio"], 2) for k, r in new.items()} == {"G1": 2.30, "G2": 2.04, "V1": 0.64, "V2": 1.17}
    assert [k for k, r in new.items() if r["within_25"]] == ["V2"]  # v5: G2, V2
    # The plan's colocated step against the published on-policy step: 0.22-0.57 (the stated phases are too fast).
    assert {k: round(r["colocated_s"] / r["published_colocated_s"], 2) for k, r in new.items()} == {
        "G1": 0.29, "G2": 0.29, "V1": 0.74, "V2": 0.46}  # v5: 0.22, 0.24, 0.57, 0.31; v6: 0.26, 0.28, 0.74, 0.43
    # Weight sync, slime PR #2146 (Qwen3-8B, one node of 8 x A100, Megatron TP4 -> SGLang TP4): published steady-state
    # means 0.755 s (NCCL broadcast) and 0.484 s (P2P shards). The plan prices 61 / 57 ms: 0 of 2 within 2x, and its
    # P2P / broadcast ratio is 0.93 against the published 0.64.
    sync = {r["id"]: r for r in rows.table(rows.NEW_ROWS)}
    assert {k: r["published_s"] for k, r in sync.items()} == {"W1": 0.755, "W2": 0.484}
    assert {k: round(r["plan_s"], 3) for k, r in sync.items()} == {"W1": 0.160, "W2": 0.075}  # v5: 0.061, 0.057
    assert not any(r["within_2x"] for r in sync.values())
    assert sync["W2"]["plan_s"] / sync["W1"]["plan_s"] == pytest.approx(0.47, abs=0.01)
    # The on-policy step published at two GPU counts: the plan's gain from doubling the GPUs against the published.
    scaling = {r["id"]: r for r in rows.scaling_table()}
    for rid, (small, full) in {"C1": (134, 111), "C2": (395, 312), "C3": (108, 98.7), "C4": (286, 345)}.items():
        assert scaling[rid]["published_x"] == pytest.approx(small / full)
    assert {k: round(r["ratio"], 2) for k, r in scaling.items()} == {"C1": 0.88, "C2": 0.87, "C3": 1.04, "C4": 1.44}
