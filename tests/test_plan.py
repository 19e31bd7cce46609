"""`rollyard plan`: the runbook's figures exactly, other configurations against hand-worked values,
the placement simulator, the decision tree, the what-ifs, and bad input."""

import json
import math
from pathlib import Path

import pytest

from rollyard.plan.command import plan_main
from rollyard.plan.inputs import PlanError, load_plan
from rollyard.plan.planner import make_plan
from rollyard.plan.simulate import simulate, timeline_text
from rollyard.plan.whatif import budget_whatif, tail_whatif

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
    # Each sync mode's time on each tier: bytes over bandwidth.
    assert doc["sync_times"]["full"]["rdma"] == pytest.approx(28e9 / 50e9)
    assert doc["sync_times"]["delta"]["commodity"] == pytest.approx(0.56e9 / 1.25e9)
    edges = {e["name"]: e for e in doc["edges"]}
    assert set(edges) == {"prompts", "samples", "rewards", "ref_logprobs", "weights", "gradients", "gather"}
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
    # Same, but on-policy (bound 0): not async -> disaggregated.
    onp = make_plan(load_plan(None, ["phases.rollout_s=300", "phases.train_s=60", "phases.reference_s=0",
                                     "sync.staleness_bound=0"]))
    assert onp.placement == "disaggregated"
    # Forced placement keeps the tree's recommendation in the record.
    forced = make_plan(load_plan(None, ["placement=colocated"]))
    assert forced.placement == "colocated" and forced.decision.recommended == "disaggregated"


def test_sync_mode_choice_follows_the_fabric():
    # 28 GB over commodity (1.25 GB/s) = 22.4 s, over 5% of a ~294 s step -> delta.
    assert make_plan(load_plan(None, ["network.sync_link=commodity"])).decision.sync_mode == "delta"
    assert make_plan(load_plan(None, [])).decision.sync_mode == "full"  # 0.56 s over RDMA
    assert make_plan(load_plan(None, ["policy.lora=true"])).decision.sync_mode == "lora"
    custom = make_plan(load_plan(None, ["network.custom={slow: 1e8}", "network.sync_link=slow"]))
    assert custom.sync_times["full"]["slow"] == pytest.approx(280.0)


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
    kw = dict(prompts=8, samples=2, overprovision=0.25, steps=40, seed=0, cap=1000, rollout_s=10.0)
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
    assert doc["sync_times"]["lora"]["commodity"] == pytest.approx(0.064)
    assert doc["sync_times"]["full"]["commodity"] == pytest.approx(12.8)
    assert {"a": "rollout", "b": "reward", "why": "reward scoring is streamed while decode continues"} \
        in doc["decision"]["overlaps"]
    assert doc["budget_whatif"]["after"]["reward"] == 0  # verifier dispatcher: off the critical path
