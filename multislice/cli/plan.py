"""``multislice plan``: search AOT-verified configs of a stage that fit in HBM, ranked by estimated speed."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from multislice import config, storage, timings, tpu
from multislice.cli.common import check_cache_dir, check_output, preflight_plan, with_profile, write_json
from multislice.config.values import INT32_MAX, MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS
from multislice.preflight import planner, user_cache_dir

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "plan": "multislice plan --profile gke-v6e-16x2 --model llama3-70b --tpu-type v6e-16 --max-slices 4",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice plan`` with its handler (``argv``: the command line)."""
    pln = sub.add_parser("plan", help="search AOT-verified configs that fit in HBM, ranked by estimated speed")
    with_profile(pln)
    pln.add_argument("--stage", help="the stage to start from (default: the first)")
    pln.add_argument("--model", help="MaxText model_name instead of the stage's (e.g. llama3-70b)")
    pln.add_argument("--tpu-type", help="slice type instead of the profile's (e.g. v6e-16)")
    pln.add_argument("--num-slices", type=int, help="slice count to start from (default: the profile's)")
    pln.add_argument("--max-slices", type=int, default=8, help="most slices to try when fewer do not fit (default 8)")
    pln.add_argument("--seq", type=int, help="sequence length (max_target_length)")
    pln.add_argument("--global-batch", type=int, help="fix sequences per step across all chips")
    pln.add_argument(
        "--fix", action="append", metavar="KNOB=VALUE", help="do not vary a knob (e.g. weight_dtype=float32)"
    )
    pln.add_argument("--want", type=int, default=3, help="fitting configs to verify")
    pln.add_argument("--budget", type=float, default=540, help="seconds of compiling to spend")
    pln.add_argument("--cache-dir", help="verdict cache (default: as for preflight)")
    pln.add_argument("--work-dir", help="scratch directory (default build/plan/<stage>)")
    pln.add_argument("--report", help="also write the JSON result here")
    pln.set_defaults(func=cmd_plan)


#: ``multislice plan``'s bounds: ``--want`` fitting configs (one slice count has at most 4 x 4 x 4 x 2 x 2 x 2 x 2
#: = 1,024 candidates, :func:`multislice.preflight.planner.candidates`); ``--max-target-length`` as the spec's
#: ``max_target_length``.
MAX_PLAN_WANT = 1024


def _plan_option_issues(args: argparse.Namespace, chips: int, first_slices: int) -> list[tuple[str, str]]:
    """``(option, message)`` for each bad ``multislice plan`` option, checked before the spec is changed.

    ``chips``: chips per slice of the planned TPU type; ``first_slices``: the slice count the search starts at.
    """
    issues: list[tuple[str, str]] = []

    def whole(option: str, value: int | None, low: int, high: int, what: str) -> None:
        if value is not None and not low <= value <= high:
            issues.append((option, f"{value} is not {what}; give {low} to {high:,}"))

    whole("--num-slices", args.num_slices, 1, INT32_MAX, "a slice count (0 slices cannot train)")
    whole("--max-slices", args.max_slices, 1, INT32_MAX, "a slice count")
    whole("--seq", args.seq, 1, 2**20, "a sequence length")
    whole("--want", args.want, 1, MAX_PLAN_WANT, "a count of fitting configs")
    whole("--global-batch", args.global_batch, 1, INT32_MAX, "a global batch (sequences per step)")
    if not (math.isfinite(args.budget) and MIN_TIMEOUT_SECONDS <= args.budget <= MAX_TIMEOUT_SECONDS):
        issues.append(("--budget", f"{args.budget:g} s: give seconds of compiling, at least {MIN_TIMEOUT_SECONDS:g} "
                                   "(a shorter budget is spent before a single candidate is looked up, even in the "
                                   f"verdict cache) and at most {MAX_TIMEOUT_SECONDS:,}"))  # fmt: skip
    if args.global_batch is not None and not issues and not _batch_fits(args.global_batch, chips, first_slices,
                                                                        args.max_slices):  # fmt: skip
        last = max(first_slices, args.max_slices)
        issues.append(("--global-batch", f"{args.global_batch} sequences do not divide over the chips of any slice "
                                         f"count from {first_slices} to {last} ({chips} chips per slice); give a "
                                         f"multiple of {chips * first_slices}"))  # fmt: skip
    return issues


