"""``wds:`` shard sets through load_dataset, the loader and the trainer: the same splits and
metrics as the folder they were packed from (and so ``csv:`` and ``rec:`` copies of it), labels
that follow their rows through pooled and filtered views, equal steps whatever the worker count,
and clear refusals (issue 35)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from data_files import image_record, write_recordio
from marginkit.data import load_dataset
from marginkit.data.datasets import read_source
from marginkit.data.loading import FixedBatches, Loader, ShuffledBatches, evaluation_loader
from marginkit.data.shards import write_shards
from marginkit.train import TrainConfig, train
from marginkit.train.errors import ConfigError

CLASSES, PER_CLASS = 6, 12


def _folder(root):
    """Images whose red channel is ``20 * class`` everywhere: a batch's labels can be read off
    its pixels."""
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 256, size=(10, 10, 3))
            pixels[..., 0] = 20 * c
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    folder = _folder(root / "images")
    write_shards(read_source(f"folder:{folder}"), root / "shards", samples_per_shard=7, progress=False)
    return folder, root / "shards"


def _class_of(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0, 0, 0].long() // 20


def _names(data) -> list[str]:
    return list(data.class_names)


def test_wds_splits_equal_the_folder_splits(packed):
    """The source's splits (and the validation rows carved from its training split), and the
    class splits of the pooled rows. (A carve-out from pooled rows follows the pool's order: the
    folder's files in order, the shard set's training rows, then its test rows.)"""
    folder, shards = packed
    pooled = {"val_fraction": 0.0}
    for options in ({}, {"split": "classes", "test_classes": 2, **pooled}, {"split": "halves", **pooled}):
        a = load_dataset(f"folder:{folder}", stream=True, seed=3, **options)
        b = load_dataset(f"wds:{shards}", seed=3, **options)
        assert b.train.streamed and "wds: sources always are" in b.info["pipeline"]
        assert (a.num_classes, a.open_set, _names(a)) == (b.num_classes, b.open_set, _names(b))
        for side in ("train", "val", "test"):
            sa, sb = getattr(a, side), getattr(b, side)
            paths_a = [sa.data.relative_path(i) for i in range(len(sa))]
            paths_b = [sb.data.relative_path(i) for i in range(len(sb))]
            order = np.argsort(paths_a)
            assert sorted(paths_a) == sorted(paths_b), (options, side)
            by_path = dict(zip(paths_b, sb.y.tolist(), strict=True))
            assert [by_path[paths_a[i]] for i in order] == sa.y[order].tolist(), (options, side)


@pytest.mark.parametrize("workers", [0, 2])
def test_training_batches_carry_the_labels_of_their_rows(packed, workers):
    _, shards = packed
    data = load_dataset(f"wds:{shards}", split="classes", test_classes=2, val_fraction=0.25, seed=1)
    names = _names(data)
    class_of_label = torch.tensor([int(n[1:]) for n in names])
    train = data.train
    loader = Loader(train.data, train.y, ShuffledBatches(len(train), 8, seed=5), workers=workers, seed=5)
    try:
        epochs = []
        for epoch in (0, 1):
            batches = list(loader.epoch(epoch))
            assert len(batches) == len(loader) == len(train) // 8
            assert all(len(b.x) == 8 and b.total == 8 and b.x.dtype == torch.uint8 for b in batches)
            for b in batches:
                assert torch.equal(class_of_label[b.y], _class_of(b.x))
            epochs.append(torch.cat([b.y for b in batches]))
        assert not torch.equal(epochs[0], epochs[1])  # each epoch has its own order
        again = [b.y for b in Loader(train.data, train.y, ShuffledBatches(len(train), 8, seed=5),
                                     workers=workers, seed=5).epoch(0)]  # fmt: skip
        assert torch.equal(torch.cat(again), epochs[0])  # seeded
        # training never reads a validation or test row: every label is a training class
        assert int(torch.cat(epochs).max()) < data.num_classes
    finally:
        loader.close()


def test_evaluation_reads_every_row_of_a_view_once(packed):
    _, shards = packed
    data = load_dataset(f"wds:{shards}", split="classes", test_classes=2, seed=1)
    test = data.test
    n = len(test)
    loader = evaluation_loader(test.data, torch.arange(n), batch_size=5, workers=2)
    rows = torch.cat([b.y for b in loader.epoch()])
    assert sorted(rows.tolist()) == list(range(n))
    subset = torch.tensor([n - 1, 0, 3])  # any rows, in any order: read in shard order, named by row
    loader = evaluation_loader(test.data, torch.arange(n), batch_size=2, workers=0, rows=subset)
    got = list(loader.epoch())
    assert sorted(torch.cat([b.y for b in got]).tolist()) == sorted(subset.tolist())
    assert len(got) == len(loader) == 2


def _copy_as(kind: str, folder, shards, tmp_path) -> str:
    """The folder as a ``wds:`` shard set, a ``csv:`` manifest (the folder's own split in its
    ``split`` column, rows in the folder's order) or a ``rec:`` RecordIO pair (records in the
    folder's order, the split left to the reader's seeded one, as the folder's)."""
    if kind == "wds":
        return f"wds:{shards}"
    raw = read_source(f"folder:{folder}")
    if kind == "csv":
        copy = tmp_path / "copy"
        shutil.copytree(folder, copy)
        rows = [
            f"{x.relative_path(i)},{raw.class_names[int(y[i])]},{side}"
            for x, y, side in ((raw.x_train, raw.y_train, "train"), (raw.x_test, raw.y_test, "test"))
            for i in range(len(x))
        ]
        (copy / "all.csv").write_text("path,label,split\n" + "\n".join(rows) + "\n", encoding="utf-8")
        return f"csv:{copy / 'all.csv'}"
    files = sorted(folder.rglob("*.png"), key=lambda p: (p.parent.name, int(p.stem)))
    write_recordio(
        tmp_path / "rec",
        {k: image_record(raw.class_names.index(p.parent.name), p.read_bytes()) for k, p in enumerate(files)},
    )
    return f"rec:{tmp_path / 'rec'}"


@pytest.mark.parametrize("kind", ["wds", "csv", "rec"])
def test_a_run_from_a_copy_equals_the_run_from_its_folder(packed, tmp_path, kind):
    """Issue 35: the same 1-epoch run from ``folder:``, ``csv:``, ``rec:`` and ``wds:`` copies of one
    data set gives the same metrics."""
    folder, shards = packed

    def run(data, name, **extra):
        cfg = TrainConfig(
            data=data, loss="cosface", model="cnn2d", epochs=2, batch_size=1000, seed=2, num_threads=1,
            val_fraction=0.0, workers=1, embedding_dim=16, data_options={"split": "classes", **extra},
        )  # fmt: skip
        return train(cfg, tmp_path / name, quiet=True, report=False).metrics

    a = run(f"folder:{folder}", "folder", stream=True)
    b = run(_copy_as(kind, folder, shards, tmp_path), kind, **({} if kind == "wds" else {"stream": True}))

    def numbers(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from numbers(v, f"{prefix}{k}.")
            elif isinstance(v, float | int) and not isinstance(v, bool) and k != "train_seconds":
                yield f"{prefix}{k}", float(v)

    na, nb = dict(numbers(a)), dict(numbers(b))
    assert na.keys() == nb.keys() and len(na) > 10
    # one full batch a step: the shards' order changes only the order of a float32 sum
    for key in na:
        assert math.isclose(na[key], nb[key], rel_tol=1e-3, abs_tol=1e-4), (key, na[key], nb[key])


def test_pair_losses_and_stream_false_are_refused_by_name(packed, tmp_path):
    _, shards = packed
    cfg = TrainConfig(data=f"wds:{shards}", loss="circle", model="cnn2d", epochs=1, batch_size=16,
                      val_fraction=0.0, num_threads=1, workers=0)  # fmt: skip
    with pytest.raises((ConfigError, ValueError), match="P×K"):
        train(cfg, tmp_path / "pairs", quiet=True, report=False)
    with pytest.raises(ValueError, match="wds: sources are always streamed"):
        load_dataset(f"wds:{shards}", stream=False)
    with pytest.raises(ValueError, match="needs a folder"):
        load_dataset("wds:")
    data = load_dataset(f"wds:{shards}")
    with pytest.raises(TypeError, match="front to back"):
        data.train.data.read(0)
    with pytest.raises(ValueError, match="P×K"):
        Loader(data.train.data, data.train.y, FixedBatches(torch.arange(4), 2), training=True)


def _config(shards, **extra):
    settings = {
        "data": f"wds:{shards}", "loss": "cosface", "model": "cnn2d", "epochs": 2, "batch_size": 8, "seed": 4,
        "num_threads": 1, "val_fraction": 0.0, "workers": 2, "embedding_dim": 8,
        "data_options": {"split": "classes"},
    }  # fmt: skip
    return TrainConfig(**{**settings, **extra})


def test_resume_at_an_epoch_boundary_is_bit_identical(packed, tmp_path):
    """A shard source's order is a function of (seed, epoch): a run stopped after an epoch and
    resumed ends with the weights of the run that was never stopped (checkpoints are per epoch)."""
    from marginkit.train.checkpoint import load_checkpoint

    _, shards = packed
    whole = train(_config(shards), tmp_path / "whole", quiet=True, report=False)
    train(_config(shards), tmp_path / "cut", quiet=True, report=False, stop_after=1)
    torch.manual_seed(999)
    resumed = train(None, tmp_path / "cut", quiet=True, report=False, resume=True)
    a, b = load_checkpoint(tmp_path / "whole" / "last.pt"), load_checkpoint(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [r["train_loss"] for r in whole.history] == [r["train_loss"] for r in resumed.history]


def test_a_killed_shard_worker_ends_the_run_clearly(packed, tmp_path, monkeypatch):
    import os
    import signal
    import time

    from marginkit.data import shards as shard_module
    from marginkit.train.errors import TrainingError

    _, shards = packed
    parent, decode = os.getpid(), shard_module.ShardSamples._decode

    def killing(self, sample):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return decode(self, sample)

    monkeypatch.setattr(shard_module.ShardSamples, "_decode", killing)
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="data-loading worker process died"):
        train(_config(shards, epochs=1), tmp_path / "run", quiet=True, report=False)
    assert time.monotonic() - t0 < 60


def test_embed_from_shards_equals_embed_from_the_folder(packed, tmp_path):
    """``marginkit embed RUN --data wds:`` embeds every split (an empty one too) with each row's
    relative path, and the same images give the same embeddings as from their folder."""
    from marginkit.cli import main

    folder, shards = packed
    run = tmp_path / "run"
    assert main(["train", "--data", f"wds:{shards}", "--model", "cnn2d", "--loss", "cosface", "--epochs", "1",
                 "--set", "batch_size=16", "--set", "num_threads=1", "--set", "workers=1",
                 "--out", str(run)]) == 0  # fmt: skip
    assert main(["embed", str(run), "--data", f"wds:{shards}", "--out", str(tmp_path / "wds.npz")]) == 0
    from marginkit.train import load_run
    from marginkit.train.evaluate import embed

    model = load_run(run, "best")["model"]
    a, folder_splits = (
        np.load(tmp_path / "wds.npz"),
        load_dataset(f"folder:{folder}", stream=True, val_fraction=0.0),
    )
    assert len(a["val_paths"]) == 0 and len(a["train_paths"]) == 60
    for split in ("train", "test"):
        data = getattr(folder_splits, split).data
        want = dict(
            zip([data.relative_path(i) for i in range(len(data))], embed(model, data).numpy(), strict=True)
        )
        got = dict(zip(a[f"{split}_paths"].tolist(), a[f"{split}_embeddings"], strict=True))
        assert got.keys() == want.keys(), split
        for path, row in got.items():
            np.testing.assert_allclose(row, want[path], atol=1e-5, err_msg=path)


def test_a_pooled_views_whole_array_keeps_its_rows_order(packed):
    """``Split.x`` of a shard source (what the baselines read) holds row i at position i, though
    the shards deliver rows in shard order."""
    folder, shards = packed
    a = load_dataset(f"folder:{folder}", stream=True, split="classes", test_classes=2, val_fraction=0.0)
    b = load_dataset(f"wds:{shards}", split="classes", test_classes=2, val_fraction=0.0)
    for side in ("train", "test"):
        sa, sb = getattr(a, side), getattr(b, side)
        xb = sb.x
        classes = torch.tensor([int(b.class_names[int(y)][1:]) for y in sb.y])
        assert torch.equal(_class_of((xb * 255).round().to(torch.uint8)), classes)
        by_path = {sa.data.relative_path(i): i for i in range(len(sa))}
        xa = sa.x
        for i in range(len(sb)):
            assert torch.equal(xb[i], xa[by_path[sb.data.relative_path(i)]])
