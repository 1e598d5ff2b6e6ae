"""``compile: true`` (``--set compile=true``): the training step calls ``torch.compile`` of the model.

The suite checks the wiring with torch's ``aot_eager`` backend (the same graph capture and autograd
split as inductor, no C++ code generation, so it runs in seconds): the compiled module trains, the
checkpoints hold the plain model's weights (no ``_orig_mod.`` prefix) and the run's metrics equal an
eager run's. Inductor's speed is measured by ``benchmarks/bench_compile.py`` (docs/throughput.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from marginkit.train import TrainConfig, train


@pytest.fixture
def aot_eager(monkeypatch):
    real = torch.compile
    compiled: list[torch.nn.Module] = []

    def compile_aot_eager(model, **kwargs):
        compiled.append(model)
        return real(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_aot_eager)
    yield compiled
    torch._dynamo.reset()


def test_a_compiled_run_trains_and_saves_the_plain_model(aot_eager, tmp_path):
    options = {"data": "digits", "loss": "cosface", "epochs": 2, "batch_size": 64, "num_threads": 1,
               "model": "mlp", "model_options": {"hidden": [32]}, "embedding_dim": 16}  # fmt: skip
    train(TrainConfig(**options, compile=True), tmp_path / "c", quiet=True, report=False)
    assert len(aot_eager) == 1  # compiled once, at the first step, and reused
    train(TrainConfig(**options), tmp_path / "e", quiet=True, report=False)
    saved = torch.load(tmp_path / "c" / "best.pt", weights_only=False)["model"]
    eager = torch.load(tmp_path / "e" / "best.pt", weights_only=False)["model"]
    assert saved.keys() == eager.keys() and not any(k.startswith("_orig_mod") for k in saved)
    for key in saved:
        torch.testing.assert_close(saved[key], eager[key], rtol=1e-4, atol=1e-5)
    compiled = json.loads((tmp_path / "c" / "metrics.json").read_text())
    plain = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert compiled["knn_accuracy"] == pytest.approx(plain["knn_accuracy"], abs=2e-3)
