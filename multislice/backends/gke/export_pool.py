"""Whether the node pool the verify-and-export Job goes to can hold it: checked by provision before any node pool is
created (:meth:`multislice.backends.gke.GkeBackend.provision`).

The Job (:mod:`multislice.backends.gke.exporter`) asks for memory (request = limit), ``exporter.cpu`` CPUs and an
``ephemeral-storage`` request the size of its ``emptyDir`` scratch volume, and goes to the nodes
``exporter.node_selector`` names. On a pool whose nodes cannot give that, the pod is never scheduled and the cluster
autoscaler adds no node for it: the export fails after the whole training, at ``job_unschedulable_grace``. So when a
stage has an export and the selector names a node pool (``cloud.google.com/gke-nodepool``), :func:`check` reads that
pool (one ``nodePools.get``: ``container.clusters.get``, as listing the TPU pools needs) and refuses, naming the pool
and the fix (a ``gcloud`` command with a machine type and boot disk that fit):

- the pool does not exist;
- its machine type's allocatable memory or CPU (:func:`allocatable_memory`, :func:`allocatable_cpu_millis`) is below
  the Job's request;
- its boot disk's allocatable ephemeral storage (:func:`allocatable_ephemeral_storage`) is below the scratch
  request.

A selector by other labels (or none) is not checked: said so, no refusal. Nor is a pool whose ephemeral storage is on
local SSDs (``ephemeralStorageLocalSsdConfig``), whose size depends on the disks' count and filesystem.

**Machine types** (:data:`SERIES`): memory and vCPUs of the standard shapes of the N2, N2D, C3 (standard, highmem,
highcpu) and M3 (megamem, ultramem) series, as Compute Engine's machine family pages give them
(https://cloud.google.com/compute/docs/general-purpose-machines: N2 ``standard`` 4 GB per vCPU, ``highmem`` 8 GB
(n2-highmem-128: 864 GB), ``highcpu`` 1 GB; N2D the same ratios; C3 ``standard`` 4 GB, ``highmem`` 8 GB, ``highcpu``
2 GB on 4, 8, 22, 44, 88 or 176 vCPUs; https://cloud.google.com/compute/docs/memory-optimized-machines: m3-megamem-64
976 GB, m3-megamem-128 1,952 GB, m3-ultramem-32/64/128 976/1,952/3,904 GB; Compute Engine's GB are GiB, the
``memoryMb`` of ``machineTypes.get``), and custom types by their name (``n2-custom-8-65536``: vCPUs, MiB). Any other
machine type: "unknown machine type: memory and CPU not checked".

**Allocatable** (what the scheduler and the cluster autoscaler place pods against): GKE reserves part of each node
(https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes, "Node allocatable resources"):

- memory: 25 % of the first 4 GiB, 20 % of the next 4 GiB, 10 % of the next 8 GiB, 6 % of the next 112 GiB and 2 %
  above 128 GiB, plus the 100 MiB eviction threshold; and the node's capacity is already below the machine's
  memory by what the kernel keeps (1/64 of it, + 16 MiB, + 64 MiB above 3 GiB, + 8 MiB up to 8 GiB, + min(0.175 %,
  248 MiB) on COS and Ubuntu: cluster-autoscaler ``cloudprovider/gce/gce_reserved.go``, ``CalculateKernelReserved``,
  the estimate the autoscaler itself scales up from zero with);
- CPU: 6 % of the first core, 1 % of the next, 0.5 % of the next 2, 0.25 % above 4 (the same page; cluster-autoscaler
  ``cloudprovider/gce/reserved.go``);
- ephemeral storage on the boot disk of ``disk`` GiB (``config.diskSizeGb``, ``config.bootDisk.sizeGb``; the API's
  default 100 GB when unset): allocatable = capacity - eviction threshold - system reservation, with the eviction
  threshold 10 % of the capacity (kubelet ``evictionHard`` ``nodefs.available``) and the system reservation
  min(50 % x disk, 6 GiB + 35 % x disk, 100 GiB) (the same page, "Local ephemeral storage reservation"); the
  capacity is the disk less the node image's own partitions (COS: 1.5635 % + 4.148 GiB, Ubuntu: 3.083 % + 0.171 GiB,
  both + min(0.1 %, 100 MiB): cluster-autoscaler ``gce_reserved.go``, ``CalculateOSReservedEphemeralStorage``).
  For the default 100 GB COS boot disk this gives 43.77 GiB; GKE's page shows such a node with a capacity of
  98831908Ki and 47060071478 bytes (43.83 GiB) allocatable, of which its kube-reserved ``ephemeral-storage=41Gi``
  (6 GiB + 35 % x 100 GiB) is the system reservation. Memory and disk figures are estimates to within about 1 %.

**Zones**: no zone catalogue is consulted. The pool's ``locations`` are zones where GKE accepted its machine type: GKE
refuses to create a node pool, or add a location to it, with a machine type a zone does not offer, so an existing
pool's machine type is offered where its nodes go. (Whether a zone has the capacity when the autoscaler asks for a
node is not knowable in advance: the Job's ``timeouts.scale_up_grace`` covers that, docs/gke-setup.md.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multislice.backends.gke import exporter, nodepool

if TYPE_CHECKING:
    from google.cloud import container_v1

    from multislice.plan import Plan

#: The node label GKE sets to the node's pool name.
POOL_LABEL = "cloud.google.com/gke-nodepool"
#: Bytes in a GiB (Compute Engine's "GB" of memory and disk).
GIB = 2**30
#: Bytes in a MiB.
MIB = 2**20
#: The GKE API's boot disk size when a pool does not say (``NodeConfig.diskSizeGb``: "the default disk size is 100GB").
DEFAULT_DISK_GB = 100

#: Machine series -> shape -> (GiB of memory per vCPU, the vCPU counts offered); Compute Engine's machine family
#: pages (module docstring). Exceptions to the ratio are in :data:`MEMORY_EXCEPTIONS`.
SERIES: dict[str, dict[str, tuple[float, tuple[int, ...]]]] = {
    "n2": {
        "standard": (4, (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)),
        "highmem": (8, (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)),
        "highcpu": (1, (2, 4, 8, 16, 32, 48, 64, 80, 96)),
    },
    "n2d": {
        "standard": (4, (2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 224)),
        "highmem": (8, (2, 4, 8, 16, 32, 48, 64, 80, 96)),
        "highcpu": (1, (2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 224)),
    },
    "c3": {
        "standard": (4, (4, 8, 22, 44, 88, 176)),
        "highmem": (8, (4, 8, 22, 44, 88, 176)),
        "highcpu": (2, (4, 8, 22, 44, 88, 176)),
    },
    "m3": {
        "megamem": (15.25, (64, 128)),
        "ultramem": (30.5, (32, 64, 128)),
    },
}
#: Machine types whose memory is not their series' ratio x vCPUs, GiB.
MEMORY_EXCEPTIONS = {"n2-highmem-128": 864}
_STANDARD = re.compile(r"^([a-z][a-z0-9]*)-([a-z]+)-(\d+)$")
_CUSTOM = re.compile(r"^(?:([a-z][a-z0-9]*)-)?custom-(\d+)-(\d+)(?:-ext)?$")


class ExportPoolUnfit(nodepool.NodePoolError):
    """The node pool ``exporter.node_selector`` names is missing or cannot hold the verify-and-export Job."""


@dataclass(frozen=True)
class Machine:
    """A machine type's size: ``memory_bytes`` (bytes) and ``vcpus``."""

    name: str
    memory_bytes: int
    vcpus: int


