"""Developer profile of the trainer's step on a GPU (not the published benchmark).

Runs ``marginkit.train.train`` (the built-in ``resnet`` at 64×64, batch 256, CosFace, SGD) with
``torch.profiler`` over its last epoch, and the bare loop of ``device_check.py`` under the same
profiler: the wall time per step and the top ops by self CPU and by self CUDA time show whether the
step waits on the host (Python, the loader) or on the device. Then the bare timm ``resnet18`` loop at
112×112 bf16 with and without channels-last weights / inputs and ``cudnn.benchmark``.

    PYTHONPATH=src python benchmarks/_profile_trainer.py
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from device_check import bare_loop, synthetic_npz


def table(prof: profile, key: str, rows: int = 18) -> None:
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


def trainer_profile(device: torch.device, n: int, size: int, model: str, amp: str) -> None:
    from marginkit.train import TrainConfig, train
    from marginkit.train import trainer as trainer_module

    real = trainer_module._one_epoch
    seen: dict[str, float] = {}

    def profiled(run, bar):  # type: ignore[no-untyped-def]
        if run.epoch < 1:
            return real(run, bar)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            stats = real(run, bar)
            seen["s_per_step"] = (time.perf_counter() - t0) / stats["steps"]
        print(f"\n### train() {model}: {1e3 * seen['s_per_step']:.2f} ms / step under the profiler\n")
        table(prof, "self_cpu_time_total")
        table(prof, "self_cuda_time_total", 12)
        return stats

    trainer_module._one_epoch = profiled
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "d.npz"
            synthetic_npz(data, n, size, 100)
            config = TrainConfig(
                data=f"npz:{data}", model=model, loss="cosface", optimizer="sgd", lr=0.01, epochs=2,
                batch_size=256, amp=amp, device=device.type, embedding_dim=512, eval_every=1000,
            )  # fmt: skip
            train(config, Path(tmp) / "run", quiet=True, report=False, stop_after=2)
    finally:
        trainer_module._one_epoch = real


def bare_profile(device: torch.device, n: int, size: int, model_name: str, amp: bool) -> None:
    from marginkit.models import build_model  # type: ignore[attr-defined]

    model = build_model(model_name, (3, size, size), 512).to(device)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8).to(device)
    labels = (torch.arange(n) % 100).to(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rate, _ = bare_loop(model, 512, 100, images, labels, 256, amp, device, 40)
    print(f"\n### bare loop {model_name}: {1e3 * 256 / rate:.2f} ms / step under the profiler\n")
    table(prof, "self_cpu_time_total")
    table(prof, "self_cuda_time_total", 12)


def timm_variants(device: torch.device) -> None:
    from marginkit.models import build_model  # type: ignore[attr-defined]

    print("\n### timm:resnet18 112×112 bf16, bare loop, samples/s\n")
    n = 8192
    for cl in (False, True):
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            model = build_model("timm:resnet18", (3, 112, 112), 512).to(device)
            images = torch.randint(0, 256, (n, 3, 112, 112), dtype=torch.uint8).to(device)
            if cl:
                model = model.to(memory_format=torch.channels_last)
                images = images.contiguous(memory_format=torch.channels_last)
            labels = (torch.arange(n) % 100).to(device)
            rate, _ = bare_loop(model, 512, 100, images, labels, 256, True, device, 60)
            print(f"channels_last={cl} cudnn.benchmark={bench}: {rate:.0f}", flush=True)
    torch.backends.cudnn.benchmark = False


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with contextlib.suppress(Exception):
        print(torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version())
    if device.type == "cuda":
        timm_variants(device)
    bare_profile(device, 8192, 64, "resnet", False)
    trainer_profile(device, 8192, 64, "resnet", "off")


if __name__ == "__main__":
    main()
