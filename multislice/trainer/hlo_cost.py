"""What one step of a compiled train program costs, read from its optimized HLO and XLA's cost analysis.

The AOT compile (:mod:`multislice.trainer.aot`) hands this module two things of
the compiled executable: ``compiled.cost_analysis()`` (XLA's ``HloCostAnalysis``:
``flops`` and ``bytes accessed`` per device) and ``compiled.as_text()`` (the
optimized, SPMD-partitioned HLO module of one device). From them it makes a
small summary (:func:`summarize`) that the step-time estimate
(:mod:`multislice.preflight.step_time`) reads:

- **loop factors**: XLA's cost analysis counts the body of a ``while`` loop once
  (measured here with libtpu 0.0.52: a 4-layer ``lax.scan`` of one matmul, under
  ``jax.grad``, reports 5 matmuls of FLOPs where the step runs 12). MaxText scans
  its decoder layers (``scan_layers``), so most of a step is inside loops. This
  module counts the matmul FLOPs (``dot`` and ``convolution``) and the bytes of
  each top-level instruction in every computation, once as the cost analysis does
  and once with each computation weighted by how often it runs (the trip counts of
  the loops around it, :func:`multiplicities`); the ratio scales the cost
  analysis's FLOPs to the whole step. Bytes are read from the HLO itself: XLA's
  ``bytes accessed`` counts every memory space alike, where HBM traffic is what sits in
  memory space 0 of each layout (``S(1)`` is the on-chip VMEM, ``S(5)`` host memory). A fusion's bytes
  follow XLA's ``HloCostAnalysis::HandleFusion`` (:func:`fusion_bytes`): an operand read through a
  ``dynamic-slice`` costs the slice, an output that is a ``dynamic-update-slice`` costs the update, so a
  scanned layer costs its layer of a stacked ``[layers, ...]`` buffer, not the stack.
- **kernels**: a Pallas kernel (MaxText's splash attention) is a ``custom-call`` to
  ``tpu_custom_call`` whose FLOPs XLA's cost analysis leaves out (measured here: the
  Llama 3.1 8B recipe's matmuls alone match its count to 0.1%); the summary counts their
  runs, and the estimate adds MaxText's attention FLOPs for them.
- **collectives**: every ``all-gather``, ``reduce-scatter``, ``all-reduce``,
  ``all-to-all`` and ``collective-permute`` (also as ``*-start`` async ops), with its
  result bytes per chip, its group size (from ``replica_groups``, explicit
  ``{{0,1},{2,3}}`` or iota ``[2,16]<=[32]`` form, :func:`parse_replica_groups`) and
  the number of times it runs; a collective whose group spans two slices (by the
  mesh's device -> slice mapping) is DCN, else ICI. On a multislice mesh XLA:TPU
  splits a cross-slice collective into an ICI part and a DCN part that it sends
  through the MegaScale runtime (``send``/``recv`` with ``is_host_transfer=true`` and
  ``_xla_megascale_transfer_type="ALL_GATHER"`` etc.): those are DCN collectives
  over the slices.

Bytes moved per chip follow the ring algorithms (``g`` = group size, ``B`` = result
bytes per chip): all-gather ``B(g-1)/g``, reduce-scatter ``B(g-1)``, all-reduce
``2B(g-1)/g``, all-to-all ``B(g-1)/g``, collective-permute ``B``.

No JAX import: the text is parsed with regular expressions, so the tests and the
pipeline environment can use it too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

#: Bytes per element of HLO primitive types (``token`` and tuples hold none themselves).
DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0,
}  # fmt: skip

_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\](?:\{[^}]*\})?")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[^\s(]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"\b(?P<kind>calls|body|condition|to_apply|true_computation|false_computation)=%(?P<name>[^\s,)}]+)"
)
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<body>(?:\{[0-9, ]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")
#: A collective-permute's pairs, ``source_target_pairs={{0,3},{1,0},...}``: the body is every ``{a,b}`` up to the
#: closing brace (a lazy match up to the first ``},`` would stop after the first pair's ``{0,3``).
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>(?:\{\d+,\d+\},?)*)\}")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(?P<kind>[A-Z_]+)"')

#: Collective opcodes (the ``-start`` forms are XLA's async versions; their ``-done`` halves are not counted).
COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}  # fmt: skip
#: MegaScale (DCN) transfer types -> the collective they carry out.
MEGASCALE_KINDS = {
    "ALL_GATHER": "all-gather", "ALL_REDUCE": "all-reduce", "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute",
}  # fmt: skip
#: Instructions that move no data of their own (HloCostAnalysis gives them no bytes either).
NO_BYTES = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip


def array_bytes(shape: str) -> float:
    """Bytes of an HLO shape's arrays (a tuple's elements summed): ``bf16[8,1024]{1,0}`` -> 16384."""
    total = 0.0
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match.group("dims").split(",") if d]
        total += math.prod(dims) * DTYPE_BYTES.get(match.group("dtype"), 4)
    return total


#: XLA:TPU memory spaces in layouts (``S(n)``): none or 0 is HBM, 1 the on-chip VMEM, 5 pinned host memory
#: (host offload); the others are small (semaphores, scalar memory).
HBM, HOST = "0", "5"


def bytes_by_space(shape: str) -> dict[str, float]:
    """Bytes of an HLO shape's arrays by memory space (``S(n)`` of each layout; none is HBM, ``"0"``)."""
    out: dict[str, float] = {}
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match.group("dims").split(",") if d]
        space = re.search(r"S\((\d+)\)", match.group(0))
        key = space.group(1) if space else HBM
        out[key] = out.get(key, 0.0) + math.prod(dims) * DTYPE_BYTES.get(match.group("dtype"), 4)
    return out


