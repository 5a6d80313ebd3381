"""The two device halves of a Kyutai TTS step (`TTSGen.listen`: temporal step with cross-attention to the voice
and the text sample; `TTSGen.speak`: the 32-step DepFormer (or 24: `n_q`) with its weight schedule and low-rank
embeddings, the audio delay's mask and the ring) make no host sync and no CPU tensor: TTS 1.6B's shapes on the
`meta` device, the Triton path forced and its launches no-ops (`tests/host_sync.py`). The host's part of the step
sits between them, by design (docs/ARCHITECTURE.md, "Text-to-speech models")."""

from __future__ import annotations

import pytest
import torch

from duplexd.engine.models.config import TTS_1_6B
from duplexd.engine.tts.config import TTSConfig
from duplexd.engine.tts.generate import TTSGen
from duplexd.engine.tts.words import WordFeeder
from duplexd.engine.weights.checkpoint import build_lm
from duplexd.kernels.dispatch import force_triton

from .host_sync import HostWork

TTS = TTSConfig(
    tables={},
    sum=(),
    speaker_dim=512,
    cross_pos_emb=True,
    cross_pos_emb_scale=1.0,
    audio_delay=1.28,
    second_stream_ahead=2,
    voice_suffix=".safetensors",
)


@pytest.fixture(scope="module")
def gen() -> TTSGen:
    lm = build_lm(TTS_1_6B, device="meta", dtype=torch.bfloat16)
    gen = TTSGen(lm, None, TTS, num_slots=5, buckets=(4, 8), pad=True)  # type: ignore[arg-type]  # no conditioner
    for slot in range(5):
        gen.states[slot] = WordFeeder(TTS_1_6B.text_in_card).start([])
    return gen


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("speaking", ["all", "some", "none"])
def test_the_device_halves_of_a_step_do_no_host_work(gen, no_launch, greedy, speaking):
    index = torch.tensor([0, 2, 3, 4], device="meta")
    rows = {"all": None, "some": torch.tensor([1, 3], device="meta"), "none": torch.zeros(0, dtype=torch.long)}
    rows_on_device = None if rows[speaking] is None else rows[speaking].to("meta")
    text = torch.zeros(4, dtype=torch.long, device="meta")
    with force_triton(), HostWork() as host:
        hidden, sampled, offsets = gen.listen(index, greedy)
        out, valid = gen.speak(index, text, hidden, greedy, rows_on_device)
    assert not host.ops, "host work in a TTS step's device halves:\n" + "\n".join(map(str, host.ops))
    assert hidden.shape == (4, TTS_1_6B.dim) and sampled.shape == (4,) and offsets.shape == (4,)
    assert out.shape == (4, 1 + TTS_1_6B.dep_q) and valid.shape == (4,)
    assert "_split_kernel" in no_launch  # the temporal step ran its paged attention
    if not greedy:
        assert "_sample_kernel" in no_launch


def test_the_halves_at_a_bucket_as_graphs_capture_them_do_no_host_work(gen, no_launch):
    """What a CUDA graph of each half holds: three rows padded to a bucket of four with the scratch slot, every row
    sampled and through the DepFormer."""
    index = torch.tensor([0, 2, 4], device="meta")
    text = torch.zeros(3, dtype=torch.long, device="meta")
    with force_triton(), HostWork() as host:
        hidden, sampled, offsets = gen.bucketed_listen(index)
        out, valid = gen.bucketed_speak(index, text, hidden)
    assert not host.ops, "host work in a TTS step's bucketed halves:\n" + "\n".join(map(str, host.ops))
    assert hidden.shape == (3, TTS_1_6B.dim) and sampled.shape == (3,) and offsets.shape == (3,)
    assert out.shape == (3, 1 + TTS_1_6B.dep_q) and valid.shape == (3,)
    assert gen.bucketed_listen.bucket(3) == 4 and "_sample_kernel" in no_launch


def test_fewer_codebooks_do_no_host_work(no_launch):
    """`--tts-n-q 24`: a 24-step DepFormer, the zero token written for the other 8 codebooks, bucketed."""
    lm = build_lm(TTS_1_6B, device="meta", dtype=torch.bfloat16)
    gen = TTSGen(lm, None, TTS, num_slots=3, buckets=(4,), pad=True, n_q=24)  # type: ignore[arg-type]
    for slot in range(3):
        gen.states[slot] = WordFeeder(TTS_1_6B.text_in_card).start([])
    index = torch.tensor([0, 2], device="meta")
    with force_triton(), HostWork() as host:
        hidden, _, _ = gen.bucketed_listen(index)
        out, _ = gen.bucketed_speak(index, torch.zeros(2, dtype=torch.long, device="meta"), hidden)
    assert not host.ops, "host work in a 24-codebook TTS step:\n" + "\n".join(map(str, host.ops))
    assert out.shape == (2, 1 + 24)
