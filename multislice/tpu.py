"""TPU catalog: what a TPU type name (``v6e-16``) means on GKE.

A *slice* is a set of TPU chips joined by ICI; on GKE a multi-host slice is one
node pool whose nodes (TPU VMs, called *hosts* here) each expose
``chips_per_host`` chips as the ``google.com/tpu`` resource. Slices talk to each
other over DCN.

Sources of the facts below:

- GKE TPU planning and node labels:
  https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus and
  https://cloud.google.com/kubernetes-engine/docs/how-to/tpu-multislice
  (label ``cloud.google.com/gke-tpu-accelerator``, ``cloud.google.com/gke-tpu-topology``).
- Per-generation chips, HBM and peak bf16 FLOP/s:
  https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s, 32 GiB HBM per chip),
  https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s, 16 GiB),
  https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s, 95 GiB usable),
  https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s, 32 GiB).
- Name to topology and machine type, as xpk maps them
  (AI-Hypercomputer/xpk ``src/xpk/core/system_characteristics.py``): the number
  in ``v6e-16`` counts TensorCores, which is chips for v6e and v5e (1 core per
  chip) and twice the chips for v5p and v4; multi-host slices use 4 chips per
  host (``ct6e-standard-4t``, ``ct5lp-hightpu-4t``, ``ct5p-hightpu-4t``,
  ``ct4p-hightpu-4t``).
- v6e machine types by topology (the "Supported configurations" table of
  https://cloud.google.com/tpu/docs/v6e and GKE's
  https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus): 1x1 on one
  ``ct6e-standard-1t``, 2x2 on one ``ct6e-standard-4t``, 2x4 (8 chips) either on one
  ``ct6e-standard-8t`` VM (single-host, 8 chips per host) or on two ``ct6e-standard-4t``
  VMs (the GKE API only; this catalog's default, as xpk's), and 4x4 and larger on
  ``ct6e-standard-4t`` hosts only.
- GKE runs v5e 2x4 as a multi-host slice of two ``ct5lp-hightpu-4t`` nodes in
  its multislice + Kueue tutorial:
  https://cloud.google.com/kubernetes-engine/docs/tutorials/tpu-multislice-kueue
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 1024**3

#: Node label GKE puts on TPU nodes naming the TPU generation.
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
#: Node label GKE puts on TPU nodes naming the slice topology.
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
#: Node label naming the node pool; JobSet's exclusive placement keys on it.
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
#: Extended resource a TPU node exposes, one per chip.
TPU_RESOURCE = "google.com/tpu"


class UnknownTpuType(ValueError):
    """Raised for a TPU type name the catalog does not know; the message lists valid names."""


@dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation as GKE offers it.

    Attributes:
        name: Short generation name used in TPU type names (``v6e``).
        aliases: Other prefixes accepted for the same generation (``v5e`` for ``v5litepod``).
        gke_accelerator: Value of the ``cloud.google.com/gke-tpu-accelerator`` node label.
        multi_host_machine_type: GKE machine type of each host of a multi-host slice.
        single_host_machine_types: Machine type for single-host topologies, by topology.
        other_machine_types: Machine types a topology may also be given on (``RunSpec.machine_type``),
            by topology: machine type -> chips per host (v6e 2x4: ``ct6e-standard-8t``, 8 chips on 1 host).
        tensorcores_per_chip: TensorCores per chip (the unit of the number in ``v5p-16``).
        hbm_bytes_per_chip: High-bandwidth memory per chip, bytes (the product page's figure).
        usable_hbm_bytes_per_chip: HBM per chip that XLA:TPU lets a program use, bytes: the
            "available HBM" its out-of-memory error names (libtpu 0.0.52, measured here by AOT
            compile; ``G`` in its messages is GiB). Less than ``hbm_bytes_per_chip`` by what
            the runtime reserves.
        maxtext_prefix: Generation prefix of MaxText's ``compile_topology`` names
            (``maxtext/utils/accelerator_to_spec_map.py``: ``v5e-16``, ``v6e-16``).
        peak_bf16_flops_per_chip: Peak dense bf16 FLOP/s per chip.
        topologies: Supported slice topologies, smallest first.
        doc: The Cloud TPU page the numbers come from.
    """

    name: str
    aliases: tuple[str, ...]
    gke_accelerator: str
    multi_host_machine_type: str
    single_host_machine_types: dict[str, str]
    other_machine_types: dict[str, dict[str, int]]
    tensorcores_per_chip: int
    hbm_bytes_per_chip: int
    usable_hbm_bytes_per_chip: int
    maxtext_prefix: str
    peak_bf16_flops_per_chip: float
    topologies: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class SliceType:
    """One TPU slice shape, e.g. ``v6e-16`` = topology 4x4 = 16 chips on 4 hosts.

    Attributes:
        name: Canonical TPU type name (``v6e-16``).
        generation: The generation this slice belongs to.
        topology: Chip topology, the ``cloud.google.com/gke-tpu-topology`` value (``4x4``).
        chips: Chips in the slice.
        hosts: TPU VMs (GKE nodes, and so JobSet pods) in the slice.
        chips_per_host: Chips per host, the ``google.com/tpu`` limit of each pod.
        machine_type: GKE machine type of each host (``ct6e-standard-4t``).
    """

    name: str
    generation: TpuGeneration
    topology: str
    chips: int
    hosts: int
    chips_per_host: int
    machine_type: str

    @property
    def multi_host(self) -> bool:
        """True when the slice spans more than one host (GKE multislice needs this)."""
        return self.hosts > 1

    @property
    def gke_accelerator(self) -> str:
        """The ``cloud.google.com/gke-tpu-accelerator`` node label value."""
        return self.generation.gke_accelerator

    @property
    def hbm_bytes_per_chip(self) -> int:
        """HBM per chip, bytes."""
        return self.generation.hbm_bytes_per_chip

    @property
    def usable_hbm_bytes_per_chip(self) -> int:
        """HBM per chip a program may use, bytes (XLA:TPU's "available HBM")."""
        return self.generation.usable_hbm_bytes_per_chip

    @property
    def peak_bf16_flops_per_chip(self) -> float:
        """Peak dense bf16 FLOP/s per chip."""
        return self.generation.peak_bf16_flops_per_chip

    @property
    def maxtext_topology(self) -> str:
        """This slice as MaxText's ``compile_topology`` names it (``v5litepod-16`` -> ``v5e-16``)."""
        return f"{self.generation.maxtext_prefix}-{self.chips * self.generation.tensorcores_per_chip}"

    @property
    def flavor_name(self) -> str:
        """A Kueue ResourceFlavor name for this slice shape (``v6e-4x4``)."""
        return f"{self.generation.name}-{self.topology}"


