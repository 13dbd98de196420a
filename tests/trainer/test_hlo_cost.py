# ruff: noqa: E501 - HLO lines are as XLA prints them
"""The compiled step's costs from its HLO: loop trip counts, matmul FLOPs, collectives and their networks."""

import json
import subprocess

import pytest

from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.trainer import hlo_cost
from tests.conftest import ROOT
from tests.trainer import hlo_program

RECORDED = ROOT / "tests" / "data" / "hlo" / "scan_grad_v6e-16x2.hlo"
#: XLA's cost analysis of the recorded program (libtpu 0.0.52): each loop body counted once.
RECORDED_COST = {"flops": 84017152.0, "bytes accessed": 31117344.0}
TWO_SLICES = [0] * 16 + [1] * 16


def test_replica_groups_explicit_and_iota_forms():
    assert hlo_cost.parse_replica_groups("x, replica_groups={{0,1},{2,3}}, dimensions={0}") == [[0, 1], [2, 3]]
    assert hlo_cost.parse_replica_groups("replica_groups=[2,4]<=[8], to_apply=%add") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # iota(8) as 2 x 4, transposed: columns become the groups.
    assert hlo_cost.parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo_cost.parse_replica_groups("replica_groups=[2,16]<=[16,2]T(1,0)")[0] == list(range(0, 32, 2))
    assert hlo_cost.parse_replica_groups("replica_groups={}, dimensions={0}") is None
    assert hlo_cost.parse_replica_groups("channel_id=1") is None


def test_ring_bytes_per_chip():
    assert hlo_cost.moved_bytes("all-gather", 1600, 16) == 1500
    assert hlo_cost.moved_bytes("reduce-scatter", 100, 16) == 1500
    assert hlo_cost.moved_bytes("all-reduce", 1600, 16) == 3000
    assert hlo_cost.moved_bytes("collective-permute", 64, 2) == 64
    assert hlo_cost.moved_bytes("all-reduce", 1600, 1) == 0


SYNTHETIC = """HloModule synthetic, entry_computation_layout={(bf16[32,64]{1,0})->bf16[32,64]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p: (s32[], bf16[32,64])) -> (s32[], bf16[32,64]) {
  %p = (s32[], bf16[32,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = bf16[32,64]{1,0} get-tuple-element(%p), index=1
  %w = bf16[64,64]{1,0} all-gather(%h), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
  %x = bf16[64,64]{1,0} all-gather(%h), channel_id=2, replica_groups={{0,2},{1,3}}, dimensions={0}, use_global_device_ids=true
  %d = bf16[32,64]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = bf16[32,64]{1,0} all-reduce(%d), channel_id=3, replica_groups=[2,2]<=[4], to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[32,64]{1,0}) tuple(%next, %r)
}

%cond (p: (s32[], bf16[32,64])) -> pred[] {
  %p = (s32[], bf16[32,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[32,64]) -> bf16[32,64] {
  %a = bf16[32,64]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], bf16[32,64]{1,0}) tuple(%start, %a)
  %loop = (s32[], bf16[32,64]{1,0}) while(%init), condition=%cond, body=%body
  %out = bf16[32,64]{1,0} get-tuple-element(%loop), index=1
  %sent = (bf16[1,32,64]{2,1,0}, u32[], token[]) recv(%tok), channel_id=9, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_GATHER"}
  ROOT %copy = bf16[32,64]{1,0} copy(%out)
}
"""


def test_loops_run_their_trip_count_and_collectives_take_their_slice_network():
    module = hlo_cost.parse_module(SYNTHETIC)
    counts, unknown = hlo_cost.multiplicities(module)
    assert (counts["main"], counts["body"], unknown) == (1, 6, 0)
    # Devices 0, 1 on slice 0 and 2, 3 on slice 1: {0,1} is within a slice (ICI), {0,2} spans both (DCN).
    summary = hlo_cost.summarize(SYNTHETIC, {"flops": 262144.0, "bytes accessed": 1000.0}, [0, 0, 1, 1], 2)
    assert summary["hlo"]["matmul_flops_once"] == 2 * 32 * 64 * 64
    assert summary["hlo"]["matmul_flops"] == 6 * 2 * 32 * 64 * 64
    assert summary["flops"] == 6 * 262144.0  # XLA's count scaled by the loop factor
    by = {(c["network"], c["op"]): c for c in summary["collectives"]}
    gather = 64 * 64 * 2
    assert by["ici", "all-gather"] == {"network": "ici", "op": "all-gather", "group": 2, "moved_bytes": 6 * gather / 2,
                                       "count": 6}  # fmt: skip
    assert by["dcn", "all-gather"]["count"] == 6 + 1  # the loop's cross-slice gather and the MegaScale recv
    assert by["dcn", "all-gather"]["moved_bytes"] == 6 * gather / 2 + 32 * 64 * 2 / 2
    assert by["ici", "all-reduce"]["moved_bytes"] == 6 * 2 * (32 * 64 * 2) / 2


