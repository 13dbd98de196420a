"""The multislice training pipeline: config to trained and verified model.

Graph, for a profile with stages S1..Sn::

    exit handler: cleanup
    ├── plan (one task per stage, all before anything is created)
    ├── prepare_data (one task per stage: raw text -> ArrayRecord shards, a Dataset artifact; reused when unchanged)
    ├── preflight (one task per stage: AOT compile for the TPU topology; fails before provision if HBM is short)
    ├── provision
    └── S1: admit -> launch -> train -> verify_checkpoint
        -> S2: admit -> ... (a stage starts only after the previous one's checkpoint verified)

The pipeline is built per profile (:func:`build_pipeline`): the profile fixes
the stages and their model and parallelism; every field a user changes per
run is a named pipeline parameter whose default is the profile's value
(:mod:`multislice.config.parameters`): ``run_name``, ``backend``, ``tpu_type``,
``num_slices``, ``output_dir``, ``trainer_image``, ``namespace``, ``queue``,
``priority``, ``max_restarts``, ``skip_preflight`` and ``stage<N>_steps``,
``stage<N>_per_device_batch_size``. The plan tasks validate them with the same
code as the CLI's ``--set``.

Caching is off for every task: a cached train or admit would report work
that did not happen in this run.
"""

import inspect
from typing import Any

from kfp import compiler, dsl

from components import DEFAULT_BASE_IMAGE
from components import admit as admit_component
from components import cleanup as cleanup_component
from components import launch as launch_component
from components import plan as plan_component
from components import preflight as preflight_component
from components import prepare_data as prepare_data_component
from components import provision as provision_component
from components import train as train_component
from components import verify_checkpoint as verify_component
from multislice import config
from multislice.config import parameters
from multislice.delivery import targets

PIPELINE_NAME = "multislice-training"


def pipeline_parameters(spec: config.RunSpec) -> list[inspect.Parameter]:
    """The pipeline's parameters, with types and the profile's values as defaults."""
    return [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=value, annotation=kind)
        for name, (kind, value) in parameters.parameter_values(spec).items()
    ]


def build_pipeline(
    profile: dict[str, Any], base_image: str | None = None, kubernetes: targets.KubernetesConfig | None = None
):
    """Build the pipeline for a profile's content.

    Args:
        profile: The profile (``configs/<name>.yaml`` content); validated here.
        base_image: Image the components run in; default the profile's ``images.pipeline``.
        kubernetes: kfp-kubernetes platform config put on every task (``kfp``
            target); None for none (``vertex`` target).

    Returns:
        A KFP pipeline (GraphComponent): call it under ``kfp.local`` or compile it.

    Raises:
        multislice.config.ConfigError: the profile is invalid.
    """
    spec = config.load_spec(profile)
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
    run_names = [p.name for p in parameters.RUN_PARAMETERS]
    signature = inspect.Signature(pipeline_parameters(spec))

    def body(*args, **kwargs):
        values = dict(zip(signature.parameters, args, strict=False)) | kwargs
        run_values = {name: values[name] for name in run_names}
        exit_task = cleanup_op(
            backend=values["backend"],
            output_dir=values["output_dir"],
            run_name=values["run_name"],
            pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            namespace=values["namespace"],
            cluster=profile_data["cluster"],
            unique_run_name=values["unique_run_name"],
            notify_webhook_url=values["notify_webhook_url"],
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
                ).set_display_name(f"plan {stage.name}")
                plans.append(task)
            prepared = [
                prepare_op(plan=plan_task.output, stage=stage.name).set_display_name(f"prepare_data {stage.name}")
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
            previous = provision_op(plan=plans[0].output).set_display_name("provision").after(*checks)
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
                    plan=plan_task.output, stage=stage.name, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER
                ).after(train)
                for step, task in (("admit", admit), ("launch", launch), ("train", train), ("verify", verify)):
                    task.set_display_name(f"{step} {stage.name}")
                tasks += [admit, launch, train, verify]
                previous = verify
            for task in [*plans, *tasks]:
                task.set_caching_options(False)
            if kubernetes is not None:
                for task in [exit_task, *plans, *tasks]:
                    kubernetes.apply(task, task.component_spec.name.replace("-", "_"), spec)

    body.__signature__ = signature
    body.__annotations__ = {p.name: p.annotation for p in body.__signature__.parameters.values()}
    body.__name__ = PIPELINE_NAME.replace("-", "_")
    stage_list = ", ".join(s.name for s in spec.stages)
    body.__doc__ = (
        f"Multislice training on {spec.num_slices} x {spec.tpu_type} (backend {spec.backend}): "
        f"stages {stage_list}; each trained with MaxText and its checkpoint verified."
    )
    return dsl.pipeline(name=PIPELINE_NAME, description=body.__doc__)(body)


def compile_pipeline(
    profile: dict[str, Any],
    output: str,
    base_image: str | None = None,
    target: str = "kfp",
    kubernetes: targets.KubernetesConfig | None = None,
) -> str:
    """Compile the profile's pipeline to a YAML file at ``output`` for a target (:mod:`multislice.delivery.targets`).

    ``kfp``: the PipelineSpec plus the kfp-kubernetes platform config
    (``kubernetes``, default :class:`multislice.delivery.targets.KubernetesConfig()`), two
    YAML documents. ``vertex``: the PipelineSpec alone, one document.
    Returns the path.

    Raises:
        multislice.config.ConfigError: invalid profile or unknown target.
    """
    targets.check_target(target)
    platform = None if target == "vertex" else (kubernetes or targets.KubernetesConfig())
    compiler.Compiler().compile(build_pipeline(profile, base_image, platform), output)
    return output
