"""Every shell command in README.md's and docs/*.md's code blocks works as written, or is an explicit exception.

Each command line of a code block (``$ `` prompts taken off, ``\\`` continuations joined, comments dropped) is:

- **run as written** when it is cheap and local (:data:`RUN`: ``multislice render``, ``multislice plan`` without
  a compile, ``--help``), in a scratch directory, and must exit 0;
- **parsed** when it needs a cluster, a cloud project or minutes of compiling: ``multislice ...`` through the
  CLI's own argparse parser (:func:`multislice.cli.app.build_parser`), so a misspelt flag, a verb or a choice
  that does not exist fails here. In a synopsis line (``[--opt X]``, ``a|b``, ``...``) each verb, each
  ``--flag`` of it and each value of a flag with choices must be the CLI's (:func:`synopsis_problems`);
- ``make TARGET [VAR=value]``: the target must be one the Makefile defines (and ``PROFILE=`` a profile);
- anything else (``gcloud``, ``kubectl``, ``docker``, ...) is in :data:`EXCEPTIONS` with the reason it is not
  run here. A command of a tool in neither list fails the test: add it to one, with its reason.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from multislice.cli.app import build_parser
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Code blocks with these info strings hold shell commands (an empty one too: the docs' plain blocks).
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
#: Programs whose commands this test checks; a line starting with another word is not a command (output, YAML).
CHECKED = ("multislice", "make", "uv", ".venvs/bootstrap/bin/uv", "pip", "export")

#: The first word of commands not run or parsed here, and why.
EXCEPTIONS = {
    "gcloud": "needs a Google Cloud project and credentials",
    "kubectl": "needs a GKE cluster",
    "docker": "needs a Docker engine (none on the development machines); `make images` is checked instead",
    "git": "clones an upstream repository over the network (docs/gke-setup.md's in-place restart agent)",
    "curl": "reaches the network from a pod (docs/gke-setup.md's egress check)",
}
#: Whole commands not run as written, and why (their flags are still parsed where they are ``multislice``'s).
NOT_RUN = {
    "multislice preflight --profile gke-v6e-16x2-seed --stage seed-llama3-70b":
        "a real AOT compile (minutes): the aot tier runs it as written "
        "(tests/preflight/test_preflight.py::test_the_readme_example_compiles_here_without_credentials_and_a_rerun_is_cached)",
    "make run": "the e2e tier (`make run` is a full local training run)",
    "make run PROFILE=elastic": "the e2e tier (an elastic local training run, tests/e2e)",
    "make test": "the whole suite",
    "make compile": "compiles every profile for two targets (minutes); tests/golden compiles each profile",
}  # fmt: skip
#: Commands run as written whose shown outcome is not a success: their exit status (else 0, or 2 for ``error:``).
EXIT_STATUS = {
    "multislice plan --profile gke-v6e-16x2 --stage llama3-70b --model llama3.1-405b --tpu-type v5e-4 --num-slices 1":
        1,  # "nothing fits" (docs/preflight.md): the search's answer, exit 1 as for a stage that does not fit
}  # fmt: skip
#: ``multislice`` verbs run as written when the line has no placeholder: local, seconds, no cloud.
RUN = {"render", "plan"}
#: Words that mark a line as a synopsis, not a command to run as written.
PLACEHOLDER = re.compile(r"\[|\]|\||\.\.\.|<|>|\b(?:P|S|DIR|FILE|URL|NAME|STAGE|SCHEDULE_ID|ID|T|C|N|Z|D)\b")


def commands() -> list[tuple[str, str, list[str]]]:
    """(``file:line``, command, its shown output) for every command line of every shell code block in
    :data:`DOCS`; the output is the lines after a ``$ `` command up to the next one (``[]`` without a prompt)."""
    found = []
    # NAME="..." lines of the blocks, expanded as the shell would; a doc may use one another defines
    # (docs/gke-setup.md's $DEPLOY is docs/delivery.md's)
    variables: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if block.group(1) not in SHELL_BLOCKS:
                continue
            first_line = text[: block.start(2)].count("\n") + 1
            lines = block.group(2).splitlines()
            i = 0
            while i < len(lines):
                start, line = i, lines[i].strip()
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1].rstrip() + " " + lines[i].strip()
                i += 1
                shown: list[str] = []
                if line.startswith("$ "):
                    while i < len(lines) and not lines[i].startswith("$ "):
                        shown.append(lines[i].strip())
                        i += 1
                line = line.removeprefix("$ ")
                assignment = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.+)", line)
                if assignment and len(shlex.split(line, comments=True)) == 1:
                    variables[assignment.group(1)] = shlex.split(line)[0].split("=", 1)[1]
                    continue
                line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m, v=variables: v.get(m.group(1), m.group(0)), line)
                words = line.split()
                if not words:
                    continue
                head = words[0]
                if "=" in head and head.split("=")[0].isupper():  # VAR=value command
                    head = words[1] if len(words) > 1 else ""
                if head in CHECKED or head in EXCEPTIONS:
                    found.append((f"{doc.relative_to(ROOT)}:{first_line + start}", line, shown))
    return found


def without_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (a ``#`` inside quotes stays)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return shlex.join(list(lexer))


SYNOPSIS = re.compile(r"[\[\]|]|^\.\.\.$|^…$")


def is_synopsis(argv: list[str]) -> bool:
    """A synopsis (``[--opt X]``, ``a|b``, ``...``) rather than a command to type as it is."""
    return any(SYNOPSIS.search(word) for word in argv)


def strict_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The CLI's parser with prefix matching off (``--num-slice`` for ``--num-slices``): a documented flag is
    written out in full, so a shortened or misspelt one fails here though argparse would take a prefix."""
    parser = build_parser(argv)
    todo = [parser]
    while todo:
        current = todo.pop()
        current.allow_abbrev = False
        todo += list(subparsers(current).values())
    return parser


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found[0].choices) if found else {}