#: A gradient all-reduce offloaded to the SparseCore as libtpu 0.0.52 compiles it with the v6e flags
#: (the 8B production stage's HLO): an async custom call whose called computation, on the ``sparsecore``
#: execution thread, holds the all-reduce, and ends with ``}, execution_thread="sparsecore"``.
SPARSECORE = """HloModule sparsecore, entry_computation_layout={(bf16[32,64]{1,0})->bf16[32,64]{1,0}}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%x, %y)
}

%called_computation.17 (param_0: bf16[32,64]) -> bf16[32,64] {
  %param_0 = bf16[32,64]{1,0} parameter(0)
  ROOT %all-reduce.252 = bf16[32,64]{1,0} all-reduce(%param_0), channel_id=27, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
}, execution_thread="sparsecore"

%after (q: bf16[32,64], w: bf16[64,64]) -> bf16[32,64] {
  %q = bf16[32,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  ROOT %d = bf16[32,64]{1,0} dot(%q, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[32,64]) -> bf16[32,64] {
  %a = bf16[32,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} constant({...})
  %start = ((), (), (s32[8]{0})) custom-call-start(), async_execution_thread="sparsecore", custom_call_target="TODO(b/522284627)", called_computations={%called_computation.17}, backend_config={"sparse_core_config":{"offload":"OFFLOAD_COLLECTIVE"}}
  %done = bf16[32,64]{1,0} custom-call-done(%start)
  ROOT %out = bf16[32,64]{1,0} call(%a, %w), to_apply=%after
}
"""


def test_an_all_reduce_offloaded_to_the_sparsecore_is_counted_and_ends_its_computation():
    module = hlo_cost.parse_module(SPARSECORE)
    # The computation after the SparseCore one is its own, not more instructions of the SparseCore one.
    assert [i.name for i in module["called_computation.17"].instructions] == ["param_0", "all-reduce.252"]
    assert [i.name for i in module["after"].instructions] == ["q", "w", "d"]
    counts, _ = hlo_cost.multiplicities(module)
    assert counts["called_computation.17"] == 1 and counts["after"] == 1
    summary = hlo_cost.summarize(SPARSECORE, None, [0, 0], 1)
    assert summary["collectives"] == [
        {"network": "ici", "op": "all-reduce", "group": 2, "moved_bytes": 2 * (32 * 64 * 2) / 2, "count": 1}
    ]
    assert summary["flops"] == 2 * 32 * 64 * 64


def test_hbm_bytes_leave_out_vmem_and_host_memory_and_slices_move_only_the_slice():
    assert hlo_cost.bytes_by_space("bf16[8,128]{1,0:T(8,128)(2,1)}") == {"0": 2048}
    assert hlo_cost.bytes_by_space("(bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, f32[4]{0:S(5)})") == {"1": 2048, "5": 16}
    shapes = {"buffer": "bf16[32,1024]{1,0:S(5)}", "row": "bf16[1,1024]{1,0}", "i": "s32[]"}
    update = hlo_cost.Instruction(
        "u", "bf16[32,1024]{1,0:S(5)}", "dynamic-update-slice", ["buffer", "row", "i", "i"], ""
    )
    # the row is read from HBM and written to host memory
    assert hlo_cost.instruction_bytes(update, shapes) == {"0": 2048, "5": 2048}
    read = hlo_cost.Instruction("s", "bf16[1,1024]{1,0}", "dynamic-slice", ["buffer", "i", "i"], "")
    assert hlo_cost.instruction_bytes(read, shapes) == {"5": 2048, "0": 2048}


