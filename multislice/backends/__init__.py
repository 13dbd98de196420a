"""Backends: where the steps act. ``local`` runs JobSets on this machine; ``gke`` is not built yet.

The steps (:mod:`multislice.steps`) talk to a backend through a small set of
calls (create, get, wait, delete and list JobSets; read a pod's log). The
local backend implements them with processes; the GKE backend will implement
them with the Kubernetes API (JobSet, Kueue) and google-cloud-container.
"""

from __future__ import annotations

from pathlib import Path

from multislice.backends.local import LocalBackend


class BackendUnavailable(RuntimeError):
    """The run asks for a backend that cannot act here; the message says what to use."""


def backend_for(backend: str, run_dir: str | Path) -> LocalBackend:
    """The backend that runs this run's JobSets.

    Raises:
        BackendUnavailable: ``gke`` (not built yet) or an unknown name.
    """
    if backend == "local":
        return LocalBackend(run_dir)
    if backend == "gke":
        raise BackendUnavailable(
            "backend=gke: the GKE implementations of the steps (Kubernetes and GKE APIs) are not built yet; "
            "`multislice render --profile gke-v6e-16x2` writes the manifests to apply by hand, and "
            "backend=local runs the same pipeline on this machine"
        )
    raise BackendUnavailable(f"unknown backend {backend!r}; use local or gke")
