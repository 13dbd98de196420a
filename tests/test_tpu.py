"""TPU catalog: names parse to the shapes GKE documents."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multislice import tpu


@pytest.mark.parametrize(
    ("name", "topology", "chips", "hosts", "chips_per_host", "machine_type", "accelerator"),
    [
        ("v6e-16", "4x4", 16, 4, 4, "ct6e-standard-4t", "tpu-v6e-slice"),
        ("v6e-256", "16x16", 256, 64, 4, "ct6e-standard-4t", "tpu-v6e-slice"),
        ("v6e-4", "2x2", 4, 1, 4, "ct6e-standard-4t", "tpu-v6e-slice"),
        ("v6e-1", "1x1", 1, 1, 1, "ct6e-standard-1t", "tpu-v6e-slice"),
        ("v5litepod-8", "2x4", 8, 2, 4, "ct5lp-hightpu-4t", "tpu-v5-lite-podslice"),
        ("v5e-16", "4x4", 16, 4, 4, "ct5lp-hightpu-4t", "tpu-v5-lite-podslice"),
        ("v5p-8", "2x2x1", 4, 1, 4, "ct5p-hightpu-4t", "tpu-v5p-slice"),
        ("v5p-128", "4x4x4", 64, 16, 4, "ct5p-hightpu-4t", "tpu-v5p-slice"),
        ("v6e-4x4", "4x4", 16, 4, 4, "ct6e-standard-4t", "tpu-v6e-slice"),
        ("v5p-2x2x2", "2x2x2", 8, 2, 4, "ct5p-hightpu-4t", "tpu-v5p-slice"),
    ],
)
def test_parse_known_types(name, topology, chips, hosts, chips_per_host, machine_type, accelerator):
    shape = tpu.parse_tpu_type(name)
    assert (shape.topology, shape.chips, shape.hosts, shape.chips_per_host) == (topology, chips, hosts, chips_per_host)
    assert (shape.machine_type, shape.gke_accelerator) == (machine_type, accelerator)
    assert shape.multi_host == (hosts > 1)


def test_hbm_per_chip_from_the_tpu_docs():
    assert tpu.parse_tpu_type("v6e-16").hbm_bytes_per_chip == 32 * 2**30
    assert tpu.parse_tpu_type("v5p-16").hbm_bytes_per_chip == 95 * 2**30
    assert tpu.parse_tpu_type("v5e-16").hbm_bytes_per_chip == 16 * 2**30


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("v7q-16", "generation one of"),
        ("v6e-12", "valid v6e types are"),
        ("v5p-7", r"counts TensorCores \(2 per chip\)"),
        ("tpu", "expected <generation>-<size>"),
    ],
)
def test_unknown_types_say_what_is_valid(name, fragment):
    with pytest.raises(tpu.UnknownTpuType, match=fragment):
        tpu.parse_tpu_type(name)


@given(st.sampled_from(tpu.all_slice_types()))
def test_every_shape_is_consistent_and_round_trips(shape):
    assert shape.chips == shape.hosts * shape.chips_per_host
    assert tpu.parse_tpu_type(shape.name) == shape
    assert tpu.parse_tpu_type(f"{shape.generation.name}-{shape.topology}") == shape
    assert int(shape.name.split("-")[1]) == shape.chips * shape.generation.tensorcores_per_chip


def test_v6e_8_on_one_vm_is_a_machine_type_choice_of_its_topology():
    """cloud.google.com/tpu/docs/v6e: 2x4 on one ct6e-standard-8t VM or two ct6e-standard-4t (GKE API only)."""
    default, one_vm = tpu.parse_tpu_type("v6e-8"), tpu.parse_tpu_type("v6e-8", "ct6e-standard-8t")
    assert (default.machine_type, default.hosts, default.chips_per_host) == ("ct6e-standard-4t", 2, 4)
    assert (one_vm.machine_type, one_vm.hosts, one_vm.chips_per_host) == ("ct6e-standard-8t", 1, 8)
    assert (one_vm.topology, one_vm.chips, one_vm.multi_host) == ("2x4", 8, False)
    assert tpu.parse_tpu_type("v6e-2x4", "ct6e-standard-4t") == default
    assert tpu.machine_types(default) == ["ct6e-standard-4t", "ct6e-standard-8t"]
    assert tpu.machine_types(tpu.parse_tpu_type("v6e-16")) == ["ct6e-standard-4t"]


@pytest.mark.parametrize(
    ("name", "machine_type", "fragment"),
    [
        ("v6e-16", "ct6e-standard-8t", "GKE offers that topology on ct6e-standard-4t; ct6e-standard-8t hosts v6e-8"),
        ("v6e-4", "ct6e-standard-8t", "cannot host v6e-4 (topology 2x2, 4 chips)"),
        ("v5litepod-8", "ct6e-standard-8t", "offers that topology on ct5lp-hightpu-4t"),
        ("v6e-8", "n2-standard-8", "ct6e-standard-4t or ct6e-standard-8t"),
    ],
)
def test_a_machine_type_that_cannot_host_the_slice_is_refused_with_the_choices(name, machine_type, fragment):
    with pytest.raises(tpu.UnknownTpuType, match=re.escape(fragment)):
        tpu.parse_tpu_type(name, machine_type)
