"""timm / torchvision backbones end to end in the pinned environment (torch 2.14.1 with
torchvision 0.29.1 and timm, ``constraints.txt``): the inputs adapted with each model's own
config, training, ``weights`` (state dict / safetensors / run directory), ``pretrained`` from
an offline hub cache, ``init_from``, ``freeze``, export to ONNX, ``embed`` and ``serve``.

The models: timm's ``test_resnet`` (a 0.37 M-parameter ResNet with its own pretrained config:
160 px, mean and std 0.5) and torchvision's ``resnet18`` (its weights' ImageNet statistics,
224 px), both trained at 32 px. (torchvision's smaller ShuffleNet / MNASNet reach only 0.2 K-NN
accuracy on digits after one epoch at 32 px; ResNet-18 0.96 in half MobileNet V3's time.)
Nothing is downloaded: the weight files and hub caches are made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.models.external import import_library

timm = import_library("timm")
torchvision = import_library("torchvision")

from torchvision.transforms.v2 import functional as TF  # noqa: E402

from marginkit.cli import main  # noqa: E402
from marginkit.models import build_model  # noqa: E402
from marginkit.train import TrainConfig, train  # noqa: E402
from marginkit.train.errors import ConfigError  # noqa: E402
from marginkit.train.trainer import load_run, load_splits  # noqa: E402

TIMM, TV = "timm:test_resnet", "torchvision:resnet18"
E2E = {TIMM: {"image_size": 32}, TV: {"image_size": 32}}
CLASSIFIER = {TIMM: "fc.", TV: "fc."}


def _config(model: str, **extra) -> TrainConfig:
    return TrainConfig(
        data="digits", loss="cosface", model=model, model_options=dict(E2E[model]), embedding_dim=16,
        epochs=1, batch_size=64, num_threads=1, k=3, precise_bn=512, **extra,
    )  # fmt: skip


def _library_model(model: str, num_classes: int = 7) -> torch.nn.Module:
    """The library's own model, classifier included, as a downloaded checkpoint holds it."""
    torch.manual_seed(1)
    arch = model.split(":", 1)[1]
    if model.startswith("timm:"):
        return timm.create_model(arch, num_classes=num_classes)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)