def machine(machine_type: str) -> Machine | None:
    """The memory and vCPUs of a Compute Engine machine type (:data:`SERIES`, custom types by name), or None when
    the table does not know it."""
    if match := _CUSTOM.match(machine_type):
        return Machine(machine_type, int(match.group(3)) * MIB, int(match.group(2)))
    match = _STANDARD.match(machine_type)
    if not match or match.group(1) not in SERIES or match.group(2) not in SERIES[match.group(1)]:
        return None
    per_vcpu, counts = SERIES[match.group(1)][match.group(2)]
    vcpus = int(match.group(3))
    if vcpus not in counts:
        return None
    gib = MEMORY_EXCEPTIONS.get(machine_type, per_vcpu * vcpus)
    return Machine(machine_type, int(gib * GIB), vcpus)


def known_machines() -> list[Machine]:
    """Every standard machine type of :data:`SERIES`, smallest memory first (then fewest vCPUs)."""
    names = [
        f"{s}-{shape}-{n}" for s, shapes in SERIES.items() for shape, (_, counts) in shapes.items() for n in counts
    ]
    found = [m for m in map(machine, names) if m is not None]
    return sorted(found, key=lambda m: (m.memory_bytes, m.vcpus, m.name))


def _bracketed(capacity: float, brackets: Sequence[tuple[float, float]]) -> float:
    """What a marginal-rate schedule reserves of ``capacity``: ``(threshold, rate)`` pairs, each rate applying from
    its threshold up to the next one's."""
    reserved = 0.0
    for i, (threshold, rate) in enumerate(brackets):
        top = brackets[i + 1][0] if i + 1 < len(brackets) else math.inf
        reserved += max(0.0, min(capacity, top) - threshold) * rate
    return reserved


