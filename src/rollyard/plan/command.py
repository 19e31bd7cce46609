"""`rollyard plan` and `rollyard review`: argument parsing, output files, exit codes.

Exit codes: 0 done; 2 bad input (a plan field, a file, a run directory), with one clear message
on stderr and no traceback; ``review --check`` returns 1 when a verification item fails.
Runnable on its own: ``python -m rollyard.plan.command plan|review ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollyard.config import ConfigError
from rollyard.telemetry.rundir import RunDirError

BAD_INPUT = (ConfigError, RunDirError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Options and positionals in any order (``plan FILE --json key=value``)."""
    try:
        return p.parse_intermixed_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed by argparse)
        return int(e.code or 0)


def _fail(cmd: str, e: BaseException) -> int:
    msg = " ".join(str(e).split()) if "\n" not in str(e) else str(e)
    print(f"rollyard {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _write(out: Path, files: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_text(content)


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollyard plan",
        description="Price an RL step before it runs: edges and bytes, sync time per network tier, steps/hour per "
                    "placement, the decision tree, a decision record, budget and tail-batching what-ifs.")
    p.add_argument("args", nargs="*", metavar="FILE | key.sub=value",
                   help="a plan file (.toml/.yaml; none = the runbook defaults) and field overrides, "
                        "e.g. policy.params=7e9 trainer.dp=4")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a field override (repeatable)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument("--defaults", action="store_true", help="allow an empty plan file: price the runbook's reference "
                                                           "workload (without it an empty file is an error)")
    p.add_argument("--out", metavar="DIR", help="write plan.json, plan.yaml (resolved inputs), decision_record.md, "
                                                "timeline.txt and timeline.png to DIR")
    p.add_argument("--calibrate-from", metavar="RUN_DIR",
                   help="price the plan with rates measured in RUN_DIR (a baseline run on this machine): its shape, "
                        "decode bandwidth, trainer FLOP/s, measured reward/reference/algorithm seconds, sync software "
                        "cost and its step-to-step spread as the budget tolerance; overrides apply on top. With --out, "
                        "DIR/plan.yaml is the budget for `rollyard review RUN --plan DIR/plan.yaml --check`")
    p.add_argument("--lengths-from", metavar="RUN_DIR", help="tail what-if: response lengths from RUN_DIR/lengths.jsonl")
    p.add_argument("--fields", action="store_true", help="list every plan field with its default, unit and bounds")
    p.add_argument("--list-optimizations", action="store_true", help="list the budget what-if's optimizations")
    return p


def plan_main(argv: list[str]) -> int:
    args = _parse(plan_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        return _plan(args)
    except BAD_INPUT as e:
        return _fail("plan", e)


def _plan(args: argparse.Namespace) -> int:
    from rollyard.plan import inputs as I
    from rollyard.plan.planner import make_plan
    from rollyard.plan.record import decision_record
    from rollyard.plan.render import console, print_plan
    from rollyard.plan.whatif import CATALOG

    if args.fields:
        print("\n".join(I.describe()))
        return 0
    if args.list_optimizations:
        for o in CATALOG.values():
            factor = f"{o.factor:.3g}x" if o.factor != float("inf") else "off-path"
            print(f"{o.name:<26} {o.role:<10} {factor:>8}  {o.seed_says}")
        return 0
    files = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a] + args.set
    for o in overrides:
        value = o.split("=", 1)[1]
        if value.count("{") != value.count("}") or value.count("[") != value.count("]") or not o.split("=", 1)[0]:
            raise I.PlanError(f"override {o!r} is cut short: the shell split it at a space; fix: quote the whole "
                              f"override, e.g. 'network.custom={{roce = 25e9}}'")
    if len(files) > 1:
        raise I.PlanError(f"give one plan file, got {len(files)}: {', '.join(files)}")
    lengths = source = None
    if args.calibrate_from:
        from rollyard.plan.calibrate import calibrate

        if files:
            raise I.PlanError(f"--calibrate-from builds the plan from {args.calibrate_from}; got a plan file too "
                              f"({files[0]}); fix: drop the file, and give changes as key.sub=value overrides")
        data, _ = calibrate(args.calibrate_from)
        inputs = I.load_plan_data(data, overrides)
        lengths = [n for step in _run_lengths(args.calibrate_from).values() for n in step] or None
        source = f"{args.calibrate_from} ({len(lengths or [])} responses)"
    else:
        inputs = I.load_plan(files[0] if files else None, overrides, defaults=args.defaults)
    if args.lengths_from:
        from rollyard.plan.review import read_lengths
        lengths = [n for step in read_lengths(args.lengths_from).values() for n in step]
        if not lengths:
            raise RunDirError(f"{args.lengths_from}: lengths.jsonl holds no response lengths")
        source = f"{args.lengths_from} ({len(lengths)} responses)"
    plan = make_plan(inputs, lengths, source)
    bad = _non_finite(plan.as_dict())
    if bad:
        raise I.PlanError(f"the plan overflows: {bad} is not a finite number; fix: check the exponents of the inputs "
                          f"(rollyard plan --fields lists every unit)")
    record = decision_record(plan)
    if args.json:
        print(json.dumps({**plan.as_dict(), "decision_record": record}, indent=1, default=str))
    else:
        c = console()
        print_plan(plan, c)
        c.print()
    if args.out:
        write_plan(plan, record, Path(args.out))
        if not args.json:
            print(f"wrote {args.out}/: plan.json, plan.yaml, decision_record.md, timeline.txt, timeline.png")
    elif not args.json:
        print()
        print(record)
    return 0