def _start(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


def _assert_trunk_is(start: dict[str, torch.Tensor], source: dict[str, torch.Tensor], model: str) -> None:
    checked = 0
    for key, value in source.items():
        if not key.startswith(CLASSIFIER[model]):
            assert torch.equal(start[f"net.{key}"], value), key
            checked += 1
    assert checked == len([k for k in start if k.startswith("net.")])  # every trunk tensor


# ---------------------------------------------------------------------- the models' own configs
@pytest.mark.parametrize(
    ("name", "reference", "size"),
    [
        (TIMM, lambda: timm.data.resolve_data_config({}, model=timm.create_model("test_resnet")), 160),
        (TV, lambda: vars(torchvision.models.ResNet18_Weights.DEFAULT.transforms()), 224),
    ],
)
def test_inputs_are_adapted_with_the_models_own_statistics(name, reference, size, gen):
    model = build_model(name, (1, 8, 8), embedding_dim=8, image_size=24)
    x = torch.rand(3, 1, 8, 8, generator=gen)
    ref = reference()
    want = TF.normalize(
        TF.resize(x.expand(-1, 3, -1, -1), [24, 24], antialias=False), list(ref["mean"]), list(ref["std"])
    )
    torch.testing.assert_close(model.adapt(x), want, rtol=0, atol=1e-6)
    # not one guess for both: timm's test_resnet was trained with 0.5 / 0.5, resnet18 with ImageNet's
    assert model.mean.flatten().tolist() == pytest.approx(
        [0.5] * 3 if name == TIMM else [0.485, 0.456, 0.406]
    )
    default = build_model(name, (1, 8, 8), embedding_dim=8)
    assert default.image_size == (size, size)  # the pretrained config's input size
    assert default(x).shape == (3, 8)


def test_unknown_models_and_wrong_channels_are_named():
    with pytest.raises(ValueError, match="timm has no model 'resnet181'.*resnet18"):
        build_model("timm:resnet181", (1, 8, 8))
    with pytest.raises(ValueError, match="torchvision has no model"):
        build_model("torchvision:mobilenet_v9", (1, 8, 8))
    with pytest.raises(ValueError, match="3-channel images"):
        build_model(TIMM, (2, 8, 8))
    with pytest.raises(ValueError, match="expects images"):
        build_model(TIMM, (40,))


# ---------------------------------------------------------------------- train, export, embed, serve
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One epoch on digits for each model (shared by the tests below)."""
    root = tmp_path_factory.mktemp("vision-runs")
    out = {}
    for i, model in enumerate(E2E):
        result = train(_config(model), root / f"run{i}", quiet=True, report=False)
        assert result.finished and result.metrics["knn_accuracy"] > 0.3, model  # 10 classes: chance 0.1
        out[model] = root / f"run{i}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", list(E2E))
def test_train_export_embed_serve(model, runs, tmp_path):
    """ONNX within 1e-5 of eager PyTorch and 1e-4 of `marginkit embed`; one enrol + identify."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from marginkit.export import export_model
    from marginkit.gallery import Gallery
    from marginkit.serve import create_app

    run = load_run(runs[model])
    x = load_splits(run["config"]).test.x
    with torch.no_grad():
        eager = run["model"](x)
    bundle = export_model(runs[model], "onnx", tmp_path / "bundle")
    got = bundle.embed(x.numpy(), preprocessed=True)
    assert float(np.abs(got - eager.numpy()).max()) <= 1e-5
    assert main(["embed", str(runs[model]), "--out", str(tmp_path / "e.npz"), "--split", "test", "-q"]) == 0
    with np.load(tmp_path / "e.npz") as z:
        np.testing.assert_allclose(got, z["test_embeddings"], rtol=0, atol=1e-4)
    gallery = Gallery(tmp_path / "g.db", bundle, far=1e-2)
    with TestClient(create_app(bundle, gallery)) as client:
        r = client.post("/enroll", json={"identity": "a", "inputs": x[:2].numpy().tolist()})
        assert r.status_code == 200, r.text
        r = client.post("/identify", json={"inputs": x[:1].numpy().tolist(), "k": 1})
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["candidates"][0]["identity"] == "a"


# ---------------------------------------------------------------------- starting weights
@pytest.mark.parametrize("model", list(E2E))
@pytest.mark.parametrize("form", ["pt", "safetensors"])
def test_library_weight_files_start_the_trunk(model, form, tmp_path):
    """The library's own state dict (classifier included), as downloaded elsewhere."""
    source = _library_model(model).state_dict()
    if form == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file(source, str(path))
    else:
        path = tmp_path / "model.pt"
        torch.save(source, path)
    train(_config(model, weights=str(path)), tmp_path / "run", quiet=True, report=False, stop_after=0)
    _assert_trunk_is(_start(tmp_path / "run"), source, model)


@pytest.mark.parametrize("model", list(E2E))
def test_a_run_starts_the_trunk_or_with_init_from_the_projection_too(model, runs, tmp_path):
    trained = torch.load(runs[model] / "best.pt", weights_only=True)["model"]
    train(_config(model, weights=str(runs[model])), tmp_path / "w", quiet=True, report=False, stop_after=0)
    start = _start(tmp_path / "w")
    assert all(torch.equal(start[k], v) for k, v in trained.items() if k.startswith("net."))
    assert not torch.equal(start["projection.weight"], trained["projection.weight"])  # new
    code = main(["train", "--data", "digits", "--loss", "arcface", "--init-from", str(runs[model]),
                 "--stop-after", "0", "--num-threads", "1", "--out", str(tmp_path / "i"), "-q",
                 "--no-report"])  # fmt: skip
    assert code == 0  # the run's backbone, embedding_dim and model_options (image_size 32) are taken
    start = _start(tmp_path / "i")
    assert start.keys() == trained.keys() and all(torch.equal(start[k], v) for k, v in trained.items())


_OFFLINE = """
import sys
from marginkit.cli import main
codes = [main(["train", "--data", "digits", "--loss", "cosface", "--backbone", name, "--pretrained",
               "--set", "model_options.image_size=32", "--stop-after", "0", "--num-threads", "1",
               "--out", out, "-q", "--no-report"]) for name, out in zip(sys.argv[1::2], sys.argv[2::2])]
print("CODES", codes)
"""


@pytest.mark.slow
def test_pretrained_from_offline_hub_caches(tmp_path):
    """``--pretrained`` with HF_HUB_OFFLINE=1 and a Hugging Face cache under HF_HOME (timm), and a
    torch.hub cache under TORCH_HOME (torchvision), in a fresh process: the environment as a user
    sets it before starting. A model whose file is in neither cache fails, naming where it goes."""
    from safetensors.torch import save_file

    timm_source = _library_model(TIMM, num_classes=1000).state_dict()
    hub_id = timm.models.get_pretrained_cfg("test_resnet").hf_hub_id  # timm/test_resnet.r160_in1k
    repo = tmp_path / "hf" / "hub" / f"models--{hub_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(timm_source, str(repo / "snapshots" / commit / "model.safetensors"))
    tv_source = _library_model(TV, num_classes=1000).state_dict()
    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(tv_source, tmp_path / "torch" / "hub" / "checkpoints" / url.rsplit("/", 1)[-1])
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "TORCH_HOME": str(tmp_path / "torch"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    args = [
        TIMM,
        str(tmp_path / "timm"),
        TV,
        str(tmp_path / "tv"),
        "timm:test_efficientnet",
        str(tmp_path / "no"),
    ]
    proc = subprocess.run([sys.executable, "-c", _OFFLINE, *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert "CODES [0, 0, 2]" in proc.stdout, proc.stdout + proc.stderr
    _assert_trunk_is(_start(tmp_path / "timm"), timm_source, TIMM)
    _assert_trunk_is(_start(tmp_path / "tv"), tv_source, TV)
    assert "model.safetensors of the Hugging Face repository 'timm/test_efficientnet" in proc.stderr


def test_pretrained_without_network_says_where_to_put_the_file(tmp_path, monkeypatch):
    import huggingface_hub.constants

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(
        ConfigError, match=r"download https://\S+ elsewhere and put it at .*torch/hub/checkpoints"
    ):
        train(_config(TV, pretrained=True), tmp_path / "tv", quiet=True, report=False, stop_after=0)
    # HF_HUB_OFFLINE=1 as it is read when huggingface_hub is imported (done already in this process)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(
        ConfigError, match="model.safetensors of the Hugging Face repository 'timm/test_resnet"
    ):
        train(_config(TIMM, pretrained=True), tmp_path / "timm", quiet=True, report=False, stop_after=0)


def test_torch_hub_files_are_read_without_unpickling(tmp_path, monkeypatch):
    """A pickle planted in torch.hub's cache is refused, not run (torch.hub unpickles by default)."""
    import pickle

    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    (cache / url.rsplit("/", 1)[-1]).write_bytes(pickle.dumps(Path("x"), protocol=2))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(ConfigError, match="pretrained weights of torchvision:resnet18 could not be"):
        train(_config(TV, pretrained=True), tmp_path / "tv", quiet=True, report=False, stop_after=0)


# ---------------------------------------------------------------------- freezing
def test_freeze_stages_and_checkpointing(gen):
    model = build_model(TIMM, (1, 16, 16), embedding_dim=8, image_size=32)
    assert len(model.stage_modules()) == 5  # stem, layer1..layer4 (timm's coarse groups)
    model.freeze(2)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("net.conv1") for n in frozen) and any(n.startswith("net.layer1") for n in frozen)
    assert not any(n.startswith(("net.layer2", "projection")) for n in frozen)
    model.train()
    assert not model.net.bn1.training and model.net.layer2[0].bn1.training
    plain = build_model(TIMM, (1, 16, 16), embedding_dim=8, image_size=32)
    ckpt = build_model(TIMM, (1, 16, 16), embedding_dim=8, image_size=32)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(True)
    x = torch.rand(4, 1, 16, 16, generator=gen)
    plain.train()(x).sum().backward()
    ckpt.train()(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    tv = build_model(TV, (1, 8, 8))
    assert [type(s).__name__ for s in tv.stage_modules()] == ["Conv2d", "BatchNorm2d"] + ["Sequential"] * 4
    with pytest.raises(ValueError, match="torchvision models offer no gradient checkpointing"):
        tv.set_grad_checkpointing(True)


@pytest.mark.parametrize("model", list(E2E))
def test_a_frozen_trunk_does_not_move(model, runs, tmp_path):
    config = _config(model, weights=str(runs[model]), freeze="trunk", train_per_class=20)
    train(config, tmp_path / "run", quiet=True, report=False)
    start = torch.load(runs[model] / "best.pt", weights_only=True)["model"]
    after = _start(tmp_path / "run")
    trunk = [k for k in after if k.startswith("net.")]
    assert all(torch.equal(after[k], start[k]) for k in trunk)  # weights and batch-norm statistics
    assert (
        json.loads(torch.load(tmp_path / "run" / "last.pt", weights_only=True)["config"])["freeze"] == "trunk"
    )


def test_resume_is_bit_identical_with_a_frozen_timm_trunk(tmp_path):
    config = _config(TIMM, freeze="2", backbone_lr_mult=0.5, grad_checkpointing=True, train_per_class=20)
    config.epochs = 2
    whole = train(config, tmp_path / "whole", quiet=True, report=False)
    train(config, tmp_path / "cut", quiet=True, report=False, stop_after=1)
    resumed = train(None, tmp_path / "cut", quiet=True, report=False, resume=True)
    a = _start(tmp_path / "whole")
    b = _start(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.metrics["knn_accuracy"] == resumed.metrics["knn_accuracy"]
    assert np.isfinite(whole.metrics["knn_accuracy"])
