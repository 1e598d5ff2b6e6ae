import io
import math
from collections import deque

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.mining import MemoryBank


def batch(gen, n, dim, start, dtype=torch.float32):
    """Rows whose first coordinate is a running id (so order is visible), labels = id."""
    emb = torch.randn(n, dim, generator=gen, dtype=torch.float64).to(dtype)
    ids = torch.arange(start, start + n)
    emb[:, 0] = ids.to(dtype)
    return emb, ids


@given(
    size=st.integers(1, 9),
    dim=st.integers(1, 4),
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=8),
    seed=st.integers(0, 2**31),
)
def test_matches_a_one_row_at_a_time_fifo(size, dim, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    bank = MemoryBank(size, dim)
    reference = deque(maxlen=size)  # independent: insert rows one by one
    start = 0
    for n in sizes:
        emb, lab = batch(gen, n, dim, start)
        start += n
        bank.update(emb, lab)
        reference.extend(zip(emb, lab.tolist(), strict=True))
        got_emb, got_lab = bank.get()
        assert len(bank) == len(reference) == got_emb.shape[0] == got_lab.shape[0]
        assert got_lab.tolist() == [y for _, y in reference]
        if reference:
            assert torch.equal(got_emb, torch.stack([e for e, _ in reference]))
        assert bank.is_full == (len(reference) == size)


def test_entries_are_detached_and_get_returns_copies(gen):
    bank = MemoryBank(4, 3)
    x = torch.randn(3, 3, generator=gen, requires_grad=True)
    bank.update(x * 2, torch.tensor([0, 1, 2]))
    mem, lab = bank.get()
    assert not mem.requires_grad
    # A loss against the bank, then an update before backward (the usual order), must work.
    q = torch.randn(2, 3, generator=gen, requires_grad=True)
    loss = (q @ mem.T).sum()
    bank.update(torch.randn(4, 3, generator=gen), torch.tensor([5, 6, 7, 8]))
    loss.backward()
    assert torch.allclose(q.grad, mem.sum(0).expand(2, 3))
    assert lab.tolist() == [0, 1, 2]  # the earlier snapshot is unchanged
    assert bank.get()[1].tolist() == [5, 6, 7, 8]


def test_dtype_follows_first_batch_or_argument(gen):
    bank = MemoryBank(5, 2)
    assert bank.dtype is None and bank.device is None
    bank.update(torch.randn(2, 2, generator=gen).half(), torch.tensor([0, 1], dtype=torch.int32))
    assert bank.dtype == torch.float16 and bank.device == torch.device("cpu")
    bank.update(torch.full((1, 2), 1.0 / 3, dtype=torch.float64), torch.tensor([2]))
    mem, lab = bank.get()
    assert mem.dtype == torch.float16 and lab.dtype == torch.int64
    assert mem[-1, 0].item() == pytest.approx(1.0 / 3, abs=1e-3)

    exact = MemoryBank(5, 2, dtype=torch.float64)
    exact.update(torch.randn(2, 2, generator=gen).bfloat16(), torch.tensor([0, 1]))
    assert exact.get()[0].dtype == torch.float64


def test_device_mismatch_is_an_error_not_a_silent_copy(gen):
    bank = MemoryBank(4, 2)
    bank.update(torch.randn(2, 2, generator=gen), torch.tensor([0, 1]))
    bank.to("meta")  # stand-in for another device
    assert bank.device == torch.device("meta")
    with pytest.raises(ValueError, match="memory bank lives on meta"):
        bank.update(torch.randn(1, 2, generator=gen), torch.tensor([2]))
    bank.reset()  # the next batch places it again
    bank.update(torch.randn(1, 2, generator=gen), torch.tensor([3]))
    assert bank.device == torch.device("cpu") and len(bank) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lazily_placed_on_the_first_batch_device(gen):
    bank = MemoryBank(4, 2)
    bank.update(torch.randn(3, 2, generator=gen).cuda(), torch.tensor([0, 1, 2]))  # CPU labels
    mem, lab = bank.get()
    assert mem.is_cuda and lab.is_cuda and lab.tolist() == [0, 1, 2]


def test_state_dict_round_trip_and_resume(gen):
    bank = MemoryBank(6, 3)
    start = 0
    for n in (4, 5):
        emb, lab = batch(gen, n, 3, start)
        start += n
        bank.update(emb, lab)
    buffer = io.BytesIO()
    torch.save(bank.state_dict(), buffer)
    buffer.seek(0)
    restored = MemoryBank(6, 3)
    restored.load_state_dict(torch.load(buffer))
    for a, b in zip(bank.get(), restored.get(), strict=True):
        assert torch.equal(a, b)
    emb, lab = batch(gen, 4, 3, start)
    bank.update(emb, lab)
    restored.update(emb, lab)  # same subsequent evictions
    for a, b in zip(bank.get(), restored.get(), strict=True):
        assert torch.equal(a, b)

    smaller = MemoryBank(2, 3)
    smaller.load_state_dict(bank.state_dict())
    assert smaller.get()[1].tolist() == bank.get()[1].tolist()[-2:]
    with pytest.raises(ValueError, match="dim 3, this memory bank has dim 4"):
        MemoryBank(6, 4).load_state_dict(bank.state_dict())
    with pytest.raises(ValueError, match="missing 'labels'"):
        MemoryBank(6, 3).load_state_dict({"dim": 3, "embeddings": torch.zeros(0, 3)})


def test_reset_and_empty_get():
    bank = MemoryBank(3, 2)
    emb, lab = bank.get()
    assert emb.shape == (0, 2) and lab.shape == (0,) and lab.dtype == torch.int64
    bank.update(torch.ones(5, 2), torch.arange(5))
    assert len(bank) == 3 and bank.get()[1].tolist() == [2, 3, 4]
    bank.reset()
    assert len(bank) == 0 and bank.device is None
    bank.update(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    assert len(bank) == 0


@pytest.mark.parametrize(
    ("emb", "lab", "error", "match"),
    [
        (torch.ones(3), torch.arange(3), ValueError, "embeddings must have at least 2"),
        (torch.ones(3, 5), torch.arange(3), ValueError, r"embeddings must have shape \[n, dim=4\]"),
        (torch.ones(2, 3, 4), torch.arange(2), ValueError, r"embeddings must have shape \[n, dim=4\]"),
        (torch.ones(3, 4, dtype=torch.long), torch.arange(3), TypeError, "embeddings must be a floating"),
        (torch.tensor([[math.nan] * 4]), torch.arange(1), ValueError, "embeddings contains NaN"),
        (torch.ones(3, 4), torch.ones(3), TypeError, "labels must be an integer"),
        (torch.ones(3, 4), torch.arange(2), ValueError, "labels must have one entry per row"),
        (torch.ones(3, 4), torch.zeros(3, 1, dtype=torch.long), ValueError, "labels must be 1-D"),
    ],
)
def test_update_validates(emb, lab, error, match):
    with pytest.raises(error, match=match):
        MemoryBank(4, 4).update(emb, lab)


def test_constructor_validates():
    with pytest.raises(ValueError, match="size must be >= 1"):
        MemoryBank(0, 4)
    with pytest.raises(TypeError, match="dim must be an int"):
        MemoryBank(4, 2.0)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        MemoryBank(4, 2, dtype=torch.int64)
