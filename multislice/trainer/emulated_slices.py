"""DCN on CPU: group the processes of each emulated slice into one DCN granule.

On TPU, every device carries ``slice_index`` (which slice it sits in) and
MaxText builds a multislice mesh with
``jax.experimental.mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape,
devices)``: devices are grouped into granules by ``slice_index``, each granule
gets an ICI mesh of ``ici_shape``, and the granules are tiled over
``dcn_shape`` (``maxtext/utils/maxtext_utils.py``, ``create_device_mesh``).

CPU devices in a multi-process JAX job do not say which emulated slice they
belong to (all report slice 0, or nothing), so that grouping would fail or put
every process in one slice. Here an emulated slice is a JobSet child Job: its
``PROCESSES_IN_JOB`` processes are the slice's hosts, and JAX process ``p``
belongs to slice ``p // PROCESSES_IN_JOB`` (MaxText numbers processes
``JOB_INDEX * PROCESSES_IN_JOB + JOB_COMPLETION_INDEX``,
``maxtext/utils/max_utils.py``, ``initialize_jax_for_cpu``).

:func:`emulated_hybrid_device_mesh` tags each device with that slice index and
hands the tagged devices to JAX's own ``create_hybrid_device_mesh``, so the
mesh is exactly the one JAX builds for devices that carry those slice indices.
:func:`install` routes MaxText's call to it. Nothing changes on TPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.experimental import mesh_utils

log = logging.getLogger(__name__)

_jax_create_hybrid_device_mesh = mesh_utils.create_hybrid_device_mesh


class SliceTaggedDevice:
    """A device seen through a proxy that adds ``slice_index``.

    Attributes other than ``slice_index`` are the wrapped device's. ``device``
    gives the wrapped device back.
    """

    __slots__ = ("device", "slice_index")

    def __init__(self, device: Any, slice_index: int):
        self.device = device
        self.slice_index = slice_index

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)

    def __repr__(self) -> str:
        return f"SliceTaggedDevice({self.device!r}, slice_index={self.slice_index})"


def emulated_slice_index(process_index: int, processes_per_slice: int) -> int:
    """Slice of a JAX process: ``process_index // processes_per_slice``.

    Raises:
        ValueError: ``processes_per_slice`` is not positive.
    """
    if processes_per_slice < 1:
        raise ValueError(f"processes_per_slice must be positive, got {processes_per_slice}")
    return process_index // processes_per_slice


def emulated_hybrid_device_mesh(
    mesh_shape: Sequence[int],
    dcn_mesh_shape: Sequence[int],
    devices: Sequence[Any],
    processes_per_slice: int,
    **kwargs: Any,
) -> np.ndarray:
    """JAX's hybrid (ICI x DCN) mesh with slices defined by process groups.

    Args:
        mesh_shape: ICI degree per mesh axis (product = devices per slice).
        dcn_mesh_shape: DCN degree per mesh axis (product = slices).
        devices: Every device of the job (``jax.devices()``).
        processes_per_slice: Processes (hosts) per emulated slice.
        **kwargs: Passed on to ``create_hybrid_device_mesh``.

    Returns:
        ndarray of the original devices, shape ``mesh_shape * dcn_mesh_shape``
        elementwise, as ``create_hybrid_device_mesh`` returns.

    Raises:
        ValueError: from JAX, when the slice count differs from the DCN product
            or a slice's device count from the ICI product.
    """
    tagged = [SliceTaggedDevice(d, emulated_slice_index(d.process_index, processes_per_slice)) for d in devices]
    mesh = _jax_create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, tagged, **kwargs)
    return np.vectorize(lambda t: t.device, otypes=[object])(mesh)


def describe_mesh(mesh: np.ndarray, ici: Sequence[int], dcn: Sequence[int], axis_names: Sequence[str]) -> str:
    """One line naming the mesh axes that are not 1, e.g. ``fsdp=8 (ici 4 x dcn 2), tensor=2``."""
    parts = []
    for name, size, i, d in zip(axis_names, mesh.shape, ici, dcn, strict=False):
        if size != 1:
            parts.append(f"{name}={size} (ici {i} x dcn {d})" if d != 1 else f"{name}={size}")
    return ", ".join(parts) or "all axes 1"


@contextlib.contextmanager
def install(processes_per_slice: int, axis_names: Sequence[str] = ()) -> Iterator[None]:
    """Route ``mesh_utils.create_hybrid_device_mesh`` through the emulated slices, for CPU devices.

    MaxText looks the function up on the module at call time, so replacing
    the module attribute is enough. TPU and GPU devices keep JAX's function.
    Each mesh built is logged with its DCN granules.
    """

    def create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices=None, **kwargs):
        import jax

        devices = list(jax.devices() if devices is None else devices)
        if devices[0].platform != "cpu":
            return _jax_create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices, **kwargs)
        mesh = emulated_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices, processes_per_slice, **kwargs)
        slices: dict[int, set[int]] = {}
        for device in devices:
            slices.setdefault(emulated_slice_index(device.process_index, processes_per_slice), set()).add(
                device.process_index
            )
        granules = "; ".join(f"slice {s}: processes {sorted(p)}" for s, p in sorted(slices.items()))
        names = list(axis_names) if len(axis_names) == len(mesh.shape) else [f"axis{i}" for i in range(mesh.ndim)]
        log.info(
            "emulated multislice mesh: %d slices as DCN granules (%s); mesh %s",
            len(slices),
            granules,
            describe_mesh(mesh, mesh_shape, dcn_mesh_shape, names),
        )
        return mesh

    mesh_utils.create_hybrid_device_mesh = create_hybrid_device_mesh
    try:
        yield
    finally:
        mesh_utils.create_hybrid_device_mesh = _jax_create_hybrid_device_mesh
