import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Two shared cores: keep intra-op threads low so parallel suites stay predictable. Under
# pytest-xdist (`./dev.sh test` runs one worker per core and one more) the workers share the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A long hunt for rare counterexamples, not run by CI: HYPOTHESIS_PROFILE=soak pytest tests/...
settings.register_profile("soak", max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (stable order otherwise): spread over xdist's workers from the
    start, the longest ones do not all end up in one worker's tail."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: every random test input comes from here, never from global state."""
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """One tiny trained run (digits, mlp, 2 epochs), shared by the export and serve tests."""
    from marginkit.train.config import TrainConfig
    from marginkit.train.trainer import train

    run = tmp_path_factory.mktemp("tiny-run") / "run"
    config = TrainConfig(
        data="digits", loss="cosface", model="mlp", model_options={"hidden": [32]}, embedding_dim=16,
        epochs=2, batch_size=64, num_threads=1, k=3,
    )  # fmt: skip
    train(config, run, quiet=True, report=False)
    return run


@pytest.fixture(scope="session")
def onnx_bundle(tiny_run, tmp_path_factory: pytest.TempPathFactory):
    """The tiny run exported as an ONNX bundle (marginkit.export.Bundle)."""
    from marginkit.export import export_model

    return export_model(tiny_run, "onnx", tmp_path_factory.mktemp("bundle") / "onnx")