def allocatable_memory(memory_bytes: int) -> int:
    """A GKE node's allocatable memory, bytes, on a machine of ``memory_bytes``: less the kernel's, GKE's
    kube-reserved and the 100 MiB eviction threshold (module docstring: GKE's plan-node-sizes page and
    cluster-autoscaler ``gce_reserved.go``). Machines under 1 GiB keep GKE's minimum 255 MiB reservation."""
    kernel = memory_bytes / 64 + 16 * MIB + (64 * MIB if memory_bytes > 3 * GIB else 0)
    kernel += min(0.00175 * memory_bytes, 248 * MIB) + (8 * MIB if memory_bytes <= 8 * GIB else 0)
    if memory_bytes < GIB:
        reserved = 255 * MIB
    else:
        brackets = [(0, 0.25), (4 * GIB, 0.2), (8 * GIB, 0.1), (16 * GIB, 0.06), (128 * GIB, 0.02)]
        reserved = _bracketed(memory_bytes, brackets)
    return max(0, int(memory_bytes - kernel - reserved - 100 * MIB))


def allocatable_cpu_millis(vcpus: int) -> int:
    """A GKE node's allocatable CPU, millicores, on ``vcpus`` vCPUs (GKE's plan-node-sizes page)."""
    millis = vcpus * 1000
    return millis - int(_bracketed(millis, [(0, 0.06), (1000, 0.01), (2000, 0.005), (4000, 0.0025)]))


def allocatable_ephemeral_storage(disk_gb: int, image_type: str = "COS_CONTAINERD") -> int:
    """A GKE node's allocatable ephemeral storage, bytes, on a boot disk of ``disk_gb`` GiB with node image
    ``image_type`` (``COS_CONTAINERD``, ``UBUNTU_CONTAINERD``): the disk less the image's partitions, the 10 %
    eviction threshold and GKE's system reservation (module docstring)."""
    disk = disk_gb * GIB
    buffer = min(100 * MIB, math.ceil(0.001 * disk))
    if image_type.upper().startswith("UBUNTU"):
        image = math.ceil(0.03083 * disk) + math.ceil(0.171 * GIB) + buffer
    else:
        image = math.ceil(0.015635 * disk) + math.ceil(4.148 * GIB) + buffer
    capacity = disk - image
    system = min(0.5 * disk, 6 * GIB + 0.35 * disk, 100 * GIB)
    return max(0, int(capacity - 0.1 * capacity - system))


def disk_for(scratch_bytes: int, image_type: str = "COS_CONTAINERD") -> int:
    """The smallest boot disk, GiB (at least GKE's 10 GB minimum), whose allocatable ephemeral storage holds
    ``scratch_bytes``."""
    low, high = 10, 10
    while allocatable_ephemeral_storage(high, image_type) < scratch_bytes:
        low, high = high, high * 2
    while low < high:  # allocatable grows with the disk: bisect
        middle = (low + high) // 2
        if allocatable_ephemeral_storage(middle, image_type) >= scratch_bytes:
            high = middle
        else:
            low = middle + 1
    return high


