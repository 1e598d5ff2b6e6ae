"""Speaker verification from audio: reading wav / flac, the Kaldi filterbank front-end, speaker backbones
(ECAPA-TDNN, wespeaker's ResNet34) and VoxCeleb-style trial lists."""
