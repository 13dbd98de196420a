"""Step reports: typed records of what each step did, written to the run directory and read back by attribute.

Each step returns one of these and writes it as JSON to
``<run_dir>/reports/[<stage>/]<step>.json`` through :mod:`multislice.storage`
(a local path or ``gs://``, the same code). KFP components hand them on as
plain dicts (:meth:`StepReport.to_dict`; a component output must be JSON)
and the next component reads them back with ``model_validate``. The CLI's
summary, the UI pages, :func:`multislice.delivery.results.read_run` and the
exit handler's notification read them from the run directory.

Units are in the field names: ``_bytes`` (bytes), ``_seconds`` (seconds),
``_per_chip`` (one TPU chip), ``_per_device`` (one JAX device: a chip, or a
CPU device standing in for one on the local backend).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from multislice import storage
from multislice.elastic import Resize
from multislice.plan import Plan, StagePlan, renamed_key


class StepReport(BaseModel):
    """Base of the step reports: strict fields (a misspelt one is an error), JSON-able."""

    model_config = ConfigDict(extra="forbid")

    #: The step's name; the report file is ``<step>.json`` (``verification.json`` for verify_checkpoint).
    step: ClassVar[str] = ""
    #: The report's file name under ``reports/[<stage>/]``.
    file_name: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (what a KFP component returns), without null values at any depth.

        kfp.local refuses a ``None`` inside a dict output ("Value must be one of the following
        types: str, int, float, bool, dict, and list"); a field left out reads back as its default.
        """
        return _without_none(self.model_dump(mode="json"))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def report_path(plan: Plan | str, file_name: str, stage: StagePlan | str | None = None) -> str:
    """``<run_dir>/reports/[<stage>/]<file_name>`` (a local path or ``gs://`` URL) of a plan or a run directory."""
    run_dir = plan.run_dir if isinstance(plan, Plan) else plan
    name = stage.name if isinstance(stage, StagePlan) else stage
    return storage.join(run_dir, "reports", *([name] if name else []), file_name)


def write(plan: Plan, report: StepReport, stage: StagePlan | None = None) -> StepReport:
    """Write a report to the run directory (local or ``gs://``) and return it."""
    storage.write_json(report_path(plan, report.file_name, stage), report.to_dict())
    return report


def parse[R: StepReport](kind: type[R], data: dict[str, Any]) -> R:
    """A report read back from a run directory: fields this version does not know are left out.

    A run directory outlives an upgrade (a rerun under the same run name, a
    schedule that continues one run), so an older report's retired fields must
    not make it unreadable; what the report must hold is still checked.
    """
    return kind.model_validate({key: value for key, value in data.items() if key in kind.model_fields})


def read[R: StepReport](kind: type[R], plan: Plan, stage: StagePlan | str | None = None) -> R | None:
    """A step's report from the run directory (:func:`parse`), or None when the step has not written one."""
    data = storage.read_json(report_path(plan, kind.file_name, stage))
    return None if data is None else parse(kind, data)


class PlanReport(StepReport):
    """plan: the validated, resolved run (:class:`multislice.plan.Plan`)."""

    step: ClassVar[str] = "plan"
    file_name: ClassVar[str] = "plan.json"
    plan: Plan