def _add(total: dict[str, float], more: dict[str, float], times: float = 1.0) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value * times


def instruction_bytes(
    instruction: Instruction, shapes: dict[str, str], module: dict[str, Computation] | None = None
) -> dict[str, float]:
    """Bytes one top-level instruction reads and writes, by memory space (HloCostAnalysis-like).

    Operands and result; an async ``*-start`` counts its operands and its result (tuple element 1);
    a dynamic slice reads and writes only the slice, a dynamic update slice only the update. A
    ``fusion`` (its fused computation looked up in ``module``) counts what XLA's cost analysis counts
    of it (:func:`fusion_bytes`): a scanned layer's fusion that slices one layer out of the stacked
    ``[layers, ...]`` buffer, or writes one layer into it in place, moves one layer, not the stack.
    """
    if instruction.opcode == "fusion" and module is not None:
        called = re.search(r"calls=%([^\s,)}]+)", instruction.attributes)
        if called and called.group(1) in module:
            return fusion_bytes(module, instruction, shapes, module[called.group(1)])
    out: dict[str, float] = {}
    elements = _tuple_elements(instruction.shape)
    result = elements[1] if instruction.opcode.endswith("-start") and len(elements) > 1 else instruction.shape
    operands = [shapes.get(o, "") for o in instruction.operands]
    if instruction.opcode.startswith("dynamic-slice") and operands:
        size = array_bytes(result)
        source = bytes_by_space(operands[0])
        _add(out, {next(iter(source), HBM): size})
        _add(out, bytes_by_space(result))
        return out
    if instruction.opcode.startswith("dynamic-update-slice") and len(operands) > 1:
        update = bytes_by_space(operands[1])
        target = bytes_by_space(operands[0])
        _add(out, update)
        _add(out, {next(iter(target), HBM): sum(update.values())})
        return out
    _add(out, bytes_by_space(result))
    for operand in operands:
        _add(out, bytes_by_space(operand))
    return out


def _users(computation: Computation) -> dict[str, list[Instruction]]:
    """Instruction name -> the instructions that use it (each user once, in order)."""
    users: dict[str, list[Instruction]] = {}
    for instruction in computation.instructions:
        for operand in dict.fromkeys(instruction.operands):
            users.setdefault(operand, []).append(instruction)
    return users


def _fused_parameter(computation: Computation, index: int) -> Instruction | None:
    """The ``parameter(index)`` instruction of a fused computation, or None."""
    return next(
        (i for i in computation.instructions if i.opcode == "parameter" and i.raw_operands.strip() == str(index)),
        None,
    )


def _fused_computation(module: dict[str, Computation], fusion: Instruction) -> Computation | None:
    called = re.search(r"calls=%([^\s,)}]+)", fusion.attributes)
    return module.get(called.group(1)) if called else None