#: A scanned 4-layer program as XLA:TPU fuses it: each iteration reads one layer of the stacked
#: ``[4, 256, 512]`` activations through a dynamic-slice fusion and writes one layer back through a fusion
#: whose root is a dynamic-update-slice (in place), beside a broadcast fusion that reads a bias whole.
STACKED = """HloModule stacked

%read_layer (param_0: bf16[4,256,512], param_1: s32[]) -> bf16[256,512] {
  %param_0 = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)S(6)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %slice = bf16[1,256,512]{2,1,0:T(8,128)(2,1)} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,256,512}
  %layer = bf16[256,512]{1,0:T(8,128)(2,1)} bitcast(%slice)
  ROOT %neg = bf16[256,512]{1,0:T(8,128)(2,1)} negate(%layer)
}

%write_layer (param_0: bf16[4,256,512], param_1: s32[], param_2: bf16[256,512]) -> (bf16[4,256,512], bf16[256,512]) {
  %param_0 = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_2 = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(2)
  %row = bf16[1,256,512]{2,1,0:T(8,128)(2,1)} bitcast(%param_2)
  %param_1 = s32[]{:T(128)S(6)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %update = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0, %row, %param_1, %zero, %zero)
  %twice = bf16[256,512]{1,0:T(8,128)(2,1)} add(%param_2, %param_2)
  ROOT %out = (bf16[4,256,512]{2,1,0:T(8,128)(2,1)}, bf16[256,512]{1,0:T(8,128)(2,1)}) tuple(%update, %twice)
}

%bias (param_0: f32[512]) -> f32[256,512] {
  %param_0 = f32[512]{0} parameter(0)
  ROOT %b = f32[256,512]{1,0} broadcast(%param_0), dimensions={1}
}

%body (p: (s32[], bf16[4,256,512])) -> (s32[], bf16[4,256,512]) {
  %p = (s32[], bf16[4,256,512]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)S(6)} get-tuple-element(%p), index=0
  %stack = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %x = bf16[256,512]{1,0:T(8,128)(2,1)} fusion(%stack, %i), kind=kLoop, calls=%read_layer
  %w = (bf16[4,256,512]{2,1,0:T(8,128)(2,1)}, bf16[256,512]{1,0:T(8,128)(2,1)}) fusion(%stack, %i, %x), kind=kLoop, calls=%write_layer
  %next_stack = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} get-tuple-element(%w), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,256,512]{2,1,0:T(8,128)(2,1)}) tuple(%next, %next_stack)
}

%cond (p: (s32[], bf16[4,256,512])) -> pred[] {
  %p = (s32[], bf16[4,256,512]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (stack: bf16[4,256,512], v: f32[512]) -> (s32[], bf16[4,256,512]) {
  %stack = bf16[4,256,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %v = f32[512]{0} parameter(1)
  %bias = f32[256,512]{1,0} fusion(%v), kind=kLoop, calls=%bias
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,256,512]{2,1,0:T(8,128)(2,1)}) tuple(%zero, %stack)
  ROOT %loop = (s32[], bf16[4,256,512]{2,1,0:T(8,128)(2,1)}) while(%init), condition=%cond, body=%body
}
"""


def test_fusions_move_one_layer_of_a_stacked_buffer_as_xla_counts_them():
    """XLA's HloCostAnalysis (FusionParameterReadBytes, FusionProcessOutputBytesAccessed): a fusion operand
    read by a dynamic-slice costs the slice, one updated in place by a dynamic-update-slice root costs the
    update, not the stack; an index operand and a broadcast operand are read whole."""
    module = hlo_cost.parse_module(STACKED)
    body = module["body"]
    shapes = {i.name: i.shape for i in body.instructions}
    layer, index = 256 * 512 * 2, 4
    read, write = body.by_name()["x"], body.by_name()["w"]
    # the layer slice and the index read, the negated layer written
    assert hlo_cost.instruction_bytes(read, shapes, module) == {"0": layer + layer, "6": index}
    # operand 0 (the stack) aliases output 0: nothing of it read; the update (param 2, read once for
    # both the update and the add) and the index read; the update and the sum written
    assert hlo_cost.instruction_bytes(write, shapes, module) == {"0": layer + layer + layer, "6": index}
    entry = module["main"]
    bias = hlo_cost.instruction_bytes(entry.by_name()["bias"], {i.name: i.shape for i in entry.instructions}, module)
    assert bias == {"0": 512 * 4 + 256 * 512 * 4}
    # Per step: 4 iterations of 5 layers' bytes (and the counter's add: a constant read, a scalar written),
    # the bias, the condition's compare (counted once, as its caller): linear in the layers, where counting
    # the stacked operand whole (4 layers) per use made it quadratic.
    summary = hlo_cost.summarize(STACKED, None)
    assert summary["bytes_accessed"] == 4 * (5 * layer + 4 + 4) + 512 * 4 + 256 * 512 * 4 + (4 + 4 + 1)
    assert summary["hlo"]["bytes"] == summary["bytes_accessed"] + 4 * 3 * index  # S(6) scalars: not HBM


