"""The Hugging Face Hub's tree API on 127.0.0.1, for the plan's ``hf://`` listing (:mod:`multislice.config.hub`).

It answers what ``HfApi.list_repo_tree`` asks (huggingface_hub 2.4.0, ``hf_api.py`` ``_iter_repo_tree_pages``):
``GET /api/datasets/{owner}/{name}/tree/{revision}[/{path}]?recursive=true``, a JSON list of
``{"type": "file"|"directory", "path", "size"}``, :attr:`FakeHub.page_size` entries a page with the next page in a
``Link: <url>; rel="next"`` header (``utils/_pagination.py``). A dataset, revision or directory it does not hold is
404; a private dataset asked without ``Authorization: Bearer <its token>`` is 401 (the Hub's "Repository Not
Found" for an anonymous caller, ``utils/_http.py`` ``hf_raise_for_status``).

What it does not model: gated datasets (listing them needs no acceptance on the Hub), ``expand``, non-recursive
listing, rate limits (HTTP 429), redirects of renamed repositories, and the real Hub's page size (1,000).
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from multislice.config import hub


class FakeHub:
    """``with FakeHub({"owner/name": {"main": ["en/a.parquet", ...]}}) as fake:``; ``fake.endpoint`` for
    ``$HF_ENDPOINT``; ``private`` maps a dataset to the token that may list it; ``requests`` the paths asked."""

    def __init__(self, datasets: dict[str, dict[str, list[str]]], *, private: dict[str, str] | None = None,
                 page_size: int = 2):  # fmt: skip
        self.datasets, self.private, self.page_size = datasets, private or {}, page_size
        self.requests: list[tuple[str, str | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.requests.append((self.path, self.headers.get("Authorization")))
                status, body, headers = fake.answer(self.path, self.headers.get("Authorization"))
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, raw: str, authorization: str | None) -> tuple[int, Any, dict[str, str]]:
        url = urllib.parse.urlsplit(raw)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.split("/")  # '', api, datasets, owner, name, tree, revision[, path]
        if parts[1:3] != ["api", "datasets"] or len(parts) < 7 or parts[5] != "tree":
            return 404, {"error": "Not Found"}, {}
        repo, revision = f"{parts[3]}/{parts[4]}", urllib.parse.unquote(parts[6])
        directory = urllib.parse.unquote("/".join(parts[7:]))
        if repo in self.private and authorization != f"Bearer {self.private[repo]}":
            return 401, {"error": "Repository Not Found"}, {}
        files = self.datasets.get(repo, {}).get(revision)
        if files is None:
            return 404, {"error": f"Revision Not Found or Repository Not Found: {repo}@{revision}"}, {}
        inside = [f for f in files if not directory or f.startswith(directory + "/")]
        if directory and not inside:
            return 404, {"error": f"Entry Not Found: {directory}"}, {}
        entries = sorted({d for f in inside for d in _parents(f, directory)}) + sorted(inside)
        listed = [{"type": "directory", "path": d} if d not in inside else {"type": "file", "path": d, "size": 1}
                  for d in entries]  # fmt: skip
        start = int(query.get("cursor", ["0"])[0])
        page, headers = listed[start : start + self.page_size], {}
        if start + self.page_size < len(listed):
            cursor = urllib.parse.urlencode({"recursive": "true", "cursor": start + self.page_size})
            headers["Link"] = f'<{self.endpoint}{url.path}?{cursor}>; rel="next"'
        return 200, page, headers

    def __enter__(self) -> FakeHub:
        # serve_forever checks for shutdown() each poll_interval (0.5 s by default): end the test at once
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def env(self) -> dict[str, str]:
        """The environment that points :mod:`multislice.config.hub` (and huggingface_hub) here."""
        return {hub.ENDPOINT_ENV: self.endpoint}


def _parents(path: str, directory: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts)) if "/".join(parts[: i + 1]).startswith(directory)
            and "/".join(parts[: i + 1]) != directory]  # fmt: skip