def fusion_parameter_read_bytes(
    module: dict[str, Computation], computation: Computation, parameter: Instruction
) -> float:
    """Bytes a fusion reads of one operand: XLA's ``HloCostAnalysis::FusionParameterReadBytes``.

    From openxla/xla ``xla/service/hlo_cost_analysis.cc`` (as vendored in tensorflow/tensorflow
    ``third_party/xla``, commit 037c4f1b): over the fused parameter's users, a ``slice`` reads its
    result; a ``dynamic-slice`` reads its result when the parameter is the sliced operand (else, an
    index, the parameter once); a ``dynamic-update-slice`` reads nothing of its operand 0 (aliased to
    the output, updated in place) and the parameter once otherwise; ``broadcast`` and ``reshape`` read
    the whole parameter each; every other user shares one read of the whole parameter. A nested fusion
    whose parameter is its root's first operand ("simple") is judged by the nested fusion's users the
    same way, else by this rule inside it. Bytes are of the fused computation's shapes (no memory space).
    """
    users = _users(computation)
    full = array_bytes(parameter.shape)
    size = 0.0
    seen = False

    def dynamic_slice(user: Instruction, source: str, seen_user: bool) -> tuple[float, bool]:
        if user.operands and user.operands[0] == source:
            return array_bytes(user.shape), seen_user
        return (0.0, True) if seen_user else (array_bytes(shapes[source]), True)

    def update_slice(user: Instruction, source: str, seen_user: bool) -> tuple[float, bool]:
        if (not user.operands or user.operands[0] != source) and not seen_user:
            return array_bytes(shapes[source]), True
        return 0.0, seen_user

    shapes = {i.name: i.shape for i in computation.instructions}
    for user in users.get(parameter.name, []):
        if user.opcode == "fusion":
            nested = _fused_computation(module, user)
            if nested is None:
                size, seen = (size, True) if seen else (size + full, True)
                continue
            root = next((i for i in nested.instructions if i.root), None)
            for index, operand in enumerate(user.operands):
                if operand != parameter.name:
                    continue
                inner = _fused_parameter(nested, index)
                simple = root is not None and (
                    not root.operands or (inner is not None and root.operands[0] == inner.name)
                )
                nested_seen = False
                for fusion_user in users.get(user.name, []):
                    if simple and fusion_user.opcode == "slice":
                        size += array_bytes(fusion_user.shape)
                    elif simple and fusion_user.opcode == "dynamic-slice":
                        more, nested_seen = dynamic_slice(fusion_user, user.name, nested_seen)
                        size += more
                    elif simple and fusion_user.opcode == "dynamic-update-slice":
                        more, nested_seen = update_slice(fusion_user, user.name, nested_seen)
                        size += more
                    elif not nested_seen:
                        nested_seen = True
                        size += fusion_parameter_read_bytes(module, nested, inner) if inner is not None else full
        elif user.opcode == "slice":
            size += array_bytes(user.shape)
        elif user.opcode == "dynamic-slice":
            more, seen = dynamic_slice(user, parameter.name, seen)
            size += more
        elif user.opcode == "dynamic-update-slice":
            more, seen = update_slice(user, parameter.name, seen)
            size += more
        elif user.opcode in ("broadcast", "reshape"):
            size += full
        elif not seen:
            seen = True
            size += full
    return size


