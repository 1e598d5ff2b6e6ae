"""The loader policy (marginkit.data.loading) and the device conversion (marginkit.data.device)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from marginkit.data.device import prefetched, to_model_input
from marginkit.data.loading import (
    Batches,
    Loader,
    ShuffledBatches,
    default_workers,
    evaluation_loader,
    read_all,
    worker_failure,
)
from marginkit.data.samples import BadSampleError, LazySamples


class Rows(LazySamples):
    """A lazy source of ``n`` uint8 rows ``[3, 4, 4]`` whose pixels encode the row (and, given a
    generator, one draw from it); rows in ``bad`` raise BadSampleError; reading row ``kill`` kills
    the reading process (a worker dying as the out-of-memory killer would end it)."""

    sample_shape = (3, 4, 4)
    dtype = np.dtype(np.uint8)

    def __init__(self, n: int, *, bad: tuple[int, ...] = (), kill: int | None = None) -> None:
        super().__init__()
        self.n, self.bad, self.kill = n, bad, kill
        self.parent = os.getpid()

    def _num_keys(self) -> int:
        return self.n

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        if key in self.bad:
            raise BadSampleError(self._where_key(key), "truncated JPEG")
        if key == self.kill and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        draw = 0 if rng is None else int(rng.integers(0, 50))
        return np.full(self.sample_shape, (key + draw) % 256, dtype=np.uint8)

    def _where_key(self, key: int) -> str:
        return f"/data/rows/{key}.jpg"

    def _relative_key(self, key: int) -> str:
        return f"rows/{key}.jpg"


def test_uint8_over_255_is_bit_identical_to_numpy():
    """Every 8-bit value converts on the device exactly as numpy's x.astype(float32) / 255 did."""
    values = np.arange(256, dtype=np.uint8)
    ref = values.astype(np.float32) / np.float32(255.0)
    got = to_model_input(torch.from_numpy(np.tile(values, 67)), "cpu").numpy()  # past one SIMD width
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.tile(ref, 67))
    x = torch.rand(5, 3, dtype=torch.float64)
    mean, std = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([2.0, 3.0, 4.0])
    np.testing.assert_array_equal(to_model_input(x, mean=mean, std=std), (x.float() - mean) / std)


def test_prefetched_moves_each_batch_once_in_order():
    moved = []
    out = list(prefetched(iter(range(5)), lambda b: moved.append(b) or b * 10))
    assert out == [0, 10, 20, 30, 40] and moved == [0, 1, 2, 3, 4]
    assert list(prefetched(iter([]), lambda b: b)) == []


def test_in_memory_batches_are_todays_gathers():
    x = torch.randint(0, 256, (50, 1, 2, 2), dtype=torch.uint8)
    y = torch.arange(50) % 7
    plan = ShuffledBatches(50, 16, seed=3)
    loader = Loader(x, y, plan, workers=4)
    assert loader.workers == 0 and not loader.lazy  # a gather needs no worker
    for epoch in (0, 1):
        plan_copy = ShuffledBatches(50, 16, seed=3)
        plan_copy.set_epoch(epoch)
        got = list(loader.epoch(epoch))
        want = list(plan_copy)
        assert len(got) == len(want) == 3
        for batch, idx in zip(got, want, strict=True):
            assert batch.x.dtype == torch.uint8 and torch.equal(batch.x, x[idx])
            assert torch.equal(batch.y, y[idx])
            assert batch.total == 16


def test_a_rank_reads_its_share_of_each_batch():
    x, y = torch.arange(40).reshape(40, 1), torch.arange(40)
    plan = ShuffledBatches(40, 10, seed=0)
    whole = [b.y for b in Loader(x, y, plan).epoch(2)]
    shares = [[0, 3], [3, 6], [6, 10]]
    parts = [[b.y for b in Loader(x, y, plan, share=lambda n, s=s: slice(*s)).epoch(2)] for s in shares]
    for i, batch in enumerate(whole):
        assert torch.equal(torch.cat([p[i] for p in parts]), batch)  # same steps, disjoint shares