def _v5p_topologies() -> tuple[str, ...]:
    # The standard v5p shapes from https://cloud.google.com/tpu/docs/v5p.
    return (
        "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
        "8x8x8", "8x8x16", "8x16x16", "16x16x16", "16x16x24",
    )  # fmt: skip


def _v4_topologies() -> tuple[str, ...]:
    # The default v4 shapes xpk offers (system_characteristics.py).
    return (
        "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
        "8x8x8", "8x8x12", "8x8x16", "8x16x16",
    )  # fmt: skip


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            name="v6e",
            aliases=(),
            gke_accelerator="tpu-v6e-slice",
            multi_host_machine_type="ct6e-standard-4t",
            single_host_machine_types={"1x1": "ct6e-standard-1t", "2x2": "ct6e-standard-4t"},
            other_machine_types={"2x4": {"ct6e-standard-8t": 8}},
            tensorcores_per_chip=1,
            hbm_bytes_per_chip=32 * GIB,
            usable_hbm_bytes_per_chip=round(31.24 * GIB),
            maxtext_prefix="v6e",
            peak_bf16_flops_per_chip=918e12,
            topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
            doc="https://cloud.google.com/tpu/docs/v6e",
        ),
        TpuGeneration(
            name="v5litepod",
            aliases=("v5e",),
            gke_accelerator="tpu-v5-lite-podslice",
            multi_host_machine_type="ct5lp-hightpu-4t",
            single_host_machine_types={"1x1": "ct5lp-hightpu-1t", "2x2": "ct5lp-hightpu-4t"},
            other_machine_types={},
            tensorcores_per_chip=1,
            hbm_bytes_per_chip=16 * GIB,
            usable_hbm_bytes_per_chip=round(15.75 * GIB),
            maxtext_prefix="v5e",
            peak_bf16_flops_per_chip=197e12,
            topologies=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
            doc="https://cloud.google.com/tpu/docs/v5e",
        ),
        TpuGeneration(
            name="v5p",
            aliases=(),
            gke_accelerator="tpu-v5p-slice",
            multi_host_machine_type="ct5p-hightpu-4t",
            single_host_machine_types={"2x2x1": "ct5p-hightpu-4t"},
            other_machine_types={},
            tensorcores_per_chip=2,
            hbm_bytes_per_chip=95 * GIB,
            usable_hbm_bytes_per_chip=round(95.73 * GIB),
            maxtext_prefix="v5p",
            peak_bf16_flops_per_chip=459e12,
            topologies=_v5p_topologies(),
            doc="https://cloud.google.com/tpu/docs/v5p",
        ),
        TpuGeneration(
            name="v4",
            aliases=(),
            gke_accelerator="tpu-v4-podslice",
            multi_host_machine_type="ct4p-hightpu-4t",
            single_host_machine_types={"2x2x1": "ct4p-hightpu-4t"},
            other_machine_types={},
            tensorcores_per_chip=2,
            hbm_bytes_per_chip=32 * GIB,
            usable_hbm_bytes_per_chip=round(30.75 * GIB),
            maxtext_prefix="v4",
            peak_bf16_flops_per_chip=275e12,
            topologies=_v4_topologies(),
            doc="https://cloud.google.com/tpu/docs/v4",
        ),
    )
}

