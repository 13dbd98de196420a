"""``multislice compile``: the profile's pipeline compiled to YAML for KFP or Vertex AI Pipelines."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from multislice import config
from multislice.cli.common import check_output, profile_and_overrides, with_profile
from multislice.delivery import images
from multislice.delivery.targets import KubernetesConfig
from multislice.errors import InputError

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "compile": "multislice compile --profile gke-v6e-16x2 --output build/pipelines/gke-v6e-16x2.yaml\n"
    "multislice compile --profile gke-v6e-16x2 --target vertex --output build/pipelines/gke.vertex.yaml",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice compile`` with its handler (``argv``: the command line)."""
    comp = sub.add_parser("compile", help="compile the profile's pipeline to YAML")
    with_profile(comp)
    comp.add_argument("--output", required=True, help="YAML file to write")
    comp.add_argument("--base-image", help="image of the pipeline components (default: the profile's images.pipeline)")
    comp.add_argument(
        "--target",
        choices=["kfp", "vertex"],
        default="kfp",
        help="kfp: with kfp-kubernetes platform config (2 YAML documents); vertex: one document",
    )
    comp.add_argument(
        "--node-selector",
        action="append",
        metavar="KEY=VALUE",
        help="kfp target: node label the component pods must match (repeatable)",
    )
    comp.add_argument(
        "--images",
        default="build/images",
        metavar="DIR",
        help="where `multislice images build` / `make images PUSH=1` wrote <image>.json: pushed images are "
        "compiled in by digest (default build/images; ignored when absent)",
    )
    comp.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile the profile's pipeline to YAML (overrides become the parameters' defaults)."""
    from pipelines.multislice_training import compile_pipeline  # kfp (2-5 s): only for the verbs that compile

    check_output("--output", args.output, directory=False, suffixes=(".yaml", ".yml"))
    if args.base_image is not None and (problem := config.values.image_problem(args.base_image)):
        raise InputError(f"--base-image: {problem}", "give an image reference, or leave --base-image out")
    selector = _node_selector(args.node_selector) if args.node_selector else None  # refused before any warning
    profile, overrides = profile_and_overrides(args)
    built = images.built_references(args.images)
    if "trainer" in built and not any(k in overrides for k in ("trainer_image", "images.trainer")):
        overrides["images.trainer"] = built["trainer"]
        print(f"trainer image (by digest, from {args.images}): {built['trainer']}")
    if "pipeline" in built and not args.base_image:
        args.base_image = built["pipeline"]
        print(f"pipeline image (by digest, from {args.images}): {built['pipeline']}")
    spec = config.load_spec(profile, overrides)
    data = config.spec_to_data(spec)
    _warn_unbuilt(args, spec)
    kubernetes = KubernetesConfig(node_selector=selector) if selector is not None else None
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    compile_pipeline(data, args.output, args.base_image, target=args.target, kubernetes=kubernetes)
    print(f"pipeline for profile {args.profile} compiled for {args.target} to {args.output}")
    return 0


def _warn_unbuilt(args: argparse.Namespace, spec: config.RunSpec) -> None:
    """Say on stderr which image the compiled pipeline references that no cluster can pull as this project's
    (:func:`multislice.delivery.images.unpublished_problem`), with the fix. A warning, not a refusal: compiling
    offline, before the images are built, keeps working."""
    for what, reference, option in (
        ("pipeline", args.base_image or spec.images.pipeline, "--base-image REF (or --set images.pipeline=REF)"),
        ("trainer", spec.images.trainer, "--set images.trainer=REF"),
        *(
            [
                (
                    "in-place restart agent",
                    spec.images.in_place_restart_agent,
                    "--set images.in_place_restart_agent=REF (built from kubernetes-sigs/jobset v0.12.0, "
                    "cmd/in-place-restart-agent/Dockerfile; docs/gke-setup.md), or --set restart_strategy=recreate",
                )
            ]
            if spec.backend == "gke" and spec.restart_strategy != "recreate"
            else []
        ),
    ):
        if problem := images.unpublished_problem(reference):
            print(
                f"warning: the compiled pipeline's {what} image {problem}: no `multislice images build` recorded a "
                f"pushed {what} image in {args.images}; build and push the images "
                "(`make images PUSH=1 IMAGE_REPO=REGISTRY/PATH`, or `make images-cloud PROJECT=... REPO=...`) and "
                "compile again, or name a pushed image with "
                f"{option}",
                file=sys.stderr,
            )


def _node_selector(pairs: list[str]) -> dict[str, str]:
    """``--node-selector KEY=VALUE`` pairs as a node selector: Kubernetes label keys and values, as written.

    Raises:
        ConfigError: a pair without ``=``, or a key or value that is not a valid label key or value.
    """
    selector: dict[str, str] = {}
    issues = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        problem = (
            f"{pair!r} is not KEY=VALUE" if not sep else config.values.label_key_problem(key)
        ) or config.values.label_value_problem(value)
        if problem:
            issues.append(("--node-selector", f"{problem}; e.g. --node-selector cloud.google.com/gke-nodepool=cpu"))
        selector[key] = value
    if issues:
        raise config.ConfigError(issues)
    return selector
