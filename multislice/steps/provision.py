"""provision: make sure the capacity and the queueing objects the run needs exist.

Renders the run's Kueue objects (:mod:`multislice.render.kueue`), validates them
against the Kueue CRDs, writes them to ``<run_dir>/manifests/kueue.yaml``, and
hands them to the backend (:meth:`multislice.backends.base.Backend.provision`).
On GKE that creates or checks the TPU node pools (one per slice), checks that
the JobSet and Kueue CRDs are served at the versions this project renders,
and server-side applies the Kueue objects (the cluster-scoped ones only with
``service_accounts.kueue_cluster_objects``; otherwise a cluster admin applies
them, :mod:`multislice.render.rbac`). On the local backend there are no node
pools and no Kueue: it checks that this machine can host the emulated slices
(the trainer environment, memory, the JAX coordinator port) and says plainly
that nothing was applied.
"""

from __future__ import annotations

from typing import Any

import yaml

from multislice import cancel, storage
from multislice.backends import Backend
from multislice.plan import Plan
from multislice.render import kueue, schema
from multislice.reports import ProvisionReport
from multislice.steps import backend_of, cancellable, teller, write_report


def kueue_objects(plan: Plan) -> list[dict[str, Any]]:
    """The run's Kueue objects, validated against the Kueue CRDs.

    Raises:
        multislice.render.schema.ManifestInvalid: one does not validate (a renderer bug).
    """
    objects = kueue.render_kueue_objects(plan)
    for obj in objects:
        schema.validate(obj)
    return objects


def run(plan: Plan, pipeline_run_id: str = "", *, backend: Backend | None = None) -> ProvisionReport:
    """Check or create capacity and queueing objects for the plan; returns the provision report.

    ``pipeline_run_id``: the pipeline run this is for: node pools created now are labelled with it (deleted if
    the run is terminated), and the step holds the run meanwhile (:func:`multislice.steps.cancellable`).

    Raises:
        multislice.errors.UserError: capacity is missing or mismatched, or the CRDs are not installed (the
            message says what to change).
    """
    with cancellable("provision", plan=plan, run_id=pipeline_run_id) as removal:
        removal.backend = backend = backend_of(plan, backend, "provision")
        objects = kueue_objects(plan)
        manifest = storage.join(plan.run_dir, "manifests", "kueue.yaml")
        storage.write_text(manifest, yaml.safe_dump_all(objects, sort_keys=False))
        cancel.point("provision:checking")
        report = backend.provision(plan, objects, teller("provision"), pipeline_run_id=pipeline_run_id)
        cancel.point("provision:report")
        return write_report(plan, report.model_copy(update={"kueue_manifest": manifest}))
