"""wds: shards (write, read locally and over HTTP, seeded order, rank/worker split, bad shards) and
one data set read through folder:, csv:, rec: and wds: copies giving identical samples."""

from __future__ import annotations

import functools
import http.server
import shutil
import sys
import threading
import types
from collections import Counter

import numpy as np
import pytest

from data_files import image_record, make_folder, write_recordio
from marginkit.data import shards as shards_module
from marginkit.data.folder import scan_folder
from marginkit.data.manifest import read_manifest
from marginkit.data.recordio import read_recordio
from marginkit.data.samples import BadSampleError, concat_samples
from marginkit.data.shards import META_NAME, SkippedSample, open_shards, write_shards


def _by_key(lazy, labels):
    return {lazy.relative_path(i): (lazy.read(i), int(labels[i])) for i in range(len(lazy))}


def _pool(raw):
    parts = [(raw.x_train, raw.y_train), (raw.x_test, raw.y_test)]
    if raw.x_val is not None:
        parts.append((raw.x_val, raw.y_val))
    return concat_samples([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.fixture
def folder(tmp_path):
    return make_folder(tmp_path / "images", per_class=5)


@pytest.fixture
def shard_dir(tmp_path, folder):
    write_shards(scan_folder(folder), tmp_path / "shards", samples_per_shard=4)
    return tmp_path / "shards"


def _items(samples):
    return list(samples)


def test_written_shards_read_back_as_the_source(folder, shard_dir):
    raw = scan_folder(folder)
    opened = open_shards(shard_dir)
    assert opened.class_names == ["cat", "dog", "emu"] and opened.sample_shape == (3, 6, 8)
    assert set(opened.splits) == {"train", "test"}
    for split, (x, y) in {"train": (raw.x_train, raw.y_train), "test": (raw.x_test, raw.y_test)}.items():
        expected = _by_key(x, y)
        got = _items(opened.splits[split])
        assert len(got) == len(expected) and opened.splits[split].num_samples == len(expected)
        for array, label, key, _ in got:
            np.testing.assert_array_equal(array, expected[key][0])
            assert array.dtype == np.uint8 and label == expected[key][1]
        np.testing.assert_array_equal(np.sort(opened.labels[split]), np.sort(y))
    meta = (shard_dir / META_NAME).read_text()
    assert '"encoding": "encoded"' in meta and "train-000002.tar" in meta  # 12 samples, 4 a shard
    assert not list(shard_dir.glob("*.tmp"))


def test_same_data_through_folder_csv_rec_and_wds(tmp_path, folder):
    raw = scan_folder(folder, test_fraction=0.0)
    x, y = _pool(raw)
    reference = _by_key(x, y)
    paths = sorted(reference)
    # csv: the same files, listed in a manifest at the folder's root
    rows = [f"{raw.class_names[reference[p][1]]},{p},train" for p in paths]
    (folder / "all.csv").write_text("label,path,split\n" + "\n".join(rows) + "\n")
    # rec: the same files' bytes as im2rec records, key = position in `paths`
    write_recordio(
        tmp_path / "rec",
        {k: image_record(reference[p][1], (folder / p).read_bytes()) for k, p in enumerate(paths)},
    )
    write_shards(raw, tmp_path / "wds")
    copies = {}
    csv_x, csv_y = _pool(read_manifest(folder / "all.csv", test_fraction=0.0))
    copies["csv"] = _by_key(csv_x, csv_y)
    rec_x, rec_y = _pool(read_recordio(tmp_path / "rec", test_fraction=0.0))
    copies["rec"] = {
        paths[int(k.split("#")[1])]: v for k, v in _by_key(rec_x, rec_y).items()
    }  # the record key is the file's position
    copies["wds"] = {key: (a, lab) for a, lab, key, _ in open_shards(tmp_path / "wds").splits["train"]}
    for name, copy in copies.items():
        assert sorted(copy) == paths, name
        for p in paths:
            np.testing.assert_array_equal(copy[p][0], reference[p][0], err_msg=f"{name} {p}")
            assert copy[p][1] == reference[p][1], (name, p)


def test_arrays_are_stored_as_npy(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (7, 1, 4, 4), dtype=np.uint8)
    y = np.arange(7) % 2
    write_shards({"train": (x, y)}, tmp_path / "s", class_names=["a", "b"], samples_per_shard=3)
    opened = open_shards(tmp_path / "s")
    got = {key: (a, lab) for a, lab, key, _ in opened.splits["train"]}
    for i in range(7):
        np.testing.assert_array_equal(got[f"train/{i}"][0], x[i])
        assert got[f"train/{i}"][1] == y[i]


def test_seeded_order_by_seed_and_epoch(shard_dir):
    def order(seed, epoch):
        samples = open_shards(shard_dir, seed=seed, shuffle_buffer=5).splits["train"]
        samples.set_epoch(epoch)
        return [key for _, _, key, _ in samples]

    first = order(0, 0)
    assert first == order(0, 0) and sorted(first) == sorted(order(0, 1))
    assert first != order(0, 1) and first != order(1, 0)


def _with_worker(monkeypatch, worker, workers):
    monkeypatch.setattr(
        "torch.utils.data.get_worker_info", lambda: types.SimpleNamespace(id=worker, num_workers=workers)
    )


def test_split_by_rank_then_worker_with_equal_counts(tmp_path, folder, monkeypatch):
    raw = scan_folder(folder, test_fraction=0.0)  # 15 samples: shards of 4, 4, 4, 3
    write_shards(raw, tmp_path / "s", samples_per_shard=4)
    per_rank = {}
    for rank in range(2):
        keys = []
        for worker in range(2):
            _with_worker(monkeypatch, worker, 2)
            samples = open_shards(tmp_path / "s", rank=rank, world_size=2).splits["train"]
            keys += [key for _, _, key, _ in samples]
        per_rank[rank] = keys
        assert len(keys) == 7 == samples.samples_per_rank  # 15 // 2 a rank, 4 + 3 between workers
    # in the first pass each shard goes to one rank and one worker: no sample is read twice there
    assert not set(per_rank[0]) & set(per_rank[1]) or max(Counter(per_rank[0] + per_rank[1]).values()) <= 2
    # evaluation splits: each sample once over the ranks
    monkeypatch.setattr("torch.utils.data.get_worker_info", lambda: None)
    seen = []
    for rank in range(3):
        evaluation = shards_module.ShardSamples(
            str(tmp_path / "s"), "train", shards_module.read_metadata(str(tmp_path / "s")),
            shuffle=False, rank=rank, world_size=3,
        )  # fmt: skip
        seen += [key for _, _, key, _ in evaluation]
    assert sorted(seen) == sorted(raw.x_train.relative_path(i) for i in range(15))


def test_brace_pattern_selects_shards(shard_dir):
    opened = open_shards(f"{shard_dir}/train-{{000000..000001}}.tar")
    assert set(opened.splits) == {"train"} and opened.splits["train"].num_samples == 8
    assert len(list(opened.splits["train"])) == 8
    with pytest.raises(ValueError, match=r"train-000009\.tar are not listed"):
        open_shards(f"{shard_dir}/train-{{000008..000009}}.tar")


@pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset reads http(s) with curl")
def test_reading_over_http_from_a_local_server(shard_dir):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(shard_dir))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        remote = open_shards(url, shuffle_buffer=1)
        local = open_shards(shard_dir, shuffle_buffer=1)
        got = [(key, lab, a.tobytes()) for a, lab, key, _ in remote.splits["train"]]
        assert got == [(key, lab, a.tobytes()) for a, lab, key, _ in local.splits["train"]]
        np.testing.assert_array_equal(remote.labels["test"], local.labels["test"])
        with pytest.raises((FileNotFoundError, ValueError), match="marginkit-shards.json"):
            open_shards(url + "nothing/")
    finally:
        server.shutdown()
        server.server_close()


def test_url_forms(monkeypatch):
    base, names = shards_module._locate("s3://bucket/faces/train-{000000..000002}.tar")
    assert base == "s3://bucket/faces" and names == [
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
    ]
    assert shards_module._join(base, META_NAME) == f"s3://bucket/faces/{META_NAME}"
    calls = []

    class FakePipe:
        def __init__(self, args, **kw):
            calls.append(args)

    import webdataset.gopen  # noqa: F401 - the module, not the function of that name

    module = sys.modules["webdataset.gopen"]
    monkeypatch.setattr(module, "Pipe", FakePipe)
    monkeypatch.setattr(module, "gopen_schemes", dict(module.gopen_schemes))
    shards_module._open("s3://bucket/faces/train-000000.tar")
    assert calls == [["aws", "s3", "cp", "s3://bucket/faces/train-000000.tar", "-"]]  # no shell
    with pytest.raises(ValueError, match="pipe: URLs run shell commands"):
        open_shards("pipe:cat /etc/passwd")
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        open_shards("ftp://host/x.tar")


def test_truncated_shard_names_it_or_is_skipped(shard_dir):
    shard = shard_dir / "train-000001.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2 + 100])  # inside a member
    with pytest.raises(BadSampleError, match=rf"{shard}: (truncated or corrupt tar shard|truncated shard)"):
        list(open_shards(shard_dir).splits["train"])
    samples = open_shards(shard_dir, on_bad_sample="skip").splits["train"]
    items = list(samples)
    skipped = [i for i in items if isinstance(i, SkippedSample)]
    assert len(items) == samples.num_samples == 12  # the share is kept: steps stay equal
    assert skipped and {s.where for s in skipped} == {str(shard)} and skipped[0].count >= 1


def test_shard_cut_at_a_member_boundary_is_counted(shard_dir):
    import tarfile

    shard = shard_dir / "train-000000.tar"
    with tarfile.open(shard) as archive:
        members = archive.getmembers()
    keep = members[-3].offset  # drop the last sample's three members and the end blocks
    shard.write_bytes(shard.read_bytes()[:keep])
    with pytest.raises(BadSampleError, match=rf"{shard}: truncated shard: 3 of its 4 samples"):
        list(open_shards(shard_dir, shuffle_buffer=1).splits["train"])


def test_bad_sample_inside_a_shard(tmp_path):
    x = np.zeros((3, 1, 2, 2), dtype=np.uint8)
    write_shards({"train": (x, np.zeros(3, dtype=np.int64))}, tmp_path / "s")
    meta = tmp_path / "s" / META_NAME
    meta.write_text(meta.read_text().replace('"dtype": "uint8"', '"dtype": "float32"'))
    with pytest.raises(BadSampleError, match=r"train-000000\.tar sample train-000000000: holds uint8"):
        list(open_shards(tmp_path / "s").splits["train"])


def test_unfinished_or_foreign_folders(tmp_path, folder, shard_dir):
    (shard_dir / META_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="unfinished"):
        open_shards(shard_dir)
    (shard_dir / META_NAME).write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a shard set written by marginkit"):
        open_shards(shard_dir)
    write_shards(scan_folder(folder), tmp_path / "again")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_shards(scan_folder(folder), tmp_path / "again")
    write_shards(scan_folder(folder), tmp_path / "again", overwrite=True)