def synopsis_problems(argv: list[str]) -> list[str]:
    """What in a synopsis the CLI does not know: a verb (each of ``a|b``), a ``--flag`` of that verb, or a value
    of a flag with choices (each of ``a|b``). Placeholders (``P``, ``[target flags]``) are not checked."""
    problems: list[str] = []
    words = [w.strip("[]") for w in argv]
    parsers = [strict_parser(argv)]
    while words and parsers and subparsers(parsers[0]) and not words[0].startswith("-"):
        names, words = words[0].split("|"), words[1:]
        choices = subparsers(parsers[0])
        problems += [f"no verb {name!r}" for name in names if name not in choices]
        parsers = [choices[name] for name in names if name in choices]
    for parser in parsers:
        options = {o: a for a in parser._actions for o in a.option_strings}
        for i, word in enumerate(words):
            if not word.startswith("--"):
                continue
            flag = word.split("=", 1)[0]
            if flag not in options:
                problems.append(f"{parser.prog}: no option {flag}")
                continue
            choices = options[flag].choices
            if choices is not None and i + 1 < len(words) and not words[i + 1].startswith("-"):
                problems += [f"{parser.prog} {flag}: no choice {v!r}" for v in words[i + 1].split("|")
                             if v not in choices]  # fmt: skip
    return problems


def parses(argv: list[str]) -> str:
    """``''`` when the CLI's parser accepts ``argv`` (``multislice`` taken off), else argparse's message."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            strict_parser(argv).parse_args(argv)
    except SystemExit as exit:
        return err.getvalue().strip() or f"exit {exit.code}"
    return ""


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.M))


def check(line: str, tmp_path: Path, shown: list[str] | None = None) -> None:
    """Run or parse one documented command (see the module's docstring); an AssertionError names what fails.

    A command run as written with its output shown (``shown``) must print each shown line (``...`` stands
    for lines left out), and exit non-zero exactly when the shown output is an ``error:``.
    """
    command = without_comment(line)
    argv = shlex.split(command)
    while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
        argv = argv[1:]
    head = argv[0]
    if head in EXCEPTIONS:
        return
    if head == "export":
        assert all("=" in a for a in argv[1:]), f"{line!r}: export without NAME=value"
        return
    if head == "make":
        targets = [a for a in argv[1:] if "=" not in a]
        assert targets and all(t in make_targets() for t in targets), f"{line!r}: no such make target"
        assert command in NOT_RUN, f"{command!r}: run it here, or add it to NOT_RUN with the reason it is not"
        for assignment in (a for a in argv[1:] if a.startswith("PROFILE=")):
            profile = assignment.split("=", 1)[1]
            assert (ROOT / "configs" / f"{profile}.yaml").is_file(), f"{line!r}: no profile {profile}"
        return
    if head == "pip":
        assert argv[1] == "install", f"{line!r}: only `pip install` is documented"
        return
    if head.endswith("uv"):
        assert argv[1:3] == ["build", "--wheel"] and "--python" in argv, f"{line!r}: uv build offline needs --python"
        return
    assert head == "multislice", line
    if is_synopsis(argv[1:]):
        problems = synopsis_problems(argv[1:])
        assert not problems, f"{line!r}: {problems}"
        return
    problem = parses(argv[1:])
    assert not problem, f"{line!r} does not parse: {problem}"
    if argv[1] in RUN and not PLACEHOLDER.search(" ".join(argv[1:])) and command not in NOT_RUN:
        done = subprocess.run(
            [sys.executable, "-m", "multislice.cli", *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        status = EXIT_STATUS.get(command, 2 if shown and shown[0].startswith("error:") else 0)
        assert done.returncode == status, f"{line!r} exited {done.returncode}, not {status}: {done.stderr[-2000:]}"
        printed = [out.strip() for out in (done.stdout + done.stderr).splitlines()]
        missing = [want for want in shown or [] if want and want != "..." and want not in printed]
        assert not missing, f"{line!r} did not print {missing}; it printed:\n" + "\n".join(printed[-40:])


DOCUMENTED = commands()


def test_the_docs_show_commands_of_each_kind():
    heads = {shlex.split(without_comment(c))[0] for _, c, _ in DOCUMENTED}
    assert {"multislice", "make", "gcloud", "kubectl"} <= heads
    assert len(DOCUMENTED) > 40


@pytest.mark.parametrize("where,line,shown", DOCUMENTED, ids=[w for w, _, _ in DOCUMENTED])
def test_each_documented_command_runs_or_parses_as_written(where, line, shown, tmp_path):
    check(line, tmp_path, shown)


@pytest.mark.parametrize(
    "line",
    [
        "multislice plan --profile gke-v6e-16x2 --stage llama3-70b --num-slice 2",  # a prefix of --num-slices
        "multislice plan --profile gke-v6e-16x2 --stage llama3-70b --num-slces 2",
        "multislice render --profile local --ouput build/m",
        "multislice schedule create --profile P --target vertx --cron '0 3 * * *'",  # a choice misspelt
        "multislice preflight --profile P [--stage S] [--no-alternatives]",  # in a synopsis' optional group
        "make image",
    ],
)
def test_a_misspelt_command_fails_the_check(line, tmp_path):
    with pytest.raises(AssertionError):
        check(line, tmp_path)


def test_the_module_entry_point_is_what_the_multislice_script_runs():
    # the run-as-written commands go through `python -m multislice.cli`; the console script is multislice.cli:main
    assert 'multislice = "multislice.cli:main"' in (ROOT / "pyproject.toml").read_text()
    done = subprocess.run([sys.executable, "-m", "multislice.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: multislice")
