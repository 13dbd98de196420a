"""TPU node pools on GKE: one per slice, created, adopted or checked through the GKE API (google-cloud-container).

A multi-host TPU slice on GKE is one node pool: ``hosts`` nodes of the slice's
machine type, placed together by a COMPACT placement policy whose
``tpu_topology`` is the slice topology (``4x4``); GKE creates or repairs the
slice as one unit. A multislice run needs ``num_slices`` such pools, and the
JobSet's exclusive placement (``cloud.google.com/gke-nodepool``) puts each
child Job on its own pool. Sources:

- https://cloud.google.com/kubernetes-engine/docs/how-to/tpus (create a multi-host
  TPU slice node pool: ``--machine-type``, ``--tpu-topology``, ``--num-nodes``; spot,
  flex-start, reservations);
- https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters.nodePools
  (``NodePool``: ``placementPolicy.type COMPACT``, ``placementPolicy.tpuTopology``,
  ``config.spot``, ``config.flexStart``, ``config.reservationAffinity``,
  ``queuedProvisioning``, ``networkConfig.additionalNodeNetworkConfigs``);
- xpk ``src/xpk/core/nodepool.py`` (``run_gke_node_pool_create_command``: pools named
  ``<prefix>-<i>``, ``--placement-type=COMPACT --tpu-topology`` only for multi-host slices,
  ``--num-nodes`` = VMs per slice, 0 for flex-start) and ``src/xpk/core/capacity.py``
  (flex-start: autoscaling with ``--max-nodes`` = VMs per slice, ``--location-policy=ANY``,
  ``--reservation-affinity=none``, ``--no-enable-autorepair``; reservation:
  ``--reservation-affinity=specific --reservation=NAME``);
- https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods
  and the Ray multislice guide (``--additional-node-network network=,subnetwork=`` for DCN NICs).

This module never modifies a node pool. A pool that exists with the
run's name but another shape is an error with a field-by-field diff, raised
before anything is created. A pool it creates for a pipeline run carries that
run's id as the GCE resource label :data:`RUN_LABEL` (``config.resourceLabels``);
the only pools ever deleted are those, when that run was terminated
(:func:`delete_run_pools`, called by the exit handler and the reaper for a
cancelled run), and not while another run's pod or workload may use them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multislice import config
from multislice.errors import InputError
from multislice.render import launchers
from multislice.render.ray import DRANET_NODE_LABEL

if TYPE_CHECKING:
    from google.cloud import container_v1

    from multislice.plan import Plan

#: The GKE API's REST base URL.
GKE_API = "https://container.googleapis.com/v1"
#: Reservation affinity key for a specific reservation (Compute Engine ``reservationAffinity``).
RESERVATION_KEY = "compute.googleapis.com/reservation-name"
#: How GKE says it cannot start another operation on the cluster yet.
CLUSTER_BUSY = re.compile(r"please wait and try again|concurrent operations", re.IGNORECASE)
#: Node pool statuses a pool can be adopted in (``NodePool.Status``).
USABLE = ("RUNNING", "RUNNING_WITH_ERROR", "RECONCILING")
#: GCE resource label (``NodeConfig.resourceLabels``) naming the pipeline run a created pool was created for.
#: Resource label values: lower-case letters, digits, ``-`` and ``_``, at most 63 characters.
RUN_LABEL = "multislice-pipeline-run"


def run_label_value(pipeline_run_id: str) -> str:
    """``pipeline_run_id`` as a GCE resource label value: lower-cased, other characters as ``-``, 63 at most."""
    return re.sub(r"[^a-z0-9_-]", "-", pipeline_run_id.lower())[:63]


class NodePoolError(InputError):
    """A node pool could not be ensured; the message says what is wrong and what to do."""


class NodePoolMismatch(NodePoolError):
    """Pools exist under the run's names with another shape. ``diffs``: pool name -> ``[(field, wanted, found)]``."""

    def __init__(self, message: str, diffs: dict[str, list[tuple[str, Any, Any]]]):
        super().__init__(message)
        self.diffs = diffs