def fusion_bytes(
    module: dict[str, Computation], fusion: Instruction, shapes: dict[str, str], fused: Computation
) -> dict[str, float]:
    """Bytes a top-level ``fusion`` reads and writes, by memory space, as XLA's ``HloCostAnalysis::HandleFusion``.

    From openxla/xla ``xla/service/hlo_cost_analysis.cc`` (``FusionProcessOutputBytesAccessed``,
    ``FusionProcessOperandBytesRead``): an output (each element of a root ``tuple``) that is a
    ``dynamic-update-slice`` writes only its update (operand 0 is the fusion's operand, updated in
    place); every other output is written whole; each operand is read as much as
    :func:`fusion_parameter_read_bytes` says. So a fusion inside a scanned layer's loop that reads one
    layer of the stacked ``bf16[layers, ...]`` activations through a ``dynamic-slice``, or writes one
    layer into it, moves one layer per run, not the whole stack (counting the stack made the HBM term
    grow with layers squared: 64 layers read 64 layers each). Read bytes fall in the memory space of the
    operand's layout, written bytes in that of the output element's.
    """
    out: dict[str, float] = {}
    root = next((i for i in fused.instructions if i.root), None)
    by_name = fused.by_name()
    elements = _tuple_elements(fusion.shape)
    for index, element in enumerate(elements):
        produced = root
        if root is not None and root.opcode == "tuple" and len(elements) > 1 and index < len(root.operands):
            produced = by_name.get(root.operands[index])
        if produced is not None and produced.opcode == "dynamic-update-slice" and len(produced.operands) > 1:
            update = array_bytes(by_name[produced.operands[1]].shape) if produced.operands[1] in by_name else 0.0
            space = bytes_by_space(element)
            _add(out, {next(iter(space), HBM): update})
        else:
            _add(out, bytes_by_space(element))
    for index, operand in enumerate(fusion.operands):
        whole = bytes_by_space(shapes.get(operand, ""))
        total = sum(whole.values())
        parameter = _fused_parameter(fused, index)
        if parameter is None or not total or parameter.shape.startswith("("):
            _add(out, whole)
            continue
        read = fusion_parameter_read_bytes(module, fused, parameter)
        _add(out, whole, read / total)
    return out


def array_dims(shape: str) -> list[int]:
    """The dimensions of the first array in an HLO shape (``[]`` for a scalar or no array)."""
    match = _ARRAY.search(shape)
    return [int(d) for d in match.group("dims").split(",") if d] if match else []


@dataclass
class Instruction:
    """One HLO instruction: ``%name = shape opcode(operands), attributes``."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str
    root: bool = False
    #: The operands' text as printed: the literal of a ``constant`` (``constant(4)`` -> ``4``).
    raw_operands: str = ""


@dataclass
class Computation:
    """One HLO computation: its instructions in order, and whether it is the entry."""

    name: str
    entry: bool = False
    instructions: list[Instruction] = field(default_factory=list)

    def by_name(self) -> dict[str, Instruction]:
        """Instruction name -> instruction."""
        return {i.name: i for i in self.instructions}


def _split_shape(text: str) -> tuple[str, str]:
    """``'(a, b) op(...)'`` -> (``'(a, b)'``, ``'op(...)'``): the shape may be a tuple with spaces."""
    if text.startswith("("):
        depth = 0
        for index, char in enumerate(text):
            depth += char == "("
            depth -= char == ")"
            if depth == 0:
                return text[: index + 1], text[index + 1 :].lstrip()
    shape, _, rest = text.partition(" ")
    return shape, rest


def _split_call(text: str) -> tuple[str, str, str]:
    """``'op(%a, %b), attrs'`` -> (op, operands text, attributes text)."""
    opcode, _, rest = text.partition("(")
    depth = 1
    for index, char in enumerate(rest):
        depth += char in "({"
        depth -= char in ")}"
        if depth == 0:
            return opcode.strip(), rest[:index], rest[index + 1 :].lstrip(", ")
    return opcode.strip(), rest, ""


def parse_module(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text (``compiled.as_text()``), by name, in printed order.

    Raises:
        ValueError: the text holds no ``ENTRY`` computation (not an HLO module).
    """
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group("name"), entry=bool(header.group("entry")))
                computations[current.name] = current
            continue
        stripped = line.strip()
        if stripped == "}" or stripped.startswith("}, execution_thread="):  # a SparseCore computation ends so
            current = None
            continue
        root = stripped.startswith("ROOT ")
        stripped = stripped.removeprefix("ROOT ")
        if not stripped.startswith("%") or " = " not in stripped:
            continue
        name, _, rest = stripped.partition(" = ")
        shape, call = _split_shape(rest)
        opcode, operands, attributes = _split_call(call)
        names = re.findall(r"%([^\s,()]+)", operands)
        current.instructions.append(Instruction(name[1:], shape, opcode, names, attributes, root, operands))
    if not any(c.entry for c in computations.values()):
        raise ValueError("no ENTRY computation in the HLO text: not an HLO module")
    return computations


