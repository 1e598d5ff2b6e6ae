"""Issue 28's raw library exceptions, each now a clear error naming what is wrong.

- a K-NN index whose metadata says HNSW but lacks its graph member (was ``KeyError: 'faiss_index'``);
- labels on the meta device, from every class-level and pair loss (was ``RuntimeError:
  Tensor.item() cannot be called on meta tensors``, from the one shared label check);
- an ``mnist-idx`` ``.gz`` that decompresses to 4 GiB under a 3 GiB address-space limit (was
  ``MemoryError``): refused from its header against the input limit, capped below ``RLIMIT_AS``.
"""

import gzip
import json
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import marginkit.losses as losses
from marginkit.heads import CosineHead, ShardedCosineHead
from marginkit.knn import IndexFileError, KNNClassifier

META = torch.device("meta")


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("dropped", [("hnsw_levels", "hnsw_offsets", "hnsw_neighbors"), ("hnsw_neighbors",)])
def test_hnsw_index_without_its_graph_is_refused_by_name(gen, tmp_path, version, dropped):
    ref = torch.randn(40, 6, generator=gen)
    path = tmp_path / "h.npz"
    KNNClassifier(3, backend="hnsw").fit(ref, torch.arange(40) % 4).save(path)
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files if name not in dropped}
    meta = {**json.loads(str(arrays.pop("metadata"))), "version": version}
    if version < 3:
        arrays.pop("classes")
    bad = tmp_path / f"v{version}.npz"
    np.savez(bad, **arrays, metadata=np.array(json.dumps(meta)))
    message = "version-1 HNSW index" if version == 1 else r"lacks .*'hnsw_neighbors'.*\(the HNSW graph\)"
    with pytest.raises(IndexFileError, match=message) as info:
        KNNClassifier.load(bad)
    assert str(bad) in str(info.value)


def _losses():
    """(name, loss) for every loss of marginkit.losses that can be built with its defaults."""
    out = []
    for name in sorted(losses.__all__):
        cls = getattr(losses, name)
        if not name.endswith("Loss"):
            continue
        try:
            out.append((name, cls()))
        except TypeError:  # a wrapper (GatheredPairLoss) needs another loss
            continue
    return out


@pytest.mark.parametrize(("name", "loss"), _losses(), ids=[n for n, _ in _losses()])
def test_meta_labels_and_inputs_are_refused_by_name(name, loss, gen):
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    emb = torch.randn(6, 8, generator=gen)
    if getattr(loss, "reads_class_blocks", False) or name == "MEPLoss":
        x = CosineHead(5, 8)(emb, with_norms=True) if name == "AdaFaceLoss" else CosineHead(5, 8)(emb)
        label_name = "target" if name == "MEPLoss" else "labels"
    else:
        x, label_name = emb, "labels"
    loss(x, labels)  # the real call works
    with pytest.raises(ValueError, match=f"{label_name} is on the meta device"):
        loss(x, labels.to(META))
    if isinstance(x, torch.Tensor):
        with pytest.raises(ValueError, match="is on the meta device"):
            loss(x.detach().to(META), labels)


def test_meta_labels_on_a_sharded_head_are_refused_by_name(gen):
    head = ShardedCosineHead(5, 8)
    out = head(torch.randn(4, 8, generator=gen))
    with pytest.raises(ValueError, match="labels is on the meta device"):
        losses.CosFaceLoss()(out, torch.tensor([0, 1, 2, 3], device=META))


def _idx_dir_decompressing_to_4_gib(root):
    """MNIST IDX files whose train images decompress to 4 GiB (64 gzip members of 64 MiB of zeros)."""
    root.mkdir()
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 65536, 256, 256)
    member = gzip.compress(bytes(64 << 20), compresslevel=1)
    with open(root / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(gzip.compress(header))
        for _ in range(64):
            f.write(member)
    for name, ndim, shape in [("train-labels-idx1", 1, (65536,)), ("t10k-images-idx3", 3, (1, 2, 2)),
                              ("t10k-labels-idx1", 1, (1,))]:  # fmt: skip
        head = bytes([0, 0, 0x08, ndim]) + struct.pack(f">{ndim}I", *shape)
        (root / f"{name}-ubyte").write_bytes(head + bytes(int(np.prod(shape))))


def _error_in_subprocess(setup: str, call: str) -> str:
    """Run ``setup`` then ``call`` in a fresh Python; the ``ValueError`` it raised, as printed."""
    handler = "except ValueError as exc:\n    print('ValueError:', exc)\n"
    code = f"{textwrap.dedent(setup)}\ntry:\n    {call}\n{handler}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_idx_gz_of_4_gib_with_3_gib_of_address_space_left_is_refused_from_its_header(tmp_path):
    root = tmp_path / "mnist"
    _idx_dir_decompressing_to_4_gib(root)
    # The limit is set after the imports: torch's CUDA build maps several GB of address space
    # for its libraries alone, so an absolute 3 GiB limit would stop the import, not the read.
    setup = """
        import os, resource
        from marginkit._files import input_limit_bytes
        from marginkit.data.loaders import read_mnist_idx
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), resource.RLIM_INFINITY))
        assert input_limit_bytes() < 3 << 30  # below the address-space limit, not the 4096 MB default
        """
    out = _error_in_subprocess(setup, f"read_mnist_idx({str(root)!r})")
    assert "ValueError:" in out and "IDX array [65536, 256, 256]) needs 4,096.0 MB" in out, out
    assert "above the input memory limit" in out and "under this process's RLIMIT_AS of" in out, out


def test_npz_reader_shares_the_address_space_cap(tmp_path):
    path = tmp_path / "big.npz"
    np.savez(path, x=np.zeros((1 << 20,), np.uint8))  # 1 MB
    setup = """
        import os, resource
        from marginkit._files import read_npz_arrays
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), resource.RLIM_INFINITY))  # 1 MB left
        """
    out = _error_in_subprocess(setup, f"read_npz_arrays({str(path)!r})")
    assert "ValueError:" in out and "RLIMIT_AS" in out, out