_NAME = re.compile(r"^(?P<prefix>[a-z0-9]+?)-(?P<size>\d+(?:x\d+){0,2})$")


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def _slice(generation: TpuGeneration, topology: str, machine_type: str | None = None) -> SliceType:
    chips = _chips(topology)
    if machine_type is not None and machine_type in generation.other_machine_types.get(topology, {}):
        chips_per_host = generation.other_machine_types[topology][machine_type]
    elif topology in generation.single_host_machine_types:
        machine_type = generation.single_host_machine_types[topology]
        chips_per_host = chips
    else:
        machine_type = generation.multi_host_machine_type
        chips_per_host = 4
    return SliceType(
        name=f"{generation.name}-{chips * generation.tensorcores_per_chip}",
        generation=generation,
        topology=topology,
        chips=chips,
        hosts=chips // chips_per_host,
        chips_per_host=chips_per_host,
        machine_type=machine_type,
    )


def all_slice_types() -> list[SliceType]:
    """Every slice shape in the catalog, generation by generation, smallest first."""
    return [_slice(g, t) for g in GENERATIONS.values() for t in g.topologies]


def machine_types(shape: SliceType) -> list[str]:
    """The GKE machine types a slice shape can be given on: its default first, then the others of its topology."""
    others = shape.generation.other_machine_types.get(shape.topology, {})
    default = _slice(shape.generation, shape.topology).machine_type
    return [default, *(m for m in others if m != default)]


def with_machine_type(shape: SliceType, machine_type: str | None) -> SliceType:
    """``shape`` on ``machine_type`` (hosts and chips per host follow it); None keeps the default.

    Raises:
        UnknownTpuType: a machine type the shape's topology is not offered on; the message names the reason
            and the machine types it is offered on (:data:`GENERATIONS`, from the generation's Cloud TPU page).
    """
    if machine_type is None or machine_type == shape.machine_type:
        return shape
    choices = machine_types(shape)
    if machine_type not in choices:
        elsewhere = [
            _slice(g, t, machine_type).name
            for g in GENERATIONS.values()
            for t in g.topologies
            if machine_type in machine_types(_slice(g, t))
        ]
        hint = f"; {machine_type} hosts {', '.join(elsewhere)}" if elsewhere else ""
        raise UnknownTpuType(
            f"machine type {machine_type!r} cannot host {shape.name} (topology {shape.topology}, {shape.chips} chips): "
            f"GKE offers that topology on {' or '.join(choices)}{hint} (source: {shape.generation.doc})"
        )
    return _slice(shape.generation, shape.topology, machine_type)


def parse_tpu_type(name: str, machine_type: str | None = None) -> SliceType:
    """Parse a TPU type name into its slice shape.

    Accepts ``<generation>-<tensorcores>`` (``v6e-16``, ``v5p-128``,
    ``v5litepod-16``, alias ``v5e-16``) and ``<generation>-<topology>``
    (``v6e-4x4``, ``v5p-4x4x4``), as xpk does.

    ``machine_type`` picks another machine type the topology is offered on (:func:`with_machine_type`):
    ``parse_tpu_type("v6e-8", "ct6e-standard-8t")`` is 8 chips on one host instead of two hosts of 4.

    Returns:
        The SliceType (chips, hosts, chips per host, topology, machine type).

    Raises:
        UnknownTpuType: the name is not a known generation and size (the message lists the valid sizes of
            that generation), or a machine type the topology is not offered on.
    """
    match = _NAME.fullmatch(name.strip().lower())
    generation = None
    if match:
        prefix = match.group("prefix")
        generation = next((g for g in GENERATIONS.values() if prefix == g.name or prefix in g.aliases), None)
    if match is None or generation is None:
        known = ", ".join(sorted(GENERATIONS))
        raise UnknownTpuType(
            f"unknown TPU type {name!r}: expected <generation>-<size> with generation one of "
            f"{known} (v5e is an alias of v5litepod), e.g. v6e-16"
        )
    size = match.group("size")
    shapes = [_slice(generation, t) for t in generation.topologies]
    for shape in shapes:
        if size == shape.topology or size == str(shape.chips * generation.tensorcores_per_chip):
            return with_machine_type(shape, machine_type)
    valid = ", ".join(s.name for s in shapes)
    unit = "TensorCores (2 per chip)" if generation.tensorcores_per_chip == 2 else "chips"
    raise UnknownTpuType(
        f"unknown TPU type {name!r}: the number after {generation.name}- counts {unit}; "
        f"valid {generation.name} types are {valid}"
    )
