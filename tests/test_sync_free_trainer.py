"""The training step reads nothing back from the device (issue 36), counted on the CPU.

A :class:`DispatchCounter` around each training epoch counts the aten ops that read the device
(``.item()``, ``bool()``, ``nonzero``, boolean masks, ...); reads inside ``torch.optim`` (the
optimiser's step counters live on the host even for CUDA parameters, and the schedulers') are left
out, and every read of the step meter (one copy of the steps' losses and extremes since the last
read) is counted in.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dispatch_counts import DispatchCounter
from marginkit.train import TrainConfig, train
from marginkit.train import trainer as _trainer
from marginkit.train.errors import TrainingError
from marginkit.train.progress import StepMeter


class _OutsideOptim(DispatchCounter):
    """Counts only while ``inside`` is zero."""

    inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _quiet(fn, counter):
    def wrapped(*args, **kwargs):
        counter.inside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.inside -= 1

    return wrapped


def _count_epoch(monkeypatch, tmp_path, loss, **options):
    counted = {"reads": 0, "steps": 0, "meter": 0, "names": {}}
    one_epoch, read = _trainer._one_epoch, StepMeter.read

    def meter_read(self, *args, **kwargs):
        counted["meter"] += 1
        return read(self, *args, **kwargs)

    def counted_epoch(run, bar):
        counter = _OutsideOptim()
        run.optimizer.step = _quiet(run.optimizer.step, counter)
        run.scheduler.step = _quiet(run.scheduler.step, counter)
        try:
            with counter:
                stats = one_epoch(run, bar)
        finally:  # the checkpoint pickles the scheduler's __dict__
            del run.optimizer.step, run.scheduler.step
        counted["reads"] += counter.reads
        counted["steps"] += stats["steps"]
        counted["names"] = dict(counter.read_names)
        return stats

    monkeypatch.setattr(_trainer, "_one_epoch", counted_epoch)
    monkeypatch.setattr(StepMeter, "read", meter_read)
    cfg = TrainConfig(data="digits", loss=loss, epochs=1, batch_size=32, num_threads=1, **options)
    train(cfg, tmp_path / loss, quiet=True, report=False)
    return counted


LOSSES = ["cosface", "arcface", "qmargin", "circle", "local_triplet"]


@pytest.mark.parametrize("loss", LOSSES)
def test_an_epoch_reads_the_device_at_most_once_per_ten_steps(monkeypatch, tmp_path, loss):
    got = _count_epoch(monkeypatch, tmp_path, loss)
    reads = got["reads"] + got["meter"]
    assert got["steps"] >= 20
    assert reads * 10 <= got["steps"], (reads, got["steps"], got["names"])


def test_the_meter_is_read_every_sync_every_steps(monkeypatch, tmp_path):
    got = _count_epoch(monkeypatch, tmp_path, "cosface", sync_every=10)
    assert got["meter"] == got["steps"] // 10 + 1


def test_the_first_non_finite_step_is_reported_exactly(monkeypatch, tmp_path):
    """A loss that turns infinite at step 7 of epoch 2 stops the run naming that step, though the
    steps read the device only every 50 steps; the last committed epoch stays resumable."""
    from marginkit.train import components

    calls = {"n": 0}
    build = components.build_loss

    class InfiniteAt(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            out = self.inner(*args)
            if self.training:
                calls["n"] += 1
            return out * math.inf if calls["n"] >= steps_per_epoch + 7 else out

    monkeypatch.setattr(components, "build_loss", lambda *a, **kw: InfiniteAt(build(*a, **kw)))
    cfg = TrainConfig(data="digits", loss="cosface", epochs=3, batch_size=32, num_threads=1)
    from marginkit.train.components import load_splits

    steps_per_epoch = len(load_splits(cfg).train) // 32
    with pytest.raises(
        TrainingError, match=r"^loss became inf at epoch 2, step 7; lower lr or set grad_clip$"
    ):
        train(cfg, tmp_path / "r", quiet=True, report=False)
    ckpt = torch.load(tmp_path / "r" / "last.pt", weights_only=False)
    assert ckpt["epoch"] == 1


def test_non_finite_embeddings_name_their_step(monkeypatch, tmp_path):
    from marginkit.train import components

    build = components.build_components

    def poisoned(*args, **kwargs):
        model, head, loss = build(*args, **kwargs)
        count = {"n": 0}

        def hook(module, inputs, output):
            if module.training:
                count["n"] += 1
                if count["n"] == 3:
                    return output * math.nan
            return output

        model.register_forward_hook(hook)
        return model, head, loss

    monkeypatch.setattr(_trainer, "build_components", poisoned)
    cfg = TrainConfig(data="digits", loss="cosface", epochs=1, batch_size=32, num_threads=1)
    with pytest.raises(
        TrainingError, match=r"^embeddings became non-finite at epoch 1, step 3 \(the weights"
    ):
        train(cfg, tmp_path / "r", quiet=True, report=False)


def _meter_steps(meter: StepMeter, losses: list[float], bad_embeddings: set[int], start: int = 0) -> int:
    """Add the steps; returns the aten ops the meter dispatched for them."""
    steps = [
        (torch.tensor(v, dtype=torch.float32), torch.full((2, 3), math.nan if i in bad_embeddings else 1.0))
        for i, v in enumerate(losses, start)
    ]
    with DispatchCounter() as c:
        for loss, emb in steps:
            meter.add(loss, emb)
    assert c.reads == 0
    return c.ops


@pytest.mark.parametrize("fold", [1, 2, 5, 1024])
def test_the_meter_sums_as_the_host_would_and_names_the_first_bad_step(monkeypatch, fold):
    """Whatever the read points and however many steps are folded on the device before a read: the
    loss sums equal adding each step's float32 loss to a float64 sum on the host, bit for bit, and
    the first non-finite step is reported with what was non-finite and the loss there."""
    monkeypatch.setattr(StepMeter, "FOLD", fold)
    g = torch.Generator().manual_seed(0)
    losses = (torch.rand(23, generator=g) * 7).tolist()
    meter = StepMeter(torch.device("cpu"))
    ops = _meter_steps(meter, losses[:7], set())
    if fold > 7:
        assert ops == 7 * 3  # per step: the detaches of the loss and the embeddings, one aminmax
    first = meter.read()
    host = 0.0
    for v in losses[:7]:
        host += float(torch.tensor(v, dtype=torch.float32))
    assert (first.loss_sum, first.window_sum, first.window_steps, first.first_bad) == (host, host, 7, None)
    poisoned = losses[7:]
    poisoned[6] = math.inf  # step 13: the loss; step 11: the embeddings, first
    _meter_steps(meter, poisoned, {11, 15}, start=7)
    second = meter.read()
    window = 0.0
    for v in poisoned:
        value = float(torch.tensor(v, dtype=torch.float32))
        host += value
        window += value
    assert (second.loss_sum, second.window_sum, second.window_steps) == (host, window, 16)
    assert (second.first_bad, second.what, second.value) == (
        11,
        "embeddings",
        float(torch.tensor(poisoned[4])),
    )


def test_the_meter_reports_the_earliest_bad_step_of_any_rank():
    ranks = [StepMeter(torch.device("cpu")) for _ in range(2)]
    _meter_steps(ranks[0], [1.0] * 6, {4})
    _meter_steps(ranks[1], [1.0, 2.0, math.nan, 1.0, 1.0, 1.0], set())
    rows = {}
    ranks[1].read(lambda row: rows.setdefault(1, row)[None], rank=0)
    reading = ranks[0].read(lambda row: torch.stack([row, rows[1]]), rank=0)
    assert (reading.first_bad, reading.what, reading.loss_sum) == (2, "loss", 6.0)
    assert math.isnan(reading.value)
