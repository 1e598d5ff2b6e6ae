"""timm / torchvision backbones end to end: build, adapt inputs, train, export, serve, starting weights.

These tests need timm and torchvision importable beside this torch. torchvision's compiled
operators load only with the torch build they were made for; where none exists for the pinned
torch (the project's build machines: torch 2.13.0 CPU, see docs/finetune.md) the whole module is
skipped with the import error as its reason. Run them in an environment that has both, e.g.
``pip install torch==2.14.1 torchvision==0.29.1 timm`` then ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from marginkit.models.external import import_library

try:
    import_library("timm")
    import_library("torchvision")
except ImportError as exc:  # the reason is shown by pytest -rs
    pytest.skip(f"timm / torchvision not usable here: {exc}", allow_module_level=True)

import timm
import torchvision
from torchvision.transforms.v2 import functional as TF

from marginkit.models import build_model
from marginkit.train import TrainConfig, train
from marginkit.train.errors import ConfigError
from marginkit.train.trainer import load_run, load_splits

E2E = {  # the two models of the issue, at 32 px (a CPU trains them in seconds)
    "timm:resnet18": {"image_size": 32},
    "torchvision:mobilenet_v3_small": {"image_size": 32},
}


def _config(model: str, **extra) -> TrainConfig:
    return TrainConfig(
        data="digits", loss="cosface", model=model, model_options=dict(E2E[model]), embedding_dim=16,
        epochs=1, batch_size=64, num_threads=1, k=3, precise_bn=512, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("timm:resnet18", lambda: timm.data.resolve_data_config({}, model=timm.create_model("resnet18"))),
        (
            "torchvision:mobilenet_v3_small",
            lambda: vars(torchvision.models.MobileNet_V3_Small_Weights.DEFAULT.transforms()),
        ),
    ],
)
def test_inputs_are_adapted_with_the_models_own_statistics(name, reference, gen):
    model = build_model(name, (1, 8, 8), embedding_dim=8, image_size=24)
    x = torch.rand(3, 1, 8, 8, generator=gen)
    ref = reference()
    want = TF.normalize(
        TF.resize(x.expand(-1, 3, -1, -1), [24, 24], antialias=False), list(ref["mean"]), list(ref["std"])
    )
    torch.testing.assert_close(model.adapt(x), want, rtol=0, atol=1e-6)
    default = build_model(name, (1, 8, 8), embedding_dim=8)
    assert default.image_size == (224, 224)  # the pretrained config's input size
    assert default(x).shape == (3, 8)


def test_unknown_models_and_wrong_channels_are_named():
    with pytest.raises(ValueError, match="timm has no model 'resnet181'.*resnet18"):
        build_model("timm:resnet181", (1, 8, 8))
    with pytest.raises(ValueError, match="torchvision has no model"):
        build_model("torchvision:mobilenet_v9", (1, 8, 8))
    with pytest.raises(ValueError, match="3-channel images"):
        build_model("timm:resnet18", (2, 8, 8))
    with pytest.raises(ValueError, match="expects images"):
        build_model("timm:resnet18", (40,))


@pytest.mark.slow
@pytest.mark.parametrize("model", list(E2E))
def test_train_export_serve_end_to_end(model, tmp_path, capsys):
    """Train 1 epoch on digits, export ONNX (within 1e-5 of eager PyTorch), serve one identify."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from marginkit.export import export_model
    from marginkit.gallery import Gallery
    from marginkit.serve import create_app

    t0 = time.perf_counter()
    result = train(_config(model), tmp_path / "run", quiet=True, report=False)
    t_train = time.perf_counter() - t0
    assert result.finished and result.metrics["knn_accuracy"] > 0.3  # 10 classes: chance is 0.1
    run = load_run(tmp_path / "run")
    x = load_splits(run["config"]).test.x[:40]
    with torch.no_grad():
        eager = run["model"](x)
    t0 = time.perf_counter()
    bundle = export_model(tmp_path / "run", "onnx", tmp_path / "bundle")
    t_export = time.perf_counter() - t0
    got = bundle.embed(x.numpy(), preprocessed=True)
    assert float((got - eager).abs().max()) <= 1e-5
    t0 = time.perf_counter()
    gallery = Gallery(tmp_path / "g.db", bundle, far=1e-2)
    with TestClient(create_app(bundle, gallery)) as client:
        r = client.post("/enroll", json={"identity": "a", "inputs": x[:2].numpy().tolist()})
        assert r.status_code == 200, r.text
        r = client.post("/identify", json={"inputs": x[:1].numpy().tolist(), "k": 1})
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["candidates"][0]["identity"] == "a"
    t_serve = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\n{model}: train 1 epoch {t_train:.1f} s, export {t_export:.1f} s, serve {t_serve:.1f} s")


