"""Synthetic speakers -> audio:DIR -> ECAPA-TDNN trained with CosFace on seeded crops -> a trial list
over unseen speakers: the EER of evaluate_trials equals a brute-force EER from the embeddings."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from marginkit.audio.ecapa_tdnn import ECAPATDNN
from marginkit.audio.evaluate import embed_utterances, evaluate_trials, relative_paths, speaker_cohort
from marginkit.audio.sources import read_audio_folder
from marginkit.audio.synthetic import synthetic_speakers, write_speaker_folder
from marginkit.audio.trials import read_trials
from marginkit.heads import CosineHead
from marginkit.losses import CosFaceLoss

pytest.importorskip("soundfile")


def brute_eer(scores: np.ndarray, labels: np.ndarray) -> float:
    """Sweep every threshold; the crossing of FAR(t) and FRR(t), interpolated linearly."""
    thresholds = np.concatenate([[-np.inf], np.unique(scores)])
    far = np.array([(scores[~labels] > t).mean() for t in thresholds])
    frr = np.array([(scores[labels] <= t).mean() for t in thresholds])
    k = int(np.flatnonzero((far[:-1] - frr[:-1] >= 0) & (far[1:] - frr[1:] <= 0))[0])
    d0, d1 = far[k] - frr[k], far[k + 1] - frr[k + 1]
    w = d0 / (d0 - d1) if d0 != d1 else 0.0
    return float(far[k] + w * (far[k + 1] - far[k]))


@pytest.mark.slow
def test_train_then_score_unseen_speakers(tmp_path) -> None:
    torch.manual_seed(0)
    write_speaker_folder(tmp_path, synthetic_speakers(24, seed=4), 5, seconds=(0.6, 1.0), seed=5)
    raw = read_audio_folder(tmp_path, crop_seconds=0.5, test_fraction=1 / 3, split_seed=1)
    x, y = raw.x_train, raw.y_train
    classes, y_local = np.unique(y, return_inverse=True)
    model = ECAPATDNN((8000,), 32, True, channels=32, aggregation_channels=48, num_bins=40)
    head = CosineHead(len(classes), 32)
    loss_fn = CosFaceLoss(scale=16.0, margin=0.2)
    untrained = copy.deepcopy(model)
    params = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    model.train()
    for step in range(80):
        index = np.random.default_rng([0, step]).choice(len(x), 16, replace=False)
        crops = np.stack([x.read(int(i), np.random.default_rng([0, step, int(i)])) for i in index])
        loss = loss_fn(head(model(torch.from_numpy(crops))), torch.from_numpy(y_local[index]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # A trial list over the unseen test speakers, VoxCeleb format, paths relative to the folder.
    names = relative_paths(raw.x_test)
    speakers = raw.y_test
    rng = np.random.default_rng(2)
    pairs = [(a, b) for a in range(len(names)) for b in range(a + 1, len(names))]
    chosen = rng.choice(len(pairs), 120, replace=False)
    lines = []
    for c in chosen:
        i, j = pairs[c]
        lines.append(f"{int(speakers[i] == speakers[j])} {names[i]} {names[j]}")
    (tmp_path / "trials.txt").write_text("\n".join(lines) + "\n")
    trials = read_trials(tmp_path / "trials.txt")
    metrics = evaluate_trials(model, raw.x_test, trials)
    assert metrics["num_trials"] == 120
    # Brute force from the embed output: each utterance embedded once, whole.
    emb, kept, skipped = embed_utterances(model, raw.x_test)
    assert not skipped and kept.tolist() == list(range(len(names)))
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    row = {n: i for i, n in enumerate(names)}
    a = np.array([row[p] for p in trials.enrol])
    b = np.array([row[p] for p in trials.test])
    scores = np.sum(unit[a] * unit[b], axis=1)
    assert metrics["eer"] == pytest.approx(brute_eer(scores, trials.labels), abs=1e-6)
    before = evaluate_trials(untrained, raw.x_test, trials)["eer"]
    print("EER", before, metrics["eer"])
    assert metrics["eer"] < before - 0.1  # training helped on speakers it never saw (16 train, 8 test)
    cohort = speaker_cohort(model, x, y, per_speaker=2)
    assert cohort.shape == (len(classes), 32)
    normed = evaluate_trials(model, raw.x_test, trials, cohort=cohort, top_k=4)
    assert normed["norm"].startswith(f"as-norm (top 4 of {len(classes)} cohort rows")
