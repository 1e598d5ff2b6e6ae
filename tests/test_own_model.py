"""Training one's own ``nn.Module`` through the Python API: ``train(config, run_dir, model=module)``,
then resume, evaluate, load and export the run with a new instance of the same class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from marginkit.train import TrainConfig, evaluate_run, load_run, train
from marginkit.train.config import apply_overrides
from marginkit.train.errors import ConfigError
from marginkit.train.rundir import load_checkpoint
from test_trainer import assert_same, blobs, small_config, state_tensors


class TinyNet(nn.Module):
    """A user's embedding model: 12 features -> D, not normalised unless asked."""

    def __init__(self, dim: int = 6, unit: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, dim))
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.net(x)
        return nn.functional.normalize(z, dim=1) if self.unit else z


@pytest.fixture(scope="module")
def data_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    return "features:" + str(blobs(tmp_path_factory.mktemp("data") / "blobs.npz"))


def new_net(**kwargs) -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(**kwargs)


def test_own_module_is_trained_recorded_and_evaluated(data_spec, tmp_path):
    net = new_net(unit=True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    result = train(small_config(data_spec, loss="cosface"), tmp_path / "run", model=net, quiet=True)
    config = result.config
    assert config.model == "custom" and config.model_options == {"class": f"{__name__}.TinyNet"}
    assert config.embedding_dim == 6 and config.normalize  # read from the module's output
    assert not torch.equal(net.net[0].weight, before["net.0.weight"])  # trained in place
    last = load_checkpoint(tmp_path / "run" / "last.pt")["model"]
    assert all(torch.equal(net.state_dict()[k], v) for k, v in last.items())  # it holds the last epoch
    assert 0.5 < result.metrics["knn_accuracy"] <= 1
    again = evaluate_run(tmp_path / "run", model=TinyNet(unit=True), write=False)
    for key in ("knn_accuracy", "head_accuracy", "precision_at_1", "map_at_r", "fingerprint"):
        assert again[key] == result.metrics[key], key
    loaded = load_run(tmp_path / "run", model=TinyNet(unit=True))
    best = load_checkpoint(tmp_path / "run" / "best.pt")["model"]
    assert all(torch.equal(loaded["model"].state_dict()[k], v) for k, v in best.items())


def test_a_run_of_ones_own_module_needs_it_to_load(data_spec, tmp_path):
    train(small_config(data_spec, epochs=1), tmp_path / "run", model=new_net(), quiet=True, report=False)
    with pytest.raises(ConfigError, match=r"trained its own model \(test_own_model\.TinyNet, .*model="):
        load_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="trained its own model"):
        evaluate_run(tmp_path / "run", write=False)
    with pytest.raises(RuntimeError, match="does not match its model"):  # another architecture
        load_run(tmp_path / "run", model=TinyNet(dim=5))
    train(small_config(data_spec, epochs=1), tmp_path / "builtin", quiet=True, report=False)
    with pytest.raises(ConfigError, match="built-in model 'mlp'"):
        load_run(tmp_path / "builtin", model=TinyNet())


def test_resumed_with_a_new_instance_equals_the_uninterrupted_run(data_spec, tmp_path):
    cfg = small_config(data_spec, epochs=3)
    train(cfg, tmp_path / "whole", model=new_net(), quiet=True, report=False)
    train(cfg, tmp_path / "cut", model=new_net(), quiet=True, report=False, stop_after=1)
    other = TinyNet()  # any initial weights: the checkpoint's replace them
    assert train(cfg, tmp_path / "cut", resume=True, model=other, quiet=True, report=False).finished
    assert train(None, tmp_path / "cut", resume=True, model=TinyNet(), quiet=True, report=False).finished
    assert_same(state_tensors(tmp_path / "whole"), state_tensors(tmp_path / "cut"))


def test_export_of_ones_own_module(data_spec, tmp_path):
    pytest.importorskip("onnxruntime")
    from marginkit.export import export_model

    train(small_config(data_spec, epochs=1), tmp_path / "run", model=new_net(), quiet=True, report=False)
    bundle = export_model(tmp_path / "run", "onnx", tmp_path / "bundle", model=TinyNet(), examples=4)
    assert bundle.embedding_dim == 6 and bundle.input_shape == (12,)
    assert bundle.manifest["embedding"]["normalized"] is False  # this module does not normalise


def test_bad_modules_are_refused_by_name(data_spec, tmp_path):
    cfg = small_config(data_spec, epochs=1)

    class Flat(nn.Module):
        def forward(self, x):
            return x.unsqueeze(1)  # [B, 1, 12]: not [B, D]

    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(7, 3)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        train(cfg, tmp_path / "a", model=lambda x: x, quiet=True)
    with pytest.raises(ConfigError, match=r"must map inputs \[B, \*input_shape\] .* returned \[2, 1, 12\]"):
        train(cfg, tmp_path / "b", model=Flat(), quiet=True)
    with pytest.raises(ConfigError, match=r"failed on inputs of shape \[2, 12\].*RuntimeError"):
        train(cfg, tmp_path / "c", model=Wrong(), quiet=True)
    with pytest.raises(ConfigError, match="model 'custom' is your own nn.Module"):
        apply_overrides(TrainConfig(), {"model": "custom", "data": "digits"})
    assert not any((tmp_path / name).exists() for name in "abc")  # refused before writing anything


def test_train_chooses_its_threads_and_gives_the_callers_back(data_spec, tmp_path):
    """The README's advice for one's own loop (torch.set_num_threads(1)) survives a train()."""
    from marginkit.train.runtime import available_cores

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    lines: list[str] = []
    try:
        cfg = small_config(data_spec, epochs=1, num_threads=None)
        result = train(cfg, tmp_path / "run", model=new_net(), report=False, log=lines.append)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert result.config.num_threads == available_cores()  # chosen, recorded in config.yaml
    assert any(f"{available_cores()} torch thread(s) per process" in line for line in lines), lines
