"""marginkit.export: exported models equal PyTorch, bundles hold what they claim, hostile bundles fail."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import marginkit.models
from marginkit.audio.models import SPEAKER_MODELS  # registers them: the same list in every worker
from marginkit.cli import main
from marginkit.export import BundleError, NpzError, export_model, load_bundle, read_npz
from marginkit.export.model_file import load_model_file, write_model_file
from marginkit.models import build_model
from marginkit.train.evaluate import embed
from marginkit.train.trainer import load_run, load_splits

BACKBONES = {
    "mlp": ((20,), {"hidden": [16]}),
    "cnn1d": ((2, 24), {"channels": [8, 16]}),
    "cnn2d": ((1, 12, 12), {"channels": [8, 16]}),
    "resnet": ((3, 16, 16), {"width": 8, "blocks": [1, 1]}),
}


def test_every_backbone_is_covered():
    # the speaker backbones' ONNX export (waveform in, fbank in the graph) is tested in
    # tests/test_audio_models.py
    assert set(BACKBONES) == set(marginkit.models.MODELS) - set(SPEAKER_MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BACKBONES))
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_exported_backbone_equals_pytorch(tmp_path, gen, name, fmt):
    shape, options = BACKBONES[name]
    model = build_model(name, shape, embedding_dim=12, **options)
    model.train()
    with torch.no_grad():  # non-trivial batch-norm running statistics
        for _ in range(3):
            model(torch.randn(16, *shape, generator=gen) * 2 + 0.5)
    model.eval()
    path = tmp_path / f"model.{fmt}"
    write_model_file(model, shape, path, fmt)
    run = load_model_file(path, fmt)
    assert model.training is False  # the caller's module is untouched
    for batch in (1, 7):  # the batch axis is dynamic
        x = torch.randn(batch, *shape, generator=gen)
        with torch.no_grad():
            want = model(x).numpy()
        got = run(x.numpy())
        assert got.shape == (batch, 12)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_bundle_model_equals_pytorch_on_the_runs_test_set(tiny_run, onnx_bundle, tmp_path, fmt):
    bundle = onnx_bundle if fmt == "onnx" else export_model(tiny_run, "torchscript", tmp_path / "ts")
    run = load_run(tiny_run)
    splits = load_splits(run["config"])
    want = embed(run["model"], splits.test.x)
    got = bundle.embed(splits.test.x, preprocessed=True)
    assert got.shape == want.shape and len(got) == len(splits.test)
    assert float((got - want).abs().max()) <= 1e-5
    # raw inputs (uint8 images here) go through the run's preprocessing
    raw = np.round(splits.test.x[:10].numpy() * 255).astype(np.uint8)
    np.testing.assert_allclose(
        bundle.embed(raw).numpy(),
        embed(run["model"], torch.from_numpy(raw / np.float32(255))).numpy(),
        atol=1e-5,
    )


def test_bundle_holds_index_classes_calibration_and_fingerprint(tiny_run, onnx_bundle):
    run = load_run(tiny_run)
    splits = load_splits(run["config"])
    m = onnx_bundle.manifest
    assert m["format"] == "marginkit.bundle" and m["version"] == 1
    assert onnx_bundle.model_fingerprint == run["fingerprint"]
    assert onnx_bundle.class_names == [str(i) for i in range(10)]
    assert onnx_bundle.input_shape == (1, 8, 8) and onnx_bundle.input_kind == "image"
    assert {p.name for p in onnx_bundle.path.iterdir()} == {
        "manifest.json",
        "model.onnx",
        "knn_index.npz",
        "examples.npz",
    }

    knn = onnx_bundle.knn()
    train = embed(run["model"], splits.train.x)
    test = embed(run["model"], splits.test.x)
    assert knn.k == run["config"].k and knn.num_references == len(splits.train)
    sims = torch.nn.functional.normalize(test) @ torch.nn.functional.normalize(train).T
    votes = splits.train.y[sims.topk(knn.k, dim=1).indices]
    brute = torch.stack([torch.bincount(v, minlength=10) for v in votes]).argmax(1)
    assert (knn.predict(test) == brute).float().mean() >= 0.99  # near-ties may round either way

    # calibration: thresholds from the validation pairs by brute force
    val = torch.nn.functional.normalize(embed(run["model"], splits.val.x)).double()
    s = val @ val.T
    i, j = torch.triu_indices(len(val), len(val), 1)
    same = splits.val.y[i] == splits.val.y[j]
    impostor = torch.sort(s[i, j][~same], descending=True).values
    cal = onnx_bundle.calibration
    assert cal["num_impostor"] == len(impostor) and cal["num_genuine"] == int(same.sum())
    for row in cal["rows"]:
        m_allowed = int(np.floor(row["far"] * len(impostor) + 1e-9))
        if m_allowed < 1:
            assert row["threshold"] is None
            with pytest.raises(ValueError, match="impostor pairs"):
                onnx_bundle.threshold(row["far"])
        else:
            assert row["threshold"] == pytest.approx(float(impostor[m_allowed]), abs=1e-6)
            assert onnx_bundle.threshold(row["far"]) == row["threshold"]
            # realised FAR <= target (float32 pair scores: compare at their resolution)
            assert float((impostor > row["threshold"] + 1e-6).double().mean()) <= row["far"]
    assert [row["far"] for row in cal["rows"]] == [1e-2, 1e-3, 1e-4]


def test_calibration_table_without_pairs_says_why():
    from marginkit.export import calibration_table
    from marginkit.export.calibration import threshold_at

    e = torch.nn.functional.normalize(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    for labels, why in [
        (torch.tensor([0]), "no pair"),
        (torch.tensor([1, 1, 1, 1]), "no impostor"),
        (torch.tensor([0, 1, 2, 3]), "no genuine"),
    ]:
        table = calibration_table(e[: len(labels)], labels)
        assert why in table["unavailable"] and all(r["threshold"] is None for r in table["rows"])
        with pytest.raises(ValueError, match=why):
            threshold_at(table, 1e-2)
    with pytest.raises(ValueError, match="has FARs 0.01, 0.001, 0.0001"):
        threshold_at(table, 0.05)


def test_standardised_vectors_round_trip(tmp_path):
    from marginkit.train.config import TrainConfig
    from marginkit.train.trainer import train

    config = TrainConfig(
        data="breast_cancer", loss="softmax", model="mlp", model_options={"hidden": [16]}, embedding_dim=8,
        epochs=1, batch_size=64, num_threads=1, k=3,
    )  # fmt: skip
    train(config, tmp_path / "run", quiet=True, report=False)
    bundle = export_model(tmp_path / "run", "onnx", tmp_path / "bundle", examples=4)
    assert bundle.manifest["input"]["standardized"] and (bundle.path / "preprocessing.npz").is_file()
    run = load_run(tmp_path / "run")
    splits = load_splits(run["config"])
    raw = splits.test.x * run["facts"]["std"] + run["facts"]["mean"]  # back to the raw features
    got, want = bundle.embed(raw.numpy()), embed(run["model"], splits.test.x)
    assert float((got - want).abs().max()) <= 1e-5
    assert bundle.calibration["rows"][0]["threshold"] is not None


def test_cli_export(tiny_run, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["export", str(tiny_run), "--format", "onnx", "--out", str(out), "--examples", "2"]) == 0
    text = capsys.readouterr().out
    assert "bundle" in text and "FAR 1e-02" in text
    assert load_bundle(out).manifest["examples"]["count"] == 2
    assert main(["export", str(tiny_run), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "c")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------- hostile bundles
def tampered(bundle, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    result = edit(copy, manifest)
    if result is not False:
        (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def set_key(*path, value):
    def edit(_root, manifest):
        obj = manifest
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return edit


def _replace_model(root, manifest):
    (root / "model.onnx").write_bytes(b"garbage")


def _pickled_index(root, manifest):
    with zipfile.ZipFile(root / "knn_index.npz", "w") as z:
        buf = io.BytesIO()
        np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
        z.writestr("labels.npy", buf.getvalue())
    import hashlib

    manifest["knn_index"]["sha256"] = hashlib.sha256((root / "knn_index.npz").read_bytes()).hexdigest()


def _symlinked_model(root, manifest):
    (root / "model.onnx").rename(root / "real.onnx")
    (root / "model.onnx").symlink_to(root / "real.onnx")


def _not_json(root, manifest):
    (root / "manifest.json").write_text("{not json")
    return False


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_not_json, "not valid JSON"),
        (set_key("version", value=99), "version 99"),
        (set_key("format", value="other"), "not a marginkit bundle"),
        (set_key("model", "file", value="../model.onnx"), "plain file name"),
        (set_key("model", "format", value="pickle"), "model.format"),
        (set_key("input", "shape", value=[1, "8", 8]), "input.shape"),
        (set_key("input", "shape", value=[1, 8, 9]), "does not run|differ"),
        (set_key("embedding", "dim", value=True), "embedding.dim"),
        (set_key("model_fingerprint", value="sha256:xyz"), "model_fingerprint"),
        (set_key("calibration", "rows", value=[{"far": 2.0, "threshold": 0.1}]), "far"),
        (set_key("calibration", "rows", value=[{"far": 0.01, "threshold": "high"}]), "threshold"),
        (_replace_model, "SHA-256"),
        (_symlinked_model, "not a regular file"),
    ],
)
def test_hostile_bundles_fail_naming_the_file(onnx_bundle, tmp_path, edit, match):
    path = tampered(onnx_bundle, tmp_path, edit)
    with pytest.raises(BundleError, match=match) as info:
        load_bundle(path)
    assert str(path) in str(info.value)


def test_a_pickled_index_is_never_unpickled(onnx_bundle, tmp_path):
    path = tampered(onnx_bundle, tmp_path, _pickled_index)
    bundle = load_bundle(path)  # the index loads lazily, on first use
    with pytest.raises(BundleError, match="knn_index.npz.*dtype object"):
        bundle.knn()


def test_wrong_model_is_caught_by_the_examples(onnx_bundle, tmp_path):
    import hashlib

    other = build_model("mlp", (1, 8, 8), embedding_dim=16, hidden=[32]).eval()

    def swap(root, manifest):
        write_model_file(other, (1, 8, 8), root / "model.onnx", "onnx")
        manifest["model"]["sha256"] = hashlib.sha256((root / "model.onnx").read_bytes()).hexdigest()

    with pytest.raises(BundleError, match="differ from PyTorch"):
        load_bundle(tampered(onnx_bundle, tmp_path, swap))


def test_torchscript_needs_trust(tiny_run, tmp_path):
    export_model(tiny_run, "torchscript", tmp_path / "ts", examples=2)
    with pytest.raises(BundleError, match="executes code"):
        load_bundle(tmp_path / "ts")
    assert load_bundle(tmp_path / "ts", trust_torchscript=True).format == "torchscript"


def test_missing_or_non_bundle_directories(tmp_path):
    with pytest.raises(BundleError, match="no bundle directory"):
        load_bundle(tmp_path / "absent")
    with pytest.raises(BundleError, match="manifest.json: missing"):
        load_bundle(tmp_path)


# ---------------------------------------------------------------------- npz reader
def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def test_read_npz_bounds_and_refusals():
    data = npz_bytes(x=np.arange(12, dtype=np.float32).reshape(3, 4), s=np.array("meta"))
    got = read_npz(data, where="f", max_bytes=10_000, required=("x",))
    np.testing.assert_array_equal(got["x"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert str(got["s"]) == "meta"
    with pytest.raises(NpzError, match="exceeds the limit"):
        read_npz(data, where="f", max_bytes=40)
    with pytest.raises(NpzError, match="missing array"):
        read_npz(data, where="f", max_bytes=10_000, required=("y",))
    with pytest.raises(NpzError, match="unexpected array"):
        read_npz(data, where="f", max_bytes=10_000, names=("x",))
    with pytest.raises(NpzError, match="not an .npz"):
        read_npz(b"hello", where="f", max_bytes=100)
    with pytest.raises(NpzError, match="dtype object"):
        buf = io.BytesIO()
        np.save(buf, np.array([1, None], dtype=object), allow_pickle=True)
        z = io.BytesIO()
        with zipfile.ZipFile(z, "w") as zf:
            zf.writestr("x.npy", buf.getvalue())
        read_npz(z.getvalue(), where="f", max_bytes=10_000)
    # a header that claims a huge array is refused before any data is read
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**6)}
    )
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + b"\0" * 64)
    with pytest.raises(NpzError, match="exceeds the limit"):
        read_npz(z.getvalue(), where="f", max_bytes=2**30)
    with pytest.raises(NpzError, match="truncated"):
        z = io.BytesIO()
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f4", "fortran_order": False, "shape": (100,)}
        )
        with zipfile.ZipFile(z, "w") as zf:
            zf.writestr("x.npy", b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + b"\0" * 8)
        read_npz(z.getvalue(), where="f", max_bytes=10_000)
