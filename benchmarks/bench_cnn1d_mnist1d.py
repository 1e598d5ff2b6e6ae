"""Plain softmax sanity run of the default ``cnn1d`` backbone on mnist1d (accuracy and time).

    python benchmarks/bench_cnn1d_mnist1d.py [--epochs 10] [--threads 1] [--quick]

Normalised softmax (cosine logits, scale 16), AdamW 3e-3 with a one-cycle schedule, batch
128, no augmentation, on the default split (3601 train / 399 val / 1000 test). Prints test
accuracy of the softmax head and of 1-NN / 5-NN over the training embeddings, plus wall and
process CPU time of training.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from marginkit.data import load_dataset
from marginkit.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one epoch, for a smoke run")
    args = parser.parse_args()
    epochs = 1 if args.quick else args.epochs
    torch.set_num_threads(args.threads)
    data = load_dataset("mnist1d", seed=0)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = build_model("cnn1d", data.input_shape, embedding_dim=64)
    weight = torch.nn.Parameter(torch.randn(10, 64) * 0.01)
    opt = torch.optim.AdamW([*model.parameters(), weight], lr=3e-3, weight_decay=5e-4)
    batch = 128
    steps = epochs * -(-len(data.train) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.15)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(data.train), generator=gen)
        for i in range(0, len(order), batch):
            b = order[i : i + batch]
            logits = 16 * model(data.train.x[b]) @ F.normalize(weight, dim=1).T
            loss = F.cross_entropy(logits, data.train.y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model.eval()
    with torch.no_grad():
        ref, query = model(data.train.x), model(data.test.x)
        head = (query @ F.normalize(weight, dim=1).T).argmax(1)
        top = (query @ ref.T).topk(5, dim=1).indices
        knn1 = data.train.y[top[:, 0]]
        knn5 = F.one_hot(data.train.y[top], 10).sum(1).argmax(1)  # ties: lowest class id
    acc = {
        k: float((v == data.test.y).double().mean())
        for k, v in (("head", head), ("1nn", knn1), ("5nn", knn5))
    }
    params = sum(p.numel() for p in model.parameters())
    print("| epochs | threads | params | head acc | 1-NN | 5-NN | train wall s | train CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {epochs} | {args.threads} | {params} | {acc['head']:.4f} | {acc['1nn']:.4f} | {acc['5nn']:.4f} "
        f"| {wall:.1f} | {cpu:.1f} |"
    )


if __name__ == "__main__":
    main()
