"""Speaker verification from audio: reading wav / flac (:mod:`~marginkit.audio.io`), the ``audio:``
sources (:mod:`~marginkit.audio.sources`), Kaldi's log-mel filterbank in torch
(:mod:`~marginkit.audio.fbank`), the ECAPA-TDNN and ResNet34 speaker backbones, and trial lists
(:mod:`~marginkit.audio.trials`). See docs/audio.md."""

from marginkit._lazy import attach
from marginkit.audio.models import register as _register

_register()  # build_model("ecapa_tdnn" | "speaker_resnet34", ...)

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "KaldiFbank": "fbank",
        "SPEAKER_MODELS": "models",
        "ECAPATDNN": "ecapa_tdnn",
        "SpeakerResNet": "resnet",
        "SpeakerModel": "speaker",
        "AudioFiles": "sources",
        "read_audio_folder": "sources",
        "read_wav_scp": "sources",
        "read_audio_source": "sources",
        "read_audio": "io",
        "read_crop": "io",
        "audio_info": "io",
        "Trials": "trials",
        "read_trials": "trials",
        "score_trials": "trials",
        "trial_scores": "trials",
    },
)
