"""The memory model and the planner: pruning never drops a config that AOT says fits; search logic."""

import json
from pathlib import Path

import pytest

from multislice import config, maxtext, memory, tpu
from multislice.plan import resolve_degrees
from multislice.preflight import planner

RECORDED = json.loads((Path(__file__).with_name("data") / "aot_recorded.json").read_text())["results"]


def test_parameter_counts_match_maxtext():
    # Llama 3 8B and 70B as published (8.03B, 70.55B); the local stages as the verifier counted
    # MaxText's own parameter tree (2 x 128256 x 64 embedding and head plus the layers).
    assert memory.ModelDims(**maxtext.MODEL_DIMS["llama3-8b"]).parameters == 8_030_261_248
    assert round(memory.ModelDims(**maxtext.MODEL_DIMS["llama3-70b"]).parameters / 1e9, 2) == 70.55
    local = config.load_profile("local")
    assert [memory.model_dims(s).parameters for s in local.stages] == [16_539_968, 16_663_104]


def knobs_of(entry: dict) -> tuple[memory.ModelDims, memory.Knobs, int]:
    """Model dims, knobs and sequence length of a recorded compile, read from its MaxText arguments."""
    args = dict(a.split("=", 1) for a in entry["maxtext_args"])
    if "model_name" in args:
        dims = memory.ModelDims(**maxtext.MODEL_DIMS[args["model_name"]])
    else:
        dims = memory.ModelDims(
            **{k: int(args[maxtext.MODEL_DIM_KEYS[k]]) for k in maxtext.MODEL_DIM_KEYS},
            tied_embedding=args.get("logits_via_embedding") == "true",
        )
    shape = tpu.parse_tpu_type(entry["compile_topology"])
    ici = {a: int(args.get(f"ici_{a}_parallelism", maxtext.ICI_DEFAULTS.get(a, 1))) for a in maxtext.PARALLELISM_AXES}
    dcn = {a: int(args.get(f"dcn_{a}_parallelism", maxtext.DCN_DEFAULTS.get(a, 1))) for a in maxtext.PARALLELISM_AXES}
    knobs = memory.Knobs(
        per_device_batch_size=float(args["per_device_batch_size"]),
        remat_policy=args.get("remat_policy", "full"),
        ici=resolve_degrees(ici, shape.chips),
        dcn=resolve_degrees(dcn, entry["num_slices"]),
        optimizer_offload=args.get("optimizer_memory_host_offload") == "true",
        parameter_offload=args.get("parameter_memory_host_offload") == "true",
        weight_dtype=args.get("weight_dtype", "float32"),
    )
    return dims, knobs, int(args["max_target_length"])


def test_the_recorded_set_has_fits_and_does_not_fits_of_the_70b_on_v6e():
    verdicts = {(e["compile_topology"], e["verdict"]) for e in RECORDED if "llama3-70b" in str(e["maxtext_args"])}
    assert verdicts == {("v6e-16", "fits"), ("v6e-16", "does_not_fit")}


@pytest.mark.parametrize("entry", RECORDED, ids=lambda e: f"{e['compile_topology']}x{e['num_slices']}-{e['verdict']}")
def test_lower_bound_never_prunes_a_config_aot_says_fits(entry):
    dims, knobs, seq = knobs_of(entry)
    usable = tpu.parse_tpu_type(entry["compile_topology"]).usable_hbm_bytes_per_chip
    estimate = memory.estimate(dims, knobs, seq)
    if entry["verdict"] == "fits":
        assert estimate.lower_bound_bytes <= entry["total_bytes"] <= usable
        kept, pruned = planner.prune([_candidate(knobs, estimate)], usable)
        assert kept and not pruned
        if entry["total_bytes"] > 2**30:  # tiny models are dominated by code and runtime buffers
            assert abs(estimate.estimate_bytes - entry["total_bytes"]) / entry["total_bytes"] < 0.25
    else:
        assert estimate.estimate_bytes > usable  # the estimate agrees it does not fit


def _candidate(knobs, estimate):
    stage = config.load_profile("gke-v6e-16x2-seed").stages[1]
    return planner.Candidate(stage, 2, knobs, estimate, 0.3, 4096.0)


