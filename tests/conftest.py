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


def _expected_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    return 0.0 if marker is None else float(marker.kwargs.get("seconds", 10))


def _shares(n: int, workers: int) -> list[int]:
    """How pytest-xdist's ``worksteal`` first splits ``n`` tests: contiguous shares, one per
    worker, ``pending // workers_left`` each."""
    sizes, left = [], n
    for w in range(workers, 0, -1):
        sizes.append(left // w)
        left -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Spread the ``slow`` tests over xdist's workers from the start, longest first.

    ``worksteal`` gives each worker a contiguous share of the collection and moves tests only
    from the tail of a busy worker's queue: slow tests gathered at the front all landed in the
    first worker's share. Here each slow test (longest first, by ``slow(seconds=...)``) joins
    the share with the least expected time, at its head; the other tests keep their order.
    """
    slow = sorted((i for i in items if _expected_seconds(i)), key=_expected_seconds, reverse=True)
    fast = [i for i in items if not _expected_seconds(i)]
    sizes = _shares(len(items), max(1, WORKERS))
    heads: list[list[pytest.Item]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for item in slow:
        room = [k for k in range(len(sizes)) if len(heads[k]) < sizes[k]]
        k = min(room, key=lambda j: load[j])
        heads[k].append(item)
        load[k] += _expected_seconds(item)
    ordered, rest = [], iter(fast)
    for head, size in zip(heads, sizes, strict=True):
        ordered += head + [next(rest) for _ in range(size - len(head))]
    assert len(ordered) == len(items)
    items[:] = ordered


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
