"""A real server with a text-to-speech model, shared by the tests of its endpoints, and moshi's oracle of what
moshi-server would send.

The server (`duplexd serve` with Kyutai's STT as its main model and `--tts` a random TTS model written as Kyutai
lays its repos out, its text head leaning to start words itself) is driven as moshi-server's Rust side drives its
Python worker: one `Text` per word, then `Eos`. moshi's `TTSModel.generate` (temperature 0, fp32) is the oracle of
the frames: fed one word per step, the worker gives generate's frames with its voices built `[file, file]`, and
times each word from its consumption step (`kyutai_dsm` notes in docs/ARCHITECTURE.md). The expected messages are
built from those: `Text{word, (c_j + 1) / 12.5, (c_{j+1} + 1) / 12.5}`, the last one to the step count the worker
ends at (generate's end plus `max_delay`), and the audio rows after the audio delay decoded by Mimi, clamped as the
worker clamps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import shutil

import msgpack
import numpy as np
import pytest
import torch
from moshi.models import loaders
from moshi.models.tts import Entry
from safetensors.torch import load_file, save_file
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexd.engine.models.config import DEMO_MIMI_32
from duplexd.engine.models.mimi import MimiModel, MimiStreams
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.tts.config import tts_config_from_dict
from duplexd.engine.tts.demo import tts_keys
from duplexd.engine.tts.model import load_tts
from duplexd.engine.tts.service import PCM_LIMIT
from duplexd.engine.tts.words import StreamWords, Word
from duplexd.engine.weights.checkpoint import save_mimi_weights
from duplexd.engine.weights.demo import ensure_demo

from .built_once import built_once, computed_once
from .live_server import running_server
from .ref_models import reference_tts, tts_reference_kwargs, tuned_tts_lm
from .test_asr_e2e import HEADERS, KEY, words_model

SPEAKER_DIM, DELAY_STEPS, MAX_DELAY, FINAL_PADDING = 8, 5, 2, 4
RAW = {
    "dim": 64,
    "n_q": 32,  # Mimi's 32 codebooks, all said
    "dep_q": 32,
    "card": 2048,  # the demo Mimi's codebooks
    "num_heads": 4,
    "num_layers": 3,
    "hidden_scale": 4.125,
    "context": 16,  # the window slides within a sentence
    "max_period": 10000,
    "delays": [0, 0] + [2] * 31,
    "depformer_dim": 32,
    "depformer_dim_feedforward": 96,
    "depformer_num_heads": 2,
    "depformer_num_layers": 2,
    "depformer_weights_per_step": True,
    "depformer_weights_per_step_schedule": [0, 1, 1, 1] + [2] * 28,
    "depformer_low_rank_embeddings": 8,
    "demux_second_stream": True,
    "cross_attention": True,
    **tts_keys(SPEAKER_DIM, 64, audio_delay=0.4),  # 5 steps
}
VOICES = ("expresso/ex01_happy.wav", "unmute-prod-website/default_voice.wav")
TEXT = 'Hello there, this is a (short) test: of the speech model’s <break time="0.3s"/> words.'
STREAMS = 4
IDLE = 2.0


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    """RAW's folder and moshi's LM in it, written once for the whole run (tuning the LM runs a generation)."""
    root = built_once(tmp_path_factory, "tts-model", lambda root: write_model_folder(root, RAW))
    return root / "tts", reference_tts_lm(root / "tts")


def reference_tts_lm(folder):
    """moshi's LM as `write_model_folder` saved it in `folder`."""
    raw = json.loads((folder / "config.json").read_text())
    lm = loaders.get_moshi_lm(None, lm_kwargs=tts_reference_kwargs(raw), device="cpu", dtype=torch.float32)
    lm.load_state_dict(load_file(str(folder / raw["moshi_name"])))
    return lm.eval()


def write_model_folder(root, layout: dict):
    """A TTS folder of `layout` (RAW's keys) as Kyutai lays one out, voices included, and moshi's LM in it."""
    tokenizer_path = ensure_demo(root / "cache").tokenizer
    tokenizer = TextTokenizer(tokenizer_path)
    raw = {**layout, "text_card": tokenizer.vocab_size, "moshi_name": "lm.safetensors"}
    raw["mimi_name"] = "mimi.safetensors"
    raw["tokenizer_name"] = "tokenizer.model"
    tts = tts_config_from_dict(raw)
    assert tts is not None and tts.delay_steps == DELAY_STEPS
    folder = root / "tts"
    for k, name in enumerate(VOICES):
        path = folder / "voices" / (name + tts.voice_suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        emb = torch.randn(1, SPEAKER_DIM, tts.speaker_frames, generator=torch.Generator().manual_seed(20 + k))
        save_file({"speaker_wavs": emb}, str(path))
    words = StreamWords(tokenizer.encode).split(TEXT)
    lm = tuned_tts_lm(raw, lambda lm: moshi_generate(lm, words, [voice_path(folder, 0)]))
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(folder / raw["moshi_name"]))
    save_mimi_weights(MimiModel(DEMO_MIMI_32).init_weights_(5), folder / raw["mimi_name"], naming="fused")
    shutil.copy(tokenizer_path, folder / raw["tokenizer_name"])
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, lm


