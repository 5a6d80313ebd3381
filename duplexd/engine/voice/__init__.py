"""Voice cloning: a voice embedding for the TTS made from a recording, as moshi-server's `voice.py` makes it.

`denoiser.py` is the speech denoiser (Demucs, the network of Facebook's `dns64` checkpoint), `signal.py` the band
split, the resampling and the loudness, `maker.py` the whole recipe and its refusals.
"""