class HbmUse(BaseModel):
    """XLA's ``CompiledMemoryStats`` of one AOT compile, bytes per chip.

    ``total`` = argument + output + temp + generated_code - alias (what sits in HBM);
    ``host_*`` is what host offloading keeps in host memory instead.
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    host_argument: int = 0
    host_output: int = 0
    host_alias: int = 0
    host_temp: int = 0
    host_generated_code: int = 0
    total: int


class PreflightTarget(BaseModel):
    """What a stage was compiled for: ``num_slices`` x ``tpu_type`` (``compile_topology`` in MaxText's names)."""

    tpu_type: str
    compile_topology: str
    num_slices: int
    chips: int


class CostEstimate(BaseModel):
    """Chip-hours and price of a stage's steps (:func:`.preflight.cost_estimate`).

    Attributes:
        basis: ``step_time``: at the stage's estimated step time (its report's ``step_time``; ``assumed_mfu`` is
            then that estimate's MFU); ``assumed_mfu``: no step-time estimate, so at the profile's
            ``cost.assumed_mfu`` of peak bf16 FLOP/s (reports written before ``basis`` are such).
        assumed_mfu: The model FLOPs utilisation the step seconds imply, 0-1.
    """

    basis: Literal["step_time", "assumed_mfu"] = "assumed_mfu"
    assumed_mfu: float
    peak_bf16_flops_per_chip: float
    estimated_step_seconds: float
    steps: int
    chips: int
    chip_hours: float
    price_per_chip_hour: float
    currency: str
    price_source: str
    estimated_cost: float


class StepTimeEstimate(BaseModel):
    """A stage's estimated step time from its AOT compile (:func:`multislice.preflight.step_time.estimate`).

    Seconds per step, per device (chip) figures. ``step_seconds`` = ``roofline_seconds`` / ``efficiency``;
    ``roofline_seconds`` is the largest of the four terms (``bound``), assuming collectives and HBM traffic
    overlap compute; ``no_overlap_seconds`` is their sum.
    """

    model_config = ConfigDict(extra="forbid")

    step_seconds: float
    roofline_seconds: float
    no_overlap_seconds: float
    compute_seconds: float
    hbm_seconds: float
    ici_seconds: float
    dcn_seconds: float
    bound: Literal["compute", "hbm", "ici", "dcn"]
    flops_per_device: float
    bytes_accessed_per_device: float
    ici_bytes_per_device: float
    dcn_bytes_per_device: float
    tokens_per_second_per_device: float | None = None
    mfu: float | None = None
    efficiency: float
    calibration: str
    peaks_source: str


class ElasticVerdict(BaseModel):
    """Preflight's verdict on one slice count of an elastic stage (:func:`multislice.preflight.check_elastic`).

    Attributes:
        slices: Slices of this count.
        gradient_accumulation_steps: MaxText micro-batches per step on it.
        global_batch_size: Sequences per step on it.
        verdict: ``fits``, ``does_not_fit``, ``error`` or ``not_runnable`` (the stage never trains on it).
        source: ``aot`` (compiled for this count), ``memory_model`` (the memory model's lower bound is over the
            usable HBM, so it was not compiled) or ``plan`` (not runnable).
        used_bytes_per_chip: HBM per chip it uses (fits) or needs (does not fit), bytes.
        headroom_bytes_per_chip: Usable HBM minus use, bytes (negative when it does not fit).
        compile_seconds: Seconds of the compile (or of the first one, when cached).
        cached: The verdict came from the cache.
        reason: Why not runnable, or the compiler's or memory model's words.
    """

    model_config = ConfigDict(extra="forbid")

    slices: int
    gradient_accumulation_steps: int = 1
    global_batch_size: float = 0
    verdict: Literal["fits", "does_not_fit", "error", "not_runnable"]
    source: Literal["aot", "memory_model", "plan"] = "aot"
    used_bytes_per_chip: int | None = None
    headroom_bytes_per_chip: int | None = None
    compile_seconds: float | None = None
    cached: bool = False
    reason: str | None = None


class PreflightReport(StepReport):
    """preflight: one stage's AOT-compile verdict (:func:`multislice.preflight.stage_report`).

    Attributes:
        verdict: ``fits``, ``does_not_fit``, ``error`` (MaxText rejected the config, or no verdict) or ``skipped``.
        hbm_bytes_per_chip: HBM XLA lets a program use per chip (the compiler's "available").
        bytes_per_chip: What the stage uses, when it fits.
        required_bytes_per_chip: What the compiler says it needs, when it does not fit.
        headroom_bytes_per_chip: ``hbm_bytes_per_chip`` minus use (negative when it does not fit).
        alternative: The planner's nearest fitting config when the stage does not fit (its ``as_dict``).
        elastic: An elastic stage's verdict on each smaller slice count it may shrink to (empty otherwise).
        step_time: The estimated step time, tokens/s/device and MFU from the compile, when it fits.
    """

    step: ClassVar[str] = "preflight"
    file_name: ClassVar[str] = "preflight.json"
    stage: str
    verdict: Literal["fits", "does_not_fit", "error", "skipped"]
    target: PreflightTarget | None = None
    units: str = "bytes per chip (GiB = 2**30 bytes; XLA's 'G')"
    hbm_bytes_per_chip: int | None = None
    bytes_per_chip: HbmUse | None = None
    required_bytes_per_chip: int | None = None
    headroom_bytes_per_chip: int | None = None
    compile_seconds: float | None = None
    cached: bool = False
    model_tflops_per_step_per_device: float | None = None
    tokens_per_step_per_device: float | None = None
    mesh: Any = None
    versions: dict[str, str] | None = None
    maxtext_args: list[str] = Field(default_factory=list)
    compiler_message: str | None = None
    error: str | None = None
    cost: CostEstimate | None = None
    step_time: StepTimeEstimate | None = None
    alternative: dict[str, Any] | None = None
    elastic: list[ElasticVerdict] = Field(default_factory=list)

    @property
    def used_bytes_per_chip(self) -> int | None:
        """HBM per chip the stage uses (fits) or needs (does not fit), bytes."""
        return self.bytes_per_chip.total if self.bytes_per_chip else self.required_bytes_per_chip


class ProvisionReport(StepReport):
    """provision: capacity and queueing objects for the run.

    Attributes:
        backend: ``local`` or ``gke``.
        node_pools: The TPU node pools, one per slice (GKE: created, adopted or checked).
        kueue_objects: Kueue objects applied (GKE) or rendered and validated but not applied (local).
        kueue_objects_left_to_admin: Cluster-scoped Kueue objects a cluster admin applies (GKE).
        kueue_manifest: Where the rendered Kueue objects were written in the run directory.
        crds: CRD name -> versions the cluster serves (GKE).
        capacity: What this machine offers the emulated slices (local).
        trainer_versions: Package -> version in the trainer environment (local).
        restart_strategy: How the run's TPU JobSets restart, ``InPlaceRestart`` or ``Recreate``, as provision found
            the cluster accepts (GKE, :mod:`multislice.backends.gke.in_place`); admit renders it. None: not checked.
        restart_strategy_note: Why that strategy and, for a fallback to Recreate, what to enable.
    """

    step: ClassVar[str] = "provision"
    file_name: ClassVar[str] = "provision.json"
    backend: str
    note: str = ""
    node_pools: list[dict[str, Any]] = Field(default_factory=list)
    kueue_objects: list[str] = Field(default_factory=list)
    kueue_objects_left_to_admin: list[str] = Field(default_factory=list)
    kueue_manifest: str | None = None
    crds: dict[str, list[str]] | None = None
    field_manager: str | None = None
    namespace: str | None = None
    capacity: dict[str, Any] | None = None
    trainer_env: str | None = None
    trainer_versions: dict[str, str] = Field(default_factory=dict)
    restart_strategy: str | None = None
    restart_strategy_note: str = ""


class AdmitReport(StepReport):
    """admit: the stage's workload created (or adopted) and admitted by Kueue; or skipped.

    Attributes:
        skipped: The stage's final checkpoint already existed (a rerun): nothing was created.
        adopted: A workload of this name and spec existed (a retried step) and was taken over.
        replaced: The pipeline run id of a finished workload of this name (an earlier run this one continues)
            that was deleted and created anew; None when there was none.
        flavors: Kueue ResourceFlavors assigned.
        wait_seconds: From submission to admission.
        workload: The Kueue Workload's name (GKE).
        manifest: Where the submitted manifest was written in the run directory.
        pipeline_run_id: The pipeline run that created (or adopted) the workload: what launch and train select it
            by when they are cancelled (''  in a report of an older release).
    """

    step: ClassVar[str] = "admit"
    file_name: ClassVar[str] = "admit.json"
    jobset: str
    skipped: bool = False
    reason: str = ""
    admitted: bool = False
    adopted: bool = False
    replaced: str | None = None
    pipeline_run_id: str = ""
    local_queue: str | None = None
    cluster_queue: str | None = None
    flavors: list[str] = Field(default_factory=list)
    wait_seconds: float = 0.0
    workload: str | None = None
    uid: str | None = None
    manifest: str | None = None
    note: str = ""


class PodPlacement(BaseModel):
    """Where one pod runs: its slice (child Job index), host (completion index), node and node pool."""

    slice: int
    host: int
    node: str | None = None
    node_pool: str | None = None
    pid: int | None = None


class LaunchReport(StepReport):
    """launch: every pod of every slice running, and where (pod name -> placement).

    Attributes:
        workload: The launched object's name (its JobSet, or RayJob); ``jobset`` is a read alias, and a report
            written with the old ``jobset`` key loads.
    """

    step: ClassVar[str] = "launch"
    file_name: ClassVar[str] = "launch.json"
    workload: str
    skipped: bool = False
    pods: int = 0
    startup_seconds: float = 0.0
    placement: dict[str, PodPlacement] = Field(default_factory=dict)
    node_pools: list[str] = Field(default_factory=list)
    note: str = ""

    @model_validator(mode="before")
    @classmethod
    def _old_jobset_key(cls, data: Any) -> Any:
        """A report written before ``workload`` named the launched object ``jobset``: read it as ``workload``."""
        return renamed_key(data, "jobset", "workload")

    @property
    def jobset(self) -> str:
        """The launched object's name: :attr:`workload`."""
        return self.workload


class TrainReport(StepReport):
    """train: what the stage's training did, from MaxText's per-step lines (:class:`multislice.metrics.TrainSummary`).

    Attributes:
        steps_trained: Distinct steps with metrics.
        restarts: JobSet restarts during training.
        restart_causes: Why each restart happened (the failed pod, its exit code and reason), in order.
        wall_seconds: From following the training to its end.
        step_time_seconds: Mean step time over steady steps.
        first_eval_loss: MaxText's eval loss (mean cross-entropy per target token, nats) at the first eval.
        final_eval_loss: ... at the last eval; ``final_eval_perplexity`` is its exp.
        evals: Evals logged (``eval_interval``); None when the stage has no eval.
        metrics_file: MaxText's per-step metrics records as JSON lines, in the run directory.
        leader_logs: What was followed: the leader's log of each attempt (files locally, pod names on GKE).
        goodput: Productive training time / total job time, 0-1, as Google's ml-goodput-measurement defines it
            (:mod:`multislice.goodput`): each step kept once, the first step of an attempt at the steady step time.
        steps_lost: Step records trained again after a restore.
        productive_seconds: The productive training time, seconds.
        job_seconds: The total job time, seconds: the train step's wall time plus the first attempt's start-up
            before it began following.
        badput_seconds: The rest of ``job_seconds`` by cause (:data:`multislice.goodput.CATEGORIES`: ``startup``,
            ``compile``, ``restore``, ``checkpoint_save``, ``lost_steps``, ``waiting``, ``other``), seconds.
        resizes: Elastic stages: each resize with its cause and cost (:class:`multislice.elastic.Resize`).
        slice_timeline: Elastic stages: slice count per step, as runs (:func:`multislice.elastic.slice_timeline`).
        global_batch_size: Elastic stages: sequences per step, the same on every slice count (gradient accumulation).
        launcher: What launched the stage: ``jobset`` or ``ray`` (restarts are then Ray Train's worker group retries).
        compiles: The leader's XLA compiles of a second or more and its loads from the cache, in order:
            ``attempt`` (0 first, 1 after the first restart...), ``function``, ``seconds`` (compiling, or
            loading from the run's persistent compilation cache) and ``cache_hit``
            (:func:`multislice.metrics.parse_compile_line`).
        restores: The checkpoint each attempt started from, in order (:func:`multislice.metrics.parse_restore_line`):
            ``attempt``, ``step`` (None: no checkpoint, a fresh start) and, with emergency checkpoints, ``tier``
            (``local``: the newest step was on a slice's checkpoint ramdisk; ``persistent``: read from the
            stage's checkpoint directory) and ``slice`` (the replica that held the local one).
        data_reread: Stages on streamed data (``hf``, which keeps no position in the checkpoint): for each attempt
            that restored a checkpoint, how many of its steps trained again on data already trained on, as the
            stream started again from its start (:func:`multislice.steps.train.data_reread`): ``attempt``,
            ``restored_step``, ``steps``.
    """

    step: ClassVar[str] = "train"
    file_name: ClassVar[str] = "train.json"
    jobset: str
    launcher: str = "jobset"
    skipped: bool = False
    compiles: list[dict[str, Any]] = Field(default_factory=list)
    restores: list[dict[str, Any]] = Field(default_factory=list)
    data_reread: list[dict[str, Any]] = Field(default_factory=list)
    steps_trained: int | None = None
    restarts: int | None = None
    restart_causes: list[str] = Field(default_factory=list)
    wall_seconds: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    first_eval_loss: float | None = None
    final_eval_loss: float | None = None
    final_eval_perplexity: float | None = None
    evals: int | None = None
    step_time_seconds: float | None = None
    tokens_per_second_per_device: float | None = None
    tflops_per_second_per_device: float | None = None
    records: int | None = None
    metrics_file: str | None = None
    leader_logs: list[str] = Field(default_factory=list)
    goodput: float | None = None
    steps_lost: int | None = None
    productive_seconds: float | None = None
    job_seconds: float | None = None
    badput_seconds: dict[str, float] = Field(default_factory=dict)
    resizes: list[Resize] = Field(default_factory=list)
    slice_timeline: list[dict[str, int]] = Field(default_factory=list)
    global_batch_size: float | None = None


class PrepareDataReport(StepReport):
    """prepare_data: the stage's tokenized shards (:mod:`multislice.trainer.prepare_data`).

    Attributes:
        skipped: The stage's data needs no preparation (not ``text``).
        uri: The shards' directory (local or ``gs://``).
        reused: The shards of an earlier preparation were reused (same sources and tokenizer).
        seconds: Wall time of the step's work.
        manifest: The shards' manifest (source files and SHA-256, tokenizer, token and shard counts).
    """

    step: ClassVar[str] = "prepare_data"
    file_name: ClassVar[str] = "prepare_data.json"
    skipped: bool = False
    uri: str | None = None
    reused: bool | None = None
    seconds: float | None = None
    manifest: dict[str, Any] = Field(default_factory=dict)


class Check(BaseModel):
    """One check of the checkpoint verifier.

    Attributes:
        skipped: The check could not run on this checkpoint (``checksums`` of a checkpoint with no digest record and no
            ledger: one from elsewhere); it does not fail the verdict, and is shown as SKIPPED, never PASS.
    """

    name: str
    passed: bool
    detail: str
    skipped: bool = False

    @model_validator(mode="before")
    @classmethod
    def _skipped_by_detail(cls, data: Any) -> Any:
        """A check whose detail says ``skipped: ...`` is skipped: a trainer image built before ``skipped`` was
        written for ``loss_replay`` (``multislice/trainer/verify.py``) reported it as passed with that detail."""
        if isinstance(data, dict) and str(data.get("detail", "")).startswith("skipped:") and "skipped" not in data:
            return {**data, "skipped": True}
        return data

    @property
    def result(self) -> str:
        """``PASS``, ``FAIL`` or ``SKIPPED``, as the CLI, the step's log and its Markdown page show the check."""
        return "SKIPPED" if self.skipped else "PASS" if self.passed else "FAIL"


class VerificationReport(StepReport):
    """verify_checkpoint: the checkpoint verifier's report (``multislice/trainer/verify.py``).

    Written by the trainer image, read here: fields it adds later are ignored, not refused.

    Attributes:
        verdict: ``PASS``, ``FAIL`` or ``ERROR`` (the verifier could not run; ``error`` says why).
        written_mesh: Mesh axis -> size the checkpoint's arrays were sharded over when written.
        state_step: The TrainState step recorded in the final checkpoint (its directory's step + 1).
        array_check: What the finiteness check restored: ``mode`` (``all`` or ``sample``),
            ``checkpoint_bytes``, ``full_check_bytes``, ``arrays``, ``restored``.
        loss_replay: The functional check: ``checkpoint_step``, ``logged_step``, ``logged_loss``,
            ``computed_loss``, ``tolerance`` (absolute), ``source`` (TensorBoard or metrics.jsonl).
        final_loss: The final checkpoint's loss against the logged curve: ``expected_loss``,
            ``computed_loss``, ``tolerance``.
        job: The verifier's Job (GKE).
    """

    model_config = ConfigDict(extra="ignore")
    step: ClassVar[str] = "verify_checkpoint"
    file_name: ClassVar[str] = "verification.json"
    verdict: Literal["PASS", "FAIL", "ERROR"]
    checks: list[Check] = Field(default_factory=list)
    checkpoint_dir: str | None = None
    expected_step: int | None = None
    all_steps: list[int] = Field(default_factory=list)
    latest_step: int | None = None
    parameter_count: int | None = None
    expected_parameter_count: int | None = None
    written_mesh: dict[str, int] | str | None = None
    state_step: int | None = None
    array_check: dict[str, Any] | None = None
    loss_replay: dict[str, Any] | None = None
    final_loss: dict[str, Any] | None = None
    seconds: float | None = None
    error: str | None = None
    job: str | None = None

    @property
    def failed_checks(self) -> list[Check]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c.passed]


