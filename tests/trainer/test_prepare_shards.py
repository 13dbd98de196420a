"""prepare_data's sharding and reuse decisions (multislice.trainer.prepare_shards): ranges, identities, no re-read."""

from __future__ import annotations

import os

import pytest
from etils import epath

from multislice.config.data import TextData, TokenizerSpec, recipe_key
from multislice.trainer import prepare_data as work
from multislice.trainer import prepare_shards


@pytest.mark.parametrize(
    ("sizes", "workers", "ranges"),
    [
        ([10] * 10, 2, [(0, 5), (5, 10)]),
        ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # one large file is a range of its own
        ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
        ([5], 3, [(0, 1)]),  # fewer files than workers: one range a file
        ([3, 3, 3], 5, [(0, 1), (1, 2), (2, 3)]),
        ([0, 0, 0], 2, [(0, 1), (1, 3)]),  # empty files: by count
        ([7, 1, 1, 1, 1, 1, 1, 1], 4, [(0, 1), (1, 3), (3, 5), (5, 8)]),  # a large first file: the rest shared
    ],
)
def test_sources_split_into_contiguous_ranges_of_about_equal_bytes(sizes, workers, ranges):
    found = prepare_shards.split_ranges(sizes, workers)
    assert found == ranges
    assert found[0][0] == 0 and found[-1][1] == len(sizes)
    assert all(a < b for a, b in found) and all(found[i][1] == found[i + 1][0] for i in range(len(found) - 1))


def test_no_file_or_no_worker_cannot_be_split():
    with pytest.raises(ValueError, match="cannot split 0 files"):
        prepare_shards.split_ranges([], 2)
    with pytest.raises(ValueError, match="into 0 ranges"):
        prepare_shards.split_ranges([1], 0)


def test_local_hashes_are_read_again_only_for_files_that_changed(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"f{i}.txt"
        path.write_text(f"file {i}")
        files.append(str(path))
    cache = str(tmp_path / "cache" / "hashes.json")
    first, read = prepare_shards.cached_sha256(files, cache)
    assert read == 3 and first == [work.file_sha256(f)[0] for f in files]
    assert prepare_shards.cached_sha256(files, cache) == (first, 0)  # nothing read: every stat is the cached one
    (tmp_path / "f1.txt").write_text("file 1, changed")
    again, read = prepare_shards.cached_sha256(files, cache)
    assert read == 1 and again[0] == first[0] and again[2] == first[2] and again[1] != first[1]
    # the same bytes written again (a new mtime): read again, the same digest
    os.utime(files[0], ns=(1, 1))
    assert prepare_shards.cached_sha256(files, cache) == (again, 1)


def test_gs_sources_are_identified_from_the_listing_without_reading_them(gcs, monkeypatch, tmp_path):
    for i in range(3):
        epath.Path(f"gs://bucket/corpus/d{i}.txt").write_text(f"document {i} " * 20)

    def no_read(path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(work, "file_sha256", no_read)
    data = TextData(files=("gs://bucket/corpus/*.txt",), workers=2)
    sources = prepare_shards.list_sources(data, cache_file=str(tmp_path / "h.json"))
    assert [s["path"] for s in sources] == [f"gs://bucket/corpus/d{i}.txt" for i in range(3)]
    assert all(s["crc32c"] and s["generation"] and s["bytes"] == len(f"document {i} " * 20)
               for i, s in enumerate(sources))  # fmt: skip
    wanted = prepare_shards.fingerprint_of(data, TokenizerSpec(), 128, sources)
    # The same bytes uploaded again: a new generation, the same CRC32C: the same fingerprint (no re-preparation).
    epath.Path("gs://bucket/corpus/d1.txt").write_text("document 1 " * 20)
    same = prepare_shards.list_sources(data, cache_file=str(tmp_path / "h.json"))
    assert same[1]["generation"] != sources[1]["generation"]
    assert prepare_shards.fingerprint_of(data, TokenizerSpec(), 128, same) == wanted
    # Other bytes: another fingerprint.
    epath.Path("gs://bucket/corpus/d1.txt").write_text("document one " * 20)
    changed = prepare_shards.list_sources(data, cache_file=str(tmp_path / "h.json"))
    assert prepare_shards.fingerprint_of(data, TokenizerSpec(), 128, changed) != wanted
    # The workers' request: the listing and ranges written beside the dataset, under the fingerprint.
    request = prepare_shards.work_request(data, TokenizerSpec(), 128, "gs://bucket/datasets/k", changed)
    assert request["workers"] == 2 and request["parts_dir"].startswith("gs://bucket/datasets/k.parts-")
    listing = epath.Path(request["parts_dir"], prepare_shards.SOURCES).read_text()
    assert '"ranges": [[0, 1], [1, 3]]' in listing or '"ranges": [[0, 2], [2, 3]]' in listing


def test_the_worker_count_is_not_part_of_the_recipe():
    one = recipe_key(TextData(files=("a",)), TokenizerSpec(), 128)
    assert one == recipe_key(TextData(files=("a",), workers=8, parallelism=4), TokenizerSpec(), 128)
