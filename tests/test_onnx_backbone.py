"""``onnx:FILE`` backbones: an insightface-style ONNX ResNet converted by onnx2torch, checked against
onnxruntime, validated as a hostile file, trained, frozen, exported, embedded and served.

The ONNX files are made here by exporting a small torch model with torch's TorchScript-based
exporter at opset 11, as insightface's ArcFace models were (``Conv``, ``BatchNormalization``,
``PRelu``, ``Add``, ``Flatten``, ``Gemm`` and a final ``BatchNormalization``: its ``features`` layer).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from marginkit.models.external import import_library

onnx = import_library("onnx")
import_library("onnx2torch")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from marginkit.cli import main  # noqa: E402
from marginkit.models import build_model  # noqa: E402
from marginkit.models.onnx_backbone import OnnxBackbone  # noqa: E402
from marginkit.train import TrainConfig, train  # noqa: E402
from marginkit.train.config import ConfigError, apply_overrides  # noqa: E402
from marginkit.train.trainer import load_run, load_splits  # noqa: E402

SIZE = 16  # the ONNX model's own input size: digits' 8x8 images are resized to it


class Block(nn.Module):
    """insightface's IBasicBlock: BN, conv, BN, PReLU, strided conv, BN, plus the shortcut."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.bn2, self.prelu = nn.BatchNorm2d(cout), nn.PReLU(cout)
        self.conv2, self.bn3 = nn.Conv2d(cout, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, 2, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + self.down(x)


class IResNet(nn.Module):
    """A two-block insightface IResNet: stem, blocks, BN, dropout, flatten, fc, BatchNorm1d features."""

    def __init__(self, size: int = SIZE, width: int = 8, dim: int = 24) -> None:
        super().__init__()
        self.conv1, self.bn1, self.prelu = (
            nn.Conv2d(3, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.PReLU(width),
        )
        self.layer1, self.layer2 = Block(width, width), Block(width, 2 * width)
        self.bn2, self.dropout = nn.BatchNorm2d(2 * width), nn.Dropout(0.0)
        self.fc, self.features = nn.Linear(2 * width * (size // 4) ** 2, dim), nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.prelu(self.bn1(self.conv1(x)))))
        return self.features(self.fc(torch.flatten(self.dropout(self.bn2(x)), 1)))


def export_onnx(module: nn.Module, path: Path, shape: tuple[int, ...], *, dynamic_hw: bool = False) -> Path:
    axes = {0: "None", **({2: "h", 3: "w"} if dynamic_hw else {})}
    with warnings.catch_warnings():  # the TorchScript-based exporter is deprecated
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (torch.randn(2, *shape),), str(path), input_names=["input.1"],
            output_names=["fc1"], dynamic_axes={"input.1": axes}, opset_version=11, dynamo=False,
        )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def iresnet_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    net = IResNet()
    with torch.no_grad():  # trained-looking statistics, so that batch norm is not the identity
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
            if isinstance(m, nn.PReLU):
                m.weight.uniform_(0.1, 0.4)
    return export_onnx(net, tmp_path_factory.mktemp("onnx") / "w600k_tiny.onnx", (3, SIZE, SIZE))


def _config(path: Path, **extra) -> TrainConfig:
    base = {"data": "digits", "loss": "cosface", "model": f"onnx:{path}", "embedding_dim": 16, "epochs": 1,
            "batch_size": 64, "num_threads": 1, "k": 3}  # fmt: skip
    return apply_overrides(TrainConfig(), {**base, **extra})


# ---------------------------------------------------------------------- conversion
def test_the_converted_graph_equals_onnxruntime(iresnet_file, gen):
    ops = {n.op_type for n in onnx.load(str(iresnet_file)).graph.node}
    assert {"Conv", "BatchNormalization", "PRelu", "Add", "Flatten", "Gemm"} <= ops  # insightface's ops
    model = build_model(f"onnx:{iresnet_file}", (1, 8, 8), embedding_dim=16)
    assert isinstance(model, OnnxBackbone) and model.image_size == (SIZE, SIZE) and model.channels == 3
    model.eval()
    session = ort.InferenceSession(str(iresnet_file), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 3, SIZE, SIZE, generator=gen)
    want = session.run(None, {"input.1": x.numpy()})[0]
    with torch.no_grad():
        got = model.net(x).numpy()
    assert got.shape == (5, 24)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # inputs: grey repeated, resized to the file's 16x16, insightface's (p - 127.5) / 127.5
    images = torch.rand(5, 1, 8, 8, generator=gen)
    big = nn.functional.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    expected = (big * 255 - 127.5) / 127.5
    torch.testing.assert_close(model.adapt(images), expected.expand(-1, 3, -1, -1), rtol=0, atol=1e-6)
    with torch.no_grad():
        want = session.run(None, {"input.1": expected.expand(-1, 3, -1, -1).contiguous().numpy()})[0]
        np.testing.assert_allclose(model.features(images).numpy(), want, rtol=0, atol=1e-5)


def test_every_weight_trains_and_batch_norm_follows_the_data(iresnet_file, gen):
    model = build_model(f"onnx:{iresnet_file}", (3, SIZE, SIZE), embedding_dim=16)
    params = dict(model.named_parameters())
    assert all(p.requires_grad for p in params.values())
    slopes = [n for n in params if "initializer" in n]  # PReLU slopes: initializers made parameters
    assert len(slopes) == 3 and all(params[n].shape[1:] == (1, 1) for n in slopes)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) >= 3 and any(isinstance(m, nn.BatchNorm1d) for m in norms)  # the features layer
    before = {n: p.detach().clone() for n, p in params.items()}
    stats = [m.running_mean.clone() for m in norms]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    target = torch.randn(8, 16, generator=gen)  # not a function of the norm alone: unit rows
    (model(torch.rand(8, 3, SIZE, SIZE, generator=gen)) * target).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in params.items()), [
        n for n, p in params.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)
    ]
    opt.step()
    assert [n for n, p in params.items() if torch.equal(before[n], p)] == []
    assert all(not torch.equal(a, m.running_mean) for a, m in zip(stats, norms, strict=True))


