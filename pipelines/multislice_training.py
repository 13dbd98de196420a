"""The multislice training pipeline: config to trained and verified model.

Graph, for a profile with stages S1..Sn::

    exit handler: cleanup
    ├── plan (one task per stage, all before anything is created)
    ├── prepare_data (one task per stage: raw text -> ArrayRecord shards, a Dataset artifact; reused when unchanged)
    ├── preflight (one task per stage: AOT compile for the TPU topology; fails before provision if HBM is short)
    ├── provision
    └── S1: admit -> launch -> train -> verify_checkpoint [-> export]
        -> S2: admit -> ... (a stage starts only after the previous one's checkpoint verified)

Lineage: train outputs the stage's final checkpoint as a ``Model`` artifact (``model``), which
verify_checkpoint and export take as input; export outputs the Hugging Face export as a second
``Model`` (``hf_model``), for a stage whose ``export`` is set (:mod:`multislice.delivery.lineage`).

The pipeline is built per profile (:func:`build_pipeline`): the profile fixes
the stages and their model and parallelism; every field a user changes per
run is a named pipeline parameter whose default is the profile's value
(:mod:`multislice.config.parameters`): ``run_name``, ``backend``, ``tpu_type``,
``machine_type``, ``num_slices``, ``output_dir``, ``trainer_image``, ``namespace``, ``queue``,
``priority``, ``max_restarts``, ``skip_preflight`` and ``stage<N>_steps``,
``stage<N>_per_device_batch_size``, and where the run goes: ``cluster_project``,
``cluster_location``, ``cluster_name``, ``cluster_access``, ``zone``,
``pipeline_service_account``, ``trainer_service_account``, so one compiled YAML
serves any cluster. The plan tasks validate them with the same code as the
CLI's ``--set``; every parameter carries its description from the parameter
table (kfp reads it from the pipeline function's docstring ``Args:``).

A pipeline compiled for a remote target (KFP, Vertex AI; ``remote=True``)
does not offer ``backend`` (the profile's value is kept: ``local`` cannot
work there), and ``output_dir`` has no default there: the run form asks for
the bucket, since no default could be right for every deployment and a
placeholder (``gs://your-bucket/...``) fails only after the run started.
The plan tasks carry the compiling release (:mod:`multislice.release`) and
refuse to run in an image of another.

Reruns: ``unique_run_name`` defaults to true in the compiled pipeline
(:data:`COMPILED_DEFAULTS`), so a second run with the defaults is a new run
with its own directory and JobSets. To continue an earlier run (resume from
its checkpoints), set ``unique_run_name=false`` and ``run_name`` to that run's
full name (``multislice submit --continue RUN`` does): its admit steps replace
the JobSets the earlier run left finished.

Retries: the steps that are idempotent against the cluster get a task retry
policy (:data:`RETRIED_STEPS`, :data:`RETRY`; kfp ``PipelineTask.set_retry``,
kept in the PipelineSpec, so KFP and Vertex AI both honour it): prepare_data
adopts its shard workers' Indexed Job by spec hash (a retried worker reuses the
parts it finished) and reuses shards whose manifest has the same fingerprint,
preflight adopts its compile Jobs by spec hash and reads verdicts from the
verdict cache (a model that does not fit fails again in seconds, after the
backoff), provision applies what exists already, admit adopts its JobSet by
spec hash, launch and train re-attach to the running JobSet, verify_checkpoint
reads. What they retry: a CPU Job's pod that found no node in time, an API or
node blip, a lost component pod. plan is not retried: its failures (a bad
value) are the same on every try. The exit handler is not retried. ``multislice
run`` (kfp.local, which also honours the policy) compiles without it: a local
failure is reported at once.

Caching is off for every task: a cached train or admit would report work
that did not happen in this run.
"""

import inspect
from typing import Any

from kfp import compiler, dsl

from components import DEFAULT_BASE_IMAGE
from components import admit as admit_component
from components import cleanup as cleanup_component
from components import export as export_component
from components import launch as launch_component
from components import plan as plan_component
from components import preflight as preflight_component
from components import prepare_data as prepare_data_component
from components import provision as provision_component
from components import train as train_component
from components import verify_checkpoint as verify_component
from multislice import config, release
from multislice.config import parameters
from multislice.delivery import targets

PIPELINE_NAME = "multislice-training"
#: Steps (component names) that get the task retry policy: idempotent against the cluster.
RETRIED_STEPS = ("prepare-data", "preflight", "provision", "admit", "launch", "train", "verify-checkpoint")
#: ``set_retry`` arguments: 2 retries, 60 s then 120 s apart (a node or API blip, a lost component pod).
RETRY: dict[str, Any] = {"num_retries": 2, "backoff_duration": "60s", "backoff_factor": 2.0,
                         "backoff_max_duration": "600s"}  # fmt: skip