class ExportReport(StepReport):
    """export: the exporter's report (``multislice/trainer/export.py``), written by the trainer image.

    Attributes:
        verdict: ``PASS`` (written, and its logits matched MaxText's), ``FAIL`` (they did not) or ``ERROR``
            (the export could not be made; ``error`` says why).
        export_dir: Where the export is (local path or ``gs://``).
        checkpoint_step: The checkpoint step exported.
        parameter_count: Parameters written.
        files: The export directory's files.
        logits_check: ``passed`` (every loader passed), ``max_abs_diff``, ``max_abs_logit``, ``argmax_agree``,
            ``atol``, ``rtol``, ``detail`` (transformers 5's comparison), ``positions``, ``sample_fraction`` and
            ``loaders``: each loader's comparison (``transformers5``, ``transformers4``) with its
            ``transformers_version``.
        dtype: The exported weights' dtype (``bfloat16`` or ``float32``).
        shards: Safetensors shards written (the conversion's layer groups).
        memory: Peak RSS of the conversion and of the check, and the largest group's bytes.
        hub: The Hugging Face Hub repository and commit, when uploaded.
        job: The export Job that ran it (GKE), or None.
    """

    model_config = ConfigDict(extra="ignore")
    step: ClassVar[str] = "export"
    file_name: ClassVar[str] = "export.json"
    verdict: Literal["PASS", "FAIL", "ERROR"]
    format: str = "huggingface"
    export_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_step: int | None = None
    parameter_count: int | None = None
    architecture: str | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    tokenizer_vocab_size: int | None = None
    scan_layers: bool | None = None
    files: list[str] = Field(default_factory=list)
    logits_check: dict[str, Any] | None = None
    dtype: str | None = None
    max_position_embeddings: int | None = None
    shards: int | None = None
    memory: dict[str, Any] | None = None
    hub: dict[str, Any] | None = None
    seconds: float | None = None
    error: str | None = None
    job: str | None = None