@dataclass(frozen=True)
class Needs:
    """What the largest export of the run asks of one node: bytes, millicores, and the stages asking each most."""

    memory_bytes: int
    memory_stage: str
    cpu_millis: int
    scratch_bytes: int
    scratch_stage: str


def needs(plan: Plan) -> Needs | None:
    """The largest memory and scratch requests of the run's export Jobs (:func:`.exporter.resources`, as rendered),
    or None when no stage exports."""
    from kubernetes.utils import parse_quantity  # the Kubernetes client's quantity parser

    asks = []
    for stage in plan.stages:
        if stage.export:
            requests = exporter.resources(plan, stage)["requests"]
            asks.append((stage.name, *(int(parse_quantity(requests[k])) for k in ("memory", "ephemeral-storage"))))
    if not asks:
        return None
    memory = max(asks, key=lambda a: a[1])
    scratch = max(asks, key=lambda a: a[2])
    cpu = int(parse_quantity(str(plan.spec.exporter.cpu)) * 1000)
    return Needs(memory[1], memory[0], cpu, scratch[2], scratch[0])


def _gib(count: float) -> str:
    return f"{count / GIB:.1f} GiB"


def _commands(plan: Plan, pool: str, need: Needs, image_type: str, exists: bool) -> str:
    """The ``gcloud`` commands that give ``pool`` (or a new pool) a machine type and boot disk that fit."""
    fits = [
        m
        for m in known_machines()
        if allocatable_memory(m.memory_bytes) >= need.memory_bytes
        and allocatable_cpu_millis(m.vcpus) >= need.cpu_millis
    ]
    disk = max(disk_for(need.scratch_bytes, image_type), DEFAULT_DISK_GB)
    c = plan.spec.cluster
    where = [f"--cluster={c.name}", f"--location={c.location}", f"--project={c.project}"]
    size = ([f"--machine-type={fits[0].name}"] if fits else []) + [f"--disk-size={disk}"]
    other = f"export-{fits[0].name}" if fits else f"{pool}-2"
    create = ["gcloud", "container", "node-pools", "create", other if exists else pool, *where, *size]
    create += ["--num-nodes=0", "--enable-autoscaling", "--min-nodes=0", "--max-nodes=1"]
    create.append("--workload-metadata=GKE_METADATA")
    sized = f"{fits[0].name} ({_gib(fits[0].memory_bytes)}, {fits[0].vcpus} vCPUs)" if fits else "a larger machine"
    text = f"a machine type such as {sized} and a boot disk of {disk} GB: "
    if exists:
        update = ["gcloud", "container", "node-pools", "update", pool, *where, *size]
        text += f"update the pool ({' '.join(update)}; GKE recreates its nodes), or create another ("
        text += f"{' '.join(create)}) and set exporter.node_selector to {{{POOL_LABEL}: {create[4]}}}"
    else:
        text += f"create it ({' '.join(create)}), or set exporter.node_selector to a pool that has them"
    return text + "; see docs/gke-setup.md, The export Job"


