"""Render synthetic "speakers" with espeak-ng: a folder in VoxCeleb's layout and a trial list.

A SIMULATION of speakers, not recordings of people: each "speaker" is an espeak-ng voice (an
English accent: en-us, en-gb, en-gb-scotland, ...), a voice variant (m1-m7, f1-f5, klatt, ...),
a base pitch and a speaking rate; its utterances are different sentences spoken with small
per-utterance jitter of pitch and rate. Speaker-verification models can be developed and tested
on it offline, and its EER says something about the code, nothing about real voices.

Output (cached outside the repository; default ``$MARGINKIT_CACHE/espeak_speakers`` or
``~/.cache/marginkit/espeak_speakers``)::

    OUT/<speaker>/<session>/<nnnnn>.wav   16 kHz mono 16-bit PCM (espeak's 22.05 kHz resampled by soxr)
    OUT/speakers.tsv                      speaker -> voice, variant, pitch, rate
    OUT/trials.txt                        VoxCeleb format, label first, over the last --test-speakers

Usage::

    python benchmarks/make_espeak_speakers.py --speakers 40 --utterances 12 [--out DIR]
    marginkit train --data audio:OUT --trials OUT/trials.txt --model ecapa_tdnn

espeak-ng is a system package (Debian / Ubuntu: ``apt-get install espeak-ng``); the script
says so and stops when it is missing. The output is deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-029", "en-gb-x-gbcwmd")
VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "klatt2", "klatt3",
    "croak", "grandpa", "grandma", "edward", "john", "steph", "linda", "max", "david",
)  # fmt: skip
_TEXT = (
    "the margin keeps every speaker apart while the model learns to listen for the voice and not the words "
    "seven quiet rivers cross the northern valley before the winter snow arrives on the hills "
    "please call me back tomorrow morning about the meeting we planned at the station "
    "a careful reader checks each number twice and writes the answer in a small blue notebook "
    "bright lights in the harbour guided the fishing boats home after the long night at sea "
    "music from the old radio filled the kitchen as the bread was baking in the oven "
    "the committee will review the proposal and publish its decision before the end of the month "
    "our neighbours grow tomatoes beans and sunflowers in the garden behind the library"
)
WORDS = _TEXT.split()


def espeak_missing() -> str | None:
    if shutil.which("espeak-ng") is None:
        return (
            "espeak-ng is not installed: it is a system package, not a Python one. On Debian / Ubuntu: "
            "apt-get install espeak-ng (then run this script again)"
        )
    return None


def sentence(rng: np.random.Generator) -> str:
    start = int(rng.integers(0, len(WORDS) - 16))
    return " ".join(WORDS[start : start + int(rng.integers(8, 16))])


def render(text: str, voice: str, pitch: int, rate: int, out: Path, tmp: Path) -> None:
    import soundfile as sf
    import soxr

    raw = tmp / "raw.wav"
    subprocess.run(
        ["espeak-ng", "-v", voice, "-p", str(pitch), "-s", str(rate), "-w", str(raw), text],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    wave, rate_in = sf.read(raw, dtype="float32")
    wave = np.asarray(soxr.resample(wave, rate_in, 16000), dtype=np.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, wave, 16000, subtype="PCM_16")


def trial_list(
    paths: list[str], speakers: list[str], rng: np.random.Generator, per_utterance: int
) -> list[str]:
    """``per_utterance`` target and as many non-target trials per enrolment utterance."""
    by_speaker: dict[str, list[str]] = {}
    for p, s in zip(paths, speakers, strict=True):
        by_speaker.setdefault(s, []).append(p)
    names = sorted(by_speaker)
    lines = []
    for s in names:
        own = by_speaker[s]
        others = [o for o in names if o != s]
        for enrol in own:
            same = [p for p in own if p != enrol]
            for test in rng.choice(same, size=min(per_utterance, len(same)), replace=False):
                lines.append(f"1 {enrol} {test}")
            for _ in range(per_utterance):
                other = by_speaker[others[int(rng.integers(0, len(others)))]]
                lines.append(f"0 {enrol} {other[int(rng.integers(0, len(other)))]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the marginkit cache)")
    parser.add_argument("--speakers", type=int, default=40)
    parser.add_argument("--utterances", type=int, default=12, help="utterances per speaker")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--test-speakers", type=int, default=10, help="speakers the trial list covers")
    parser.add_argument("--trials-per-utterance", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    missing = espeak_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.speakers < 4 or not 2 <= args.test_speakers <= args.speakers:
        parser.error("need >= 4 speakers and 2 <= --test-speakers <= --speakers")
    if args.out is None:
        from marginkit.data.datasets import resolve_cache_dir

        args.out = resolve_cache_dir() / "espeak_speakers"
    out: Path = args.out
    rng = np.random.default_rng(args.seed)
    combos = list(itertools.product(ACCENTS, VARIANTS))
    chosen = rng.permutation(len(combos))[: args.speakers]
    table = ["speaker\tvoice\tpitch\trate"]
    paths, owners = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n, k in enumerate(chosen):
            accent, variant = combos[int(k)]
            name = f"spk{n:03d}"
            pitch, rate = int(rng.integers(20, 80)), int(rng.integers(130, 190))
            table.append(f"{name}\t{accent}+{variant}\t{pitch}\t{rate}")
            for u in range(args.utterances):
                rel = f"{name}/sess{u % args.sessions}/{u:05d}.wav"
                jitter_pitch = int(np.clip(pitch + rng.integers(-4, 5), 0, 99))
                jitter_rate = int(rate + rng.integers(-10, 11))
                render(sentence(rng), f"{accent}+{variant}", jitter_pitch, jitter_rate, out / rel, Path(tmp))
                paths.append(rel)
                owners.append(name)
            print(f"\r{n + 1}/{args.speakers} speakers", end="", flush=True)
    print()
    test = {f"spk{n:03d}" for n in range(args.speakers - args.test_speakers, args.speakers)}
    keep = [i for i, s in enumerate(owners) if s in test]
    trials = trial_list([paths[i] for i in keep], [owners[i] for i in keep], rng, args.trials_per_utterance)
    (out / "speakers.tsv").write_text("\n".join(table) + "\n")
    (out / "trials.txt").write_text("\n".join(trials) + "\n")
    print(f"{len(paths)} utterances of {args.speakers} simulated speakers in {out}")
    print(f"{len(trials)} trials over the last {args.test_speakers} speakers in {out / 'trials.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