class CleanupReport(StepReport):
    """cleanup (exit handler): what was deleted and kept, and the notification sent.

    Attributes:
        deleted: Objects deleted (workloads not completed, and their Jobs).
        kept: Completed workloads, left alone.
        error: Why nothing could be deleted (e.g. the cluster could not be reached).
        notified: True when the webhook took the post, else its error; None when no webhook is set.
        failed_step: The step that failed, when the run failed.
    """

    step: ClassVar[str] = "cleanup"
    file_name: ClassVar[str] = "cleanup.json"
    pipeline_status: str = ""
    deleted: list[str] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list)
    error: str | None = None
    notified: bool | str | None = None
    failed_step: str | None = None


def data_fingerprint(plan: Plan, stage: StagePlan) -> str | None:
    """The fingerprint of the data the stage trained on, or None when there is none to give.

    A ``text`` stage's prepare_data report carries its shards' manifest, whose ``fingerprint`` is the SHA-256 over
    the recipe (tokenizer, sequence length, packing) and every source file's path and SHA-256
    (:func:`multislice.trainer.prepare_data.fingerprint`). The plan cannot know it: the sources are hashed when the
    data is prepared, after plan. Other data kinds (synthetic, ``hf``, ``grain``) have no manifest: None.
    """
    prepared = read(PrepareDataReport, plan, stage)
    fingerprint = prepared.manifest.get("fingerprint") if prepared else None
    return str(fingerprint) if fingerprint else None


def model_card(plan: Plan, stage: StagePlan) -> dict[str, Any]:
    """The model card's facts for the exporter (:func:`multislice.trainer.export.command`'s ``card``): the run, the
    stage, its data fingerprint (:func:`data_fingerprint`; None when it has none), the stage's training steps and
    the final train and eval losses from the stage's train report in the run directory (left out when it has none,
    e.g. before training)."""
    trained = read(TrainReport, plan, stage)
    return {
        "run": plan.spec.run_name,
        "stage": stage.name,
        "data_fingerprint": data_fingerprint(plan, stage),
        "steps": stage.steps,
        "train_loss": trained.final_loss if trained else None,
        "eval_loss": getattr(trained, "final_eval_loss", None) if trained else None,
    }
