"""The export Jobs' node pool, checked by provision before any node pool is created: read through
google-cloud-container's real REST client from the local GKE fake (tests/gke_fake.py), as test_nodepool.py does.

The figures the check compares come from the Job as rendered (:func:`multislice.backends.gke.exporter.resources`);
the tests take them from there, not from constants, and compare the allocatable formulas with GKE's own examples.
"""

from __future__ import annotations

import functools

import pytest
from google.cloud import container_v1

from multislice import config
from multislice.backends.gke import GkeBackend, export_pool, exporter, nodepool
from multislice.plan import make_plan
from multislice.steps import provision
from tests.gke_fake import FakeGke

GIB = 2**30
POOL_PATH = "/v1/projects/my-project/locations/us-east5/clusters/tpu-cluster/nodePools/export-highmem"


def make(**overrides):
    """The gke-v6e-16x2-seed plan (stages llama3-8b and llama3-70b, both exported; exporter.node_selector
    ``cloud.google.com/gke-nodepool: export-highmem``) on the fake's cluster."""
    base = {"cluster.project": "my-project", "cluster.location": "us-east5", "cluster.name": "tpu-cluster"}
    return make_plan(config.load_profile("gke-v6e-16x2-seed", {**base, **overrides}))


@pytest.fixture
def gke():
    fake = FakeGke().start()
    yield fake
    fake.stop()


def add_export_pool(gke, machine_type="n2-highmem-16", disk_gb=600, image_type="COS_CONTAINERD", **config_fields):
    node_config = container_v1.NodeConfig(
        machine_type=machine_type, disk_size_gb=disk_gb, image_type=image_type, **config_fields
    )
    gke.add_pool(container_v1.NodePool(name="export-highmem", config=node_config, locations=["us-east5-a"]))


def known(machine_type):
    """The table's size of a machine type it knows."""
    kind = export_pool.machine(machine_type)
    assert kind is not None, machine_type
    return kind


def requests_of(plan):
    """The largest memory and scratch requests of the plan's export Jobs, bytes, as rendered."""
    from kubernetes.utils import parse_quantity

    asked = [exporter.resources(plan, s)["requests"] for s in plan.stages if s.export]
    return (
        max(int(parse_quantity(r["memory"])) for r in asked),
        max(int(parse_quantity(r["ephemeral-storage"])) for r in asked),
    )


# -- GKE's node allocatable, against its documented examples ------------------------------------------------------


def test_allocatable_matches_gkes_documented_node():
    """https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes shows a 4-vCPU, 16 GiB node with a
    100 GB boot disk (COS): allocatable cpu 3920m, memory 13498416Ki, ephemeral-storage 47060071478 (capacity
    98831908Ki, of which GKE's kube-reserved takes ephemeral-storage=41Gi)."""
    assert export_pool.allocatable_cpu_millis(4) == 3920
    storage = export_pool.allocatable_ephemeral_storage(100)
    assert 0.998 * 47060071478 <= storage <= 47060071478  # within 0.2 %, and not above it
    memory = export_pool.allocatable_memory(16 * GIB)
    assert abs(memory - 13498416 * 1024) / (13498416 * 1024) < 0.01
    # More disk, more room; the reservation's cap (100 GiB) takes over from 6 GiB + 35 % at about 269 GB.
    sizes = [export_pool.allocatable_ephemeral_storage(d) for d in (10, 50, 100, 200, 268, 270, 300, 1000)]
    assert sizes == sorted(sizes)
    assert export_pool.allocatable_ephemeral_storage(100, "UBUNTU_CONTAINERD") > storage  # a smaller OS partition


def test_machine_types_of_the_table_and_custom_ones_by_name():
    m3 = known("m3-megamem-64")
    assert (m3.memory_bytes, m3.vcpus) == (976 * GIB, 64)
    assert known("n2-highmem-128").memory_bytes == 864 * GIB  # not 8 GB per vCPU
    assert known("n2d-standard-224").memory_bytes == 896 * GIB
    assert known("c3-highmem-22").memory_bytes == 176 * GIB
    assert known("n2-custom-8-65536").memory_bytes == 64 * GIB
    for unknown in ("e2-highmem-16", "n2-standard-3", "c3-highmem-16", "ct6e-standard-4t", "m3-megamem-32"):
        assert export_pool.machine(unknown) is None, unknown


