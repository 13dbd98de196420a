"""The Dockerfiles install exactly the extras and pins pyproject.toml declares (no Docker engine needed)."""

import re
import shlex
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: image -> (extra, directories of the package the image carries)
IMAGES = {"pipeline": ("pipeline", {"multislice", "components", "pipelines"}), "trainer": ("trainer", {"multislice"})}


def dockerfile(image):
    lines, current = [], ""
    for raw in (ROOT / "containers" / image / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [shlex.split(line) for line in lines]


def lock_pins(name):
    pins = {}
    for line in (ROOT / "requirements" / f"{name}.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(3)
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_installs_exactly_its_extra_at_the_locked_versions(image):
    extra, directories = IMAGES[image]
    instructions = dockerfile(image)
    [base] = [i[1] for i in instructions if i[0] == "FROM"]
    python = re.match(r"python:(\d+\.\d+)-slim$", base).group(1)
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(f"{python}.0")
    uv_version = re.search(r"^UV_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert ["RUN", "pip", "install", "--no-cache-dir", f"uv=={uv_version}"] in instructions
    # bytecode compiled at build, before the installs: no pod compiles its modules at start
    assert instructions.index(["ENV", "UV_COMPILE_BYTECODE=1"]) < min(
        i for i, line in enumerate(instructions) if line[:3] == ["RUN", "uv", "pip"]
    )
    installs = [i for i in instructions if i[:4] == ["RUN", "uv", "pip", "install"]]
    assert len(installs) == 2
    dependencies, package = installs
    # The dependencies: pyproject's own list plus exactly this extra, constrained to the lock file.
    assert dependencies[4:] == ["--system", "--no-cache", "-r", "pyproject.toml", "--extra", extra,
                                "--constraint", f"requirements/{image}.txt"]  # fmt: skip
    assert package[4:] == ["--system", "--no-cache", "--no-deps", "."]
    copied = {i[1] for i in instructions if i[0] == "COPY"}
    assert directories | {"pyproject.toml", f"requirements/{image}.txt"} <= copied
    assert instructions.index(package) > max(instructions.index(i) for i in instructions if i[0] == "COPY")


@pytest.mark.parametrize("image", IMAGES)
def test_lock_file_pins_satisfy_pyproject(image):
    extra, _ = IMAGES[image]
    pins = lock_pins(image)
    declared = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    declared += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not pinned in requirements/{image}.txt: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements/{image}.txt pins {name}=={pins[name]}, outside pyproject's {requirement}: run `make lock`"
        )
    if image == "trainer":
        assert pins["maxtext"] == "0.2.5"
    else:
        assert (pins["kfp"], pins["kfp-kubernetes"]) == ("2.17.0", "2.17.0")
        assert "maxtext" not in pins and int(pins["protobuf"].split(".")[0]) < 7
