"""The validated plan: everything the steps need, resolved from a RunSpec.

config -> **plan** -> manifests -> backend -> steps -> pipeline. The plan is
plain, JSON-serialisable data so that one pipeline step can hand it to the
next. It fixes names (JobSets, directories), resolves MaxText's ``-1``
parallelism fills, and builds each stage's MaxText argument list.

Layout of a run's outputs (``output_dir`` may be a local path or ``gs://``)::

    <output_dir>/<run_name>/                  run directory
        <stage>/checkpoints/<step>/           Orbax checkpoints (MaxText run_name = stage)
        <stage>/tensorboard/                  MaxText's TensorBoard events
        <stage>/metrics.jsonl                 MaxText's per-step metrics, from the leader's log (train step)
        jax_cache/                            XLA compilation cache shared by the stages
        reports/[<stage>/]<step>.json         each step's report (:mod:`multislice.reports`), UI pages beside them
        manifests/                            the manifests the run submitted
        jobsets/<jobset>/                     local backend: JobSet state and pod logs
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from multislice import exporting, identity, maxtext, names, storage, tpu
from multislice.config import RunSpec, Stage, checks, data
from multislice.config.elastic import GRADIENT_ACCUMULATION_KEY, SliceCount, slice_counts


def resolve_degrees(degrees: dict[str, int], target: int) -> dict[str, int]:
    """Replace a ``-1`` degree by the value that makes the product ``target``.

    Input must already have passed :func:`multislice.config.cross_field_issues`.
    Returns every MaxText axis, with 1 for those not given.
    """
    full = {axis: 1 for axis in maxtext.PARALLELISM_AXES}
    full.update(degrees)
    fixed = 1
    for degree in full.values():
        if degree != -1:
            fixed *= degree
    return {axis: (target // fixed if degree == -1 else degree) for axis, degree in full.items()}


def renamed_key(data: Any, old: str, new: str) -> Any:
    """``data`` (a model's raw input) with its key ``old`` read as ``new``, when it has ``old`` and not ``new``."""
    if isinstance(data, dict) and old in data and new not in data:
        data = {**data}
        data[new] = data.pop(old)
    return data


class StagePlan(BaseModel):
    """One stage, resolved.

    Attributes:
        index: Position in the run, from 0.
        name: Stage name.
        model_label: Human name of the model.
        workload: The name of the object launched to train it (``<run_name>-<stage>``): its JobSet, or with
            ``launcher: ray`` its RayJob (:mod:`multislice.render.launchers`). ``jobset`` is a read alias, and a plan
            written with the old ``jobset`` key loads.
        stage_dir: Directory MaxText writes this stage to.
        checkpoint_dir: ``<stage_dir>/checkpoints``; a checkpoint per step directory.
        metrics_file: MaxText's per-step metrics records (JSON lines) the train step writes, from the
            leader's step lines.
        final_step: Step of the last checkpoint MaxText writes (``steps - 1``; steps count from 0).
        steps: Steps to train.
        ici: Every ICI axis degree, -1 resolved; product = chips per slice.
        dcn: Every DCN axis degree, -1 resolved; product = slices.
        global_batch_size: Sequences per step across all chips.
        tokens_per_step: ``global_batch_size * max_target_length``.
        data_dir: Where ``prepare_data`` writes the stage's shards (``text`` data), else None.
        maxtext_args: MaxText ``key=value`` arguments common to both hardware variants
            (:func:`multislice.render.jobset.worker_command` adds the CPU ones).
        elastic: Each slice count of an elastic stage, ``max_slices`` first, with its DCN degrees,
            gradient accumulation and MaxText arguments (:mod:`multislice.elastic`); empty when not elastic.
        wait_for_lost_slice_seconds: The stage's ``elastic.wait_for_lost_slice_seconds`` (None when not elastic).
        export: The export format after verification (``huggingface``), or None for none.
        export_dir: ``<stage_dir>/export/<format>``: where the export step writes it.
        export_dtype: The exported weights' dtype (``bfloat16`` or ``float32``: the stage's ``export_dtype``, else
            :func:`multislice.exporting.default_dtype`), or None without an export.
        export_hub_repo: The Hugging Face Hub repository the export is also published to, or None.
        export_report: ``<stage_dir>/export/report.json``: the exporter's own copy of its JSON report.
        launcher: How the stage is launched: ``jobset`` or ``ray`` (:attr:`RunSpec.launcher_for`).
        libtpu_flags: libtpu/XLA flags of the stage on TPU, name -> value (:meth:`RunSpec.libtpu_flags_for`):
            the TPU JobSet's ``LIBTPU_INIT_ARGS`` and preflight's compile flags; unused on CPU.
        local_checkpoint_directory: With emergency checkpoints (``emergency_checkpoint``), where each training pod
            mounts its node's checkpoint ramdisk (the local tier); None without.
        local_checkpoint_period: Steps between local checkpoints; None without emergency checkpoints.
    """

    model_config = ConfigDict(frozen=True)

    index: int
    name: str
    model_label: str
    workload: str
    stage_dir: str
    checkpoint_dir: str
    metrics_file: str
    final_step: int
    steps: int
    checkpoint_period: int
    ici: dict[str, int]
    dcn: dict[str, int]
    global_batch_size: float
    tokens_per_step: float
    maxtext_args: list[str]
    data_dir: str | None = None
    elastic: list[SliceCount] = []
    wait_for_lost_slice_seconds: float | None = None
    export: str | None = None
    export_dir: str | None = None
    export_dtype: str | None = None
    export_hub_repo: str | None = None
    export_report: str | None = None
    launcher: str = "jobset"
    libtpu_flags: dict[str, str] = {}
    local_checkpoint_directory: str | None = None
    local_checkpoint_period: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_jobset_key(cls, data: Any) -> Any:
        """A plan written before ``workload`` named the launched object ``jobset``: read it as ``workload``."""
        return renamed_key(data, "jobset", "workload")

    @property
    def jobset(self) -> str:
        """The launched object's name: :attr:`workload` (the name it had before a stage could be a RayJob)."""
        return self.workload

    def on_slices(self, slices: int) -> SliceCount:
        """The stage on ``slices`` slices (an elastic count). Raises KeyError for a count it has not."""
        for count in self.elastic:
            if count.slices == slices:
                return count
        raise KeyError(f"stage {self.name} has no elastic count of {slices} slices")

    def runnable_counts(self) -> list[int]:
        """Slice counts the stage may train on, most first (``[]`` when not elastic)."""
        return [c.slices for c in self.elastic if c.runnable]


class Plan(BaseModel):
    """A validated run: the spec, its slice shape, and every stage resolved.

    Attributes:
        spec: The validated RunSpec.
        run_dir: ``<output_dir>/<run_name>``.
        jax_cache_dir: XLA cache shared by the stages.
        total_chips: ``num_slices * chips``.
        stages: The resolved stages, in order.
    """

    model_config = ConfigDict(frozen=True)

    spec: RunSpec
    run_dir: str
    jax_cache_dir: str
    total_chips: int
    stages: list[StagePlan]

    @property
    def slice(self) -> tpu.SliceType:
        """The shape of one slice (``spec.tpu_type`` parsed from the TPU catalog)."""
        return self.spec.slice_type

    def stage(self, name: str) -> StagePlan:
        """The resolved stage called ``name``. Raises KeyError."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r} in the plan; stages are {', '.join(s.name for s in self.stages)}")

    def on_slices(self, stage: StagePlan, slices: int) -> tuple[Plan, StagePlan]:
        """The plan and ``stage`` as they run on ``slices`` slices (an elastic count); ``(self, stage)`` for
        ``num_slices``.

        What preflight compiles for each elastic count and what an elastic resize relaunches: the spec's
        ``num_slices`` and the plan's ``total_chips`` become the count's, the stage's DCN degrees, global batch and
        MaxText arguments (gradient accumulation included) the count's (:meth:`StagePlan.on_slices`,
        :mod:`multislice.config.elastic`).

        Raises:
            KeyError: the stage has no elastic count of ``slices`` slices.
        """
        if slices == self.spec.num_slices:
            return self, stage
        count = stage.on_slices(slices)
        spec = self.spec.model_copy(update={"num_slices": slices})
        smaller = self.model_copy(update={"spec": spec, "total_chips": self.slice.chips * slices})
        return smaller, stage.model_copy(
            update={
                "dcn": count.dcn,
                "maxtext_args": list(count.maxtext_args),
                "global_batch_size": count.global_batch_size,
            }
        )

    def to_json(self) -> str:
        """Serialise for handing to the next pipeline step."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`."""
        return cls.model_validate(json.loads(text))