class NodePoolsMissing(NodePoolError):
    """``node_pools.manage`` is false and pools are missing. ``missing``: the pool names to create."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class NodePoolOperationFailed(NodePoolError):
    """A create operation ended with an error, or did not end before the deadline."""


@dataclass(frozen=True)
class PoolShape:
    """What a slice's node pool must be; compared field by field with an existing pool.

    Attributes:
        machine_type: GKE machine type of each host (``ct6e-standard-4t``).
        topology: TPU topology (``4x4``); the placement policy's ``tpu_topology`` for multi-host slices.
        multi_host: Whether the slice spans several hosts (only then a COMPACT placement policy).
        node_count: Hosts per slice, nodes.
        provisioning: ``standard``, ``spot``, ``flex-start`` or ``reservation``.
        reservation: Reservation name (provisioning ``reservation``).
        queued_provisioning: flex-start pools that only take ProvisioningRequests.
        zone: The node location, or None to leave it to GKE (zonal cluster).
        networks: Additional node networks, ``(network, subnetwork)`` pairs.
        oauth_scopes: The nodes' OAuth scopes (``config.oauthScopes``); hostNetwork TPU pods call Google APIs
            with them.
        service_account: The nodes' Google service account (``config.serviceAccount``), None: GKE's default
            (the project's Compute Engine default service account).
        dranet: Label the nodes for GKE managed DRANET (``cloud.google.com/gke-networking-dra-driver=true``):
            a stage launched by Ray claims the additional networks through DRANET (:mod:`multislice.render.ray`).
    """

    machine_type: str
    topology: str
    multi_host: bool
    node_count: int
    provisioning: str
    reservation: str | None
    queued_provisioning: bool
    zone: str | None
    networks: tuple[tuple[str, str], ...]
    oauth_scopes: tuple[str, ...] = ()
    service_account: str | None = None
    dranet: bool = False

    @classmethod
    def of(cls, plan: Plan) -> PoolShape:
        """The shape every node pool of ``plan`` must have."""
        spec, shape = plan.spec, plan.spec.slice_type
        pools = spec.node_pools
        return cls(
            machine_type=shape.machine_type,
            topology=shape.topology,
            multi_host=shape.multi_host,
            node_count=shape.hosts,
            provisioning=pools.provisioning,
            reservation=pools.reservation,
            queued_provisioning=pools.queued_provisioning,
            zone=pools.zone,
            networks=tuple((n.network, n.subnetwork) for n in pools.additional_node_networks),
            oauth_scopes=tuple(pools.oauth_scopes),
            service_account=pools.service_account,
            dranet=bool(pools.additional_node_networks) and any(k.claims_dranet for k in launchers.kinds_of(plan)),
        )

    def fields(self) -> dict[str, Any]:
        """The compared fields, named as in the GKE API's NodePool."""
        flex = self.provisioning == "flex-start"
        out: dict[str, Any] = {
            "config.machineType": self.machine_type,
            "placementPolicy.type": "COMPACT" if self.multi_host else "TYPE_UNSPECIFIED",
            "placementPolicy.tpuTopology": self.topology if self.multi_host else "",
            # A whole slice: initialNodeCount, or autoscaling's maximum for pools that scale from 0
            # (flex-start always does).
            "nodes": self.node_count,
            "config.spot": self.provisioning == "spot",
            "config.flexStart": flex,
            "config.reservationAffinity": _affinity_text(
                "SPECIFIC_RESERVATION" if self.reservation else ("NO_RESERVATION" if flex else "UNSPECIFIED"),
                [self.reservation] if self.reservation else [],
            ),
            "queuedProvisioning.enabled": self.queued_provisioning,
            "networkConfig.additionalNodeNetworkConfigs": sorted(f"{n}/{s}" for n, s in self.networks),
            "config.oauthScopes": sorted(self.oauth_scopes),
            "config.serviceAccount": self.service_account or "default",
        }
        if self.zone:
            out["locations"] = [self.zone]
        return out


def _affinity_text(kind: str, values: list[str]) -> str:
    return kind + (f" {', '.join(values)}" if values else "")


def _last(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def existing_fields(pool: container_v1.NodePool, wanted: PoolShape) -> dict[str, Any]:
    """The compared fields of an existing pool (same keys as :meth:`PoolShape.fields`)."""
    affinity = pool.config.reservation_affinity
    # A specific reservation may be named with or without its projects/... path.
    values = [v if (wanted.reservation and "/" in wanted.reservation) else _last(v) for v in affinity.values]
    out: dict[str, Any] = {
        "config.machineType": pool.config.machine_type,
        "placementPolicy.type": pool.placement_policy.type_.name,
        "placementPolicy.tpuTopology": pool.placement_policy.tpu_topology,
        "nodes": (
            max(pool.autoscaling.max_node_count, pool.autoscaling.total_max_node_count)
            if pool.autoscaling.enabled
            else pool.initial_node_count
        ),
        "config.spot": bool(pool.config.spot),
        "config.flexStart": bool(pool.config.flex_start),
        "config.reservationAffinity": _affinity_text(affinity.consume_reservation_type.name, values),
        "queuedProvisioning.enabled": bool(pool.queued_provisioning.enabled),
        "networkConfig.additionalNodeNetworkConfigs": sorted(
            f"{_last(c.network)}/{_last(c.subnetwork)}" for c in pool.network_config.additional_node_network_configs
        ),
        "config.oauthScopes": sorted(pool.config.oauth_scopes),
        "config.serviceAccount": pool.config.service_account or "default",
    }
    if wanted.zone:
        out["locations"] = list(pool.locations)
    return out


def shape_diff(pool: container_v1.NodePool, wanted: PoolShape) -> list[tuple[str, Any, Any]]:
    """``[(field, wanted, found)]`` for every compared field where ``pool`` differs from ``wanted``."""
    want = wanted.fields()
    # A reservation-less standard pool may say UNSPECIFIED or ANY_RESERVATION (GKE's default).
    found = existing_fields(pool, wanted)
    if want["config.reservationAffinity"] == "UNSPECIFIED" and found["config.reservationAffinity"] in (
        "ANY_RESERVATION",
        "NO_RESERVATION",
    ):
        found["config.reservationAffinity"] = "UNSPECIFIED"
    # GKE makes the placement type optional when a TPU topology is given: a pool created with
    # --tpu-topology alone reads TYPE_UNSPECIFIED and is placed as a slice all the same.
    if (want["placementPolicy.type"], found["placementPolicy.type"]) == ("COMPACT", "TYPE_UNSPECIFIED") and (
        found["placementPolicy.tpuTopology"] == want["placementPolicy.tpuTopology"]
    ):
        found["placementPolicy.type"] = "COMPACT"
    # More scopes than asked for is fine; fewer is not (the TPU pods' gs:// writes use them).
    if set(want["config.oauthScopes"]) <= set(found["config.oauthScopes"]):
        found["config.oauthScopes"] = want["config.oauthScopes"]
    return [(key, want[key], found[key]) for key in want if want[key] != found[key]]


def pool_names(plan: Plan) -> list[str]:
    """The node pool of each slice: ``<name_prefix>-<slice index>``; prefix default ``tpu-<generation>-<topology>``."""
    shape = plan.spec.slice_type
    prefix = plan.spec.node_pools.name_prefix or f"tpu-{shape.flavor_name}"
    return [f"{prefix}-{i}" for i in range(plan.spec.num_slices)]


def cluster_path(plan: Plan) -> str:
    """``projects/P/locations/L/clusters/C`` of the plan's cluster.

    Raises:
        multislice.config.ConfigError: ``cluster.project``, ``location`` or ``name`` missing, or no zone for a
            regional cluster (the same checks :func:`multislice.config.load_spec` runs for backend gke).
    """
    issues = plan.spec.node_pools.issues(plan.spec.cluster)
    if issues:
        raise config.ConfigError(issues)
    c = plan.spec.cluster
    return f"projects/{c.project}/locations/{c.location}/clusters/{c.name}"


def node_pool_body(name: str, shape: PoolShape, pipeline_run_id: str = "") -> container_v1.NodePool:
    """The ``NodePool`` to create for one slice (the ``nodePool`` of a ``nodePools.create`` request).

    Standard: ``initialNodeCount`` = hosts. Spot: ``config.spot``. Reservation:
    ``config.reservationAffinity`` SPECIFIC_RESERVATION on the reservation name.
    Every pool: ``config.oauthScopes`` (default cloud-platform) and, when set,
    ``config.serviceAccount``: hostNetwork TPU pods get no Workload Identity and
    write ``gs://`` as this account with these scopes (without scopes GKE gives
    only logging and monitoring; xpk passes storage-full, gke-default and
    cloud-platform: ``src/xpk/core/nodepool.py``).
    Flex-start: ``config.flexStart``, 0 initial nodes, autoscaling 0..hosts with
    location policy ANY, reservation affinity NO_RESERVATION, auto-repair off
    (as xpk's ``--flex``); with ``queued_provisioning`` also ``queuedProvisioning.enabled``.
    With ``pipeline_run_id``, ``config.resourceLabels`` {:data:`RUN_LABEL`: the run id}: the pool is that run's
    until it ends (:func:`delete_run_pools`).
    """
    from google.cloud import container_v1

    flex = shape.provisioning == "flex-start"
    node_config = container_v1.NodeConfig(
        machine_type=shape.machine_type,
        spot=shape.provisioning == "spot",
        oauth_scopes=list(shape.oauth_scopes),
        service_account=shape.service_account or "",
    )
    if pipeline_run_id:
        node_config.resource_labels = {RUN_LABEL: run_label_value(pipeline_run_id)}
    if shape.dranet:
        node_config.labels = {DRANET_NODE_LABEL[0]: DRANET_NODE_LABEL[1]}
    if flex:
        node_config.flex_start = True
        node_config.reservation_affinity = container_v1.ReservationAffinity(
            consume_reservation_type=container_v1.ReservationAffinity.Type.NO_RESERVATION
        )
    if shape.reservation:
        node_config.reservation_affinity = container_v1.ReservationAffinity(
            consume_reservation_type=container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION,
            key=RESERVATION_KEY,
            values=[shape.reservation],
        )
    pool = container_v1.NodePool(name=name, config=node_config, initial_node_count=0 if flex else shape.node_count)
    if shape.zone:
        pool.locations = [shape.zone]
    if shape.multi_host:
        pool.placement_policy = container_v1.NodePool.PlacementPolicy(
            type_=container_v1.NodePool.PlacementPolicy.Type.COMPACT, tpu_topology=shape.topology
        )
    if flex:
        pool.autoscaling = container_v1.NodePoolAutoscaling(
            enabled=True,
            min_node_count=0,
            max_node_count=shape.node_count,
            location_policy=container_v1.NodePoolAutoscaling.LocationPolicy.ANY,
        )
        # Auto-upgrade stays on: clusters on a release channel refuse node pools without it.
        pool.management = container_v1.NodeManagement(auto_repair=False, auto_upgrade=True)
    if shape.queued_provisioning:
        pool.queued_provisioning = container_v1.NodePool.QueuedProvisioning(enabled=True)
    if shape.networks:
        pool.network_config = container_v1.NodeNetworkConfig(
            additional_node_network_configs=[
                container_v1.AdditionalNodeNetworkConfig(network=n, subnetwork=s) for n, s in shape.networks
            ]
        )
    return pool


def gcloud_create_args(plan: Plan, name: str) -> list[str]:
    """The ``gcloud`` argument list that creates the same pool as :func:`node_pool_body` (for messages and docs)."""
    spec, shape = plan.spec, PoolShape.of(plan)
    c = spec.cluster
    args = ["gcloud", "container", "node-pools", "create", name, f"--cluster={c.name}", f"--location={c.location}"]
    args += [f"--project={c.project}", f"--machine-type={shape.machine_type}"]
    if shape.zone:
        args.append(f"--node-locations={shape.zone}")
    if shape.multi_host:
        args += ["--placement-type=COMPACT", f"--tpu-topology={shape.topology}"]
    if shape.oauth_scopes:
        args.append("--scopes=" + ",".join(shape.oauth_scopes))
    if shape.service_account:
        args.append(f"--service-account={shape.service_account}")
    if shape.provisioning == "flex-start":
        args += ["--flex-start", "--num-nodes=0", "--enable-autoscaling", "--min-nodes=0"]
        args += [f"--max-nodes={shape.node_count}", "--location-policy=ANY", "--reservation-affinity=none"]
        args.append("--no-enable-autorepair")
        if shape.queued_provisioning:
            args.append("--enable-queued-provisioning")
    else:
        args.append(f"--num-nodes={shape.node_count}")
    if shape.provisioning == "spot":
        args.append("--spot")
    if shape.reservation:
        args += ["--reservation-affinity=specific", f"--reservation={shape.reservation}"]
    args += [f"--additional-node-network=network={n},subnetwork={s}" for n, s in shape.networks]
    if shape.dranet:
        args.append(f"--node-labels={DRANET_NODE_LABEL[0]}={DRANET_NODE_LABEL[1]}")
    return args


def node_pool_plan(plan: Plan) -> dict[str, Any]:
    """What provision would create, as GKE API requests (``multislice render``'s dry run).

    Returns:
        ``{"cluster", "manage", "node_pools": [{"name", "request": {"method", "uri", "body"}, "gcloud"}]}``;
        ``body`` is the JSON a ``nodePools.create`` call sends (camelCase, enum names).

    Raises:
        multislice.config.ConfigError: the cluster reference is incomplete.
    """
    from google.cloud import container_v1

    parent = cluster_path(plan)
    shape = PoolShape.of(plan)
    pools = []
    for name in pool_names(plan):
        body = json.loads(
            container_v1.NodePool.to_json(
                node_pool_body(name, shape), use_integers_for_enums=False, always_print_fields_with_no_presence=False
            )
        )
        pools.append(
            {
                "name": name,
                "request": {"method": "POST", "uri": f"{GKE_API}/{parent}/nodePools", "body": {"nodePool": body}},
                "gcloud": gcloud_create_args(plan, name),
            }
        )
    return {
        "cluster": parent,
        "manage": plan.spec.node_pools.manage,
        "note": (
            "provision creates the pools that do not exist and adopts those that match; "
            "a pool with one of these names but another shape is an error (never modified or deleted)"
            if plan.spec.node_pools.manage
            else "node_pools.manage is false: provision only checks that these pools exist; create them yourself"
        ),
        "node_pools": pools,
    }


def _describe(name: str, shape: PoolShape) -> dict[str, Any]:
    return {
        "name": name,
        "machine_type": shape.machine_type,
        "topology": shape.topology,
        "node_count": shape.node_count,
        "provisioning": shape.provisioning,
        "reservation": shape.reservation,
        "zone": shape.zone,
        "additional_node_networks": [f"{n}/{s}" for n, s in shape.networks],
    }


def _message(error: Exception) -> str:
    """The API's own message of a google.api_core error, without the REST client's ``METHOD URL:`` prefix."""
    message = getattr(error, "message", None) or str(error)
    return re.sub(r"^(GET|POST|PUT|PATCH|DELETE) \S+: ", "", message)


def _api_error(error: Exception, what: str, parent: str) -> NodePoolError:
    from google.api_core import exceptions

    hint = ""
    if isinstance(error, exceptions.NotFound):
        hint = "; check cluster.project, cluster.location and cluster.name"
    elif isinstance(error, exceptions.Forbidden):  # HTTP 403; PermissionDenied (gRPC) is a subclass
        # https://cloud.google.com/kubernetes-engine/docs/reference/api-permissions
        hint = (
            "; the caller needs container.clusters.get (list and get node pools), container.clusters.update "
            "(create them) and container.operations.get on the cluster, e.g. roles/container.clusterAdmin; "
            "or set node_pools.manage: false (then container.clusters.get, roles/container.clusterViewer, is enough) "
            "and create the pools yourself"
        )
    return NodePoolError(f"{what} on {parent} failed: {_message(error)}{hint}")


def ensure_node_pools(
    plan: Plan,
    client: container_v1.ClusterManagerClient | None = None,
    *,
    on_progress: Callable[[str], None] = print,
    poll_seconds: float = 10.0,
    deadline: float | None = None,
    pipeline_run_id: str = "",
) -> dict[str, Any]:
    """Make sure the plan's TPU node pools exist on its GKE cluster: one per slice.

    Lists the cluster's node pools once (:func:`read_pools`), then for each slice's pool name
    (:func:`pool_names`): a pool with the right shape is adopted; a missing pool
    is created (``manage: true``) or reported (``manage: false``); a pool with
    another shape is an error. Every pool is checked before any is created
    (:func:`refuse_unusable`), so on an error nothing was created. Creates are sent one after the other
    without waiting, then each CREATE_NODE_POOL operation is polled
    (``get_operation``) every ``poll_seconds`` until DONE or
    ``node_pools.operation_timeout_seconds`` (:class:`PoolCreation`). When GKE refuses a create because
    another operation runs on the cluster (400 FAILED_PRECONDITION "Operation
    ... is currently creating a node pool", or 429 concurrent operations quota),
    it waits for this call's earlier operation, or retries every ``poll_seconds``.
    Nothing is ever modified or deleted.

    Args:
        plan: The validated plan; uses ``spec.cluster`` (project, location, name),
            ``spec.node_pools``, ``spec.tpu_type`` and ``spec.num_slices``.
        client: A google-cloud-container ``ClusterManagerClient``; default one with
            Application Default Credentials.
        on_progress: Called with one line per step and per operation status change.
        poll_seconds: Seconds between ``get_operation`` polls.
        deadline: ``time.monotonic()`` past which no operation is waited for any longer (the
            provision step's ``timeouts.provision``); None for only the per-operation timeout.
        pipeline_run_id: Label the pools it creates with this run (:data:`RUN_LABEL`); adopted pools are
            never labelled (nothing is modified).

    Returns:
        ``{"cluster": "projects/P/locations/L/clusters/C", "manage": bool,
        "node_pools": [{"name", "action" ("created" | "adopted" | "checked"),
        "machine_type", "topology", "node_count", "provisioning", "reservation",
        "zone", "additional_node_networks", "status", "operation" (created only),
        "seconds" (created only: wait, s)}], "created": [names], "adopted": [names],
        "seconds": total wall time, s}``.

    Raises:
        multislice.config.ConfigError: incomplete cluster reference; nothing was called.
        NodePoolMismatch: a pool exists with a slice's name and another shape (diff per field); nothing created.
        NodePoolsMissing: ``manage: false`` and pools are missing; the message has the gcloud command for each.
        NodePoolOperationFailed: a create operation ended with an error or outlived the deadline; the
            pools created so far stay (the message names them).
        NodePoolError: the GKE API refused a call (cluster not found, permission denied), or an adopted pool
            is in ERROR or STOPPING.
    """
    from google.cloud import container_v1  # the GKE API client: only when provisioning on GKE

    started = time.monotonic()
    parent, shape, names = cluster_path(plan), PoolShape.of(plan), pool_names(plan)
    if client is None:
        client = container_v1.ClusterManagerClient()
    on_progress(
        f"node pools on {parent}: {len(names)} x {plan.spec.tpu_type} ({shape.machine_type}, topology "
        f"{shape.topology}, {shape.node_count} nodes each, {shape.provisioning})"
    )
    existing = read_pools(client, parent)
    refuse_unusable(plan, parent, shape, names, existing)
    creation = PoolCreation(plan, client, parent, shape, on_progress, poll_seconds, deadline)
    creation.pipeline_run_id = pipeline_run_id
    for name in names:
        if name in existing:
            creation.adopt(name, existing[name])
        else:
            creation.create(name)
    creation.wait_all()
    report = creation.report
    return {
        "cluster": parent,
        "manage": plan.spec.node_pools.manage,
        "node_pools": report,
        "created": [e["name"] for e in report if e["action"] == "created"],
        "adopted": [e["name"] for e in report if e["action"] in ("adopted", "checked")],
        "seconds": round(time.monotonic() - started, 1),
    }


def ray_operator_enabled(plan: Plan, client: container_v1.ClusterManagerClient | None = None) -> bool:
    """Whether GKE's Ray Operator add-on is enabled on the plan's cluster: the ``Cluster``'s
    ``addonsConfig.rayOperatorConfig.enabled`` (google-cloud-container ``container_v1.RayOperatorConfig``), read
    with one ``get_cluster`` (``container.clusters.get``, as listing node pools needs).

    Args:
        client: A ``ClusterManagerClient``; default one with Application Default Credentials.

    Raises:
        multislice.config.ConfigError: incomplete cluster reference; nothing was called.
        NodePoolError: the GKE API refused the call (the message says which permission it needs).
    """
    from google.api_core import exceptions  # the GKE API client: only when provisioning on GKE
    from google.cloud import container_v1  # idem

    parent = cluster_path(plan)
    if client is None:
        client = container_v1.ClusterManagerClient()
    try:
        found = client.get_cluster(name=parent)
    except exceptions.GoogleAPICallError as error:
        raise _api_error(error, "reading the cluster (its Ray Operator add-on)", parent) from error
    return bool(found.addons_config.ray_operator_config.enabled)


def read_pools(client: container_v1.ClusterManagerClient, parent: str) -> dict[str, container_v1.NodePool]:
    """The cluster's node pools by name (one ``list_node_pools``). Raises :class:`NodePoolError` for an API error."""
    from google.api_core import exceptions  # the GKE API client's errors: only when provisioning on GKE

    try:
        return {p.name: p for p in client.list_node_pools(parent=parent).node_pools}
    except exceptions.GoogleAPICallError as error:
        raise _api_error(error, "listing node pools", parent) from error


def delete_run_pools(
    client: container_v1.ClusterManagerClient,
    parent: str,
    pipeline_run_id: str,
    in_use: Callable[[str], str | None],
    tell: Callable[[str], None] = print,
) -> tuple[list[str], list[str]]:
    """Delete the node pools created for ``pipeline_run_id`` (resource label :data:`RUN_LABEL`): a terminated run's.

    Only pools carrying this run's label are considered (a pool it adopted, or another run created, never is).
    A pool ``in_use`` names a user of (another run's pod on its nodes or unfinished workload: the caller's
    check) is kept: it serves that run now, as an adopted pool would. Each delete is sent and not waited for
    (``nodePools.delete`` returns a DELETE_NODE_POOL operation; GKE drains and removes the nodes); a pool already
    being deleted (STOPPING) or gone counts as deleted.

    Returns:
        ``(deleted, kept)``: pool names, and ``"<pool>: <why>"`` for each kept one.

    Raises:
        NodePoolError: the GKE API refused the list or a delete (not found excepted).
    """
    from google.api_core import exceptions  # the GKE API client's errors: only on GKE

    wanted = run_label_value(pipeline_run_id)
    deleted, kept = [], []
    for name, pool in read_pools(client, parent).items():
        if not pipeline_run_id or dict(pool.config.resource_labels).get(RUN_LABEL) != wanted:
            continue
        if pool.status.name == "STOPPING":
            deleted.append(name)
            continue
        user = in_use(name)
        if user:
            kept.append(f"{name}: {user}")
            tell(f"node pool {name} (created for pipeline run {pipeline_run_id}) kept: {user}")
            continue
        try:
            op = client.delete_node_pool(name=f"{parent}/nodePools/{name}")
        except exceptions.NotFound:
            deleted.append(name)
            continue
        except exceptions.GoogleAPICallError as error:
            raise _api_error(error, f"deleting node pool {name}", parent) from error
        tell(f"node pool {name} (created for pipeline run {pipeline_run_id}): deleting ({op.name})")
        deleted.append(name)
    return deleted, kept


def refuse_unusable(
    plan: Plan, parent: str, shape: PoolShape, names: list[str], existing: dict[str, container_v1.NodePool]
) -> None:
    """Refuse, before anything is created, pools of the run's names that cannot serve it.

    Raises:
        NodePoolMismatch: a pool has another shape (each field's diff, :func:`shape_diff`).
        NodePoolError: a pool is in ERROR or STOPPING (not :data:`USABLE` nor PROVISIONING).
        NodePoolsMissing: ``node_pools.manage`` is false and pools are missing (the gcloud command for each).
    """
    diffs = {name: shape_diff(existing[name], shape) for name in names if name in existing}
    diffs = {name: diff for name, diff in diffs.items() if diff}
    if diffs:
        lines = [
            f"  {name}.{key}: wanted {want!r}, found {found!r}"
            for name, diff in diffs.items()
            for key, want, found in diff
        ]
        raise NodePoolMismatch(
            f"{len(diffs)} node pool(s) on {parent} have the run's name but another shape; nothing was created "
            "and nothing was changed:\n" + "\n".join(lines) + "\nfix: set node_pools.name_prefix to use other "
            "pools, change the run spec to match, or delete the pool yourself (gcloud container node-pools delete)",
            diffs,
        )
    broken = {
        n: existing[n] for n in names if n in existing and existing[n].status.name not in (*USABLE, "PROVISIONING")
    }
    if broken:
        raise NodePoolError(
            "; ".join(
                f"node pool {n} is {p.status.name}" + (f" ({p.status_message})" if p.status_message else "")
                for n, p in broken.items()
            )
            + f" on {parent}; nothing was created. Fix or delete it yourself, or set node_pools.name_prefix"
        )
    missing = [name for name in names if name not in existing]
    if missing and not plan.spec.node_pools.manage:
        commands = "\n".join("  " + " ".join(gcloud_create_args(plan, name)) for name in missing)
        raise NodePoolsMissing(
            f"node_pools.manage is false and {len(missing)} of {len(names)} node pool(s) are missing on {parent}: "
            f"{', '.join(missing)}. Create them (each: {shape.node_count} x {shape.machine_type}, COMPACT "
            f"placement, topology {shape.topology}), e.g.:\n{commands}\nor set node_pools.name_prefix to the "
            "prefix of your pools (named <prefix>-0, <prefix>-1, ...), or node_pools.manage: true",
            missing,
        )


class PoolCreation:
    """One :func:`ensure_node_pools` call's pools: adopted, created, and their create operations waited for.

    ``report`` holds one entry per pool, in order (the ``node_pools`` of :func:`ensure_node_pools`' result).
    """

    def __init__(
        self,
        plan: Plan,
        client: container_v1.ClusterManagerClient,
        parent: str,
        shape: PoolShape,
        on_progress: Callable[[str], None],
        poll_seconds: float,
        deadline: float | None,
    ) -> None:
        self.client, self.parent, self.shape = client, parent, shape
        self.manage = plan.spec.node_pools.manage
        self.operation_timeout_seconds = plan.spec.node_pools.operation_timeout_seconds
        self.on_progress, self.poll_seconds, self.deadline = on_progress, poll_seconds, deadline
        self.report: list[dict[str, Any]] = []
        self.pipeline_run_id = ""  # labels the pools this call creates (node_pool_body)

    def operation_timeout(self) -> float:
        """Seconds an operation may still be waited for: its own timeout, or what the deadline leaves."""
        left = float("inf") if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        return min(self.operation_timeout_seconds, left)

    def adopt(self, name: str, pool: container_v1.NodePool) -> None:
        """Record an existing pool of the right shape: ``adopted`` (``manage: true``) or ``checked``."""
        action = "adopted" if self.manage else "checked"
        self.on_progress(f"node pool {name}: exists with the right shape ({pool.status.name}), {action}")
        self.report.append({**_describe(name, self.shape), "action": action, "status": pool.status.name})

    def create(self, name: str) -> None:
        """Send the pool's create (not waited for); a pool someone else created meanwhile is adopted if it matches.

        While GKE refuses it because another operation runs on the cluster, waits for this call's earliest
        unfinished create, or retries every ``poll_seconds`` up to the operation timeout.

        Raises:
            NodePoolError: the API refused the create for another reason, or stayed busy past the timeout.
            NodePoolMismatch: the pool appeared with another shape.
        """
        from google.api_core import exceptions  # the GKE API client's errors: only when provisioning on GKE

        busy_since = time.monotonic()
        while True:
            try:
                op = self.client.create_node_pool(
                    parent=self.parent, node_pool=node_pool_body(name, self.shape, self.pipeline_run_id)
                )
            except exceptions.AlreadyExists:
                self.report.append(_adopt_raced(self.client, self.parent, name, self.shape))
                return
            except (exceptions.BadRequest, exceptions.FailedPrecondition, exceptions.TooManyRequests) as error:
                # GKE refuses a create while other operations run on the cluster (HTTP 400 FAILED_PRECONDITION
                # "Operation ... is currently creating a node pool ... Please wait and try again once it is done",
                # or 429 "... hits the concurrent operations quota").
                self._wait_while_busy(name, error, busy_since)
                continue
            except exceptions.GoogleAPICallError as error:
                raise _api_error(error, f"creating node pool {name}", self.parent) from error
            self.on_progress(f"node pool {name}: creating ({op.name})")
            self.report.append({**_describe(name, self.shape), "action": "created", "operation": op.name})
            return

    def _wait_while_busy(self, name: str, error: Exception, busy_since: float) -> None:
        """A create refused with ``error``: wait for an earlier create of this call, or ``poll_seconds``; raise
        :class:`NodePoolError` when the refusal is not "the cluster is busy" or it has lasted past the timeout."""
        unfinished = self.unfinished()
        waited_out = time.monotonic() - busy_since > self.operation_timeout()
        if not CLUSTER_BUSY.search(_message(error)) or (waited_out and not unfinished):
            raise _api_error(error, f"creating node pool {name}", self.parent) from error
        self.on_progress(
            f"node pool {name}: GKE is busy with another operation on the cluster; "
            + (f"waiting for {unfinished[0]['name']} first" if unfinished else f"retrying in {self.poll_seconds} s")
        )
        if unfinished:
            self.finish(unfinished[0])
        else:
            time.sleep(self.poll_seconds)

    def unfinished(self) -> list[dict[str, Any]]:
        """The entries of pools this call created whose operation was not waited for yet."""
        return [e for e in self.report if e["action"] == "created" and "seconds" not in e]

    def finish(self, entry: dict[str, Any]) -> None:
        """Wait for a created pool's operation (:func:`_wait`); record the wait and the pool's status."""
        location_path = self.parent.rsplit("/clusters/", 1)[0]
        waited = _wait(
            self.client,
            f"{location_path}/operations/{entry['operation']}",
            entry["name"],
            deadline_seconds=self.operation_timeout(),
            poll_seconds=self.poll_seconds,
            on_progress=self.on_progress,
            created=[e["name"] for e in self.report if e["action"] == "created"],
        )
        entry["seconds"] = round(waited, 1)
        entry["status"] = self.client.get_node_pool(name=f"{self.parent}/nodePools/{entry['name']}").status.name
        self.on_progress(f"node pool {entry['name']}: created in {entry['seconds']:.0f} s, {entry['status']}")

    def wait_all(self) -> None:
        """Wait for every create operation not waited for yet, in the order they were sent."""
        for entry in self.unfinished():
            self.finish(entry)


def _adopt_raced(client: container_v1.ClusterManagerClient, parent: str, name: str, shape: PoolShape) -> dict[str, Any]:
    """A pool that appeared since the list (someone else created it): adopt it if it matches."""
    pool = client.get_node_pool(name=f"{parent}/nodePools/{name}")
    diff = shape_diff(pool, shape)
    if diff:
        raise NodePoolMismatch(
            f"node pool {name} appeared on {parent} with another shape; nothing was changed: "
            + "; ".join(f"{k}: wanted {w!r}, found {f!r}" for k, w, f in diff),
            {name: diff},
        )
    return {**_describe(name, shape), "action": "adopted", "status": pool.status.name}


def _wait(
    client: container_v1.ClusterManagerClient,
    operation: str,
    pool: str,
    *,
    deadline_seconds: float,
    poll_seconds: float,
    on_progress: Callable[[str], None],
    created: list[str],
) -> float:
    """Poll one operation until DONE; returns the wait, seconds. Raises NodePoolOperationFailed."""
    from google.api_core import exceptions

    started = time.monotonic()
    last = None
    while True:
        try:
            op = client.get_operation(name=operation)
        except exceptions.GoogleAPICallError as error:
            raise NodePoolOperationFailed(
                f"polling {operation} (node pool {pool}) failed: {_message(error)}; the operation "
                f"may still run on GKE: gcloud container operations describe {operation.rsplit('/', 1)[1]}"
            ) from error
        elapsed = time.monotonic() - started
        state = (op.status.name, op.detail)
        if state != last:
            on_progress(
                f"node pool {pool}: {op.operation_type.name} {op.status.name} after {elapsed:.0f} s"
                + (f" ({op.detail})" if op.detail else "")
            )
            last = state
        if op.status.name == "DONE":
            message = op.error.message or op.status_message
            if message:
                raise NodePoolOperationFailed(
                    f"creating node pool {pool} failed: {message} ({operation}). Pools created by this call stay: "
                    f"{', '.join(created)}. For TPU stockouts try another node_pools.zone, provisioning spot or "
                    "flex-start, or a reservation; then rerun provision (it adopts what exists)"
                )
            return elapsed
        if elapsed > deadline_seconds:
            raise NodePoolOperationFailed(
                f"node pool {pool}: {operation} still {op.status.name} after {deadline_seconds:.0f} s "
                "(node_pools.operation_timeout_seconds, or what timeouts.provision left); it goes on in GKE. "
                "Watch it with gcloud container "
                f"operations describe {operation.rsplit('/', 1)[1]} --location={operation.split('/')[3]}, then "
                "rerun provision, which adopts the pool"
            )
        time.sleep(poll_seconds)


#: The Compute Engine default service account, which GKE nodes use when ``node_pools.service_account`` is unset.
DEFAULT_NODE_ACCOUNT = "PROJECT_NUMBER-compute@developer.gserviceaccount.com"


def iam_bindings(plan: Plan) -> list[str]:
    """The IAM bindings the identity the TPU pods write ``gs://`` with needs, as ``gcloud`` commands.

    hostNetwork TPU pods (the default, ``service_accounts.tpu_host_network``) get no Workload
    Identity (https://cloud.google.com/kubernetes-engine/docs/concepts/workload-identity#limitations):
    they act as the node's service account with the node's OAuth scopes. That account needs
    ``roles/container.defaultNodeServiceAccount`` on the project (what every GKE node needs:
    https://cloud.google.com/kubernetes-engine/docs/how-to/service-accounts), ``roles/artifactregistry.reader``
    (pull the trainer image) and ``roles/storage.objectUser`` on the output bucket (checkpoints, metrics,
    the JAX cache). With ``service_accounts.tpu_workload_identity`` the bucket role goes to the
    trainer's Google service account instead, as does ``roles/logging.logWriter`` when a stage records
    goodput (``goodput_recording``: MaxText's recorder writes its events to Cloud Logging,
    ``ml_goodput_measurement/src/goodput.py``, ``_CloudLogger``).

    Returns:
        One line per binding (a ``gcloud`` command), then none for a local ``output_dir``.
    """
    spec = plan.spec
    project = spec.cluster.project or "PROJECT"
    node = spec.node_pools.service_account or DEFAULT_NODE_ACCOUNT
    writer = spec.service_accounts.trainer_gcp_service_account if spec.service_accounts.tpu_workload_identity else node
    lines = [
        f"gcloud projects add-iam-policy-binding {project} --member=serviceAccount:{node} "
        "--role=roles/container.defaultNodeServiceAccount",
        f"gcloud projects add-iam-policy-binding {project} --member=serviceAccount:{node} "
        "--role=roles/artifactregistry.reader",
    ]
    if spec.output_dir.startswith("gs://"):
        bucket = "gs://" + spec.output_dir[len("gs://") :].split("/", 1)[0]
        lines.append(
            f"gcloud storage buckets add-iam-policy-binding {bucket} --member=serviceAccount:{writer} "
            "--role=roles/storage.objectUser"
        )
    if any(stage.goodput_recording for stage in spec.stages):
        lines.append(
            f"gcloud projects add-iam-policy-binding {project} --member=serviceAccount:{writer} "
            "--role=roles/logging.logWriter"
        )
    return lines