# -- provision's check, over the fake's REST API --------------------------------------------------------------------


def test_a_pool_that_holds_the_export_passes_and_is_described(gke):
    add_export_pool(gke)
    lines = export_pool.check(make(), gke.client())
    assert gke.calls("GET") == [(POOL_PATH, None)] and gke.calls("POST") == []
    # the export holds a layer group, not the model: a standard high-memory node (128 GB), not an M3
    assert lines[0].startswith("export node pool export-highmem: n2-highmem-16 in us-east5-a: about 116.3 GiB of")
    assert lines[1].startswith("export node pool export-highmem: 600 GB boot disk, about 427.7 GiB of ephemeral")


def test_a_missing_pool_is_refused_with_the_command_that_creates_one_that_fits(gke):
    plan = make()
    memory, scratch = requests_of(plan)
    with pytest.raises(export_pool.ExportPoolUnfit) as refused:
        export_pool.check(plan, gke.client())
    error = refused.value
    assert error.exit_code == 2
    assert error.message.startswith(
        "exporter.node_selector names node pool export-highmem (cloud.google.com/gke-nodepool), which does not "
        "exist on projects/my-project/locations/us-east5/clusters/tpu-cluster (GKE: Not found: node pool "
        "'export-highmem'.): the export Job of stage llama3-70b"
    )
    assert error.message.endswith("nothing was created")
    assert "gcloud container node-pools create export-highmem --cluster=tpu-cluster --location=us-east5" in error.fix
    # The machine type it names holds the largest export's memory and exporter.cpu; the disk its scratch.
    machine_type = error.fix.split("--machine-type=")[1].split()[0]
    kind = known(machine_type)
    assert export_pool.allocatable_memory(kind.memory_bytes) >= memory
    assert export_pool.allocatable_cpu_millis(kind.vcpus) >= plan.spec.exporter.cpu * 1000
    disk = int(error.fix.split("--disk-size=")[1].split()[0])
    assert export_pool.allocatable_ephemeral_storage(disk) >= scratch
    assert gke.calls("POST") == []


def test_a_pool_with_too_little_memory_and_cpu_is_refused_naming_both(gke):
    add_export_pool(gke, machine_type="n2-standard-4")  # 16 GiB and 4 vCPUs: 3.92 CPUs allocatable
    plan = make()
    memory, _ = requests_of(plan)
    with pytest.raises(export_pool.ExportPoolUnfit) as refused:
        export_pool.check(plan, gke.client())
    error = refused.value
    assert error.message.startswith("node pool export-highmem (exporter.node_selector) cannot hold the verify-and-")
    assert (
        f"its n2-standard-4 nodes (16.0 GiB) have about 12.9 GiB of memory allocatable, below the {memory / GIB:.1f} "
        "GiB the export Job of stage llama3-70b asks for" in error.message
    )
    assert "its n2-standard-4 nodes (4 vCPUs) have 3.92 CPUs allocatable, below exporter.cpu 8" in error.message
    assert "boot disk" not in error.message  # 600 GB holds the scratch
    assert "gcloud container node-pools update export-highmem --cluster=tpu-cluster" in error.fix
    assert "exporter.node_selector to {cloud.google.com/gke-nodepool: export-" in error.fix


