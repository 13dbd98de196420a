"""provision: make sure the capacity and the queueing objects the run needs exist.

On GKE: the TPU node pools (one per slice) through
:func:`multislice.backends.gke.nodepool.ensure_node_pools` (created when
``node_pools.manage`` is true, else only checked); a check that the JobSet and
Kueue CRDs are served at the versions this project renders (the versions
found are reported); and the Kueue objects (:mod:`multislice.render.kueue`)
server-side applied with a fixed field manager: the LocalQueue always, the
cluster-scoped ones only with ``service_accounts.kueue_cluster_objects``
(otherwise RBAC leaves them to a cluster admin, :mod:`multislice.render.rbac`).
On the local backend there are no node pools and no Kueue: it checks that this machine can host the emulated slices (the
trainer environment, CPU and memory, the JAX coordinator port), renders and
validates the Kueue objects a cluster would need, writes them under the run
directory, and says plainly that nothing was applied.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from multislice.backends.local import COORDINATOR_PORT, port_in_use, trainer_env
from multislice.plan import Plan
from multislice.render import kueue, schema
from multislice.steps import gke_api, say, write_report

#: Resident memory to allow per local trainer process, bytes. Measured here: at most
#: 1.21 GiB resident per process for either stage of the local profile; doubled for headroom.
LOCAL_BYTES_PER_PROCESS = 2 * 1024**3


class InsufficientCapacity(RuntimeError):
    """This machine cannot host the run's emulated slices; the message says what to change."""


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo, bytes."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def trainer_versions(env: Path) -> dict[str, str]:
    """Versions of the packages that affect training, as installed in the trainer environment."""
    code = (
        "from importlib.metadata import version\n"
        "for p in ('maxtext', 'jax', 'jaxlib', 'orbax-checkpoint', 'libtpu'):\n"
        "    print(p, version(p))\n"
    )
    out = subprocess.run([str(env / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def kueue_objects(plan: Plan) -> list[dict[str, Any]]:
    """The run's Kueue objects, validated against the Kueue CRDs."""
    objects = kueue.render_kueue_objects(plan)
    for obj in objects:
        schema.validate(obj)
    return objects


def run(plan: Plan, *, kube: Any = None, timings: Any = None) -> dict[str, Any]:
    """Check or create capacity for the plan; returns the provision report.

    ``kube`` and ``timings`` (GKE backend) replace the API client built from
    ``plan.spec.cluster`` and the default waits (tests pass both).

    Raises:
        InsufficientCapacity: not enough memory, or the coordinator port is taken.
        multislice.backends.local.TrainerEnvMissing: no trainer environment.
        multislice.backends.gke.cluster.CrdsMissing: (GKE) JobSet or Kueue not installed at the needed versions.
        multislice.backends.gke.nodepool.NodePoolMismatch: (GKE) a node pool exists with another shape.
    """
    if plan.spec.backend == "gke":
        return _run_gke(plan, gke_api(plan, "provision", kube=kube, timings=timings))
    spec = plan.spec
    objects = kueue_objects(plan)
    manifests = Path(plan.run_dir) / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    (manifests / "kueue.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False), encoding="utf-8")

    env = trainer_env()
    versions = trainer_versions(env)
    processes = spec.num_slices * plan.slice["hosts"]
    needed = processes * LOCAL_BYTES_PER_PROCESS
    available = available_memory_bytes()
    if available < needed:
        raise InsufficientCapacity(
            f"{processes} trainer processes ({spec.num_slices} slices x {plan.slice['hosts']} hosts) need about "
            f"{needed / 2**30:.0f} GiB of memory; {available / 2**30:.1f} GiB is available. "
            "Lower num_slices, or use a TPU type with fewer hosts per slice."
        )
    if port_in_use(COORDINATOR_PORT):
        raise InsufficientCapacity(
            f"port {COORDINATOR_PORT} (MaxText's CPU JAX coordinator) is in use on this machine; "
            "stop the process holding it (another local run?) and retry"
        )
    report = {
        "backend": "local",
        "node_pools": [],
        "note": (
            "local backend: no node pools are created and no Kueue objects are applied; this machine hosts "
            f"{spec.num_slices} emulated {plan.slice['name']} slices as {processes} processes with "
            f"{plan.slice['chips_per_host']} CPU devices each (one per chip)"
        ),
        "capacity": {
            "processes": processes,
            "devices": plan.total_chips,
            "cpu_cores": os.cpu_count(),
            "memory_needed_bytes": needed,
            "memory_available_bytes": available,
        },
        "trainer_env": str(env),
        "trainer_versions": versions,
        "kueue_objects": [f"{o['kind']}/{o['metadata']['name']}" for o in objects],
        "kueue_manifest": str(manifests / "kueue.yaml"),
    }
    say("provision", report["note"])
    say("provision", f"trainer environment {env}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    say("provision", f"Kueue objects rendered and validated (not applied): {', '.join(report['kueue_objects'])}")
    return write_report(plan, "provision", report)


def _run_gke(plan: Plan, kube: Any) -> dict[str, Any]:
    from multislice.backends.gke import cluster, nodepool
    from multislice.backends.gke.client import FIELD_MANAGER

    pools = nodepool.ensure_node_pools(plan, on_progress=lambda message: say("provision", message))
    crds = cluster.check_crds(kube)
    say(
        "provision",
        "CRDs served: " + ", ".join(f"{name} {'/'.join(versions)}" for name, versions in crds.items()),
    )
    applied, left = [], []
    for obj in kueue_objects(plan):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if "namespace" not in obj["metadata"] and not plan.spec.service_accounts.kueue_cluster_objects:
            left.append(name)  # cluster-scoped: a cluster admin applies it (multislice.render.rbac)
            continue
        stored = cluster.server_side_apply(kube, obj)
        applied.append(name)
        version = stored.get("metadata", {}).get("resourceVersion")
        say("provision", f"applied {name} (field manager {FIELD_MANAGER}, resourceVersion {version})")
    if left:
        say(
            "provision",
            f"not applied (cluster-scoped, service_accounts.kueue_cluster_objects is false; a cluster admin applies "
            f"them from `multislice render`): {', '.join(left)}",
        )
    report = {
        "backend": "gke",
        "node_pools": list(pools.get("node_pools", [])),
        "crds": crds,
        "kueue_objects": applied,
        "kueue_objects_left_to_admin": left,
        "field_manager": FIELD_MANAGER,
        "namespace": kube.namespace,
    }
    return write_report(plan, "provision", report)