def _batch_fits(global_batch: int, chips: int, first: int, last: int) -> bool:
    """Whether ``global_batch`` divides over ``chips x s`` chips for some slice count ``s`` in ``first..last``."""
    if global_batch % chips:
        return False
    per_slice = global_batch // chips  # s must divide this; enumerate its divisors up to its square root
    divisor = 1
    while divisor * divisor <= per_slice:
        if per_slice % divisor == 0 and any(first <= d <= last for d in (divisor, per_slice // divisor)):
            return True
        divisor += 1
    return False


def _fixed_knobs(pairs: list[str]) -> dict[str, Any]:
    """``--fix KNOB=VALUE`` as the planner's fixed knobs, each checked against what the planner varies.

    Raises:
        ConfigError: (field ``--fix``) an unknown knob, or a value the planner would never try.
    """
    choices: dict[str, Any] = {
        "per_device_batch_size": "a number > 0",
        "remat_policy": planner.REMAT_CHOICES,
        "optimizer_offload": (True, False),
        "parameter_offload": (True, False),
        "weight_dtype": ("float32", "bfloat16"),
    }
    fixed, issues = {}, []
    try:
        parsed = config.parse_set_arguments(pairs)
    except config.ConfigError as error:
        fix = "give --fix KNOB=VALUE, e.g. --fix weight_dtype=float32"
        raise config.ConfigError([("--fix", f"{message.replace('--set', '--fix')}; {fix}")
                                  for _, message in error.issues]) from None  # fmt: skip
    for key, value in parsed.items():
        if key not in choices:
            issues.append(("--fix", f"{key!r} is not a knob the planner varies; fix one of {', '.join(choices)} "
                                    "(ICI and DCN: set stages.N.ici / stages.N.dcn in the profile)"))  # fmt: skip
            continue
        allowed = choices[key]
        if key == "per_device_batch_size":
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = number and math.isfinite(value) and 0 < value <= 2**16
        else:
            ok = any(value is c if isinstance(c, bool) else value == c for c in allowed)
        if not ok:
            shown = allowed if isinstance(allowed, str) else ", ".join(str(c).lower() for c in allowed)
            issues.append(("--fix", f"{key}={value!r}: give {shown}"))
            continue
        fixed[key] = value
    if issues:
        raise config.ConfigError(issues)
    return fixed


def cmd_plan(args: argparse.Namespace) -> int:
    """Search fitting configs for a stage; prints them ranked, or the fewest slices that fit, or that none do.

    Every option is checked before anything is written or compiled (exit 2, the option and the fix named).
    """
    from multislice.backends.local.aot import AotSession  # jsonschema and the CRDs (0.5 s): local runs only

    if args.report:
        check_output("--report", args.report, directory=False, suffixes=(".json",))
    if args.work_dir is not None:
        check_output("--work-dir", args.work_dir, directory=True)
    if args.cache_dir is not None:
        check_cache_dir("--cache-dir", args.cache_dir, remote_ok=False)
    fixed = _fixed_knobs(args.fix or [])
    plan, stages = preflight_plan(args)
    spec, stage = plan.spec, plan.spec.stage(stages[0].name)
    try:
        slice_type = tpu.parse_tpu_type(args.tpu_type) if args.tpu_type is not None else spec.slice_type
    except (ValueError, KeyError, config.ConfigError) as error:
        raise config.ConfigError([("--tpu-type", str(error).strip("'\""))]) from None
    first = args.num_slices if args.num_slices is not None else spec.num_slices
    if issues := _plan_option_issues(args, slice_type.chips, first):
        raise config.ConfigError(issues)
    updates: dict[str, Any] = {}
    if args.model is not None:
        try:
            updates["model"] = config.ModelSpec(name=args.model)
        except ValueError as error:  # pydantic's ValidationError: the model name's own message
            messages = [e.get("msg", str(e)).removeprefix("Value error, ") for e in getattr(error, "errors", list)()]
            raise config.ConfigError([("--model", "; ".join(messages) or str(error))]) from None
    if args.seq is not None:
        updates["max_target_length"] = args.seq
    # The planner compiles; it exports nothing: a stage's export (checked against its model) is not planned, and
    # with --model another model's export check would refuse the search (docs/preflight.md's 405B example).
    updates["export"] = None
    # Where the stage is in the profile: the single-stage spec below numbers it 0, the profile may not.
    where = next((f"stages[{i}]" for i, s in enumerate(spec.stages) if s.name == stage.name), None) or next(
        (f"example_stages[{i}]" for i, s in enumerate(spec.example_stages) if s.name == stage.name), "stages[0]"
    )
    stage = stage.model_copy(update=updates)
    spec = spec.model_copy(
        update={k: v for k, v in (("tpu_type", args.tpu_type), ("num_slices", args.num_slices)) if v is not None}
    )
    # The stage's own ICI and DCN split is the search's starting point (the "nearest" config, compiled first)
    # unless --tpu-type or --num-slices changes the chips it splits; then MaxText's defaults.
    reshaped = args.tpu_type is not None or args.num_slices is not None
    reset = {"stages.0.dcn": {}, "stages.0.ici": {}} if reshaped else {}
    try:
        spec = config.load_spec(config.spec_to_data(spec.with_stages(stage)), reset)
    except config.ConfigError as error:  # name the option that set the field
        options = {"tpu_type": "--tpu-type", "num_slices": "--num-slices", "max_target_length": "--seq",
                   "model": "--model"}  # fmt: skip
        raise config.ConfigError(
            [
                (next((o for f, o in options.items() if f in field), field.replace("stages[0]", where, 1)), message)
                for field, message in error.issues
            ]
        ) from None
    stage = spec.stages[0]
    cache = args.cache_dir or spec.preflight.cache_dir or user_cache_dir()
    if not storage.is_remote(cache):
        check_cache_dir("--cache-dir" if args.cache_dir else "preflight.cache_dir", cache, remote_ok=False)
    work = Path(args.work_dir or Path("build", "plan", stage.name)).absolute()
    print(
        f"planning {stage.model.label}, sequence {stage.max_target_length}, on {spec.num_slices}..{args.max_slices} x "
        f"{spec.tpu_type} ({spec.slice_type.usable_hbm_bytes_per_chip / 2**30:.2f} GiB usable HBM per chip); "
        f"verdict cache {cache}"
    )
    with AotSession(cache, work) as session:
        found = planner.search(
            spec,
            stage,
            session,
            max_slices=args.max_slices,
            global_batch=args.global_batch,
            fixed=fixed,
            want=args.want,
            budget_seconds=args.budget,
            compile_timeout=timings.timings_for(spec, "local").compile_timeout,
        )
    write_json(args.report, found.as_dict())
    if found.fitting:
        extra = "" if found.fewest_slices == spec.num_slices else f" (none on {spec.num_slices}: fewest that fit)"
        print(
            f"\n{len(found.fitting)} AOT-verified fitting config(s) on {found.fewest_slices} slices{extra}, best first:"
        )
        for rank, c in enumerate(found.fitting, 1):
            # A fitting candidate carries its AOT report, and a report that fits its bytes per chip.
            assert c.report is not None and c.report.bytes_per_chip is not None
            found_time = c.report.step_time
            speed = (
                f"estimated step {found_time.step_seconds:.3g} s, MFU {c.ranked_mfu:.1%} "
                f"({found_time.bound}-bound, from the compiled program)"
                if found_time is not None
                else f"heuristic MFU {c.estimated_mfu:.0%}"
            )
            print(
                f"  {rank}. {c.describe()}: {c.report.bytes_per_chip.total / 2**30:.2f} GiB per chip, "
                f"{speed}, {c.tokens_per_step_per_chip:g} tokens per step per chip"
            )
        print(f"searched in {found.seconds:.0f} s")
        return 0
    if not found.slices_tried:
        print(f"\nno slice count searched within the {args.budget:.0f} s budget; raise --budget")
    elif found.exhausted:
        print(
            f"\nnothing fits: no config of {stage.model.label} fits on "
            f"{found.slices_tried[0]}..{found.slices_tried[-1]} x {spec.tpu_type} "
            f"({sum(found.pruned.values())} candidates ruled out by the memory lower bound, "
            f"{len(found.tried)} by AOT compile). Use a TPU type with more HBM per chip, or more slices."
        )
    else:
        print(f"\nno fitting config verified within the {args.budget:.0f} s budget; raise --budget")
    return 1