def test_freeze_counts_the_graphs_operators(iresnet_file):
    model = build_model(f"onnx:{iresnet_file}", (1, 8, 8), embedding_dim=16)
    stages = model.stage_modules()
    kinds = [type(s.op).__name__ for s in stages]
    assert kinds[:3] == ["Conv2d", "OnnxPReLU", "BatchNorm2d"]  # stem conv (its BN folded), PReLU, block BN
    assert kinds[-2:] == ["Linear", "BatchNorm1d"]  # fc and the features layer
    model.freeze(2)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"net.conv1/Conv.weight", "net.conv1/Conv.bias", "net.initializers.onnx_initializer_0"}
    model.freeze("trunk")
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "projection.weight",
        "projection.bias",
    ]
    model.train()
    assert not any(m.training for m in model.net.modules())
    with pytest.raises(ValueError, match="no gradient checkpointing"):
        model.set_grad_checkpointing(True)


# ---------------------------------------------------------------------- hostile files
def _graph(path: Path, nodes, inputs, outputs, initializers=(), opset=11, domains=()) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    onnx.save(helper.make_model(graph, opset_imports=imports), str(path))
    return path


def _image(name="x", shape=(None, 3, 8, 8), elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _det_graph(d: Path) -> Path:  # Det: a standard operator onnx2torch has no converter for
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Det", ["w"], ["d"]),
             helper.make_node("Mul", ["f", "d"], ["y"])]  # fmt: skip
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    return _graph(d / "det.onnx", nodes, [_image()], [_image("y", (None, 192))], [w])


def _custom_domain(d: Path) -> Path:
    node = helper.make_node("FusedConv", ["x"], ["y"], domain="com.microsoft")
    return _graph(
        d / "ms.onnx", [node], [_image()], [_image("y", (None, 3, 8, 8))], domains=["com.microsoft"]
    )


