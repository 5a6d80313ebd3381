"""Kyutai STT on the engine at many streams: buckets for hundreds of rows, and a padded batch of 129 streams whose
rows equal each stream run alone (the demo STT model and its 32-codebook Mimi, random weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.graphs import default_buckets
from duplexd.engine.models.config import DEMO_MIMI_32, DEMO_STT
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.weights.demo import random_lm

GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)


@pytest.mark.parametrize("max_batch", [1, 5, 64, 100, 128, 129, 400, 1000])
def test_buckets_cover_every_batch_and_pad_little(max_batch):
    buckets = default_buckets(max_batch)
    assert buckets[-1] == max_batch and list(buckets) == sorted(set(buckets))
    for batch in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= batch)
        assert bucket - batch < max(batch, 64), (batch, bucket)  # under double, and at most 63 rows past 64
    if max_batch <= 128:  # as before: powers of two, then the maximum
        assert all(b & (b - 1) == 0 for b in buckets[:-1])


def test_a_padded_batch_of_129_streams_equals_each_stream_alone():
    lm, mimi = random_lm(DEMO_STT, seed=3), MimiModel(DEMO_MIMI_32).init_weights_(3)
    streams, frames, fs = 129, 3, DEMO_MIMI_32.frame_size
    audio = 0.1 * np.random.default_rng(0).standard_normal((streams, frames, fs)).astype(np.float32)
    batched = Pipeline(lm, mimi, num_slots=200, pad=True)
    assert batched.bucket(streams) == 192
    for slot in range(streams):
        batched.reset(slot, GREEDY)
    outs = [batched.step(list(range(streams)), audio[:, f]) for f in range(frames)]
    alone = Pipeline(lm, mimi, num_slots=1)
    for slot in (0, 64, 128):
        alone.reset(0, GREEDY)
        for f in range(frames):
            own = alone.step([0], audio[slot : slot + 1, f])
            assert int(own.tokens[0, 0]) == int(outs[f].tokens[slot, 0]), (slot, f)
            assert torch.allclose(own.pause[0], outs[f].pause[slot], atol=1e-5), (slot, f)
    assert outs[-1].pcm.shape == (streams, 0) and outs[-1].pause.shape == (streams, 4)
    assert len({int(t) for t in outs[-1].tokens[:, 0]}) > 5, "degenerate: streams should differ"