def trip_count(module: dict[str, Computation], caller: Computation, loop: Instruction) -> int | None:
    """How many times a ``while`` instruction runs its body, or None when it cannot be read.

    ``known_trip_count`` in the backend config when XLA printed one; else the condition's root
    ``compare(get-tuple-element(param, index=k), constant(N))`` with the loop's initial value of tuple
    element ``k`` (a constant, through copies), as XLA's ``ComputeWhileLoopTripCount`` reads it.
    """
    known = _TRIP.search(loop.attributes)
    if known:
        return int(known.group("n"))
    condition = re.search(r"condition=%([^\s,]+)", loop.attributes)
    if not condition or condition.group(1) not in module:
        return None
    cond = module[condition.group(1)]
    root = next((i for i in cond.instructions if i.root), None)
    direction = re.search(r"direction=(\w+)", root.attributes) if root else None
    if root is None or root.opcode != "compare" or not direction or len(root.operands) != 2:
        return None
    found = cond.by_name()
    left, right = (found.get(n) for n in root.operands)
    flip = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}
    how = direction.group(1)
    if left is not None and left.opcode == "constant":
        left, right, how = right, left, flip.get(how, how)
    if left is None or right is None or right.opcode != "constant" or left.opcode != "get-tuple-element":
        return None
    limit = _literal(right)
    index = re.search(r"index=(\d+)", left.attributes)
    if limit is None or not index:
        return None
    start = 0
    init = caller.by_name().get(loop.operands[0]) if loop.operands else None
    if init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
        value = _resolve(caller, init.operands[int(index.group(1))])
        start = value if value is not None else 0
    if how == "LT":
        return max(limit - start, 0)
    if how == "LE":
        return max(limit - start + 1, 0)
    if how == "NE":
        return max(limit - start, 0)
    return None


def _literal(instruction: Instruction) -> int | None:
    """The integer of a scalar ``constant`` (``%c = s32[] constant(4)`` -> 4), else None."""
    match = re.fullmatch(r"\s*(-?\d+)\s*", instruction.raw_operands)
    return int(match.group(1)) if match else None


def _resolve(computation: Computation, name: str, depth: int = 0) -> int | None:
    instruction = computation.by_name().get(name)
    if instruction is None or depth > 8:
        return None
    if instruction.opcode == "constant":
        return _literal(instruction)
    if instruction.opcode in ("copy", "bitcast", "convert") and instruction.operands:
        return _resolve(computation, instruction.operands[0], depth + 1)
    return None


def multiplicities(module: dict[str, Computation]) -> tuple[dict[str, float], int]:
    """How many times each computation runs per execution of the entry, and the loops whose trips were unknown.

    A ``while`` body counts its trip count times its caller's; ``calls``, ``to_apply``, branches,
    conditions and an async ``custom-call-start``'s ``called_computations`` (libtpu 0.0.52 offloads
    all-reduces to the SparseCore that way, ``async_execution_thread="sparsecore"``) count as their caller
    (an unknown trip count counts once).
    """
    callees: dict[str, list[tuple[str, float]]] = {name: [] for name in module}
    unknown = 0
    for computation in module.values():
        for instruction in computation.instructions:
            factor = 1.0
            if instruction.opcode == "while":
                trips = trip_count(module, computation, instruction)
                if trips is None:
                    unknown += 1
                factor = float(trips if trips is not None else 1)
            for match in _CALLS.finditer(instruction.attributes):
                if match.group("name") in module:
                    weight = factor if match.group("kind") == "body" else 1.0
                    callees[computation.name].append((match.group("name"), weight))
            branches = _BRANCHES.search(instruction.attributes)
            if branches:
                for name in re.findall(r"%([^\s,}]+)", branches.group("names")):
                    if name in module:
                        callees[computation.name].append((name, 1.0))
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str) -> None:  # depth-first post-order: callees before their callers
        stack = [(name, iter(callees[name]))]
        state[name] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                state[node] = 2
                order.append(node)
            elif state.get(child[0], 0) == 0:
                state[child[0]] = 1
                stack.append((child[0], iter(callees[child[0]])))

    entry = next(c.name for c in module.values() if c.entry)
    visit(entry)
    counts = {name: 0.0 for name in module}
    counts[entry] = 1.0
    for name in reversed(order):  # callers before callees
        for child, weight in callees[name]:
            counts[child] += counts[name] * weight
    return counts, unknown