def voice_path(folder, k: int):
    tts = tts_config_from_dict(RAW)
    assert tts is not None
    return folder / "voices" / (VOICES[k] + tts.voice_suffix)


def moshi_generate(lm, words: list[Word], voices: list):
    """generate, run to the worker's end (its final padding `max_delay` steps longer)."""
    tts = reference_tts(copy.deepcopy(lm), DELAY_STEPS, max_gen_length=600, final_padding=FINAL_PADDING + MAX_DELAY)
    entries = [[Entry(list(w.tokens), w.text, w.padding) for w in words]]
    return tts.generate(entries, [tts.make_condition_attributes(voices, cfg_coef=2.0)])


@pytest.fixture(scope="session")
def server(model_folder, tmp_path_factory):
    folder, _ = model_folder
    stt = words_model(tmp_path_factory.mktemp("tts-stt"))
    log = tmp_path_factory.mktemp("tts-server") / "serve.log"
    args = [
        "--hf-repo", str(stt.root), "--max-sessions", "2", "--api-key", KEY, "--tts", str(folder),
        "--tts-temperature", "0", "--tts-streams", str(STREAMS), "--tts-idle-timeout", str(IDLE),
    ]  # fmt: skip
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def url(live, query: str = "format=PcmMessagePack") -> str:
    return f"ws://127.0.0.1:{live.port}/api/tts_streaming?{query}"


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def expected(model_folder, text: str, voice: int, mimi: MimiStreams, twice: bool = True) -> list[dict]:
    """The messages moshi-server sends for `text` (greedy), from moshi's generate; computed once per folder."""
    beside = model_folder[0].parent  # not in the model's folder, which servers read
    return computed_once(beside, (text, voice, twice), lambda: _expected(model_folder, text, voice, mimi, twice))


def _expected(model_folder, text: str, voice: int, mimi: MimiStreams, twice: bool) -> list[dict]:
    folder, lm = model_folder
    splitter = StreamWords(TextTokenizer(folder / "tokenizer.model").encode)
    words = [word for message in messages_of(text) for word in splitter.split(message)]
    path = voice_path(folder, voice)
    result = moshi_generate(lm, words, [path, path] if twice else [path])
    end = result.end_steps[0]
    assert end is not None
    steps = end + DELAY_STEPS + FINAL_PADDING + MAX_DELAY
    consumed = result.all_consumption_times[0]
    assert len(consumed) == len(words)
    out: list[dict] = [{"type": "Ready"}]
    stops = [c + 1 for c in consumed[1:]] + [steps]
    texts = [
        {"type": "Text", "text": w.text, "start_s": (c + 1) / 12.5, "stop_s": stop / 12.5}
        for w, c, stop in zip(words, consumed, stops, strict=True)
    ]
    rows = [f[0, 1:, 0] for f in result.frames[DELAY_STEPS : steps - MAX_DELAY]]
    assert len(rows) == steps - MAX_DELAY - DELAY_STEPS
    mimi.reset(0)
    with torch.no_grad():
        pcm = mimi.decode([0], torch.stack(rows, dim=1)[None]).clamp(-PCM_LIMIT, PCM_LIMIT)[0].numpy()
    # in time order: word j's Text goes out at the step word j + 1 is taken (the last at the end)
    events = [(stop - 1, 0, t) for stop, t in zip(stops[:-1], texts[:-1], strict=True)]
    events += [
        (DELAY_STEPS + MAX_DELAY + i, 1, {"type": "Audio", "pcm": pcm[i * 1920 : (i + 1) * 1920]})
        for i in range(len(rows))
    ]
    events.append((steps, 2, texts[-1]))
    out += [message for *_, message in sorted(events, key=lambda e: (e[0], e[1]))]
    return out


@pytest.fixture(scope="session")
def mimi(model_folder):
    folder, _ = model_folder
    return MimiStreams(load_tts(folder).mimi, 1)


async def say(address: str, text: str, voice_message: bytes | None = None) -> tuple[list[dict], int | None, str]:
    """DSM's `tts_rust_server.py`: one `Text` per word (`messages_of`), `Eos`, then every message until the
    close."""
    messages = []
    async with connect(address, additional_headers=HEADERS, max_size=None) as ws:
        if voice_message is not None:
            await ws.send(voice_message)
        for message in messages_of(text):
            await ws.send(msgpack.packb({"type": "Text", "text": message}))
        await ws.send(msgpack.packb({"type": "Eos"}))
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                messages.append(msgpack.unpackb(raw))
        return messages, ws.close_code, ws.close_reason


def messages_of(text: str) -> list[str]:
    """The text as DSM's script sends it, a word a message (a break tag kept whole)."""
    return re.findall(r"<break[^>]*/>|\S+", text)


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert [m["type"] for m in got] == [m["type"] for m in want]
    for g, w in zip(got, want, strict=True):
        if w["type"] == "Audio":
            assert len(g["pcm"]) == 1920
            assert np.allclose(np.asarray(g["pcm"], dtype=np.float32), w["pcm"], atol=1e-5)
        else:
            assert g == w