class RuleCompiler:
    """Stands in for AOT compile in search-logic tests: fits when the memory estimate is under ``fraction`` of HBM."""

    def __init__(self, spec: config.RunSpec, fraction: float = 0.95):
        self.spec, self.fraction, self.requests = spec, fraction, []

    def compile(self, request: dict, timeout: float = 0) -> dict:
        self.requests.append(request)
        args = dict(a.split("=", 1) for a in request["maxtext_args"])
        entry = {"compile_topology": request["compile_topology"], "num_slices": request["num_slices"],
                 "maxtext_args": [f"{k}={v}" for k, v in args.items()]}  # fmt: skip
        dims, knobs, seq = knobs_of(entry)
        estimate = memory.estimate(dims, knobs, seq).estimate_bytes
        usable = self.spec.slice_type.usable_hbm_bytes_per_chip
        if estimate <= self.fraction * usable:
            return {"verdict": "fits", "compile_seconds": 0.0, "memory": {"total": estimate, "argument": 0,
                    "output": 0, "alias": 0, "temp": estimate, "generated_code": 0, "host_argument": 0,
                    "host_temp": 0}}  # fmt: skip
        return {"verdict": "does_not_fit", "compile_seconds": 0.0, "oom": {"required_bytes": estimate}}


def test_search_verifies_up_to_want_fits_and_ranks_them_by_estimated_mfu():
    spec = config.load_profile("gke-v6e-16x2-seed")
    compiler = RuleCompiler(spec)
    found = planner.search(spec, spec.stage("llama3-70b"), compiler, want=2, on_progress=lambda _: None)
    assert len(found.fitting) == 2 and found.fewest_slices == 2
    assert all(c.verdict == "fits" for c in found.fitting)
    assert found.fitting[0].estimated_mfu >= found.fitting[1].estimated_mfu
    assert len(compiler.requests) == len(found.tried)
    assert all(r["compile_topology"] == "v6e-16" and r["num_slices"] == 2 for r in compiler.requests)


def test_nearest_alternative_to_the_seed_70b_is_batch_1_with_optimizer_offload():
    spec = config.load_profile("gke-v6e-16x2-seed")
    seed = spec.stage("seed-llama3-70b")
    usable = spec.slice_type.usable_hbm_bytes_per_chip
    kept, pruned = planner.prune(planner.candidates(spec, seed, 2), usable)
    first = planner.order(kept, usable, nearest=True)[0]
    assert first.changes == ["per_device_batch_size 2 -> 1", "optimizer_offload False -> True"]
    assert first.stage.maxtext_overrides == {"optimizer_memory_host_offload": True}
    assert pruned > 0  # e.g. every float32 config without offload: its state alone exceeds 31.24 GiB per chip


def test_the_planner_offers_dcn_data_parallelism_for_the_production_70b_where_it_may_fit():
    """DCN data 2 instead of the stage's DCN FSDP 2 (docs/preflight.md): kept only with the moments offloaded."""
    spec = config.load_profile("gke-v6e-16x2")
    stage = spec.stage("llama3-70b")
    usable = spec.slice_type.usable_hbm_bytes_per_chip
    fixed = {"per_device_batch_size": 2, "weight_dtype": "bfloat16", "parameter_offload": False}
    kept, _ = planner.prune(planner.candidates(spec, stage, 2, fixed=fixed), usable)
    data = [c for c in kept if c.knobs.dcn["data"] == 2 and c.knobs.ici["fsdp"] == 16]
    assert data and all(c.knobs.optimizer_offload for c in data)  # its state alone is 35.3 GB per chip without
    assert all("dcn {'fsdp': 2} -> {'data': 2}" in c.changes for c in data)
    fsdp = {(c.knobs.remat_policy, c.knobs.optimizer_offload): c for c in kept if c.knobs.dcn["fsdp"] == 2}
    for c in data:  # the same knobs over DCN FSDP rank below (fewer DCN bytes, one overlapped all-reduce)
        twin = fsdp.get((c.knobs.remat_policy, True))
        assert twin is None or c.estimated_mfu > twin.estimated_mfu


