"""``multislice images build``: build and push the pipeline and trainer images with Cloud Build."""

from __future__ import annotations

import argparse
from typing import Any

from multislice.delivery import images
from multislice.errors import InputError

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "images": "multislice images build --cloud-build --project my-project "
    "--repo us-east5-docker.pkg.dev/my-project/multislice\n"
    "multislice images build --cloud-build --project my-project --repo us-east5-docker.pkg.dev/my-project/multislice "
    "--service-account builder@my-project.iam.gserviceaccount.com --logging CLOUD_LOGGING_ONLY",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice images`` with its handler (``argv``: the command line)."""
    imgs = sub.add_parser("images", help="build and push the pipeline and trainer images (Cloud Build: no Docker)")
    imgs.add_argument("action", choices=["build"])
    imgs.add_argument("--cloud-build", action="store_true", help="build with Cloud Build (the repository as source)")
    imgs.add_argument("--project", required=True, help="Google Cloud project that runs the build")
    imgs.add_argument(
        "--repo", required=True, help="Artifact Registry repository: LOCATION-docker.pkg.dev/PROJECT/REPO"
    )
    imgs.add_argument("--tag", help="image tag (default <package version>-<commit>)")
    imgs.add_argument(
        "--source-bucket",
        help="bucket for the source tarball, created when missing (default <project>_cloudbuild, as gcloud; "
        "refused when another project owns it)",
    )
    imgs.add_argument(
        "--source-bucket-location",
        help="location of a source bucket created here (default Cloud Storage's, the US multi-region, as gcloud)",
    )
    imgs.add_argument(
        "--service-account",
        help="service account the build runs as (Build.serviceAccount): NAME@PROJECT.iam.gserviceaccount.com or "
        "projects/PROJECT/serviceAccounts/EMAIL; needs --logging CLOUD_LOGGING_ONLY or NONE, or --logs-bucket",
    )
    imgs.add_argument(
        "--logging",
        type=str.upper,
        choices=images.LOGGING_MODES,
        help="where Cloud Build keeps the build log (BuildOptions.logging; default Cloud Build's, LEGACY)",
    )
    imgs.add_argument(
        "--logs-bucket", help="gs://BUCKET[/PREFIX] for the build log (Build.logsBucket), a bucket you created"
    )
    imgs.add_argument("--output", default="build/images", help="where <image>.json go (default build/images)")
    imgs.set_defaults(func=cmd_images)


def cmd_images(args: argparse.Namespace) -> int:
    """Build and push both images with Cloud Build (no Docker engine), writing build/images/<image>.json."""
    if not args.cloud_build:
        raise InputError(
            "multislice images build needs --cloud-build (the only builder it drives)",
            "run `multislice images build --cloud-build --project P --repo LOCATION-docker.pkg.dev/P/REPO`, "
            "or `make images` with a local Docker engine",
        )
    built = images.cloud_build(
        args.project,
        args.repo,
        tag=args.tag,
        bucket=args.source_bucket,
        bucket_location=args.source_bucket_location,
        service_account=args.service_account,
        logging=args.logging,
        logs_bucket=args.logs_bucket,
        output_dir=args.output,
    )
    print(f"images written to {args.output}: `multislice compile` now uses them by digest")
    return 0 if len(built) == len(images.IMAGES) else 1
