"""Backends: where a run's workloads run. One interface (:class:`~.base.Backend`), one implementation per place.

``local`` (:class:`~.local.LocalBackend`) runs each pod as a process of this
machine; ``gke`` (:class:`~.gke.GkeBackend`) acts on a GKE cluster. Steps get
theirs from :func:`backend_for` (or are handed one, as the tests do) and never
ask which it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from multislice.backends.base import Backend
from multislice.config import ClusterSpec
from multislice.plan import Plan
from multislice.render.launchers import LauncherKind, named
from multislice.timings import timings_for

if TYPE_CHECKING:
    from multislice.backends.gke import GkeBackend
    from multislice.backends.local import LocalBackend

#: Backend names, as the run spec's ``backend`` field takes them.
NAMES = ("local", "gke")


def launcher_kind(name: str) -> LauncherKind:
    """The launcher kind of a ``launcher`` value as a report records it (:func:`multislice.render.launchers.named`).

    Raises:
        ValueError: an unknown name.
    """
    return named(name)


def backend_class(name: str) -> type[Backend]:
    """The backend class of a name (no connection is made).

    Raises:
        ValueError: an unknown name.
    """
    if name == "local":
        from multislice.backends.local import LocalBackend  # jsonschema and the CRDs: only when asked for

        return LocalBackend
    if name == "gke":
        from multislice.backends.gke import GkeBackend  # the kubernetes and GKE clients (2-3 s): only when asked for

        return GkeBackend
    raise ValueError(f"unknown backend {name!r}; use one of {', '.join(NAMES)}")


def create(
    name: str,
    *,
    run_dir: str,
    namespace: str = "default",
    cluster: dict[str, Any] | None = None,
    timings: Any = None,
    say: Callable[[str], None] | None = None,
) -> Backend:
    """A backend by name, from raw values (the exit handler has no plan when planning failed).

    Args:
        name: ``local`` or ``gke``.
        run_dir: The run directory (local: where JobSet state lives).
        namespace: The run's namespace (gke).
        cluster: The profile's ``cluster`` section (gke; no credentials in it).
        timings: The waits; default the backend's.
        say: Where API retry notices go (gke).

    Raises:
        ValueError: an unknown name, or a ``cluster`` section that does not validate.
        multislice.backends.gke.access.ClusterAccessError: the cluster cannot be reached as configured.
    """
    kind = backend_class(name)
    if name == "gke":
        gke = cast("type[GkeBackend]", kind)
        return gke.connect(ClusterSpec.model_validate(cluster or {}), namespace, timings, say)
    return cast("type[LocalBackend]", kind)(run_dir, timings)


def backend_for(plan: Plan, say: Callable[[str], None] | None = None) -> Backend:
    """The backend of a plan (``plan.spec.backend``), with the plan's waits (:func:`multislice.timings.timings_for`).

    Raises:
        multislice.backends.gke.access.ClusterAccessError: ``gke`` and the cluster cannot be reached as configured.
    """
    spec = plan.spec
    return create(
        spec.backend, run_dir=plan.run_dir, namespace=spec.namespace, cluster=spec.cluster.model_dump(),
        timings=timings_for(spec), say=say,
    )  # fmt: skip