def test_search_tries_more_slices_and_reports_the_fewest_that_fit():
    spec = config.load_profile("gke-v6e-16x2-seed")
    fixed = {"optimizer_offload": False, "parameter_offload": False, "weight_dtype": "float32"}
    compiler = RuleCompiler(spec)
    found = planner.search(
        spec, spec.stage("llama3-70b"), compiler, num_slices=1, fixed=fixed, want=1, on_progress=lambda _: None
    )
    assert found.slices_tried[0] == 1 and found.fewest_slices == found.slices_tried[-1] > 2
    assert found.pruned[1] > 0 and found.pruned[2] > 0  # parameters, moments and gradients alone exceed HBM


class NoCompiler:
    def compile(self, request, timeout=0):
        raise AssertionError("nothing should be compiled: every candidate is pruned")


def test_a_model_no_slice_count_can_hold_is_reported_without_compiling():
    spec = config.load_profile("gke-v6e-16x2", {"tpu_type": "v5e-4", "num_slices": 1, "stages.1.ici": {},
                                                "stages.1.dcn": {}, "stages.0.ici": {}, "stages.0.dcn": {},
                                                "stages.0.elastic": None})  # fmt: skip
    stage = spec.stage("llama3-70b").model_copy(update={"model": config.ModelSpec(name="llama3.1-405b")})
    found = planner.search(spec, stage, NoCompiler(), max_slices=8, on_progress=lambda _: None)
    assert found.fitting == [] and found.fewest_slices is None and found.exhausted
    assert found.slices_tried == list(range(1, 9)) and all(found.pruned[n] > 0 for n in found.slices_tried)


def test_a_global_batch_that_does_not_divide_is_refused():
    spec = config.load_profile("gke-v6e-16x2-seed")
    with pytest.raises(ValueError, match="does not divide over 32 chips"):
        planner.candidates(spec, spec.stage("llama3-70b"), 2, global_batch=48)
    [pdb] = {
        c.knobs.per_device_batch_size for c in planner.candidates(spec, spec.stage("llama3-70b"), 2, global_batch=64)
    }
    assert pdb == 2


class SlowAfterFirst(RuleCompiler):
    """The first compile answers; the next outruns the time it is given (as a 14-minute compile would)."""

    def compile(self, request: dict, timeout: float = 0) -> dict:
        if self.requests:
            self.requests.append(request)
            raise planner.CompileTimeout(f"no AOT verdict within {timeout:.0f} s")
        return super().compile(request, timeout)


def test_search_compiles_the_stages_own_config_first_and_stops_a_compile_that_outruns_the_budget():
    spec = config.load_profile("gke-v6e-16x2-seed")
    stage = spec.stage("llama3-70b")  # per-device batch 1, ICI tensor 4 x FSDP 4, DCN FSDP 2, optimizer offload
    compiler = SlowAfterFirst(spec)
    lines = []
    found = planner.search(spec, stage, compiler, want=3, on_progress=lines.append)
    first = dict(a.split("=", 1) for a in compiler.requests[0]["maxtext_args"])
    assert (first["per_device_batch_size"], first["ici_tensor_parallelism"], first["ici_fsdp_parallelism"]) == (
        "1",
        "4",
        "4",
    )
    assert first["optimizer_memory_host_offload"] == "true" and first["dcn_fsdp_parallelism"] == "2"
    assert [c.changes for c in found.fitting] == [[]]  # the stage as it is: verified, then the budget ran out
    assert not found.exhausted and len(compiler.requests) == 2
    assert any("outran" in line for line in lines)


def test_ici_splits_follow_whole_physical_axes():
    assert planner.ici_degrees("4x4") == {1, 4, 16}  # no tensor 2 or 8 on a v6e-16 without splitting an axis
    assert planner.ici_degrees("2x4") == {1, 2, 4, 8}
    assert planner.ici_degrees("2x2x2") == {1, 2, 4, 8}
    spec = config.load_profile("gke-v6e-16x2-seed")
    tensors = {c.knobs.ici["tensor"] for c in planner.candidates(spec, spec.stage("llama3-70b"), 2)}
    assert tensors == {1, 4}
