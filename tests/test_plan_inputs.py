"""`rollyard plan` v3: bad inputs are one line with the fix (exit 2), options and overrides parse in
any order, TOML inline tables as overrides, every phase counts at equal hardware, and the what-ifs'
cost is bounded whatever prompts x samples is."""

import json
from pathlib import Path

import pytest

from rollyard.plan import mechanisms as M
from rollyard.plan.command import plan_main
from rollyard.plan.inputs import load_plan
from rollyard.plan.planner import make_plan
from rollyard.plan.whatif import EXACT_DRAWS, MAX_UNITS, tail_whatif

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_plan(capsys, *argv):
    code = plan_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, words", [
    (["rollout.prompts=1e16"], ["rollout.prompts", "less than or equal to 1000000000"]),
    (["rollout.prompts=10000000000000000"], ["rollout.prompts", "less than or equal"]),
    (["rollout.mem_bandwidth=true"], ["rollout.mem_bandwidth", "yes/no value", "give a number"]),
    (["policy.params=false"], ["policy.params", "yes/no value"]),
    (["budget.shares={train = 2.0, rollout = -1.0}"], ["budget.shares.train = 2.0", "[0, 1]"]),
    (["budget.shares={train = 1.5, rollout = -0.5}"], ["budget.shares", "[0, 1]"]),
    (["rollout.tp=8", "rollout.gpus=4"], ["rollout.tp = 8 does not fit rollout.gpus = 4", "multiple"]),
    (["rollout.tp=3", "rollout.gpus=8"], ["rollout.tp = 3", "rollout.gpus = 9"]),
    (["rollout.tp=4", "rollout.gpus=4", "cluster.gpus=2"], ["cluster.gpus = 2", "at least 4"]),
    (["network.custom={roce", "=", "25e9}"], ["cut short", "quote the whole override"]),
    # pp = 1024 on an 8-rank trainer divided the per-tensor reshard by 1024 stages
    (["trainer.pp=1024"], ["trainer.pp x trainer.tp = 1024 x 1 = 1024 exceeds the trainer's 8 GPUs", "at least 1024"]),
    (["trainer.pp=2", "trainer.tp=8"], ["2 x 8 = 16 exceeds the trainer's 8 GPUs", "lower trainer.pp or trainer.tp"]),
    (["trainer.ep=16", "trainer.gpus=12"], ["1 x 16 = 16 exceeds the trainer's 12 GPUs", "trainer.ep"]),
    (["trainer.pp=8", "policy.layers=4"], ["trainer.pp = 8 exceeds policy.layers = 4", "trainer.pp <= 4"]),
    # the teacher's sampling (GKD's seq_kd)
    (["phases.teacher_sample_share=1.5"], ["phases.teacher_sample_share", "less than or equal to 1"]),
    (["phases.teacher_sample_share=true"], ["phases.teacher_sample_share", "yes/no value"]),
    (["phases.teacher_sample_share=0.5"], ["teacher_sample_share = 0.5 with phases.teacher_params = 0", "no teacher"]),
    (["phases.teacher_sample_share=0.5", "phases.teacher_params=1e9", "phases.teacher_placement=pool"],
     ["phases.teacher_placement = 'pool'", "set phases.teacher_placement = 'inline'"]),
    (["phases.teacher_params=1e9", "phases.teacher_sample_s=3"], ["teacher_sample_s = 3 with phases.teacher_sample_share = 0"]),
    (["phases.teacher_sample_s=-1"], ["phases.teacher_sample_s", "greater than or equal to 0"]),
    (["phases.teacher_sample_tokens=0"], ["phases.teacher_sample_tokens", "greater than 0"]),
    (["phases.teacher_sample_tokens=20000"], ["teacher_sample_tokens = 20000 exceeds tail.max_tokens = 16384",
                                              "at least 20000"]),
])
def test_bad_plan_inputs_are_one_line_with_the_fix(capsys, argv, words):
    code, out, err = run_plan(capsys, "--defaults", *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "fix" in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("override", ["network.custom={roce = 25e9}", "network.custom={roce=25e9}",
                                      "network.custom={roce: 25e9}"])
def test_inline_table_overrides_toml_or_yaml(capsys, override):
    code, out, err = run_plan(capsys, "--json", override, "network.sync_link=roce")
    assert code == 0, err
    d = json.loads(out)
    assert d["tiers"]["roce"] == 25e9
    assert d["sync_times"]["full"]["roce"] > d["sync_times"]["full"]["rdma"]  # 25 GB/s is slower than 50


def test_options_and_overrides_in_any_order(capsys):
    f = str(EXAMPLES / "plan_runbook.toml")
    orders = ([f, "--json", "rollout.prompts=10"], ["--json", f, "rollout.prompts=10"],
              ["rollout.prompts=10", f, "--json"], [f, "--set", "rollout.prompts=10", "--json"])
    docs = []
    for argv in orders:
        code, out, err = run_plan(capsys, *argv)
        assert code == 0, (argv, err)
        docs.append(json.loads(out))
    assert all(d["inputs"]["rollout"]["prompts"] == 10 for d in docs)
    assert len({json.dumps(d["bytes"], sort_keys=True) for d in docs}) == 1


def test_trainer_parallelism_at_its_bounds_prices():
    # pp x tp and pp x ep equal to the trainer's GPUs, pp equal to the layers: accepted
    p = load_plan(None, ["trainer.pp=4", "trainer.tp=2", "trainer.ep=2", "policy.layers=4"])
    assert (p.trainer.pp, p.trainer.tp, p.trainer.ep) == (4, 2, 2)


def test_scientific_notation_reaches_integer_fields():
    # TOML reads 1e3 as a number (YAML 1.1 would read a string): an integer field takes 1000.
    assert load_plan(None, ["rollout.prompts=1e3"]).rollout.prompts == 1000


def test_expected_longest_survives_huge_counts():
    # 1 - 1/(n+1) rounds to 1.0 for n ~ 1e16; the quantile is taken by symmetry instead.
    assert M.expected_longest(10**20, mean=4096, sigma=0.6, cap=16384) == 16384
    assert M.expected_longest(10**15, mean=100, sigma=0.6, cap=1e12) > M.expected_longest(10**6, mean=100, sigma=0.6,
                                                                                       cap=1e12)


@pytest.mark.parametrize("prompts, samples", [(4, 10**6), (10**9, 1), (10**9, 10**6), (256, 8)])
def test_tail_whatif_draws_are_bounded(prompts, samples):
    tw = tail_whatif(prompts=prompts, samples=samples, overprovision=0.25, steps=8, seed=0, cap=16384,
                     rollout_s=100.0, mean=4096, sigma=0.6)
    # At most MAX_UNITS (x1.25 issued) units per round, each at most EXACT_DRAWS draws, plus the fixed
    # 4000-draw percentile pool: independent of prompts x samples.
    per_round = (MAX_UNITS * 1.25 + 2) * EXACT_DRAWS
    assert tw.draws <= 2 * 8 * per_round + 4000 + 1
    assert 1 <= tw.plain_round_tokens <= 16384 and tw.speedup > 0


def test_order_statistic_draws_match_exact_draws():
    # A unit of 64 responses drawn by order statistics prices the round like 64 exact draws do
    # (same distribution of the maximum; Monte Carlo over 64 rounds, 10% agreement).
    kw = dict(prompts=64, overprovision=0.25, steps=64, seed=1, cap=10**6, rollout_s=1.0, mean=500, sigma=0.6)
    exact = tail_whatif(samples=EXACT_DRAWS, **kw)  # 16 exact draws per prompt
    many = tail_whatif(samples=EXACT_DRAWS + 1, **kw)  # 17: order statistics
    assert many.plain_round_tokens == pytest.approx(exact.plain_round_tokens, rel=0.1)
    assert many.plain_bubble == pytest.approx(exact.plain_bubble, abs=0.05)


def test_a_million_samples_plan_end_to_end(capsys):
    code, out, err = run_plan(capsys, "--defaults", "--json", "rollout.samples=1000000")
    assert code == 0, err
    assert json.loads(out)["tail_whatif"]["draws"] < 100_000


@pytest.mark.parametrize("example", ["plan_verl_async_128.toml", "plan_runbook.toml"])
def test_algorithm_seconds_count_at_equal_hardware(example):
    base = load_plan(EXAMPLES / example)
    steps = {}
    for a in (0.0, 13.98, 200.0, 500.0):
        plan = make_plan(base.model_copy(update={"phases": base.phases.model_copy(update={"algorithm_s": a})}))
        steps[a] = {k: v["step_s"] for k, v in plan.equal_hardware().items()}
    for name in steps[0.0]:
        series = [steps[a][name] for a in (0.0, 13.98, 200.0, 500.0)]
        # Never faster with more work, and 500 s of algorithm work cannot hide entirely.
        assert series == sorted(series) and series[-1] > series[0], (name, series)
    # Colocated serializes every phase: its step grows by exactly the added algorithm seconds.
    assert steps[500.0]["colocated"] - steps[0.0]["colocated"] == pytest.approx(500.0)


# ---- bounds: every count has an upper bound, and a count at its bound prices fast ----

@pytest.mark.parametrize("argv, words", [
    (["cluster.gpus=1e15"], ["cluster.gpus", "less than or equal to 1000000"]),
    (["rollout.gpus=1e9"], ["rollout.gpus", "less than or equal to 1000000"]),
    (["trainer.dp=1e7"], ["trainer.dp", "less than or equal to 1000000"]),
    (["tail.steps=10000"], ["tail.steps", "less than or equal to 64"]),
    (["network.senders=9"], ["network.senders = 9 exceeds rollout.gpus = 8", "network.senders <= 8"]),
    (["rollout.avg_tokens=20000"], ["rollout.avg_tokens = 20000 exceeds tail.max_tokens = 16384", "at least 20000"]),
    (["sync.staleness_bound=1e7"], ["sync.staleness_bound", "less than or equal"]),
])
def test_counts_beyond_their_bound_are_one_line(capsys, argv, words):
    code, out, err = run_plan(capsys, "--defaults", *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "fix" in err, err
    for w in words:
        assert w in err, (w, err)


def _int_fields(model, prefix=""):
    from pydantic import BaseModel

    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _int_fields(f.annotation, prefix + name + ".")
        elif "int" in str(f.annotation) and "float" not in str(f.annotation):
            yield prefix + name, f


def test_every_count_field_has_an_upper_bound():
    from rollyard.plan.inputs import PlanInputs

    fields = dict(_int_fields(PlanInputs))
    assert {"cluster.gpus", "rollout.gpus", "trainer.dp", "network.senders", "tail.steps"} <= set(fields)
    unbounded = [k for k, f in fields.items()
                 if not any(hasattr(m, a) for m in f.metadata for a in ("le", "lt", "max_length"))]
    assert not unbounded, unbounded


def test_split_search_is_bounded_and_finds_the_exhaustive_best(monkeypatch):
    from rollyard.plan import hardware as H

    calls = []

    def price(k):  # a step that falls then rises with the rollout pool, with a flat stretch
        calls.append(k)
        return M.PoolSplit("async", k, 10**6 - k, 0.0, 0.0, 0.0, max(5e5 / k, k / 3e3, 20.0) + k * 1e-9)

    rows = H.search_splits(price, 10**6 - 1, 8)
    assert len(calls) == len(set(calls)) <= 6 * M.SPLIT_POINTS  # not 1e6 prices
    best = min(rows, key=lambda r: r.step_s)
    exhaustive = min(range(1, 10**6), key=lambda k: max(5e5 / k, k / 3e3, 20.0) + k * 1e-9)
    assert best.rollout_gpus == exhaustive and any(r.rollout_gpus == 8 for r in rows)  # the configured split too
    # On a real plan of 1000 GPUs (999 splits: refined), the same best split as pricing all of them.
    p = load_plan(None, ["cluster.gpus=1000"])
    refined = make_plan(p).equal
    monkeypatch.setattr(M, "SPLIT_POINTS", 10**6)
    every = make_plan(p).equal
    assert len(every["async"]["all"]) == 999 > len(refined["async"]["all"])
    for name in ("disaggregated", "async"):
        assert refined[name]["best"].rollout_gpus == every[name]["best"].rollout_gpus, name
    monkeypatch.undo()
    # A million GPUs prices a bounded number of splits (pricing every one took 41 s).
    big = make_plan(load_plan(None, ["cluster.gpus=1e6"])).equal
    assert all(len(big[n]["all"]) <= 6 * M.SPLIT_POINTS for n in ("disaggregated", "async"))


def test_pp_beyond_the_trainer_is_refused_by_the_cli_in_one_line():
    # Through the installed `rollyard plan` command (a real subprocess): pp = 1024 on the default
    # 8-rank trainer is one line naming the rule, the values and the fix, exit 2, nothing on stdout, no traceback.
    import subprocess
    import sys
    exe = Path(sys.executable).parent / "rollyard"
    r = subprocess.run([str(exe), "plan", "--defaults", "trainer.pp=1024"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "trainer.pp x trainer.tp = 1024 x 1 = 1024 exceeds the trainer's 8 GPUs" in r.stderr and "fix" in r.stderr
