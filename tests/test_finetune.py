"""Fine-tuning: starting weights (weights, init_from, pretrained), freeze, backbone lr multiplier,
large-margin phase, gradient checkpointing, and exact resumption with all of them."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.cli import main
from marginkit.models import build_model
from marginkit.train.checkpoint import load_checkpoint
from marginkit.train.components import build_optimizer
from marginkit.train.config import ConfigError, TrainConfig, apply_overrides
from marginkit.train.trainer import train

BACKBONES = {
    "mlp": ((20,), {"hidden": [16, 16]}),
    "cnn1d": ((2, 24), {"channels": [8, 16]}),
    "cnn2d": ((1, 12, 12), {"channels": [8, 16]}),
    "resnet": ((3, 16, 16), {"width": 8, "blocks": [1, 2]}),
}


@pytest.fixture(scope="module")
def data_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 40)
    x = rng.normal(size=(4, 12))[y] * 1.5 + rng.normal(size=(y.size, 12))
    path = tmp_path_factory.mktemp("data") / "blobs.npz"
    np.savez(path, x=x.astype(np.float32), y=y)
    return f"features:{path}"


def config(data: str, **over: object) -> TrainConfig:
    base = {
        "data": data, "model": "mlp", "model_options": {"hidden": [32, 32]}, "embedding_dim": 8, "epochs": 3,
        "batch_size": 32, "lr": 3e-3, "k": 3, "loss": "cosface", "num_threads": 1, "val_fraction": 0.0,
    }  # fmt: skip
    base.update(over)
    return apply_overrides(TrainConfig(), base)


def model_state(run_dir: Path, name: str = "last.pt") -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / name)["model"]


@pytest.fixture(scope="module")
def source_run(data_spec, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("source") / "run"
    train(config(data_spec, epochs=2), run, quiet=True, report=False)
    return run


# ---------------------------------------------------------------------- starting weights
def _trunk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("projection.")}


@pytest.mark.parametrize("form", ["pt", "safetensors", "run", "checkpoint"])
def test_weights_start_the_trunk_only(tmp_path, data_spec, source_run, form):
    trained = model_state(source_run, "best.pt")
    if form == "pt":
        path = tmp_path / "w.pt"
        torch.save({"state_dict": {f"module.{k}": v for k, v in trained.items()}}, path)  # DDP-style
    elif form == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "w.safetensors"
        save_file(_trunk(trained), str(path))  # a trunk without projection is enough
    else:
        path = source_run if form == "run" else source_run / "best.pt"
    train(config(data_spec, weights=str(path)), tmp_path / "run", quiet=True, report=False, stop_after=0)
    start = model_state(tmp_path / "run")
    for key, value in _trunk(trained).items():
        assert torch.equal(start[key], value), key
    assert not torch.equal(start["projection.weight"], trained["projection.weight"])  # new, random


def test_init_from_keeps_trunk_and_projection_with_a_new_head(tmp_path, data_spec, source_run):
    trained = load_checkpoint(source_run / "best.pt")
    cfg = config(data_spec, init_from=str(source_run), epochs=1)
    train(cfg, tmp_path / "ft", quiet=True, report=False, stop_after=0)
    start = load_checkpoint(tmp_path / "ft" / "last.pt")
    assert all(torch.equal(start["model"][k], v) for k, v in trained["model"].items())
    assert not torch.equal(start["head"]["weight"], trained["head"]["weight"])


def test_init_from_on_the_command_line_takes_the_runs_backbone(tmp_path, data_spec, source_run, capsys):
    out = tmp_path / "cli"
    code = main(["train", "--data", data_spec, "--loss", "softmax", "--init-from", str(source_run),
                 "--epochs", "1", "--num-threads", "1", "--k", "3", "--val-fraction", "0", "--out", str(out),
                 "-q", "--no-report"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    stored = json.loads(load_checkpoint(out / "last.pt")["config"])
    assert stored["model"] == "mlp" and stored["model_options"] == {"hidden": [32, 32]}
    assert stored["embedding_dim"] == 8 and stored["init_from"] == str(source_run)
    code = main(["train", "--data", data_spec, "--loss", "softmax", "--init-from", str(source_run),
                 "--embedding-dim", "4", "--epochs", "1", "--out", str(tmp_path / "bad"), "-q"])  # fmt: skip
    assert code == 2
    assert "'projection.bias' has shape (8,), the model's is (4,)" in capsys.readouterr().err


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _save(path: Path, obj: object) -> Path:
    torch.save(obj, path)
    return path


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "missing.pt", "does not exist"),
        (lambda d: d, "holds no marginkit run"),
        (lambda d: _save(d / "w.pt", {"trunk.1.weight": torch.zeros(32, 12)}), r"lacks \d+ tensor"),
        (lambda d: _save(d / "w.pt", {"conv.weight": torch.zeros(3)}), "does not have"),
        (lambda d: _save(d / "w.pt", [1, 2]), "holds no state dict"),
        (lambda d: _save(d / "w.pt", {"a": 1}), "entry .a. is not a named tensor"),
            (lambda d: _write(d / "w.pt", pickle.dumps(Path("x"), protocol=2)), "weights_only"),
            (lambda d: _write(d / "w.safetensors", b"\x08" + bytes(7) + b"{nonsense"), "not a valid .safe"),
    ],
)  # fmt: skip
def test_bad_weight_files_are_named(tmp_path, data_spec, make, match):
    (tmp_path / "d").mkdir()
    path = make(tmp_path / "d")
    with pytest.raises(ConfigError, match=match):
        train(config(data_spec, weights=str(path)), tmp_path / "run", quiet=True, report=False, stop_after=0)


def test_weight_shapes_and_sizes_are_checked(tmp_path, data_spec, monkeypatch, source_run):
    state = dict(model_state(source_run))
    state["trunk.1.weight"] = torch.zeros(64, 12)
    path = _save(tmp_path / "w.pt", state)
    with pytest.raises(ConfigError, match=r"'trunk.1.weight' has shape \(64, 12\), the model's is \(32, 12"):
        train(config(data_spec, weights=str(path)), tmp_path / "run", quiet=True)
    from marginkit.train import starting

    monkeypatch.setattr(starting, "_SIZE_SLACK", 0)
    monkeypatch.setattr(starting, "_SIZE_FACTOR", 0)
    with pytest.raises(ConfigError, match="MiB, more than"):
        train(config(data_spec, weights=str(path)), tmp_path / "run2", quiet=True)
    # a run's checkpoint holds head and optimiser state too: memory-mapped, never refused for its size
    train(config(data_spec, weights=str(source_run)), tmp_path / "run3", quiet=True, stop_after=0)
    assert torch.equal(
        model_state(tmp_path / "run3")["trunk.1.weight"], model_state(source_run, "best.pt")["trunk.1.weight"]
    )


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"pretrained": True}, "is built in and has none"),
        ({"model": "timm:resnet18", "pretrained": True, "weights": "w.pt"}, "not both"),
        ({"init_from": "r", "weights": "w.pt"}, "drop weights"),
        ({"freeze": "half"}, "freeze must be 'none', 'trunk' or a number"),
        ({"freeze": 0}, "freeze must be"),
        ({"model": "timm:"}, "timm:NAME or torchvision:NAME"),
        ({"model": "keras:resnet"}, "unknown model"),
        ({"backbone_lr_mult": -1}, "backbone_lr_mult must be >= 0"),
        ({"large_margin": {"margin": 0.5}}, "large_margin needs epochs"),
        ({"large_margin": {"margin": 0.5, "epochs": 4}}, r"large_margin.epochs \(4\) must not exceed epochs"),
        ({"large_margin": {"margin": 2.0, "epochs": 1}}, "large_margin.margin must be <= 1"),
        ({"large_margin": {"margin": 0.5, "epochs": 1, "ramp": 1}}, "did you mean 'ramp_epochs'"),
        ({"large_margin": {"margin": 0.5, "epochs": 1, "ramp_epochs": 2}}, "must not exceed large_margin"),
        ({"loss": "softmax", "large_margin": {"margin": 0.5, "epochs": 1}}, "has no margin option"),
        ({"tracking": {"tensorbord": True}}, "did you mean 'tensorboard'"),
        ({"tracking": {"mlflow": 3}}, "true or a tracking URI"),
    ],
)
def test_fine_tuning_options_are_checked(data_spec, over, match):
    with pytest.raises(ConfigError, match=match):
        config(data_spec, **over)


def test_unimportable_libraries_fail_with_the_reason(tmp_path, data_spec, monkeypatch):
    import builtins

    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.split(".")[0] in ("timm", "torchvision"):
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ImportError, match=r"RuntimeError: operator torchvision::nms .*marginkit\[vision\]"):
        build_model("torchvision:resnet18", (1, 8, 8))
    with pytest.raises(ConfigError, match="cannot build model 'timm:resnet18'.*torch"):
        train(config("digits", model="timm:resnet18", model_options={}), tmp_path / "r", quiet=True)


# ---------------------------------------------------------------------- freeze, lr multiplier
@pytest.mark.parametrize("name", list(BACKBONES))
def test_freeze_counts_stages_and_keeps_frozen_batchnorm(name):
    shape, options = BACKBONES[name]
    model = build_model(name, shape, embedding_dim=6, **options)
    stages = model.stage_modules()
    assert len(stages) == {"mlp": 2, "cnn1d": 2, "cnn2d": 2, "resnet": 3}[name]  # resnet: stem + 2
    with pytest.raises(ValueError, match=f"more stages than model '{name}' has"):
        model.freeze(len(stages) + 1)
    model.freeze(1)
    first = {id(p) for p in stages[0].parameters()}
    for p in model.parameters():
        assert p.requires_grad == (id(p) not in first)
    model.train()
    norms = [m for m in stages[0].modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert norms and not any(m.training for m in norms)
    before = [b.clone() for m in norms for b in m.buffers()]
    model(torch.randn(8, *shape))
    after = [b for m in norms for b in m.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    model.freeze("trunk")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == ["projection.weight", "projection.bias"]


def test_a_frozen_trunk_does_not_move_and_precise_bn_keeps_it(tmp_path, data_spec, source_run):
    cfg = config(data_spec, weights=str(source_run), freeze="trunk", epochs=2)
    train(cfg, tmp_path / "run", quiet=True, report=False)
    trained, start = model_state(tmp_path / "run"), model_state(source_run, "best.pt")
    for key, value in _trunk(start).items():
        assert torch.equal(trained[key], value), key  # weights and batch-norm statistics
    assert not torch.equal(trained["projection.weight"], start["projection.weight"])


def test_backbone_lr_multiplier_sets_the_trunks_groups(data_spec):
    model = build_model("mlp", (12,), embedding_dim=8, hidden=[16])
    plain = build_optimizer(config(data_spec), model, None)
    assert [g["lr"] for g in plain.param_groups] == [3e-3, 3e-3]  # as before: decay, no decay
    scaled = build_optimizer(config(data_spec, backbone_lr_mult=0.1), model, None)
    lrs = {id(p): g["lr"] for g in scaled.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert lrs[id(p)] == pytest.approx(3e-3 if name.startswith("projection") else 3e-4), name
    model.freeze("trunk")
    frozen = build_optimizer(config(data_spec, backbone_lr_mult=0.1), model, None)
    assert sum(len(g["params"]) for g in frozen.param_groups) == 2


# ---------------------------------------------------------------------- large-margin phase
def test_large_margin_raises_the_margin_in_the_last_epochs(tmp_path, data_spec):
    cfg = config(data_spec, epochs=4, large_margin={"margin": 0.5, "epochs": 2, "ramp_epochs": 1})
    result = train(cfg, tmp_path / "run", quiet=True, report=False)
    margins = [row["margin"] for row in result.history]  # each epoch's first step
    assert margins == pytest.approx([0.2, 0.2, 0.2, 0.5])
    from marginkit.train.finetune import large_margin_scheduler
    from marginkit.train.registry import build_loss

    loss = build_loss("cosface", {})
    sched = large_margin_scheduler(cfg, loss, steps_per_epoch=10)
    seen = [sched.values()["margin"]] + [sched.step()["margin"] for _ in range(39)]
    want = [0.2] * 20 + [0.2 + 0.3 * i / 10 for i in range(10)] + [0.5] * 10
    assert seen == pytest.approx(want) and loss.margin == pytest.approx(0.5)


# ---------------------------------------------------------------------- gradient checkpointing
@pytest.mark.parametrize("name", list(BACKBONES))
def test_grad_checkpointing_gives_the_same_gradients_and_statistics(name, gen):
    shape, options = BACKBONES[name]
    plain = build_model(name, shape, embedding_dim=6, **options)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(8, *shape, generator=gen)
    plain.train()(x).square().sum().backward()
    ckpt.train()(x).square().sum().backward()
    for (key, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), key
    for (key, a), b in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
        assert torch.equal(a, b), key  # running statistics counted once, not twice
    with torch.no_grad():
        assert torch.equal(plain.eval()(x), ckpt.eval()(x))


# ---------------------------------------------------------------------- resume with everything
@pytest.mark.parametrize("start", ["weights", "init_from"])
def test_resume_is_bit_identical_with_every_fine_tuning_option(tmp_path, data_spec, source_run, start):
    cfg = config(
        data_spec, freeze="1", backbone_lr_mult=0.3, warmup_epochs=0.5, grad_checkpointing=True, epochs=3,
        large_margin={"margin": 0.4, "epochs": 2, "ramp_epochs": 1}, **{start: str(source_run)},
    )  # fmt: skip
    whole = train(cfg, tmp_path / "whole", quiet=True, report=False)
    train(cfg, tmp_path / "cut", quiet=True, report=False, stop_after=1)
    torch.manual_seed(999)
    resumed = train(None, tmp_path / "cut", quiet=True, report=False, resume=True)
    a, b = load_checkpoint(tmp_path / "whole" / "last.pt"), load_checkpoint(tmp_path / "cut" / "last.pt")
    for part in ("model", "head"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert [r["train_loss"] for r in whole.history] == [r["train_loss"] for r in resumed.history]
    assert [r["margin"] for r in resumed.history] == [r["margin"] for r in whole.history]
    assert resumed.metrics["knn_accuracy"] == whole.metrics["knn_accuracy"]


def test_grad_checkpointing_trains_the_same_run(tmp_path, gen):
    base = {"data": "digits", "model": "resnet", "model_options": {"width": 4, "blocks": [1, 1]}, "epochs": 1,
            "batch_size": 64, "num_threads": 1, "loss": "arcface", "train_per_class": 20}  # fmt: skip
    train(apply_overrides(TrainConfig(), base), tmp_path / "a", quiet=True, report=False)
    train(apply_overrides(TrainConfig(), {**base, "grad_checkpointing": True}), tmp_path / "b", quiet=True,
          report=False)  # fmt: skip
    a, b = model_state(tmp_path / "a"), model_state(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_studys_stored_defaults_read_the_new_keys_as_before():
    from marginkit.study.jobs import _legacy, library_defaults

    job = {"name": "knn/x", "kind": "knn", "loss": "cosface", "data": "digits", "seed": 0}
    now = library_defaults(job)
    new = ("weights", "pretrained", "init_from", "freeze", "backbone_lr_mult", "large_margin",
           "grad_checkpointing")  # fmt: skip
    before = json.loads(json.dumps(now))
    for key in new:
        before["train"].pop(key)
    assert _legacy(before) == json.loads(json.dumps(now))
    assert "tracking" not in now["train"]  # a runtime key: never part of a result