def _stage_args(
    spec: RunSpec, stage: Stage, run_dir: str, jax_cache_dir: str, ici: dict, dcn: dict, accumulation: int | None = None
) -> list[str]:
    args: dict[str, Any] = {
        "run_name": stage.name,
        "base_output_directory": run_dir,
        **stage.model.maxtext_args(),
        "steps": stage.steps,
        "per_device_batch_size": stage.per_device_batch_size,
        "max_target_length": stage.max_target_length,
        **data_args(spec, stage),
        "remat_policy": stage.remat_policy,
        "enable_checkpointing": True,
        "async_checkpointing": True,
        "checkpoint_period": stage.checkpoint_period,
        "jax_cache_dir": jax_cache_dir,
    }
    for axis, degree in ici.items():
        args[f"ici_{axis}_parallelism"] = degree
    for axis, degree in dcn.items():
        args[f"dcn_{axis}_parallelism"] = degree
    args.update(emergency_checkpoint_args(spec, stage, dcn))
    if stage.goodput_recording:
        # maxtext/common/goodput.py: the recorder logs as job goodput_job_name (default run_name, the stage's
        # name here, the same in every run): name the run too, so that two runs' events never mix.
        args["enable_goodput_recording"] = True
        args["goodput_job_name"] = f"{spec.run_name}-{stage.name}"
    args.update(stage.maxtext_overrides)
    if accumulation is not None and (accumulation > 1 or GRADIENT_ACCUMULATION_KEY in args):
        args[GRADIENT_ACCUMULATION_KEY] = accumulation
    return [f"{key}={maxtext.format_value(value)}" for key, value in args.items()]