def test_lazy_rows_read_in_workers_with_per_row_generators():
    data, y = Rows(30), torch.arange(30) % 3
    plan = ShuffledBatches(30, 8, seed=1)
    ref = {}
    for workers in (0, 2):
        loader = Loader(data, y, plan, workers=workers, seed=5)
        try:
            batches = list(loader.epoch(4))
        finally:
            loader.close()
        assert loader.lazy and loader.workers == workers
        ref[workers] = torch.cat([b.x for b in batches])
    # row i of epoch 4 drew from default_rng([seed, epoch, i]): the worker count does not matter
    assert torch.equal(ref[0], ref[2])
    plan.set_epoch(4)
    order = torch.cat(list(plan))
    draws = [int(np.random.default_rng([5, 4, int(i)]).integers(0, 50)) for i in order]
    assert ref[0][:, 0, 0, 0].tolist() == [(int(i) + d) % 256 for i, d in zip(order, draws, strict=True)]
    # evaluation: no generator, rows in order
    ev = torch.cat([b.x for b in evaluation_loader(data, y, batch_size=7, workers=0).epoch()])
    assert ev[:, 0, 0, 0].tolist() == list(range(30))


class FixedRows(Rows):
    """:class:`Rows` of a source that declares it draws nothing (as images): no generator."""

    uses_rng = False

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        assert rng is None  # no generator seeded per row for a source that does not draw
        return super()._read_key(key, rng)


def test_a_source_that_draws_nothing_gets_no_generator_and_worker_buffers_are_reused_safely():
    data, y = FixedRows(30), torch.arange(30)
    plan = ShuffledBatches(30, 4, seed=1)
    plan.set_epoch(2)
    order = torch.cat(list(plan))
    for workers in (0, 1, 2):
        loader = Loader(data, y, plan, workers=workers, seed=5)
        try:
            for _ in range(2):
                # every batch kept: a worker's ring buffers stay leased, later batches get fresh ones
                kept = [b.x for b in loader.epoch(2)]
                assert torch.cat(kept)[:, 0, 0, 0].tolist() == order.tolist()
                del kept
                # each batch dropped before the next: buffers are handed back and reused
                seen = [v for b in loader.epoch(2) for v in b.x[:, 0, 0, 0].tolist()]
                assert seen == order.tolist()
            if workers:
                assert int(loader.dataset.ring_flags.sum()) == 0  # every buffer handed back
        finally:
            loader.close()


def test_bad_samples_raise_naming_the_file_or_are_skipped_and_counted():
    data, y = Rows(12, bad=(3, 8)), torch.arange(12)
    with pytest.raises(BadSampleError, match="/data/rows/3.jpg: truncated JPEG"):
        list(evaluation_loader(data, y, batch_size=5, workers=0).epoch())
    loader = evaluation_loader(data, y, batch_size=5, workers=2, on_bad_sample="skip")
    try:
        batches = list(loader.epoch())
    finally:
        loader.close()
    kept = torch.cat([b.y for b in batches]).tolist()
    assert kept == [i for i in range(12) if i not in (3, 8)]
    assert sorted(loader.skipped) == ["/data/rows/3.jpg", "/data/rows/8.jpg"]
    array, rows, skipped = read_all(data, workers=0, on_bad_sample="skip")
    assert array.shape == (10, 3, 4, 4) and rows.tolist() == kept and len(skipped) == 2
    with pytest.raises(ValueError, match="on_bad_sample must be one of raise, skip"):
        Loader(data, y, ShuffledBatches(12, 4, 0), on_bad_sample="ignore")