def test_a_boot_disk_too_small_for_the_scratch_after_gkes_reservation_is_refused(gke):
    plan = make()
    _, scratch = requests_of(plan)
    # A disk bigger than the scratch volume, whose allocatable share is not: GKE keeps 10 % + min(50 %, 6 GiB + 35 %,
    # 100 GiB) and the OS partition.
    disk = int(scratch / GIB) + 40
    assert export_pool.allocatable_ephemeral_storage(disk) < scratch
    add_export_pool(gke, disk_gb=disk)
    with pytest.raises(export_pool.ExportPoolUnfit) as refused:
        export_pool.check(plan, gke.client())
    error = refused.value
    assert f"its {disk} GB boot disk leaves about" in error.message
    assert f"below the {scratch / GIB:.1f} GiB scratch volume of stage llama3-70b's export" in error.message
    assert "memory allocatable" not in error.message  # n2-highmem-16 holds it
    needed = export_pool.disk_for(scratch)
    assert f"--disk-size={needed}" in error.fix
    assert (
        export_pool.allocatable_ephemeral_storage(needed - 1)
        < scratch
        <= export_pool.allocatable_ephemeral_storage(needed)
    )


def test_the_disk_size_of_the_boot_disk_field_and_the_api_default(gke):
    """``config.bootDisk.sizeGb`` replaces ``diskSizeGb``; neither set is the API's 100 GB default (too small for
    the 70B scratch)."""
    add_export_pool(gke, disk_gb=0, boot_disk=container_v1.BootDisk(size_gb=700))
    assert "700 GB boot disk" in export_pool.check(make(), gke.client())[1]
    gke.pools.clear()
    add_export_pool(gke, disk_gb=0)
    with pytest.raises(export_pool.ExportPoolUnfit, match="its 100 GB boot disk leaves about 43.8 GiB"):
        export_pool.check(make(), gke.client())


def test_an_unknown_machine_type_is_said_not_checked_and_the_disk_still_is(gke):
    add_export_pool(gke, machine_type="e2-highmem-16")
    lines = export_pool.check(make(), gke.client())
    assert lines[0] == "export node pool export-highmem: unknown machine type e2-highmem-16: memory and CPU not checked"
    assert "600 GB boot disk" in lines[1]


def test_local_ssd_ephemeral_storage_is_said_not_checked(gke):
    local = container_v1.EphemeralStorageLocalSsdConfig(local_ssd_count=2)
    add_export_pool(gke, disk_gb=100, ephemeral_storage_local_ssd_config=local)
    lines = export_pool.check(make(), gke.client())
    assert lines[1] == (
        "export node pool export-highmem: ephemeral storage on local SSDs: the scratch volume's room not checked"
    )


def test_a_selector_by_another_label_is_not_checked_and_nothing_is_read(gke):
    plan = make(**{"exporter.node_selector": {"cloud.google.com/machine-family": "m3"}})
    [line] = export_pool.check(plan, gke.client())
    assert line.startswith(
        "export node pool: not checked: exporter.node_selector selects nodes by cloud.google.com/machine-family=m3, "
        "not by cloud.google.com/gke-nodepool; its nodes need"
    )
    assert gke.requests == []


def test_no_export_no_check(gke):
    plan = make(**{"stages.llama3-8b.export": None, "stages.llama3-70b.export": None})
    assert export_pool.check(plan, gke.client()) == [] and gke.requests == []


def test_a_missing_cluster_shows_gkes_own_message(gke):
    with pytest.raises(export_pool.ExportPoolUnfit) as refused:
        export_pool.check(make(**{"cluster.name": "other"}), gke.client())
    assert "(GKE: Not found: projects/my-project/locations/us-east5/clusters/other.)" in refused.value.message


# -- in provision: before any node pool is created ------------------------------------------------------------------


@pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage")
def test_provision_refuses_before_creating_any_tpu_pool(served, play, plan, monkeypatch):
    cluster = plan.spec.cluster
    fake = FakeGke(cluster.project, cluster.location, cluster.name).start()
    try:
        backend = GkeBackend(served.kube())
        backend.node_pool_client = fake.client()
        monkeypatch.setattr(
            nodepool, "ensure_node_pools", functools.partial(nodepool.ensure_node_pools, poll_seconds=0)
        )
        with pytest.raises(export_pool.ExportPoolUnfit, match="node pool export-highmem"):
            provision.run(plan, backend=backend)
        assert fake.calls("POST") == []  # no TPU node pool asked for
        add_export_pool(fake)
        report = provision.run(plan, backend=backend)
        assert [p["action"] for p in report.node_pools] == ["created", "created"]
    finally:
        fake.stop()
