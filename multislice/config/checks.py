"""Checks across fields of a run spec, run after the per-field checks of :mod:`.models`."""

from __future__ import annotations

import math

from multislice import exporting, libtpu_flags, maxtext, names
from multislice.config import models
from multislice.config.data import SITE_PACKAGES_PREFIX
from multislice.config.elastic import elastic_issues
from multislice.config.models import RunSpec, Stage


def _fill(degrees: dict[str, int], target: int) -> tuple[int, int | None]:
    """(product of the given degrees, value the -1 axis would take or None)."""
    fixed = math.prod(d for d in degrees.values() if d != -1)
    if -1 in degrees.values():
        return fixed, (target // fixed if fixed and target % fixed == 0 else 0)
    return fixed, None


def _describe(degrees: dict[str, int]) -> str:
    return " x ".join(f"{axis}={degree}" for axis, degree in degrees.items()) or "none"


def cross_field_issues(spec: RunSpec) -> list[tuple[str, str]]:
    """Checks that need several fields: parallelism vs slice shape, whole global batches, name lengths, uniqueness.

    Returns ``(field, message)`` pairs; empty when the spec is consistent.
    """
    issues: list[tuple[str, str]] = []
    shape = spec.slice_type
    issues += _libtpu_flag_issues(spec)
    remote = spec.output_dir.startswith("gs://")
    if spec.ray.min_slices is not None and spec.ray.min_slices > spec.num_slices:
        issues.append(
            (
                "ray.min_slices",
                f"ray.min_slices ({spec.ray.min_slices}) is more than num_slices ({spec.num_slices}); the JaxTrainer "
                "can never start: set ray.min_slices to at most num_slices, or unset it for a fixed worker count",
            )
        )
    ray_stages = [stage.name for stage in spec.stages if spec.launcher_for(stage) == "ray"]
    if spec.backend == "gke" and ray_stages and not spec.ray.head_node_selector:
        issues.append(
            (
                "ray.head_node_selector",
                f"stage(s) {', '.join(ray_stages)} are launched by Ray, whose head pod (4 CPU, 16 GiB, the driver) "
                "needs a CPU node pool, and TPU node pools are tainted for TPU pods only: set "
                "ray.head_node_selector to that pool, e.g. {cloud.google.com/gke-nodepool: cpu-pool} "
                "(docs/gke-setup.md)",
            )
        )
    if ray_stages and spec.node_pools.additional_node_networks and spec.service_accounts.tpu_host_network:
        # A Ray stage's TPU workers claim DRANET network devices on these node pools (multislice.render.ray), and
        # DRANET refuses a host-network pod that claims a device: its NRI hook RunPodSandbox returns "using host
        # network can not claim host devices" (google/dranet pkg/driver/nri_hooks.go, runPodSandbox), so the
        # kubelet never creates the pod's sandbox. DRANET moves the claimed NICs into the pod's own network
        # namespace, so DCN traffic takes the additional networks without hostNetwork.
        issues.append(
            (
                "service_accounts.tpu_host_network",
                f"stage(s) {', '.join(ray_stages)} are launched by Ray on node pools with "
                "node_pools.additional_node_networks, so their TPU workers claim DRANET network devices, and DRANET "
                "refuses to start a hostNetwork pod that claims one (the workers would never start): set "
                "service_accounts.tpu_host_network: false (DRANET moves the additional NICs into the pod's network "
                "namespace, so DCN traffic still uses them) with tpu_workload_identity: true and "
                "trainer_gcp_service_account (pods off the host network write gs:// through Workload Identity), "
                "or drop node_pools.additional_node_networks",
            )
        )
    if spec.backend == "gke" and not remote:
        issues.append(
            (
                "output_dir",
                f"{spec.output_dir!r} is a local path, but TPU pods on GKE cannot write to this machine; "
                "use a Cloud Storage location, gs://BUCKET/PATH",
            )
        )
    if spec.backend == "local" and remote:
        issues.append(
            ("output_dir", "the local backend writes to this machine's disk; use a local directory, not gs://")
        )
    if spec.backend == "gke":
        issues += spec.node_pools.issues(spec.cluster)
    seen: set[str] = set()
    for i, stage in enumerate(spec.example_stages):
        # Example stages are checked against the slice shape when one is selected (with_stages + load_spec).
        if stage.name in {s.name for s in spec.stages} | {s.name for s in spec.example_stages[:i]}:
            issues.append(
                (f"example_stages[{i}] ({stage.name}).name", f"stage name {stage.name!r} is used twice; rename one")
            )
    for i, stage in enumerate(spec.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.name in seen:
            issues.append((f"{where}.name", f"stage name {stage.name!r} is used twice; give each stage its own name"))
        seen.add(stage.name)
        for net, degrees, target, unit in (
            ("ici", stage.full_ici(), shape.chips, f"chips per {shape.name} slice"),
            ("dcn", stage.full_dcn(), spec.num_slices, "slices (num_slices)"),
        ):
            fixed, filled = _fill(degrees, target)
            if filled is None and fixed != target:
                fix = f"make the product {target}, or set one axis to -1 so MaxText fills it"
                if net == "dcn" and target == 1:  # one slice: no DCN axis; say exactly what to set
                    sets = " ".join(f"--set stages.{i}.dcn.{axis}=1" for axis, n in degrees.items() if n not in (1, -1))
                    fix = f"one slice has no DCN axis: {sets}"
                issues.append(
                    (
                        f"{where}.{net}",
                        f"{net.upper()} parallelism {_describe(degrees)} multiplies to {fixed}, but there are "
                        f"{target} {unit}; {fix}",
                    )
                )
            elif filled == 0:
                issues.append(
                    (
                        f"{where}.{net}",
                        f"{net.upper()} parallelism {_describe(degrees)}: the -1 axis cannot fill {target} {unit} "
                        f"because the other axes multiply to {fixed}, which does not divide {target}",
                    )
                )
        chips = shape.chips * spec.num_slices
        global_batch = stage.per_device_batch_size * chips
        if not math.isclose(global_batch, round(global_batch), rel_tol=1e-9) or round(global_batch) < 1:
            issues.append(
                (
                    f"{where}.per_device_batch_size",
                    f"per_device_batch_size {stage.per_device_batch_size:g} x {chips} chips gives a global batch of "
                    f"{global_batch:g} sequences, not a whole number; use a multiple of 1/{chips}",
                )
            )
        issues += elastic_issues(spec, stage, where)
        issues += emergency_checkpoint_issues(spec, stage, where)
        issues += export_issues(spec, stage, where)
        issues += _data_token_issues(spec, stage, where)
        issues += _data_source_issues(spec, stage, where)
        declared = getattr(stage.data, "sequences", None)
        lasts = declared is not None and models.data_lasts_issue(stage, declared, global_batch)
        if lasts:
            issues.append((f"{where}.steps", lasts))
        if stage.goodput_recording and spec.backend != "gke":
            issues.append(
                (
                    f"{where}.goodput_recording",
                    "goodput_recording writes to Cloud Logging, which a local run has no credentials for; leave it "
                    "off locally (the train report measures goodput on every backend) or use backend: gke",
                )
            )
        if stage.checkpoint_period > stage.steps:
            issues.append(
                (
                    f"{where}.checkpoint_period",
                    f"checkpoint_period {stage.checkpoint_period} exceeds steps {stage.steps}: only the final "
                    "checkpoint would be written, and a restart would lose every step; make it at most steps",
                )
            )
    # With unique_run_name each run's plan step appends "-<8 characters of its pipeline run id>"
    # (identity.unique_run_name): check the name every run will have, not the one given.
    from multislice import identity  # its storage imports etils.epath (0.1 s), which the config itself needs not

    suffix = identity.UNIQUE_SUFFIX_LENGTH if spec.unique_run_name else 0
    run_name = spec.run_name + "-" + "x" * (suffix - 1) if suffix else spec.run_name
    too_long = [
        (names.jobset_name(run_name, stage.name), stage.name)
        for stage in spec.stages
        if names.longest_pod_name_length(names.jobset_name(run_name, stage.name), spec.num_slices, shape.hosts)
        > names.MAX_LABEL_LENGTH
    ]
    if too_long:
        jobset, stage_name = max(too_long, key=lambda pair: len(pair[0]))
        longest = names.longest_pod_name_length(jobset, spec.num_slices, shape.hosts)
        room = names.max_jobset_name_length(spec.num_slices, shape.hosts) - len(stage_name) - 1 - suffix
        appended = (
            f" with unique_run_name, every run (each scheduled run too) appends '-' and "
            f"{identity.UNIQUE_SUFFIX_CHARACTERS} characters of its pipeline run id: {len(spec.run_name)} + "
            f"{suffix} = {len(spec.run_name) + suffix} characters of run name;"
            if suffix
            else ""
        )
        issues.append(
            (
                "run_name",
                f"JobSet {jobset!r} ({len(jobset)} characters) would get pod names of {longest} characters "
                f"(<jobset>-{names.REPLICATED_JOB}-<jobIndex>-<podIndex>-<5 random>), over Kubernetes' 63;"
                f"{appended} shorten run_name ({len(spec.run_name)} characters) to at most {max(room, 0)}"
                + (f", or shorten stage name {stage_name!r}" if room < 8 else ""),
            )
        )
    return issues


def _data_source_issues(spec: RunSpec, stage, where: str) -> list[tuple[str, str]]:
    """Where a ``text`` stage's sources can be read on its backend: on GKE, prepare_data's shard workers are pods
    (an Indexed Job of the trainer image), which read their sources from Cloud Storage; a ``site-packages:`` glob
    points into this machine's trainer environment and a local path into this machine's disk, neither of which a
    pod has (:mod:`multislice.steps.prepare_data` refuses them again before it starts a worker)."""
    files = getattr(stage.data, "files", None) if getattr(stage.data, "kind", None) == "text" else None
    if spec.backend != "gke" or not files:
        return []
    issues = []
    for i, pattern in enumerate(files):
        if pattern.startswith("gs://"):
            continue
        where_it_is = (
            "the local trainer environment's Python install"
            if pattern.startswith(SITE_PACKAGES_PREFIX)
            else "a local path"
        )
        issues.append((f"{where}.data.files[{i}]", f"{pattern!r} points into {where_it_is}, which a GKE pod does not "
                       "have (prepare_data's shard workers are pods that read Cloud Storage): copy the corpus to a "
                       "gs:// bucket the trainer's service account may read and give its glob, or use backend: "
                       "local"))  # fmt: skip
    return issues


def _data_token_issues(spec: RunSpec, stage, where: str) -> list[tuple[str, str]]:
    """Where the stage's Hugging Face dataset token can come from on its backend and launcher."""
    k8s = getattr(stage.data, "hf_token_kubernetes_secret", "")
    manager = getattr(stage.data, "hf_token_secret", "")
    field = f"{where}.data"
    if k8s and manager:
        return [(f"{field}.hf_token_secret", "both hf_token_kubernetes_secret and hf_token_secret are set; keep one")]
    if k8s and spec.backend == "local":
        return [(f"{field}.hf_token_kubernetes_secret", "the local backend has no Kubernetes Secrets: its pods read "
                 "this machine's $HF_TOKEN; export HF_TOKEN and unset data.hf_token_kubernetes_secret")]  # fmt: skip
    if manager and (stage.launcher or spec.launcher) == "ray":
        return [(f"{field}.hf_token_secret", "a Ray stage's MaxText runs in Ray worker processes that KubeRay starts "
                 "(ray start), which cannot be wrapped to read Secret Manager first; use "
                 "data.hf_token_kubernetes_secret (the worker pods get $HF_TOKEN by reference)")]  # fmt: skip
    return []


def data_degrees(spec: RunSpec, stage: Stage) -> tuple[int, int]:
    """The stage's data-parallel degrees ``(DCN data, ICI data)``, -1 filled as MaxText fills it; their product is
    the number of data-parallel replicas (copies of the whole training state). Orbax's emergency
    ``CheckpointManager`` counts replicas along the mesh's first axis, which the plan makes ``data``
    (:func:`multislice.plan.emergency_checkpoint_args`)."""
    dcn = stage.full_dcn()
    data = dcn.get("data", 1)
    if data == -1:  # MaxText fills it: the slices over the other axes' product
        data = spec.num_slices // math.prod(d for d in dcn.values() if d != -1)
    ici = stage.full_ici()
    ici_data = ici.get("data", 1)
    if ici_data == -1:
        ici_data = spec.slice_type.chips // math.prod(d for d in ici.values() if d != -1)
    return max(data, 1), max(ici_data, 1)


#: Data kinds MaxText reads through grain, whose iterator its standard checkpointer saves and restores beside the
#: state (``maxtext/common/checkpointing.py``, ``load_state_if_possible``, case 2); :func:`multislice.plan.data_args`.
GRAIN_DATA_KINDS = ("text", "grain", "tfds")
#: Why a stage reading grain data has no local tier (MaxText 0.2.5).
GRAIN_REASON = (
    "MaxText's emergency and multi-tier managers save the training state only, not the grain data iterator "
    "(maxtext/common/emergency_checkpointing.py save; checkpointing.load_state_if_possible returns no iterator for "
    "them), so a restart would read the stage's data again from its start"
)


def emergency_checkpoint_blockers(spec: RunSpec, stage: Stage) -> list[tuple[str, str]]:
    """Why the stage cannot have emergency checkpoints (a node-local tier beside the persistent one) with the rest of
    the spec: ``(reason, what to change)`` pairs, each reason with its source; empty when it can. They depend on run
    parameters (backend, launcher, data), so a profile that turns the local tier on still runs with any of them: the
    plan then leaves the local tier out and says why (:func:`multislice.plan.restore_notes`, printed by ``multislice
    render``).
    """
    blockers = []
    if spec.backend != "gke":
        blockers.append(
            (
                "they need GKE's multi-tier checkpointing CSI driver (it keeps each node's checkpoint ramdisk across "
                "pod restarts and writes the jax-init-info.txt MaxText starts from); the local backend has none",
                "use backend gke",
            )
        )
    if spec.launcher_for(stage) != "jobset":
        blockers.append(
            (
                "they run with launcher jobset only: MaxText starts them from the jax-init-info.txt GKE's "
                "checkpointing CSI driver writes, while Ray Train's JaxTrainer initialises jax.distributed itself",
                "set launcher: jobset for this stage",
            )
        )
    if stage.data.kind in GRAIN_DATA_KINDS:
        blockers.append((GRAIN_REASON, "train on synthetic or hf data"))
    emergency = stage.emergency_checkpoint
    if emergency is not None and emergency.local_period >= stage.checkpoint_period:
        blockers.append(
            (
                f"emergency_checkpoint.local_period ({emergency.local_period}) is not fewer steps than "
                f"checkpoint_period ({stage.checkpoint_period}; a run's steps lower it when the profile's period "
                "exceeds them): the local tier would never hold a step newer than the persistent one",
                "make local_period smaller (MaxText: 'much smaller than checkpoint_period')",
            )
        )
    return blockers


def has_local_tier(spec: RunSpec, stage: Stage) -> bool:
    """Whether the stage checkpoints to a node-local tier: its ``emergency_checkpoint`` is enabled and nothing in
    the spec rules it out (:func:`emergency_checkpoint_blockers`)."""
    return stage.uses_emergency_checkpoint and not emergency_checkpoint_blockers(spec, stage)


def emergency_checkpoint_issues(spec: RunSpec, stage: Stage, where: str) -> list[tuple[str, str]]:
    """Why a stage's ``emergency_checkpoint`` settings are wrong: MaxText's multi-tier or ``mesh_axes`` keys in
    ``maxtext_overrides``, which the plan sets itself. A spec in which the local tier cannot run
    (:func:`emergency_checkpoint_blockers`: the local backend, the Ray launcher, grain data) is no error: the plan
    leaves the local tier out and says why. An elastic stage, or one with one data-parallel replica, gets MaxText's
    multi-tier checkpointing instead of Orbax's emergency manager (:func:`multislice.plan.emergency_checkpoint_args`
    says why).
    """
    if not has_local_tier(spec, stage):
        return []
    issues: list[tuple[str, str]] = []
    clash = sorted(set(stage.maxtext_overrides) & {*maxtext.MULTI_TIER_CHECKPOINT_KEYS, "mesh_axes"})
    if clash:
        issues.append(
            (
                f"{where}.maxtext_overrides",
                f"{', '.join(clash)} cannot be combined with emergency_checkpoint: the plan sets MaxText's local-tier "
                "keys itself (Orbax's emergency manager with the data axis first in mesh_axes, Orbax's replica axis, "
                "for 2 or more data-parallel replicas; multi-tier checkpointing with persistent checkpoints in the "
                "stage's checkpoint directory, which verify and export read, for one); remove them from "
                "maxtext_overrides",
            )
        )
    return issues


def export_issues(spec: RunSpec, stage, where: str) -> list[tuple[str, str]]:
    """Why a stage's ``export`` could not run, from the spec alone (:mod:`multislice.exporting`): a model or
    tokenizer the exporter cannot export, a Hub repository without a credential on GKE, export options without
    ``export``. The plan step adds what needs this machine (:func:`export_environment_issues`)."""
    issues: list[tuple[str, str]] = []
    if not stage.export:
        for name in ("export_dtype", "export_hub_repo"):
            if getattr(stage, name) is not None:
                issues.append((f"{where}.{name}", f"{name} is set but export is not; set export: huggingface, or unset "
                                                  f"{name}"))  # fmt: skip
        return issues
    problem = exporting.model_issue(stage)
    if problem:
        issues.append((f"{where}.export", f"{problem}; unset export for this stage"))
    problem = exporting.tokenizer_issue(stage.tokenizer)
    if problem:
        issues.append((f"{where}.tokenizer", f"{problem}; or unset export for this stage"))
    exporter = spec.exporter
    if stage.export_hub_repo and spec.backend == "gke":
        if not (exporter.hub_token_secret or exporter.hub_token_kubernetes_secret):
            issues.append(
                (
                    f"{where}.export_hub_repo",
                    f"publishing to the Hugging Face Hub repository {stage.export_hub_repo} needs a token, and none "
                    "is named; set exporter.hub_token_kubernetes_secret to a Kubernetes Secret of namespace "
                    f"{spec.namespace} with key token (KFP), or exporter.hub_token_secret to a Secret Manager secret "
                    "version (Vertex AI); or unset export_hub_repo",
                )
            )
    return issues


def export_environment_issues(spec: RunSpec, export_dirs: dict[str, str]) -> list[tuple[str, str]]:
    """Why a stage's export could not run, from what this machine has (the plan step runs these): the tokenizer's
    local files, a local destination that cannot be written, and, on the local backend, a Hub repository with no
    token here (``$HF_TOKEN``) and no ``exporter.hub_token_secret``.

    Args:
        spec: The run spec.
        export_dirs: Stage name -> its export directory (``multislice.plan.StagePlan.export_dir``).
    """
    issues: list[tuple[str, str]] = []
    for i, stage in enumerate(spec.stages):
        if not stage.export:
            continue
        where = f"stages[{i}] ({stage.name})"
        problem = exporting.tokenizer_issue(stage.tokenizer, read_files=spec.backend == "local")
        if problem:
            issues.append((f"{where}.tokenizer", f"{problem}; or unset export for this stage"))
        problem = exporting.destination_issue(export_dirs[stage.name])
        if problem:
            issues.append(("output_dir", f"{problem}; choose an output_dir this user can write"))
        if (
            stage.export_hub_repo
            and spec.backend == "local"
            and not spec.exporter.hub_token_secret
            and not exporting.hub_token_locally()
        ):
            issues.append(
                (
                    f"{where}.export_hub_repo",
                    f"publishing to the Hugging Face Hub repository {stage.export_hub_repo} needs a token, and this "
                    "machine has none: export HF_TOKEN, or set exporter.hub_token_secret to "
                    "a Secret Manager secret version; or unset export_hub_repo",
                )
            )
    return issues


def _libtpu_flag_issues(spec: RunSpec) -> list[tuple[str, str]]:
    """A ``libtpu_flags.remove`` name that removes nothing (not a table flag of the stage(s) it applies to)."""
    generation = spec.slice_type.generation.name
    issues = []
    stages = (*spec.stages, *spec.example_stages)

    def table(stage) -> dict[str, str]:
        return libtpu_flags.table_flags(
            generation,
            stage.model.name,
            spec.libtpu_recipe_for(stage),
            libtpu_flags.offloads_to_host(stage.remat_policy, stage.maxtext_overrides),
        )

    for where, flags in [("libtpu_flags", spec.libtpu_flags)] + [
        (f"stages[{i}] ({s.name}).libtpu_flags", s.libtpu_flags) for i, s in enumerate(spec.stages)
    ]:
        pinned = libtpu_flags.NAMED.get(flags.recipe or "")
        if pinned is not None and pinned.generation != generation:
            issues.append(
                (
                    f"{where}.recipe",
                    f"{pinned.recipe} is MaxText's recipe for {pinned.generation}, and this run's tpu_type is "
                    f"{generation}: pin a {generation} recipe ("
                    + (", ".join(n for n, r in libtpu_flags.NAMED.items() if r.generation == generation) or "none")
                    + ") or remove libtpu_flags.recipe",
                )
            )

    known = set().union(*(table(stage) for stage in stages))
    for name in spec.libtpu_flags.remove:
        if name not in known:
            issues.append(
                (
                    "libtpu_flags.remove",
                    f"{name} is not a flag of any stage's recipe on {generation} (multislice.libtpu_flags); "
                    f"they are: {', '.join(sorted(known)) or 'none'}. Remove it from libtpu_flags.remove",
                )
            )
    for where, group in (("stages", spec.stages), ("example_stages", spec.example_stages)):
        for i, stage in enumerate(group):
            mine = set(table(stage)) | set(spec.libtpu_flags.add)
            issues += [
                (
                    f"{where}[{i}] ({stage.name}).libtpu_flags.remove",
                    f"{name} is not among stage {stage.name}'s flags on {generation} "
                    f"({', '.join(sorted(mine)) or 'none'}); remove it from libtpu_flags.remove",
                )
                for name in stage.libtpu_flags.remove
                if name not in mine
            ]
    return issues
