"""Listing the files of an ``hf://`` glob over the Hugging Face Hub's HTTP API, as MaxText will find them.

MaxText 0.2.5 reads grain Parquet files named ``hf://datasets/OWNER/NAME[@REVISION]/GLOB`` through
``huggingface_hub.HfFileSystem`` when the stage starts. The plan lists the same glob first, so that a glob that
matches nothing, a dataset that does not exist or a revision that is not there is refused before anything is
created. Only the listing is asked for (never a file's bytes). The pipeline image has no ``huggingface_hub``,
so this speaks the Hub API that ``HfApi.list_repo_tree`` uses (huggingface_hub 2.4.0, ``hf_api.py``
``_iter_repo_tree_pages``): ``GET {endpoint}/api/datasets/{repo}/tree/{revision}/{path}?recursive=true``, pages
followed through the ``Link: <...>; rel="next"`` header (``utils/_pagination.py``), the endpoint from
``$HF_ENDPOINT`` (``constants.py``, default ``https://huggingface.co``) and a token from ``$HF_TOKEN`` when set.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

#: huggingface_hub's variable for another Hub endpoint (constants.py ``ENDPOINT``), and its default.
ENDPOINT_ENV = "HF_ENDPOINT"
DEFAULT_ENDPOINT = "https://huggingface.co"
#: huggingface_hub's variable for a token (``HF_TOKEN``): sent when set, for a private or gated dataset.
TOKEN_ENV = "HF_TOKEN"
#: Seconds one request to the Hub may take.
TIMEOUT_SECONDS = 30.0
#: The most pages followed (the Hub gives 1,000 entries a page: 100,000 files).
MAX_PAGES = 100

_PATH = re.compile(
    r"hf://datasets/(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(@(?P<revision>[^/]+))?/(?P<glob>.+)"
)
_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


class HubListingError(Exception):
    """The Hub could not list the glob; the message says what it answered and what to check."""


@dataclass(frozen=True)
class HubGlob:
    """``hf://datasets/OWNER/NAME[@REVISION]/GLOB`` split: ``repo`` OWNER/NAME, ``revision`` (``main`` when not
    given, as huggingface_hub's ``DEFAULT_REVISION``), ``glob`` the path glob inside the dataset."""

    repo: str
    revision: str
    glob: str

    @classmethod
    def parse(cls, pattern: str) -> HubGlob:
        """Raises: ValueError: ``pattern`` is not of that shape."""
        found = _PATH.fullmatch(pattern)
        if not found:
            raise ValueError(f"{pattern!r} is not hf://datasets/OWNER/NAME[@REVISION]/GLOB")
        return cls(found["repo"], found["revision"] or "main", found["glob"])

    @property
    def directory(self) -> str:
        """The glob's leading directories without a wildcard: where the listing starts (``""``: the root)."""
        parts = self.glob.split("/")[:-1]
        fixed = []
        for part in parts:
            if any(c in part for c in "*?["):
                break
            fixed.append(part)
        return "/".join(fixed)


def glob_regex(glob: str) -> re.Pattern[str]:
    """The regular expression of a path glob, as ``HfFileSystem.glob`` matches it: fsspec's own translation
    (``fsspec.utils.glob_translate``; ``HfFileSystem`` is an fsspec filesystem): ``*`` and ``?`` within a path
    segment, ``**`` across segments, ``[...]`` a class (``[!...]`` negated)."""
    # fsspec comes with gcsfs, the Cloud Storage backend of etils[epath-gcs] (pyproject.toml); deferred: 0.2 s
    from fsspec.utils import glob_translate

    return re.compile(glob_translate(glob))


#: Prefix of the variable a stage's Kubernetes Secret token reaches the plan step in on KFP
#: (:func:`plan_token_env`).
PLAN_TOKEN_ENV_PREFIX = "MULTISLICE_HF_TOKEN_"


def plan_token_env(secret: str) -> str:
    """The variable the plan task of a KFP run gets key ``token`` of Kubernetes Secret ``secret`` in (a stage's
    ``data.hf_token_kubernetes_secret``): :data:`PLAN_TOKEN_ENV_PREFIX` and the name, upper-case, other characters
    as ``_``, then 8 hex digits of its SHA-256 (``a-b`` and ``a.b`` stay apart). One per Secret: two stages may
    read their data with different tokens, and the plan lists each stage's ``hf://`` globs with its own."""
    digest = hashlib.sha256(secret.encode()).hexdigest()[:8]
    return PLAN_TOKEN_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", secret.upper()) + "_" + digest


_STAGE_TOKEN: contextvars.ContextVar[str] = contextvars.ContextVar("hub_stage_token", default="")


@contextlib.contextmanager
def listing_with(token: str):
    """Within it, :func:`list_files` sends ``token`` (the one a stage's training pods get), else ``$HF_TOKEN``.

    The plan step lists each stage's ``hf://`` globs with that stage's token
    (:func:`multislice.steps.plan.stage_hub_tokens`); ``''`` keeps ``$HF_TOKEN``. The token is never printed.
    """
    reset = _STAGE_TOKEN.set(token)
    try:
        yield
    finally:
        _STAGE_TOKEN.reset(reset)


def list_files(pattern: str, *, timeout: float = TIMEOUT_SECONDS) -> list[str]:
    """The paths inside the dataset (sorted) of the files ``pattern`` (``hf://datasets/...``) matches.

    The token sent: the stage's (:func:`listing_with`), else ``$HF_TOKEN``, else none.

    Raises:
        ValueError: ``pattern`` is not of the shape.
        HubListingError: the Hub answered an error (404: no such dataset, revision or directory, or a private one
            without ``$HF_TOKEN``; 401/403: the token may not read it) or could not be reached.
    """
    hub = HubGlob.parse(pattern)
    matches = glob_regex(hub.glob).fullmatch
    endpoint = os.environ.get(ENDPOINT_ENV, DEFAULT_ENDPOINT).rstrip("/")
    path = "/" + urllib.parse.quote(hub.directory, safe="") if hub.directory else ""
    url: str | None = (
        f"{endpoint}/api/datasets/{hub.repo}/tree/{urllib.parse.quote(hub.revision, safe='')}{path}?recursive=true"
    )
    headers = {"Accept": "application/json"}
    token = _STAGE_TOKEN.get() or os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    found: list[str] = []
    for _ in range(MAX_PAGES):
        if url is None:
            break
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (the Hub's https URL)
                entries = json.load(response)
                link = response.headers.get("Link") or ""
        except urllib.error.HTTPError as error:
            raise HubListingError(_http_problem(hub, error.code)) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise HubListingError(
                f"could not list it on {endpoint} ({error}); the plan lists hf:// globs before anything starts: "
                f"check this machine's access to the Hub, or ${ENDPOINT_ENV}"
            ) from None
        found += [e["path"] for e in entries if e.get("type") == "file" and matches(e["path"])]
        next_page = _NEXT.search(link)
        url = next_page.group(1) if next_page else None
    return sorted(found)


def _http_problem(hub: HubGlob, status: int) -> str:
    where = f"dataset {hub.repo} at revision {hub.revision}" + (f", directory {hub.directory}" if hub.directory else "")
    if status == 404:
        return (
            f"the Hub has no {where} (HTTP 404); check the name and revision, or, for a private dataset, set "
            f"${TOKEN_ENV} where the plan runs"
        )
    if status in (401, 403):
        return f"the Hub refused to list {where} (HTTP {status}): ${TOKEN_ENV} may not read it"
    return f"the Hub answered HTTP {status} listing {where}; retry, or check the Hub's status"