def parse_replica_groups(attributes: str) -> list[list[int]] | None:
    """The replica groups of a collective's attributes, or None when it has none (all devices).

    ``replica_groups={{0,1},{2,3}}`` -> ``[[0, 1], [2, 3]]``; the iota form
    ``replica_groups=[G,S]<=[d0,d1,...]T(p0,p1,...)`` is ``iota(prod(d))`` reshaped to ``d``,
    transposed by ``p``, reshaped to G groups of S (XLA's ``IotaReplicaGroupList``).
    """
    iota = _GROUPS_IOTA.search(attributes)
    if iota:
        groups, size = (int(x) for x in iota.group("shape").split(",")[:2])
        dims = [int(x) for x in iota.group("dims").split(",")]
        perm = [int(x) for x in iota.group("perm").split(",")] if iota.group("perm") else list(range(len(dims)))
        strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
        shape = [dims[p] for p in perm]
        flat = []
        for index in range(math.prod(dims)):
            rest, coords = index, []
            for extent in reversed(shape):
                coords.append(rest % extent)
                rest //= extent
            coords.reverse()
            flat.append(sum(coords[k] * strides[perm[k]] for k in range(len(perm))))
        return [flat[g * size : (g + 1) * size] for g in range(groups)]
    listed = _GROUPS_LIST.search(attributes)
    if listed:
        groups = [
            [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", listed.group("body"))
        ]
        return [g for g in groups if g] or None
    return None


def moved_bytes(kind: str, result_bytes: float, group: int) -> float:
    """Bytes one chip sends for a collective of ``result_bytes`` per chip over ``group`` chips (ring algorithms)."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {
        "all-gather": result_bytes * share,
        "reduce-scatter": result_bytes * (group - 1),
        "all-reduce": 2 * result_bytes * share,
        "all-to-all": result_bytes * share,
        "collective-permute": result_bytes,
    }[kind]


def _network(groups: list[list[int]] | None, slice_of: list[int] | None, devices: int) -> tuple[int, bool]:
    """(group size, whether a group spans slices) for replica groups over logical device ids."""
    if not groups:
        members = list(range(devices))
        groups = [members]
    size = max(len(g) for g in groups)
    if not slice_of:
        return size, False
    spans = any(len({slice_of[d] for d in g if d < len(slice_of)}) > 1 for g in groups)
    return size, spans


def collectives(
    module: dict[str, Computation], counts: dict[str, float], slice_of: list[int] | None, num_slices: int
) -> list[dict[str, Any]]:
    """Every collective of the module, with its network, group size, bytes and how many times it runs.

    Args:
        module: :func:`parse_module`'s computations.
        counts: :func:`multiplicities`'s runs per computation.
        slice_of: Slice index of each logical device id (the mesh's devices in order), or None (one slice).
        num_slices: Slices of the mesh (the group size of a MegaScale DCN transfer).

    Returns:
        Dicts ``{"op", "network" ("ici"|"dcn"), "group", "result_bytes", "moved_bytes", "runs"}``:
        bytes per chip per run.
    """
    devices = len(slice_of) if slice_of else 1
    out = []
    for computation in module.values():
        runs = counts.get(computation.name, 0.0)
        if runs <= 0:
            continue
        for instruction in computation.instructions:
            if instruction.opcode in COLLECTIVES:
                kind = COLLECTIVES[instruction.opcode]
                shape = instruction.shape
                if instruction.opcode in ("all-gather-start", "collective-permute-start"):
                    parts = _tuple_elements(shape)
                    shape = parts[1] if len(parts) > 1 else shape
                if kind == "collective-permute":
                    pairs = _PAIRS.search(instruction.attributes)
                    ids = (
                        [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group("body"))]
                        if pairs
                        else []
                    )
                    size, spans = _network(ids or None, slice_of, devices)
                    size = 2
                else:
                    size, spans = _network(parse_replica_groups(instruction.attributes), slice_of, devices)
                result = array_bytes(shape)
                out.append(
                    {"op": kind, "network": "dcn" if spans else "ici", "group": size, "result_bytes": result,
                     "moved_bytes": moved_bytes(kind, result, size), "runs": runs}
                )  # fmt: skip
            elif instruction.opcode == "recv" and "is_host_transfer=true" in instruction.attributes:
                megascale = _MEGASCALE.search(instruction.attributes)
                if not megascale:
                    continue  # a host transfer that is not a DCN collective (host offload)
                kind = MEGASCALE_KINDS.get(megascale.group("kind"), "all-reduce")
                result = array_bytes(_tuple_elements(instruction.shape)[0])
                group = max(num_slices, 2)
                out.append(
                    {"op": kind, "network": "dcn", "group": group, "result_bytes": result,
                     "moved_bytes": moved_bytes(kind, result, group), "runs": runs}
                )  # fmt: skip
    return out


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (the shape itself when it is an array)."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, current = [], 0, ""
    for char in shape[1:-1]:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def _dims_labels(attributes: str) -> tuple[str, str, str] | None:
    match = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attributes)
    return (match.group(1), match.group(2), match.group(3)) if match else None


def _window(attributes: str, spatial: int) -> list[dict[str, int]]:
    """A convolution's window per spatial dimension: ``size``, ``lo``/``hi`` padding, ``stride`` (defaults 1/0)."""
    match = re.search(r"window=\{([^}]*)\}", attributes)
    fields = dict(re.findall(r"(\w+)=([0-9x_-]+)", match.group(1))) if match else {}
    sizes = [int(x) for x in fields["size"].split("x")] if "size" in fields else [1] * spatial
    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else []
    strides = [int(x) for x in fields["stride"].split("x")] if "stride" in fields else [1] * spatial
    out = []
    for k in range(spatial):
        lo, hi = pads[k] if k < len(pads) else (0, 0)
        out.append({"size": sizes[k] if k < len(sizes) else 1, "lo": lo, "hi": hi,
                    "stride": strides[k] if k < len(strides) else 1})  # fmt: skip
    return out


def valid_pairs(length: int, kernel: int, out: int, lo: int, stride: int = 1) -> int:
    """(output position, kernel position) pairs of one spatial dimension that read the input, not its padding.

    Input index = output x stride + kernel - lo; it counts when ``0 <= index < length``. XLA expresses a
    batch dimension of a batched matmul as a spatial one whose window slides over padding (``size=1x32
    pad=0_0x31_31``), where only one kernel position per output reads data: this is what makes its FLOPs right.
    """
    total = 0
    for k in range(kernel):
        first = max(0, -((k - lo) // stride)) if k < lo else 0
        last = min(out - 1, (length - 1 + lo - k) // stride) if length - 1 + lo - k >= 0 else -1
        total += max(0, last - first + 1)
    return total


def matmul_flops(computation: Computation, instruction: Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of a ``dot`` or ``convolution`` (2 per multiply-add), 0 for other instructions.

    dot: 2 x output elements x the product of the left operand's contracting dimensions.
    convolution: 2 x output elements x the kernel's input features x, per spatial dimension, the kernel
    positions that read input rather than padding per output position (:func:`valid_pairs`), as XLA's
    ``HloCostAnalysis::HandleConvolution`` counts them.
    """
    dims = array_dims(instruction.shape)
    out = math.prod(dims) if dims else 1
    if instruction.opcode == "dot" and instruction.operands:
        lhs = array_dims(shapes.get(instruction.operands[0], ""))
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
        picked = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
        return 2.0 * out * math.prod(lhs[d] for d in picked if d < len(lhs))
    if instruction.opcode == "convolution" and len(instruction.operands) > 1:
        labels = _dims_labels(instruction.attributes)
        lhs = array_dims(shapes.get(instruction.operands[0], ""))
        rhs = array_dims(shapes.get(instruction.operands[1], ""))
        if labels is None or len(labels[1]) != len(rhs) or len(labels[0]) != len(lhs) or len(labels[2]) != len(dims):
            return 0.0
        lhs_labels, kernel, out_labels = labels
        inner = rhs[kernel.index("i")] if "i" in kernel else 1
        spatial = sorted(c for c in kernel if c.isdigit())
        window = _window(instruction.attributes, len(spatial))
        per_output = float(inner)
        for k, label in enumerate(spatial):
            length = lhs[lhs_labels.index(label)] if label in lhs_labels else 1
            size = rhs[kernel.index(label)]
            positions = dims[out_labels.index(label)] if label in out_labels else 1
            pairs = valid_pairs(length, size, positions, window[k]["lo"], window[k]["stride"])
            per_output *= pairs / max(positions, 1)
        return 2.0 * out * per_output
    return 0.0


def _fusion_bodies(module: dict[str, Computation]) -> set[str]:
    """Computations that are the insides of fusions or reductions (no HBM traffic of their own)."""
    inside = set()
    for computation in module.values():
        for instruction in computation.instructions:
            for match in _CALLS.finditer(instruction.attributes):
                if match.group("kind") == "to_apply" or (
                    match.group("kind") == "calls" and instruction.opcode == "fusion"
                ):
                    inside.add(match.group("name"))
    return inside


def summarize(
    text: str,
    cost: dict[str, Any] | list[dict[str, Any]] | None,
    slice_of: list[int] | None = None,
    num_slices: int = 1,
) -> dict[str, Any]:
    """The cost summary of one compiled step (see the module docstring); plain data for the AOT result.

    Args:
        text: ``compiled.as_text()``: the optimized HLO of one device.
        cost: ``compiled.cost_analysis()`` (a dict, or a list of one dict as older JAX returns), or None.
        slice_of: Slice index of each logical device id of the program (the mesh's devices, flattened).
        num_slices: Slices of the mesh.

    Returns:
        ``{"cost_analysis": {"flops", "bytes_accessed"} (XLA's, loop bodies once),
        "hlo": {"matmul_flops_once", "matmul_flops", "bytes_once", "bytes", "unknown_trip_counts"},
        "flops" (per device per step: the cost analysis's scaled by the loop factor), "bytes_accessed"
        (HBM bytes read and written per device per step: the layouts' memory space 0, loop runs counted),
        "host_bytes" (the same for pinned host memory, host offload's transfers),
        "kernel_calls" (runs of Pallas kernels, ``tpu_custom_call``: their FLOPs are in neither count),
        "collectives": [{"network", "op", "group", "moved_bytes", "count"}...] (per device per step, by
        network, op and group size)}``.
    """
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    module = parse_module(text)
    counts, unknown = multiplicities(module)
    inside = _fusion_bodies(module)
    flops_once = flops_all = bytes_once = bytes_all = kernels = hbm_all = host_all = 0.0
    for computation in module.values():
        shapes = {i.name: i.shape for i in computation.instructions}
        runs = counts.get(computation.name, 0.0)
        for instruction in computation.instructions:
            if instruction.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in instruction.attributes:
                kernels += runs
            flops = matmul_flops(computation, instruction, shapes)
            flops_once += flops
            flops_all += flops * runs
            if computation.name in inside or instruction.opcode in NO_BYTES or instruction.opcode.endswith("-done"):
                continue
            moved = instruction_bytes(instruction, shapes, module)
            bytes_once += sum(moved.values())
            bytes_all += sum(moved.values()) * runs
            hbm_all += moved.get(HBM, 0.0) * runs
            host_all += moved.get(HOST, 0.0) * runs
    xla_flops = float((cost or {}).get("flops", 0.0) or 0.0)
    xla_bytes = float((cost or {}).get("bytes accessed", 0.0) or 0.0)
    flop_factor = flops_all / flops_once if flops_once else 1.0
    grouped: dict[tuple[str, str, int], dict[str, Any]] = {}
    for c in collectives(module, counts, slice_of, num_slices):
        key = (c["network"], c["op"], c["group"])
        entry = grouped.setdefault(key, {"network": key[0], "op": key[1], "group": key[2], "moved_bytes": 0.0,
                                         "count": 0.0})  # fmt: skip
        entry["moved_bytes"] += c["moved_bytes"] * c["runs"]
        entry["count"] += c["runs"]
    return {
        "cost_analysis": {"flops": xla_flops, "bytes_accessed": xla_bytes},
        "hlo": {
            "matmul_flops_once": flops_once, "matmul_flops": flops_all, "bytes_once": bytes_once,
            "bytes": bytes_all, "unknown_trip_counts": unknown,
        },
        "flops": xla_flops * flop_factor if xla_flops else flops_all,
        "kernel_calls": kernels,
        "bytes_accessed": hbm_all,
        "host_bytes": host_all,
        "collectives": sorted(grouped.values(), key=lambda e: (e["network"], e["op"], e["group"])),
    }  # fmt: skip