def check(plan: Plan, client: container_v1.ClusterManagerClient | None = None) -> list[str]:
    """Check that the node pool ``exporter.node_selector`` names can hold the run's largest export Job (module
    docstring), before any node pool is created.

    Args:
        client: A google-cloud-container ``ClusterManagerClient``; default one with Application Default
            Credentials, made only when a pool is to be read.

    Returns:
        Lines saying what was checked, or why nothing was (no export, a selector by other labels).

    Raises:
        ExportPoolUnfit: the pool does not exist, or its nodes' allocatable memory, CPU or boot-disk ephemeral
            storage is below the Job's requests; the fix has the ``gcloud`` commands.
        multislice.backends.gke.nodepool.NodePoolError: the GKE API refused the read (not found excepted).
        multislice.config.ConfigError: incomplete cluster reference; nothing was called.
    """
    need = needs(plan)
    if need is None:
        return []
    selector = plan.spec.exporter.node_selector
    pool_name = selector.get(POOL_LABEL)
    if not pool_name:
        labels = ", ".join(f"{k}={v}" for k, v in selector.items())
        return [
            "export node pool: not checked: exporter.node_selector "
            + (f"selects nodes by {labels}, not by {POOL_LABEL}" if labels else "is empty (any node)")
            + f"; its nodes need {_gib(need.memory_bytes)} of memory, {need.cpu_millis / 1000:g} CPUs and "
            f"{_gib(need.scratch_bytes)} of ephemeral storage allocatable"
        ]
    from google.api_core import exceptions  # the GKE API client: only when provisioning on GKE
    from google.cloud import container_v1  # idem

    parent = nodepool.cluster_path(plan)
    if client is None:
        client = container_v1.ClusterManagerClient()
    try:
        pool = client.get_node_pool(name=f"{parent}/nodePools/{pool_name}")
    except exceptions.NotFound as error:
        raise ExportPoolUnfit(
            f"exporter.node_selector names node pool {pool_name} ({POOL_LABEL}), which does not exist on {parent} "
            f"(GKE: {nodepool._message(error)}): "
            f"the export Job of stage {need.memory_stage} ({_gib(need.memory_bytes)} of memory, "
            f"{need.cpu_millis / 1000:g} CPUs, {_gib(need.scratch_bytes)} of scratch) would never be scheduled; "
            "nothing was created",
            _commands(plan, pool_name, need, "COS_CONTAINERD", exists=False),
        ) from None
    except exceptions.GoogleAPICallError as error:
        raise nodepool._api_error(error, f"reading node pool {pool_name} (exporter.node_selector)", parent) from error
    return _fits(plan, pool_name, pool, need)


def _fits(plan: Plan, name: str, pool: Any, need: Needs) -> list[str]:
    """Compare an existing pool's nodes with the Job's requests; raise :class:`ExportPoolUnfit` or return lines."""
    config = pool.config
    image_type = config.image_type or "COS_CONTAINERD"
    disk_gb = config.boot_disk.size_gb or config.disk_size_gb or DEFAULT_DISK_GB
    zones = ", ".join(pool.locations) or "the cluster's"
    problems, lines = [], []
    kind = machine(config.machine_type)
    if kind is None:
        lines.append(f"export node pool {name}: unknown machine type {config.machine_type}: memory and CPU not checked")
    else:
        memory, cpu = allocatable_memory(kind.memory_bytes), allocatable_cpu_millis(kind.vcpus)
        if memory < need.memory_bytes:
            problems.append(
                f"its {kind.name} nodes ({_gib(kind.memory_bytes)}) have about {_gib(memory)} of memory allocatable, "
                f"below the {_gib(need.memory_bytes)} the export Job of stage {need.memory_stage} asks for"
            )
        if cpu < need.cpu_millis:
            problems.append(
                f"its {kind.name} nodes ({kind.vcpus} vCPUs) have {cpu / 1000:g} CPUs allocatable, below "
                f"exporter.cpu {need.cpu_millis / 1000:g}"
            )
        lines.append(
            f"export node pool {name}: {kind.name} in {zones}: about {_gib(memory)} of memory and {cpu / 1000:g} CPUs "
            f"allocatable for the export Job's {_gib(need.memory_bytes)} and {need.cpu_millis / 1000:g}"
        )
    if config.ephemeral_storage_local_ssd_config.local_ssd_count:
        lines.append(f"export node pool {name}: ephemeral storage on local SSDs: the scratch volume's room not checked")
    else:
        storage = allocatable_ephemeral_storage(disk_gb, image_type)
        if storage < need.scratch_bytes:
            problems.append(
                f"its {disk_gb} GB boot disk leaves about {_gib(storage)} of ephemeral storage allocatable (after "
                f"GKE's reservation for the system: docs/gke-setup.md), below the {_gib(need.scratch_bytes)} scratch "
                f"volume of stage {need.scratch_stage}'s export"
            )
        lines.append(
            f"export node pool {name}: {disk_gb} GB boot disk, about {_gib(storage)} of ephemeral storage allocatable "
            f"for the export's {_gib(need.scratch_bytes)} scratch"
        )
    if problems:
        raise ExportPoolUnfit(
            f"node pool {name} (exporter.node_selector) cannot hold the verify-and-export Job: "
            + "; ".join(problems)
            + "; the pod would never be scheduled and the export would fail after training; nothing was created",
            _commands(plan, name, need, image_type, exists=True),
        )
    return lines
