"""The plan's listing of ``hf://`` globs over the Hub's tree API (:mod:`multislice.config.hub`), against the
loopback Hub of tests/hf_hub.py (no request leaves this machine)."""

from __future__ import annotations

import pytest

from multislice.config import hub
from tests.hf_hub import FakeHub

C4 = {"allenai/c4": {
    "main": ["README.md", "en/c4-train.00000-of-00003.parquet", "en/c4-train.00001-of-00003.parquet",
             "en/c4-train.00002-of-00003.parquet", "en/c4-validation.00000-of-00001.parquet",
             "realnewslike/c4-train.00000-of-00001.parquet"],
    "v1.0": ["en/c4-train.00000-of-00001.parquet"],
}}  # fmt: skip


@pytest.fixture
def fake(monkeypatch):
    with FakeHub(C4, private={"me/private": "hf_token_of_me"}) as served:
        served.datasets["me/private"] = {"main": ["data/train-0.parquet"]}
        monkeypatch.setenv(hub.ENDPOINT_ENV, served.endpoint)
        monkeypatch.delenv(hub.TOKEN_ENV, raising=False)
        yield served


def test_globs_match_as_fsspec_does():
    assert hub.glob_regex("en/c4-train.*.parquet").fullmatch("en/c4-train.00000-of-00003.parquet")
    assert not hub.glob_regex("*.parquet").fullmatch("en/c4-train.parquet")  # * stays within a directory
    assert hub.glob_regex("**/*.parquet").fullmatch("en/c4-train.parquet")
    assert hub.glob_regex("**/*.parquet").fullmatch("top.parquet")
    assert hub.glob_regex("en/c4-train.0000[0-1]-of-?????.parquet").fullmatch("en/c4-train.00001-of-00003.parquet")
    assert not hub.glob_regex("en/c4-train.0000[!0-1]*").fullmatch("en/c4-train.00001-of-00003.parquet")
    glob = hub.HubGlob.parse("hf://datasets/allenai/c4@refs%2Fconvert%2Fparquet/en/part-*/x.parquet")
    assert (glob.repo, glob.revision, glob.directory) == ("allenai/c4", "refs%2Fconvert%2Fparquet", "en")


def test_a_glob_is_listed_across_pages_from_its_directory(fake):
    files = hub.list_files("hf://datasets/allenai/c4/en/c4-train.*.parquet")
    assert files == [f"en/c4-train.0000{i}-of-00003.parquet" for i in range(3)]
    # listed from the glob's directory (en), recursively: its 4 files in two pages of two, following Link: rel="next"
    assert [path.split("?")[0] for path, _ in fake.requests] == ["/api/datasets/allenai/c4/tree/main/en"] * 2
    assert all("recursive=true" in path for path, _ in fake.requests)
    assert hub.list_files("hf://datasets/allenai/c4@v1.0/en/*.parquet") == ["en/c4-train.00000-of-00001.parquet"]
    assert hub.list_files("hf://datasets/allenai/c4/**/c4-train.*.parquet")[-1].startswith("realnewslike/")
    assert hub.list_files("hf://datasets/allenai/c4/en/nothing-*.parquet") == []


def test_what_the_hub_refuses_is_said_with_what_to_check(fake, monkeypatch):
    missing = r"no dataset allenai/c44 at revision main, directory en \(HTTP 404\)"
    with pytest.raises(hub.HubListingError, match=missing):
        hub.list_files("hf://datasets/allenai/c44/en/*.parquet")
    with pytest.raises(hub.HubListingError, match="revision v9"):
        hub.list_files("hf://datasets/allenai/c4@v9/en/*.parquet")
    with pytest.raises(hub.HubListingError, match=r"HTTP 401\): \$HF_TOKEN may not read it"):
        hub.list_files("hf://datasets/me/private/data/*.parquet")
    monkeypatch.setenv(hub.TOKEN_ENV, "hf_token_of_me")
    assert hub.list_files("hf://datasets/me/private/data/*.parquet") == ["data/train-0.parquet"]
    assert fake.requests[-1][1] == "Bearer hf_token_of_me"
    monkeypatch.setenv(hub.ENDPOINT_ENV, "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(hub.HubListingError, match=r"could not list it on http://127.0.0.1:9 .*\$HF_ENDPOINT"):
        hub.list_files("hf://datasets/allenai/c4/en/*.parquet")