#: Defaults of the compiled pipeline that are not the profile's: a run started from the UI or an API with the
#: defaults is a new run (``<run_name>-<8 characters of its run id>``), never a second writer of an earlier one;
#: continuing a run is the explicit ``unique_run_name=false`` with ``run_name`` the earlier run's full name.
COMPILED_DEFAULTS: dict[str, Any] = {"unique_run_name": True}


#: Parameters a remote pipeline's run form must be given (no default): see the module's docstring.
REQUIRED_REMOTE = ("output_dir",)


def pipeline_parameters(spec: config.RunSpec, remote: bool = False) -> list[inspect.Parameter]:
    """The pipeline's parameters, with types and the profile's values as defaults (none for
    :data:`REQUIRED_REMOTE` when ``remote``); required ones first, as Python needs."""
    found = [
        inspect.Parameter(
            name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty
            if remote and name in REQUIRED_REMOTE
            else COMPILED_DEFAULTS.get(name, value),
            annotation=kind,
        )
        for name, (kind, value) in parameters.parameter_values(spec, remote).items()
    ]
    return sorted(found, key=lambda p: p.default is not inspect.Parameter.empty)


def _docstring(spec: config.RunSpec, remote: bool) -> str:
    """The pipeline function's docstring: a summary, then ``Args:`` with each parameter's description."""
    stage_list = ", ".join(s.name for s in spec.stages)
    summary = (
        f"Multislice training on {spec.num_slices} x {spec.tpu_type} (backend {spec.backend}): "
        f"stages {stage_list}; each trained with MaxText and its checkpoint verified."
    )
    args = "\n".join(f"    {name}: {text.rstrip('.')}." for name, text in parameters.descriptions(spec, remote).items())
    return f"{summary}\n\nArgs:\n{args}\n"