def test_library_state_dicts_start_the_trunk(tmp_path):
    """A timm state dict as the library saves it (classifier included) starts the trunk."""
    from safetensors.torch import save_file

    source = timm.create_model("resnet18", num_classes=7)  # as a downloaded checkpoint: fc included
    save_file(source.state_dict(), str(tmp_path / "model.safetensors"))
    config = _config("timm:resnet18", weights=str(tmp_path / "model.safetensors"))
    train(config, tmp_path / "run", quiet=True, report=False, stop_after=0)
    start = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    for key, value in source.state_dict().items():
        if not key.startswith("fc."):
            assert torch.equal(start[f"net.{key}"], value), key


def test_pretrained_without_network_says_where_to_put_the_file(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    config = _config("torchvision:mobilenet_v3_small", pretrained=True)
    with pytest.raises(ConfigError, match=r"download https://\S+ elsewhere and put it at .*checkpoints"):
        train(config, tmp_path / "tv", quiet=True, report=False, stop_after=0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = _config("timm:resnet18", pretrained=True)
    with pytest.raises(ConfigError, match="model.safetensors of the Hugging Face repository 'timm/resnet18"):
        train(config, tmp_path / "timm", quiet=True, report=False, stop_after=0)


def test_freeze_stages_and_checkpointing(gen):
    model = build_model("timm:resnet18", (1, 16, 16), embedding_dim=8, image_size=32)
    assert len(model.stage_modules()) == 5  # stem, layer1..layer4 (timm's coarse groups)
    model.freeze(2)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("net.conv1") for n in frozen) and any(n.startswith("net.layer1") for n in frozen)
    assert not any(n.startswith(("net.layer2", "projection")) for n in frozen)
    model.train()
    assert not model.net.bn1.training and model.net.layer2[0].bn1.training
    plain = build_model("timm:resnet18", (1, 16, 16), embedding_dim=8, image_size=32)
    ckpt = build_model("timm:resnet18", (1, 16, 16), embedding_dim=8, image_size=32)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(True)
    x = torch.rand(4, 1, 16, 16, generator=gen)
    plain.train()(x).sum().backward()
    ckpt.train()(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    with pytest.raises(ValueError, match="torchvision models offer no gradient checkpointing"):
        build_model("torchvision:mobilenet_v3_small", (1, 8, 8)).set_grad_checkpointing(True)


def test_resume_is_bit_identical_with_a_frozen_timm_trunk(tmp_path):
    config = _config("timm:resnet18", freeze="2", backbone_lr_mult=0.5, grad_checkpointing=True)
    config.epochs = 2
    whole = train(config, tmp_path / "whole", quiet=True, report=False)
    train(config, tmp_path / "cut", quiet=True, report=False, stop_after=1)
    resumed = train(None, tmp_path / "cut", quiet=True, report=False, resume=True)
    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.metrics["knn_accuracy"] == resumed.metrics["knn_accuracy"]
    assert np.isfinite(whole.metrics["knn_accuracy"])