def _run_lengths(run_dir: str) -> dict[int, list[int]]:
    from rollyard.plan.review import read_lengths

    return read_lengths(run_dir, required=False)


def _non_finite(doc, path: str = "") -> str | None:
    """The dotted path of the first infinite or NaN number in ``doc``, or None."""
    import math

    if isinstance(doc, float) and not math.isfinite(doc):
        return path or "a figure"
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def write_plan(plan, record: str, out: Path) -> None:
    import yaml

    from rollyard.plan.simulate import timeline_png, timeline_text

    timeline = []
    for name, res in plan.sims.items():
        timeline.append(f"{name}: {res.period_s:.1f} s/step, {res.steps_per_hour:.1f} steps/h")
        timeline += timeline_text(res) + [""]
    _write(out, {
        "plan.json": json.dumps(plan.as_dict(), indent=1, default=str),
        "plan.yaml": yaml.safe_dump(plan.inputs.model_dump(mode="json"), sort_keys=False),
        "decision_record.md": record,
        "timeline.txt": "\n".join(timeline),
    })
    timeline_png(list(plan.sims.values()), out / "timeline.png")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": plan_main, "review": review_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m rollyard.plan.command plan|review [args]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def review_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollyard review",
        description="Hold a measured run against its plan: per-phase breakdown vs budget, overlap, staleness and "
                    "traffic audits, and the decision record with a Verification section.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `rollyard train`")
    p.add_argument("--plan", metavar="FILE", help="plan file (.toml/.yaml) with the phase budget; none = build the "
                                                  "plan from RUN_DIR/run.json, without a budget")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a --plan field")
    p.add_argument("--tolerance", type=float, help="fraction a phase may run over budget (default: the plan's "
                                                   "budget.tolerance, 0.2)")
    p.add_argument("--json", action="store_true", help="print the review as JSON instead of tables")
    p.add_argument("--out", metavar="DIR", help="write review.json and decision_record.md to DIR")
    p.add_argument("--check", action="store_true", help="exit 1 when a verification item fails or the budget is "
                                                         "not checked (no --plan; see plan --calibrate-from); items "
                                                         "a run cannot show say NOT CHECKED and why, and pass")
    return p


def review_main(argv: list[str]) -> int:
    args = _parse(review_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        return _review(args)
    except BAD_INPUT as e:
        return _fail("review", e)


def _review(args: argparse.Namespace) -> int:
    from rollyard.plan.inputs import PlanError
    from rollyard.plan.record import decision_record
    from rollyard.plan.render import console
    from rollyard.plan.review import PASS, print_review, review

    if args.set and not args.plan:
        raise PlanError("--set overrides a --plan file's fields; pass --plan FILE too")
    if args.tolerance is not None and not (0 <= args.tolerance < float("inf")):
        raise PlanError(f"--tolerance must be a finite fraction >= 0, got {args.tolerance}; fix: e.g. --tolerance 0.2")
    rv = review(args.run_dir, args.plan, args.tolerance, args.set)
    note = "" if args.plan else f" (from {rv.run.path.name}/run.json)"
    record = decision_record(rv.plan, rv.verification, title_note=note)
    if args.json:
        print(json.dumps({**rv.as_dict(), "decision_record": record}, indent=1, default=str))
    else:
        c = console()
        print_review(rv, c)
    if args.out:
        _write(Path(args.out), {"review.json": json.dumps(rv.as_dict(), indent=1, default=str),
                                "decision_record.md": record})
        if not args.json:
            print(f"wrote {args.out}/: review.json, decision_record.md")
    elif not args.json:
        print()
        print(record)
    if args.check and rv.verdict != PASS:
        from rollyard.plan.review import blocks

        bad = [f"{v['item']}: {v['result']}" for v in rv.verification if blocks(v)]
        print(f"rollyard review: --check: {len(bad)} item(s) did not pass: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