def build_pipeline(
    profile: dict[str, Any],
    base_image: str | None = None,
    kubernetes: targets.KubernetesConfig | None = None,
    remote: bool = False,
    retries: bool = True,
):
    """Build the pipeline for a profile's content.

    Args:
        profile: The profile (``configs/<name>.yaml`` content); validated here.
        base_image: Image the components run in; default the profile's ``images.pipeline``.
        kubernetes: kfp-kubernetes platform config put on every task (``kfp``
            target); None for none (``vertex`` target).
        remote: For KFP or Vertex AI (not ``multislice run``'s kfp.local): no ``backend``
            parameter, ``output_dir`` required, the compiling release checked by the plan tasks.
        retries: Give :data:`RETRIED_STEPS` the task retry policy :data:`RETRY` (False: none, for kfp.local).

    Returns:
        A KFP pipeline (GraphComponent): call it under ``kfp.local`` or compile it.

    Raises:
        multislice.config.ConfigError: the profile is invalid, ``base_image`` is given but is not a container
            image reference (``''`` included: it is not the default), or (``remote``) its ``run_name`` is too long
            for the runs the compiled defaults start (``unique_run_name`` true appends each run's id).
    """
    if base_image is not None and (problem := config.values.image_problem(base_image)):
        raise config.ConfigError([("base_image", f"{problem}; or leave base_image unset for images.pipeline")])
    spec = config.load_spec(profile)
    if remote and COMPILED_DEFAULTS["unique_run_name"] and not spec.unique_run_name:
        config.load_spec(profile, {"unique_run_name": True})  # each run with the defaults gets the suffix
    profile_data = config.spec_to_data(spec)
    image = base_image or spec.images.pipeline or DEFAULT_BASE_IMAGE
    plan_op = plan_component.component(image)
    preflight_op = preflight_component.component(image)
    prepare_op = prepare_data_component.component(image)
    provision_op = provision_component.component(image)
    admit_op = admit_component.component(image)
    launch_op = launch_component.component(image)
    train_op = train_component.component(image)
    verify_op = verify_component.component(image)
    cleanup_op = cleanup_component.component(image)
    export_op = export_component.component(image)
    run_names = [p.name for p in parameters.RUN_PARAMETERS]
    signature = inspect.Signature(pipeline_parameters(spec, remote))
    fixed = {"backend": spec.backend}  # what a remote pipeline does not offer keeps the profile's value
    compiled_release = release.current() if remote else {}

    def body(*args, **kwargs):
        values = fixed | dict(zip(signature.parameters, args, strict=False)) | kwargs
        run_values = {name: values[name] for name in run_names}
        exit_task = cleanup_op(
            backend=values["backend"],
            output_dir=values["output_dir"],
            run_name=values["run_name"],
            pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            namespace=values["namespace"],
            cluster=profile_data["cluster"],
            cluster_project=values["cluster_project"],
            cluster_location=values["cluster_location"],
            cluster_name=values["cluster_name"],
            cluster_access=values["cluster_access"],
            unique_run_name=values["unique_run_name"],
            notify_webhook_secret=values["notify_webhook_secret"],
        ).set_display_name("cleanup")
        exit_task.set_caching_options(False)
        with dsl.ExitHandler(exit_task, name="stages"):
            plans = []
            for index, stage in enumerate(spec.stages):
                task = plan_op(
                    profile=profile_data,
                    stage=stage.name,
                    **run_values,
                    pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    steps=values[parameters.stage_parameter_name(index, "steps")],
                    per_device_batch_size=values[parameters.stage_parameter_name(index, "per_device_batch_size")],
                    release=compiled_release,
                ).set_display_name(f"plan {stage.name}")
                plans.append(task)
            prepared = [
                prepare_op(
                    plan=plan_task.output, stage=stage.name, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER
                ).set_display_name(f"prepare_data {stage.name}")
                for stage, plan_task in zip(spec.stages, plans, strict=True)
            ]
            for earlier, later in zip(prepared, prepared[1:], strict=False):
                later.after(earlier)  # stages with the same recipe share one shard directory: one writer at a time
            checks = [
                preflight_op(plan=plan_task.output, stage=stage.name, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
                .set_display_name(f"preflight {stage.name}")
                .after(prepare)
                for stage, plan_task, prepare in zip(spec.stages, plans, prepared, strict=True)
            ]
            previous = (
                provision_op(plan=plans[0].output, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
                .set_display_name("provision")
                .after(*checks)
            )
            tasks = [*prepared, *checks, previous]
            for stage, plan_task, prepare in zip(spec.stages, plans, prepared, strict=True):
                admit = admit_op(
                    plan=plan_task.output, stage=stage.name, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER
                ).after(previous)
                launch = launch_op(plan=plan_task.output, stage=stage.name, admitted=admit.output)
                train = train_op(
                    plan=plan_task.output, stage=stage.name, admitted=admit.output, dataset=prepare.outputs["dataset"]
                ).after(launch)
                verify = verify_op(
                    plan=plan_task.output,
                    stage=stage.name,
                    pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    model=train.outputs["model"],
                )
                steps = [("admit", admit), ("launch", launch), ("train", train), ("verify", verify)]
                if stage.export:
                    exported = export_op(
                        plan=plan_task.output,
                        stage=stage.name,
                        pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                        model=train.outputs["model"],
                    ).after(verify)
                    steps.append(("export", exported))
                for step, task in steps:
                    task.set_display_name(f"{step} {stage.name}")
                tasks += [task for _, task in steps]
                previous = verify
            for task in [*plans, *tasks]:
                task.set_caching_options(False)
                if retries and task.component_spec.name in RETRIED_STEPS:
                    task.set_retry(**RETRY)
            if kubernetes is not None:
                for task in [exit_task, *plans, *tasks]:
                    kubernetes.apply(task, task.component_spec.name.replace("-", "_"), spec)
                kubernetes.mount_webhook_secret(exit_task)
                for plan_task in plans:  # the stages' Hub tokens, as their training pods get them: hf:// listing
                    kubernetes.mount_hub_tokens(plan_task, spec)

    body.__signature__ = signature
    body.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    body.__name__ = PIPELINE_NAME.replace("-", "_")
    body.__doc__ = _docstring(spec, remote)
    return dsl.pipeline(name=PIPELINE_NAME, description=body.__doc__.split("\n\n")[0])(body)


def compile_pipeline(
    profile: dict[str, Any],
    output: str,
    base_image: str | None = None,
    target: str = "kfp",
    kubernetes: targets.KubernetesConfig | None = None,
    remote: bool = True,
    retries: bool = True,
) -> str:
    """Compile the profile's pipeline to a YAML file at ``output`` for a target (:mod:`multislice.delivery.targets`).

    ``remote`` (default): for the target's server, see :func:`build_pipeline`; ``multislice run``
    compiles with ``remote=False`` for kfp.local on this machine.

    ``kfp``: the PipelineSpec plus the kfp-kubernetes platform config
    (``kubernetes``, default :class:`multislice.delivery.targets.KubernetesConfig()`), two
    YAML documents. ``vertex``: the PipelineSpec alone, one document.
    ``retries``: the task retry policy of :func:`build_pipeline` (off for kfp.local runs).
    Returns the path.

    Raises:
        multislice.config.ConfigError: invalid profile or unknown target.
    """
    targets.check_target(target)
    platform = None if target == "vertex" else (kubernetes or targets.KubernetesConfig())
    compiler.Compiler().compile(build_pipeline(profile, base_image, platform, remote, retries), output)
    return output