#: ``multi_tier_checkpointing_backup_interval_minutes`` of a multi-tier stage: a year, so that GKE's replicator never
#: backs the local tier up to its bucket. The stage's persistent tier is its own checkpoint directory
#: (:mod:`multislice.trainer.tiered_checkpoint`); a replicator backup would copy every host's shards (with one
#: data-parallel replica every node backs up its data, checkpoint-replicator ``sync.py``) to Cloud Storage a second
#: time, and while it runs the replicator keeps only the step being backed up in the ramdisk. MaxText and Orbax
#: require one of the two backup intervals (``maxtext/configs/types.py``; ``initialization.py``).
MULTI_TIER_BACKUP_INTERVAL_MINUTES = 365 * 24 * 60


def uses_multi_tier(spec: RunSpec, stage: Stage) -> bool:
    """Whether ``stage``'s local tier is MaxText's multi-tier checkpointing (an elastic stage, or one data-parallel
    replica) rather than Orbax's emergency manager (:func:`emergency_checkpoint_args` says why)."""
    return stage.elastic is not None or math.prod(checks.data_degrees(spec, stage)) < 2


def emergency_checkpoint_args(spec: RunSpec, stage: Stage, dcn: dict[str, int]) -> dict[str, Any]:
    """MaxText's keys for ``stage``'s local checkpoint tier on DCN degrees ``dcn`` (an elastic count's, else the
    stage's); ``{}`` unless its ``emergency_checkpoint`` is enabled and the spec allows it
    (:func:`multislice.config.checks.has_local_tier`).

    A fixed-size stage with 2 or more data-parallel replicas: Orbax's emergency ``CheckpointManager``.
    ``enable_emergency_checkpoint``, ``local_checkpoint_directory`` and ``local_checkpoint_period``
    (``maxtext/configs/base.yml``; MaxText requires the directory and a positive period together,
    ``maxtext/configs/types.py``), ``checkpoint_period`` left as it is. And ``mesh_axes`` with ``data`` first:
    MaxText 0.2.5 builds that manager without a ``replica_axis_index`` (``maxtext/common/emergency_checkpointing.py``),
    so Orbax takes the mesh's first axis as the replica axis (``CheckpointManagerOptions.replica_axis_index = 0``),
    and MaxText's first axis is ``diloco`` (size 1 unless DiLoCo is on). Moving a size-1 axis changes no device's
    place in the mesh.

    That manager serves neither one replica nor a resize (orbax-checkpoint 0.12.8,
    ``experimental/emergency/checkpoint_manager.py``, read and run on CPU here): with one replica it is a plain
    ``CheckpointManager`` without a local tier whose item is ``<step>/state``, and it refuses a directory holding the
    ``<step>/default`` its two-replica form writes ("Cannot provide `args` of type `Composite` when dealing with a
    single, unnamed (default) checkpointable object"), while the two-replica form reads ``<step>/default`` only
    (``_restore_from_persistent``); so an elastic stage shrunk to one slice could restore nothing.

    Those stages get MaxText's multi-tier checkpointing, whose manager the worker extends with the stage's persistent
    checkpoints (:mod:`multislice.trainer.tiered_checkpoint`: ``<step>/default`` on every slice count, and a local
    step of another mesh passed over): ``enable_multi_tier_checkpointing``, the same directory and period,
    ``mtc_data_parallelism`` the replicas on ``dcn`` (its default, the slice count, would have GKE's replicator
    treat FSDP slices as copies of each other: checkpoint-replicator ``coordinator.py`` ``infer_missing_meta``
    fills a node's missing shards with another slice's) and :data:`MULTI_TIER_BACKUP_INTERVAL_MINUTES`.
    """
    if not checks.has_local_tier(spec, stage):
        return {}
    emergency = stage.emergency_checkpoint
    assert emergency is not None  # has_local_tier
    tier = {"local_checkpoint_directory": emergency.local_directory, "local_checkpoint_period": emergency.local_period}
    if uses_multi_tier(spec, stage):
        return {
            "enable_multi_tier_checkpointing": True,
            **tier,
            "multi_tier_checkpointing_backup_interval_minutes": MULTI_TIER_BACKUP_INTERVAL_MINUTES,
            "mtc_data_parallelism": max(dcn.get("data", 1), 1) * checks.data_degrees(spec, stage)[1],
        }
    return {
        "enable_emergency_checkpoint": True,
        **tier,
        "mesh_axes": ["data", *(axis for axis in maxtext.MESH_AXES if axis != "data")],
    }