def _external(d: Path) -> Path:
    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("float_data")
    w.external_data.add(key="location", value="../../etc/passwd")
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Mul", ["f", "w"], ["y"])]
    return _graph(d / "ext.onnx", nodes, [_image()], [_image("y", (None, 192))], [w])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _flat(d: Path, name: str, inputs, out_shape=(None, 192)) -> Path:
    nodes = [helper.make_node("Flatten", [inputs[0].name], ["y"])]
    return _graph(d / name, nodes, inputs, [_image("y", out_shape)])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "none.onnx", "does not exist"),
        (lambda d: d, "is not a file"),
        (lambda d: _write(d / "junk.onnx", b"\xff" * 64), "is not an ONNX model"),
        (lambda d: _write(d / "empty.onnx", b""), "not a valid ONNX model"),
        (_det_graph, r"cannot convert to PyTorch: Det \(opset 11\)"),
        (_custom_domain, r"com\.microsoft\.FusedConv"),
        (_external, "external data files"),
        (lambda d: _flat(d, "seq.onnx", [_image("x", (None, 40, 80))], (None, 3200)),
         r"\[\?, 40, 80\].*\[N, C, H, W\]"),
        (lambda d: _flat(d, "int.onnx", [_image("x", elem=TensorProto.INT64)]), "int64|type 7"),
        (lambda d: _flat(d, "two.onnx", [_image("x"), _image("z")]), "2 input"),
        (lambda d: _flat(d, "open.onnx", [_image("x", (None, 3, "h", "w"))], (None, None)),
         "set model_options.image_size"),
    ],
)  # fmt: skip
def test_bad_onnx_files_are_refused_naming_the_problem(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        build_model(f"onnx:{path}", (1, 8, 8), embedding_dim=4)


def test_size_bound_options_and_channels_are_checked(tmp_path, iresnet_file, monkeypatch):
    from marginkit.models import onnx_backbone

    name = f"onnx:{iresnet_file}"
    with pytest.raises(ValueError, match="fixes its input at 16x16.*got \\[24, 24\\]"):
        build_model(name, (1, 8, 8), image_size=24)
    with pytest.raises(ValueError, match="model_options.std must be a number or 3 positive"):
        build_model(name, (1, 8, 8), std=[0.5, 0.0, 0.5])
    with pytest.raises(ValueError, match="model_options.mean must be a number or 3"):
        build_model(name, (1, 8, 8), mean=[0.5, 0.5])
    with pytest.raises(ValueError, match="3-channel images .* 2 channels"):
        build_model(name, (2, 8, 8))
    with pytest.raises(ValueError, match="unknown option 'size'"):
        build_model(name, (1, 8, 8), size=16)
    imagenet = build_model(name, (3, SIZE, SIZE), mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    x = torch.rand(2, 3, SIZE, SIZE)
    want = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor(
        [0.229, 0.224, 0.225]
    ).view(1, 3, 1, 1)
    torch.testing.assert_close(imagenet.adapt(x), want)
    assert build_model(**imagenet.config).config == imagenet.config  # config rebuilds it
    monkeypatch.setattr(onnx_backbone, "MAX_ONNX_BYTES", 1000)
    with pytest.raises(ValueError, match="more than an ONNX file can hold"):
        build_model(name, (1, 8, 8))


def test_symbolic_sizes_take_image_size(tmp_path):
    class Pooled(nn.Module):  # convolutions and global pooling: any size
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)

        def forward(self, x):
            return self.bn(self.conv(x)).mean(dim=(2, 3))

    path = export_onnx(Pooled(), tmp_path / "pooled.onnx", (3, 12, 12), dynamic_hw=True)
    model = build_model(f"onnx:{path}", (1, 8, 8), embedding_dim=4, image_size=20)
    assert model.image_size == (20, 20) and model.projection.in_features == 6
    assert model(torch.rand(3, 1, 8, 8)).shape == (3, 4)


def test_runs_refuse_unsupported_graphs_and_pretrained(tmp_path, iresnet_file, capsys):
    bad = _det_graph(tmp_path)
    code = main(["train", "--data", "digits", "--loss", "cosface", "--backbone", f"onnx:{bad}",
                 "--epochs", "1", "--out", str(tmp_path / "run"), "-q", "--no-report"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "Det (opset 11)" in err and "onnx2torch" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="starts from the file's own weights"):
        _config(iresnet_file, pretrained=True)
    relative = _config(Path("models") / "m.onnx")  # made absolute: the run finds it from anywhere
    assert relative.model == f"onnx:{Path.cwd() / 'models' / 'm.onnx'}"


# ---------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def onnx_run(iresnet_file, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("onnx-run") / "run"
    result = train(_config(iresnet_file), run, quiet=True, report=False)
    assert result.finished and result.metrics["knn_accuracy"] > 0.3  # 10 digits: chance is 0.1
    return run


@pytest.mark.slow
def test_train_export_embed_serve(onnx_run, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from marginkit.export import export_model
    from marginkit.gallery import Gallery
    from marginkit.serve import create_app

    run = load_run(onnx_run)
    x = load_splits(run["config"]).test.x
    bundle = export_model(onnx_run, "onnx", tmp_path / "bundle")
    got = bundle.embed(x.numpy(), preprocessed=True)
    with torch.no_grad():
        eager = run["model"](x).numpy()
    np.testing.assert_allclose(got, eager, rtol=0, atol=1e-5)
    assert main(["embed", str(onnx_run), "--out", str(tmp_path / "e.npz"), "--split", "test", "-q"]) == 0
    with np.load(tmp_path / "e.npz") as z:
        np.testing.assert_allclose(got, z["test_embeddings"], rtol=0, atol=1e-4)
    gallery = Gallery(tmp_path / "g.db", bundle, far=1e-2)
    with TestClient(create_app(bundle, gallery)) as client:
        r = client.post("/enroll", json={"identity": "a", "inputs": x[:2].numpy().tolist()})
        assert r.status_code == 200, r.text
        r = client.post("/identify", json={"inputs": x[:1].numpy().tolist(), "k": 1})
        assert r.json()["results"][0]["candidates"][0]["identity"] == "a"


def test_freeze_trunk_changes_only_the_new_layers(iresnet_file, onnx_run, tmp_path):
    start = torch.load(onnx_run / "best.pt", weights_only=True)["model"]
    config = _config(iresnet_file, init_from=str(onnx_run), freeze="trunk", train_per_class=30)
    train(config, tmp_path / "ft", quiet=True, report=False)
    after = torch.load(tmp_path / "ft" / "last.pt", weights_only=True)["model"]
    trunk = [k for k in start if k.startswith("net.")]
    assert any("running_mean" in k for k in trunk)  # batch-norm statistics are compared too
    assert all(torch.equal(start[k], after[k]) for k in trunk), [
        k for k in trunk if not torch.equal(start[k], after[k])
    ]
    assert not torch.equal(start["projection.weight"], after["projection.weight"])


def _digits_5_to_9(directory: Path) -> str:
    from marginkit.data import load_dataset

    data = load_dataset("digits", val_fraction=0.0)
    names = np.array(data.class_names)
    arrays = {}
    for split in ("train", "test"):
        part = getattr(data, split)
        keep = np.isin(names[part.y.numpy()], ["5", "6", "7", "8", "9"])
        arrays[f"{split}_images"] = np.round(part.x[keep, 0].numpy() * 255).astype(np.uint8)
        arrays[f"{split}_labels"] = part.y[keep].numpy()
    np.savez(directory / "digits5to9.npz", **arrays)
    return f"npz:{directory / 'digits5to9.npz'}"


@pytest.mark.slow
def test_init_from_digits_0_to_4_beats_scratch_on_5_to_9(iresnet_file, tmp_path):
    """The ONNX backbone trained on digits 0-4 (class-disjoint: no 5-9 seen), then on 5-9 at 10
    images per digit for 10 epochs: from that run against from the file's own (random) weights,
    same data, budget and seed, 5 seeds; K-NN accuracy on every test image of 5-9. Measured gains
    -0.004, -0.018, +0.004, +0.093, 0.000 (mean +0.015): a small model after 8 epochs on five
    digits, better on average, not on every seed (docs/finetune.md has the 10-seed benchmark)."""
    pre = _config(iresnet_file, epochs=8, data_options={"split": "classes", "test_classes": [5, 6, 7, 8, 9]})
    train(pre, tmp_path / "pre", quiet=True, report=False)
    new = _digits_5_to_9(tmp_path)
    gains = []
    for seed in range(5):
        base = {
            "data": new,
            "train_per_class": 10,
            "val_fraction": 0.0,
            "epochs": 10,
            "batch_size": 25,
            "seed": seed,
        }
        ft = train(_config(iresnet_file, init_from=str(tmp_path / "pre"), **base), tmp_path / f"ft{seed}",
                   quiet=True, report=False)  # fmt: skip
        scratch = train(_config(iresnet_file, **base), tmp_path / f"s{seed}", quiet=True, report=False)
        gains.append(ft.metrics["knn_accuracy"] - scratch.metrics["knn_accuracy"])
    assert sum(gains) / len(gains) > 0.01, gains
