"""The dispatch counter of tests/dispatch_counts.py counts ops and device reads as documented."""

import torch

from dispatch_counts import DispatchCounter


def test_counts_ops_and_each_kind_of_read() -> None:
    x = torch.randn(6, requires_grad=True)
    with DispatchCounter() as c:
        y = (x * 2).sum()
        y.backward()
    assert c.reads == 0 and c.by_name["aten.mul.Tensor"] == 2 and c.ops == sum(c.by_name.values())
    v = x.detach()
    reads = {
        "item": lambda: float(v.sum()),
        "bool": lambda: bool((v > 0).any()),
        "nonzero": lambda: v.nonzero(),
        "masked_select": lambda: v.masked_select(v > 0),
        "bool index": lambda: v[v > 0],
        "unique": lambda: torch.unique(v),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    }
    for what, f in reads.items():
        with DispatchCounter() as c:
            f()
        assert c.reads >= 1, (what, c.by_name)
    free = {
        "int index": lambda: v[torch.tensor([0, 2])],
        "repeat_interleave with output_size": lambda: torch.repeat_interleave(
            torch.tensor([1, 2]), output_size=3
        ),
        "where": lambda: torch.where(v > 0, v, 0.0),
    }
    for what, f in free.items():
        with DispatchCounter() as c:
            f()
        assert c.reads == 0 and c.ops >= 1, (what, c.read_names)