def restore_notes(plan: Plan) -> list[str]:
    """What a restart of each TPU stage restores from, one line per stage: the local tier of emergency checkpoints
    and the persistent tier, or the persistent tier alone with why the stage cannot have the local one and what to
    change to have it (:func:`multislice.config.checks.emergency_checkpoint_blockers`, each reason sourced there).
    ``multislice render`` prints them."""
    notes = []
    for stage_plan in plan.stages:
        stage = plan.spec.stage(stage_plan.name)
        persistent = f"the persistent tier ({stage_plan.checkpoint_dir}, every {stage_plan.checkpoint_period} steps)"
        if checks.has_local_tier(plan.spec, stage):
            local = (
                f"the local tier (every {stage_plan.local_checkpoint_period} steps on each node's checkpoint ramdisk, "
                f"{stage_plan.local_checkpoint_directory}"
            )
            if uses_multi_tier(plan.spec, stage):
                peers = (
                    "a replaced node's shards come from its peer in another slice through GKE's replicator"
                    if math.prod(checks.data_degrees(plan.spec, stage)) >= 2
                    else "one data-parallel replica: no peer holds a replaced node's shards"
                )
                notes.append(
                    f"{stage_plan.name}: a restart restores the newest step of either tier: {local}, each host its "
                    f"own shards, when every host kept it on this mesh: an in-place restart, or pods back on the same "
                    f"nodes; {peers}; a resize goes to the persistent tier) or {persistent}; MaxText's multi-tier "
                    "checkpointing with the stage's persistent checkpoints (multislice.trainer.tiered_checkpoint)"
                )
            else:
                notes.append(
                    f"{stage_plan.name}: a restart restores the newest step of either tier (Orbax's emergency "
                    f"CheckpointManager.restore): {local}, from a slice that kept it, broadcast to the others) or "
                    f"{persistent}"
                )
            continue
        blockers = checks.emergency_checkpoint_blockers(plan.spec, stage)
        asked = (
            "emergency_checkpoint is set but left out"
            if stage.uses_emergency_checkpoint
            else "no emergency checkpoints"
        )
        if not blockers:
            why = (
                f"emergency_checkpoint: {{local_period: N}} (N < {stage_plan.checkpoint_period}) would add a local "
                "tier on the nodes' checkpoint ramdisk (docs/gke-setup.md)"
            )
        else:
            why = f"{asked}: " + "; ".join(f"{reason} (to have them: {fix})" for reason, fix in blockers)
        notes.append(f"{stage_plan.name}: a restart restores from {persistent}; {why}")
    return notes