def test_a_killed_worker_is_a_clear_error_within_bounds():
    data, y = Rows(40, kill=17), torch.arange(40)
    loader = evaluation_loader(data, y, batch_size=4, workers=2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        try:
            for _ in loader.epoch():
                pass
        finally:
            loader.close()
    assert time.monotonic() - t0 < 30
    message = worker_failure(info.value)
    assert message is not None and "data-loading worker process died" in message
    assert worker_failure(RuntimeError("something else")) is None


def test_default_workers_keep_a_core_for_training():
    assert default_workers(1) == 1 and default_workers(2) == 1 and default_workers(5) == 4
    assert default_workers(64) == 8 and default_workers() >= 1


def test_batches_carry_the_epoch_only_in_training():
    plan = ShuffledBatches(9, 3, seed=0)
    assert {r.epoch for r in Batches(plan, epoch=True)} == {0}
    b = Batches(plan, epoch=False)
    b.set_epoch(3)
    assert {r.epoch for r in b} == {None} and plan.epoch == 3


class ImageRows(Rows):
    """Rows as ``decode_image`` returns them: ``[3, 4, 5]`` views of ``[4, 5, 3]`` pixel arrays
    (``odd``: one row of another width, which makes its batch fall back to stacking)."""

    sample_shape = (3, 4, 5)

    def __init__(self, n: int, odd: int | None = None) -> None:
        super().__init__(n)
        self.odd = odd

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        width = 6 if key == self.odd else 5
        hwc = np.arange(4 * width * 3, dtype=np.uint8).reshape(4, width, 3) + np.uint8(key)
        return hwc.transpose(2, 0, 1)


@pytest.mark.parametrize("workers", [0, 1])
def test_image_batches_keep_the_decoders_layout_and_convert_to_contiguous_model_input(workers):
    data, y = ImageRows(10), torch.arange(10)
    expected = torch.from_numpy(np.stack([data.read(i, None) for i in range(10)]))
    loader = Loader(data, y, [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 10)], workers=workers)
    try:
        batches = [b.x for b in loader.epoch()]
    finally:
        loader.close()
    x = torch.cat(batches)
    assert torch.equal(x, expected)
    assert batches[0].shape == (4, 3, 4, 5) and batches[0].is_contiguous(memory_format=torch.channels_last)
    model_input = to_model_input(batches[0])
    assert model_input.is_contiguous() and model_input.dtype == torch.float32
    assert torch.equal(model_input, expected[:4].float() / 255)


def test_a_batch_of_images_of_two_sizes_is_the_stacking_error():
    data, y = ImageRows(4, odd=2), torch.arange(4)
    loader = Loader(data, y, [torch.arange(4)], workers=0)
    with pytest.raises(ValueError, match="same shape"):
        list(loader.epoch())


def test_free_heap_is_returned_before_workers_are_forked(monkeypatch):
    # every loader that starts worker processes first hands the free heap back (they inherit less);
    # an in-memory loader starts none and does not pay for it
    from marginkit.data import loading

    calls = []
    monkeypatch.setattr(loading, "release_free_memory", lambda: calls.append(1))
    data, y = Rows(12), torch.arange(12) % 3
    for workers, expected in ((0, 0), (1, 1)):
        calls.clear()
        loader = Loader(data, y, ShuffledBatches(12, 4, seed=1), workers=workers)
        try:
            for epoch in range(2):  # persistent workers: started (and the heap trimmed) once
                list(loader.epoch(epoch))
        finally:
            loader.close()
        assert len(calls) == expected, workers
    calls.clear()
    list(
        Loader(
            torch.zeros(12, 3, 4, 4, dtype=torch.uint8), y, ShuffledBatches(12, 4, seed=1), workers=2
        ).epoch(0)
    )
    assert not calls


_FREED_HEAP = """
import ctypes, ctypes.util, sys
from marginkit.data.loading import release_free_memory, _malloc_trim

if _malloc_trim() is None:
    print("skip"); sys.exit()

def rss_mb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024

# 200 MB of 64 KiB blocks (under glibc's mmap threshold: they live in the heap), then one block
# above them that stays: the heap's top is in use, so glibc cannot shrink the heap by itself
blocks = [bytearray(b"x" * 65536) for _ in range(3200)]
pin = bytearray(b"y" * 65536)
held = rss_mb()
del blocks
before = rss_mb()
release_free_memory()
print(held, before, rss_mb())
"""


def test_release_free_memory_returns_a_pinned_heap_to_the_system():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP], capture_output=True, text=True, check=True
    ).stdout
    if out.strip() == "skip":
        pytest.skip("not glibc: malloc_trim is not there")
    held, before, after = (float(v) for v in out.split())
    assert before > held - 50  # freed but still resident: glibc kept it
    assert after < before - 150, (held, before, after)  # released