def test_batch_dimensions_as_padded_windows_count_one_kernel_position():
    # A 32-head batched matmul written as a convolution whose head dimension slides over padding (as XLA:TPU
    # writes it): one of the 32 kernel positions per output reads data.
    # (the head dimension of the input is 1 wide; the kernel of 32 slides over 31 padding positions either side)
    assert hlo_cost.valid_pairs(length=1, kernel=32, out=32, lo=31) == 32
    assert hlo_cost.valid_pairs(length=32, kernel=32, out=32, lo=31) == 528  # a 32-wide input: a real sliding window
    assert hlo_cost.valid_pairs(length=3, kernel=3, out=1, lo=0) == 3  # a real contraction over 3 positions
    shapes = {"x": "bf16[3,8192,4096,1]{2,1,3,0}", "w": "bf16[32,128,4096,1]{2,1,0,3}"}
    conv = hlo_cost.Instruction(
        "c", "bf16[3,8192,32,128]{3,1,2,0}", "convolution", ["x", "w"],
        "window={size=1x32 pad=0_0x31_31 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f",
    )  # fmt: skip
    assert hlo_cost.matmul_flops(hlo_cost.Computation("f"), conv, shapes) == 2 * 3 * 8192 * 32 * 128 * 4096


def test_not_an_hlo_module():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_cost.parse_module("hello")


def test_recorded_program_counts_every_layer_where_xla_counts_each_loop_body_once():
    """The recorded program (tests/trainer/hlo_program.py): 12 matmuls per step, XLA's cost analysis says 5."""
    summary = hlo_cost.summarize(RECORDED.read_text(), RECORDED_COST, TWO_SLICES, 2)
    dot = 2 * 8 * 1024 * 1024
    # The HLO's matmuls counted once each match XLA's count (within its non-matmul FLOPs: tanh, sums).
    assert summary["hlo"]["matmul_flops_once"] == 5 * dot
    assert summary["hlo"]["matmul_flops_once"] == pytest.approx(RECORDED_COST["flops"], rel=0.01)
    # Forward loop of 4 trips; backward loop of 3 trips after XLA peeled one iteration into the entry.
    assert summary["hlo"]["matmul_flops"] == hlo_program.EXPECTED_FLOPS == 12 * dot
    assert summary["flops"] == pytest.approx(hlo_program.EXPECTED_FLOPS, rel=0.01)
    assert summary["hlo"]["unknown_trip_counts"] == 0
    nets = {(c["network"], c["op"], c["group"]) for c in summary["collectives"]}
    # FSDP over 32 chips: gathered within each slice over ICI, and across the slices over DCN (MegaScale).
    assert nets == {("ici", "all-gather", 16), ("ici", "reduce-scatter", 16), ("dcn", "all-gather", 2),
                    ("dcn", "all-reduce", 2)}  # fmt: skip
    ici_gather = next(c for c in summary["collectives"] if c["network"] == "ici" and c["op"] == "all-gather")
    # Each layer's 1024 x 1024 bf16 weights are gathered once in the forward and once in the backward pass (15/16
    # of them arrive over ICI), plus the re-gathers of the backward pass's weight gradient.
    assert ici_gather["moved_bytes"] >= 8 * 1024 * 1024 * 2 * 15 / 16


@pytest.mark.aot
def test_a_program_compiled_here_for_two_v6e_slices_has_the_costs_of_its_steps(tmp_path):
    env = trainer_env()
    done = subprocess.run(
        [str(env / "bin" / "python"), "-m", "tests.trainer.hlo_program", str(tmp_path / "step.hlo")],
        capture_output=True, text=True, cwd=ROOT, env=trainer_process_env(env), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["slice_of"] == TWO_SLICES
    summary = found["summary"]
    assert summary["flops"] == pytest.approx(hlo_program.EXPECTED_FLOPS, rel=0.01)
    assert found["cost_analysis"]["flops"] < 0.5 * hlo_program.EXPECTED_FLOPS  # XLA: loop bodies once
    networks = {c["network"] for c in summary["collectives"]}
    assert networks == {"ici", "dcn"}