def prepared_dir(spec: RunSpec, stage: Stage) -> str | None:
    """Where ``prepare_data`` writes a ``text`` stage's shards: ``<cache_dir>/<recipe key>``; None for other data.

    ``cache_dir`` defaults to ``<output_dir>/datasets``, shared by runs, so that a run on unchanged data
    reuses the shards of an earlier one (:func:`multislice.config.data.recipe_key`).
    """
    if not isinstance(stage.data, data.TextData):
        return None
    return _shards_dir(spec, stage, stage.data)


def _shards_dir(spec: RunSpec, stage: Stage, text: data.TextData) -> str:
    """:func:`prepared_dir` of a stage whose data is ``text``."""
    base = text.cache_dir or storage.join(spec.output_dir, "datasets")
    return storage.join(base, data.recipe_key(text, stage.tokenizer, stage.max_target_length))


def data_args(spec: RunSpec, stage: Stage) -> dict[str, Any]:
    """MaxText's input-pipeline keys for the stage's data and tokenizer (``maxtext/configs/base.yml``).

    A ``maxtext:`` tokenizer path stays so in the arguments: the worker resolves it in the pod against
    the installed maxtext package (:func:`multislice.trainer.worker.resolve_package_paths`). MaxText's own
    resolution (``configs/types.py``, against ``MAXTEXT_ASSETS_ROOT``) assumes its source checkout's
    ``src/maxtext/assets`` and misses a pip install's.
    """
    source = stage.data
    if isinstance(source, data.SyntheticData):
        return {"dataset_type": "synthetic"}
    # MaxText's hf pipeline reads a Hugging Face tokenizer only: the default tiktoken file becomes its HF form.
    chosen = stage.tokenizer.for_hf_pipeline() if isinstance(source, data.HFData) else stage.tokenizer
    tokenizer = chosen.maxtext_args()
    tokenizer["tokenizer_path"] = chosen.path
    args: dict[str, Any] = {}
    if isinstance(source, data.TextData):
        folder = _shards_dir(spec, stage, source)
        args = {
            "dataset_type": "grain",
            "grain_file_type": "arrayrecord",
            "grain_train_files": storage.join(folder, "train-*.array_record"),
            "grain_eval_files": storage.join(folder, "eval-*.array_record"),
            "tokenize_train_data": False,
            "tokenize_eval_data": False,
            "packing": reads_packed(stage),
        }
        if reads_packed(stage):
            args["grain_packing_type"] = "first_fit"  # one segment id per record: documents keep their boundaries
    elif isinstance(source, data.GrainData):
        args = {
            "dataset_type": "grain",
            "grain_file_type": source.file_type,
            "grain_train_files": source.train_files,
            "train_data_columns": [source.column],
            "tokenize_train_data": not source.pretokenized,
        }
        if source.eval_files:
            args.update(
                grain_eval_files=source.eval_files,
                eval_data_columns=[source.column],
                tokenize_eval_data=not source.pretokenized,
            )
    elif isinstance(source, data.HFData):
        args = {"dataset_type": "hf", "hf_path": source.path, "train_split": source.train_split}
        args.update({k: v for k, v in (("hf_data_dir", source.data_dir), ("hf_train_files", source.train_files)) if v})
        args["train_data_columns"] = [source.column]
        if source.eval_split:
            args.update(hf_eval_split=source.eval_split, eval_data_columns=[source.column])
    elif isinstance(source, data.TFDSData):
        # On grain, as MaxText moves TFDS data (grain_data_processing.py construct_tfds_tfrecord_path): its tfds
        # pipeline needs TensorFlow, which the trainer image does not have.
        args = {
            "dataset_type": "grain",
            "grain_file_type": source.grain_file_type(),
            "grain_train_files": source.files(source.train_split),
            "train_data_columns": [source.column],
            "tokenize_train_data": True,
        }
        if source.eval_split:
            args.update(
                grain_eval_files=source.files(source.eval_split, source.eval_dataset_name),
                eval_data_columns=[source.column],
                tokenize_eval_data=True,
            )
    args.update(tokenizer)
    if stage.elastic is not None and args.get("dataset_type") == "grain":
        args.update(elastic_iterator_args())
    if stage.eval_interval > 0:
        args.update(eval_interval=stage.eval_interval, eval_steps=stage.eval_steps)
    return args


def reads_packed(stage: Stage) -> bool:
    """Whether MaxText packs a ``text`` stage's records into rows (``packing: true``, first-fit, a segment id per
    record): the data's ``packing``, except on an elastic stage, whose elastic iterator reads unpacked
    (:func:`elastic_iterator_args`), and with ``concatenate``, whose records are full rows already."""
    source = stage.data
    return isinstance(source, data.TextData) and source.packing and not source.concatenate and stage.elastic is None


