"""Backends: where the steps act. ``local`` runs JobSets on this machine; ``gke`` acts on a GKE cluster.

The local backend (:mod:`.local`) implements JobSets with processes. The GKE
backend (:mod:`.gke`) is the Kubernetes API itself: :func:`backend_for`
returns a :class:`multislice.backends.gke.client.Kube` (an API client bound to
the run's namespace, with retries), and each step's GKE path uses the modules
of :mod:`multislice.backends.gke`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from multislice.backends.local import LocalBackend

if TYPE_CHECKING:
    from multislice.backends.gke import Timings
    from multislice.backends.gke.client import Kube
    from multislice.config import ClusterSpec


class BackendUnavailable(RuntimeError):
    """The run asks for a backend that cannot act here; the message says what to use."""


def backend_for(
    backend: str,
    run_dir: str | Path,
    *,
    cluster: ClusterSpec | None = None,
    namespace: str = "default",
    timings: Timings | None = None,
    say: Any = None,
) -> LocalBackend | Kube:
    """The backend that runs this run's JobSets.

    Args:
        backend: ``local`` or ``gke``.
        run_dir: The run directory (local backend state).
        cluster: The GKE cluster and how to reach it (``gke``; see :mod:`multislice.backends.gke.access`).
        namespace: Namespace of the run's objects (``gke``).
        timings: Waits and retry deadlines (``gke``).
        say: Where API retry notices go (``gke``).

    Raises:
        BackendUnavailable: an unknown name.
        multislice.backends.gke.access.ClusterAccessError: ``gke`` and the cluster cannot be reached as configured.
    """
    if backend == "local":
        return LocalBackend(run_dir)
    if backend == "gke":
        from multislice.backends.gke import DEFAULT_TIMINGS, access
        from multislice.backends.gke.client import Kube
        from multislice.config import ClusterSpec

        api = access.api_client(cluster or ClusterSpec())
        return Kube(api, namespace, timings or DEFAULT_TIMINGS, say)
    raise BackendUnavailable(f"unknown backend {backend!r}; use local or gke")