def elastic_iterator_args() -> dict[str, Any]:
    """MaxText's keys that let an elastic stage on grain data restore its data position after a resize.

    MaxText 0.2.5 saves a grain iterator with its checkpoint, one file per data-loading process
    (``iter/process_{i}-of-{N}.json``, ``common/grain_utility.py`` ``GrainCheckpointable``), and restores only
    when the stored ``N`` is the run's process count, or a set ``expansion_factor_real_data`` accounts for the
    difference (``for_restore``: raises "The number of stored checkpoint files ... is incompatible with the
    number of JAX processes" otherwise). A shrink or a grow changes the process count. The expansion factor would
    have to be rendered anew from the previous attempt's count at every relaunch, and above 1 it makes only some
    hosts load data. Grain's ``ElasticIterator`` (``grain_use_elastic_iterator``) keeps one global position instead
    (``global_next_index``, the records read across all hosts, in ``iter/process_0.json``): every host reads
    ``global batch / hosts`` records from it, and any host count restores it, so the data continues where it
    stopped on any slice count. MaxText requires with it ``packing: false``, ``use_truncation: true``, ArrayRecord
    and no mixture (``configs/types.py``; :func:`multislice.config.elastic.elastic_data_issue` refuses the rest at
    plan): rows are padded, not packed (the prepare report's ``padding_fraction_unpacked`` is the cost).
    """
    return {"grain_use_elastic_iterator": True, "packing": False, "use_truncation": True}


def make_plan(spec: RunSpec) -> Plan:
    """Resolve a validated spec into a plan. Pure: touches no file or API."""
    shape = spec.slice_type
    run_dir = identity.run_dir(spec.output_dir, spec.run_name)
    jax_cache_dir = storage.join(run_dir, "jax_cache")
    stages = []
    for index, stage in enumerate(spec.stages):
        ici = resolve_degrees(stage.full_ici(), shape.chips)
        dcn = resolve_degrees(stage.full_dcn(), spec.num_slices)
        stage_dir = storage.join(run_dir, stage.name)
        global_batch = stage.per_device_batch_size * shape.chips * spec.num_slices
        counts = [
            count.model_copy(
                update={
                    "maxtext_args": _stage_args(
                        spec, stage, run_dir, jax_cache_dir, ici, count.dcn, count.gradient_accumulation_steps
                    )
                    if count.runnable
                    else []
                }
            )
            for count in slice_counts(spec, stage)
        ]
        stages.append(
            StagePlan(
                data_dir=prepared_dir(spec, stage),
                index=index,
                name=stage.name,
                model_label=stage.model.label,
                workload=names.jobset_name(spec.run_name, stage.name),
                stage_dir=stage_dir,
                checkpoint_dir=storage.join(stage_dir, "checkpoints"),
                metrics_file=storage.join(stage_dir, "metrics.jsonl"),
                final_step=stage.steps - 1,
                steps=stage.steps,
                checkpoint_period=stage.checkpoint_period,
                ici=ici,
                dcn=dcn,
                global_batch_size=global_batch,
                tokens_per_step=global_batch * stage.max_target_length,
                maxtext_args=_stage_args(spec, stage, run_dir, jax_cache_dir, ici, dcn),
                elastic=counts,
                wait_for_lost_slice_seconds=stage.elastic.wait_for_lost_slice_seconds if stage.elastic else None,
                export=stage.export,
                export_dir=storage.join(stage_dir, "export", stage.export) if stage.export else None,
                export_dtype=exporting.default_dtype(stage) if stage.export else None,
                export_hub_repo=stage.export_hub_repo if stage.export else None,
                export_report=storage.join(stage_dir, "export", "report.json") if stage.export else None,
                launcher=spec.launcher_for(stage),
                libtpu_flags=spec.libtpu_flags_for(stage),
                **(
                    {
                        "local_checkpoint_directory": stage.emergency_checkpoint.local_directory,
                        "local_checkpoint_period": stage.emergency_checkpoint.local_period,
                    }
                    if stage.emergency_checkpoint and checks.has_local_tier(spec, stage)
                    else {}
                ),
            )
        )
    return Plan(
        spec=spec,
        run_dir=run_dir,
        jax_cache_dir=jax_cache_dir,
        total_chips=shape.chips * spec.num_slices,
        stages=stages,
    )
