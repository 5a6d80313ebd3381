"""The models and engines behind the server: loaded before the port is bound, warmed after.

One engine per device; a new session goes to the engine that can admit the most, so a multi-GPU server fills
evenly. Loading errors (missing or corrupt files, bad configs, a tokenizer too small for the LM) surface here,
before uvicorn starts. `--random-weights PRESET` builds the preset's LM and Mimi with random weights on the device
instead (no files, no download), so a machine without checkpoints can still serve at full size, e.g. to measure
capacity; it has learnt nothing and speaks noise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from duplexd.engine.dialogue.engine import Engine, EngineConfig, EngineStats, Session
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import CapacityError, CheckpointError
from duplexd.engine.models.config import MIMI_PRESETS, PRESET_MIMI, PRESETS, ConfigError
from duplexd.engine.models.int8_weights import use_int8_kernel
from duplexd.engine.models.lm import LMModel
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.persona.prompt import PersonaPrompt
from duplexd.engine.persona.voices import VoiceLibrary
from duplexd.engine.stt.delay import delay_tokens
from duplexd.engine.transcription.service import TranscriptionConfig, TranscriptionService
from duplexd.engine.transcription.transcriber import Transcriber, model_folder
from duplexd.engine.turns import DeviceTurns
from duplexd.engine.weights.checkpoint import (
    CONFIG_NAME,
    MOSHI_NAME,
    build_lm,
    load_lm,
    load_mimi,
    mimi_ring_rule,
    quantize_lm_,
    read_stt_settings,
)
from duplexd.engine.weights.demo import draw_random_, ensure_demo
from duplexd.engine.weights.hub import resolve_file
from duplexd.engine.weights.model_files import DTYPES, TOKENIZER_NAME, ModelFiles, check_tokenizer, model_files

from .agents import Agents, load_agents
from .cloning import VoiceCloning, load_cloning
from .persona import PersonaRefused, Personas
from .settings import RANDOM_WEIGHTS_MIMI, ServerSettings
from .speech import SpeechModel, load_speech

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What `/v1/models` and the Kyutai metadata say about the model, built from the files we loaded."""

    id: str
    lm_file: str
    mimi_file: str
    tokenizer_file: str
    demo: bool
    sample_rate: int
    frame_size: int
    devices: tuple[str, ...]
    random_weights: str | None = None  # the LM preset, when its weights are random
    transcriber: str | None = None  # the Gemma 4 transcribing users' speech, when there is one
    transcriber_demo: bool = False
    persona: bool = False  # a PersonaPlex LM: sessions may be given a voice and a role text
    voices: tuple[str, ...] = ()  # the voices `--voices` loaded, by file name
    created: int = field(default_factory=lambda: int(time.time()))
    # A speech-to-text LM (Kyutai STT, text only): the steps its text lags the audio by, as moshi-server's
    # `asr_delay_in_tokens` (None: not a speech-to-text model), and its pause heads (semantic VAD)
    asr_delay_tokens: int | None = None
    pause_heads: int = 0

    @property
    def speech_to_text(self) -> bool:
        """A speech-to-text model: served by `/api/asr-streaming` and transcription sessions, not conversations."""
        return self.asr_delay_tokens is not None


def resolve_files(settings: ServerSettings) -> ModelFiles:
    """The weight files to load (demo model when none are given), by the same rules as `duplexd infer`."""
    return model_files(
        moshi_weight=settings.moshi_weight,
        mimi_weight=settings.mimi_weight,
        tokenizer=settings.tokenizer,
        config=settings.config,
        hf_repo=settings.hf_repo,
        # not given: chosen by the LM's config (32 codebooks for a speech-to-text model)
        mimi_preset=settings.mimi_preset if "mimi_preset" in settings.model_fields_set else None,
    )


def weight_dtype(settings: ServerSettings, device: str) -> torch.dtype:
    if settings.dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[settings.dtype]


def random_models(
    preset: str, device: str, dtype: torch.dtype, seed: int = 0, weights_dtype: str | None = None
) -> tuple[LMModel, MimiModel]:
    """The preset's LM in `dtype` (its projections int8 with `weights_dtype` "int8") and its Mimi in fp32 (with the
    LM's ring rule), random weights drawn on the device (`draw_random_`)."""
    lm = quantize_lm_(draw_random_(build_lm(PRESETS[preset], device=device, dtype=dtype), seed), weights_dtype)
    mimi = MimiModel(mimi_ring_rule(MIMI_PRESETS[PRESET_MIMI[preset]], lm.cfg)).init_weights_(seed).to(device)
    return lm, mimi


class RandomTextTokenizer(TextTokenizer):
    """The demo tokenizer read over a random-weight LM's whole text vocabulary: ids past its pieces show as
    `<id>`. Such an LM writes noise anyway, and its text head keeps the preset's size (and cost)."""

    def __init__(self, path: str | Path, text_card: int) -> None:
        super().__init__(path)
        self.pieces, self.text_card = self.sp.GetPieceSize(), text_card

    @property
    def vocab_size(self) -> int:
        return max(self.pieces, self.text_card)

    def piece(self, token: int) -> str:
        return super().piece(token) if token < self.pieces else f"<{int(token)}>"


def _model_id(settings: ServerSettings, files: ModelFiles) -> str:
    if settings.demo:
        return "duplexd-demo"
    if settings.random_weights:
        return f"{settings.random_weights}-random-weights"
    if settings.hf_repo:
        return settings.hf_repo
    return str(files.moshi).rstrip("/").rsplit("/", 1)[-1].removesuffix(".safetensors")


class Runtime:
    """The engines of this server and what they serve; `open_session` never blocks."""

    def __init__(
        self,
        engines: list[Engine],
        info: ModelInfo,
        transcription: TranscriptionService | None = None,
        voices: VoiceLibrary | None = None,
        personas: Personas | None = None,
        tokenizer: TextTokenizer | None = None,
        speech: SpeechModel | None = None,
        cloning: VoiceCloning | None = None,
        agents: Agents | None = None,
    ) -> None:
        if not engines:
            raise ConfigError("no engine to serve with")
        self.engines, self.info, self.transcription = engines, info, transcription
        self.speech = speech  # `--tts`: the text-to-speech model served beside the main one
        self.cloning = cloning  # `--voice-mimi`: voices for it made from recordings
        self.agents = agents  # `--llm`: voice agents on /v1/realtime, the STT and the TTS around an LLM
        self.tokenizer = tokenizer  # the LM's, for what reads its text ids (words of /api/asr-streaming)
        self.voices = voices  # `--voices`, loaded and encoded once
        self.personas = personas or Personas.off()  # what a session's text and voice prompt turn into
        self.failed: str | None = None  # why warm-up failed, if it did

    @property
    def ready(self) -> bool:
        return self.failed is None and all(e.ready for e in self.engines)

    def start(self) -> None:
        """Warm every engine up (blocking: CUDA graph capture on GPU, warm-up steps on CPU)."""
        for engine in self.engines:
            started = time.perf_counter()
            logger.info("warming up the engine on %s ...", engine.device)
            engine.start()
            logger.info("engine on %s warm in %.1f s", engine.device, time.perf_counter() - started)
        if self.transcription is not None:
            self.transcription.start()
        if self.speech is not None:
            self.speech.service.start()

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
        if self.transcription is not None:
            self.transcription.stop()
        if self.speech is not None:
            self.speech.service.stop()
        if self.cloning is not None:
            self.cloning.close()
        if self.agents is not None:
            self.agents.stop()

    def open_session(
        self, params: SamplingParams, max_frames: int | None = None, prompt: PersonaPrompt | None = None
    ) -> Session:
        """Admit a session on the engine with the most room, or raise `CapacityError`; with a persona `prompt`, the
        engine prefills it before the session goes live (`ValueError` if it cannot take that prompt)."""
        if not self.ready:
            raise CapacityError("the model is still warming up" if self.failed is None else "the model failed")
        order = sorted(self.engines, key=lambda e: e.stats().admissible_sessions, reverse=True)
        error: CapacityError | None = None
        for engine in order:
            try:
                return engine.open_session(params, max_frames, prompt)
            except CapacityError as e:
                error = e
        assert error is not None
        raise error

    def stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in self.engines]

    def admissible(self) -> int:
        return sum(s.admissible_sessions for s in self.stats()) if self.ready else 0

    def capacity(self) -> int:
        return sum(e.config.max_sessions for e in self.engines)


def load_transcription(settings: ServerSettings) -> tuple[TranscriptionService, str]:
    """The transcriber `--transcribe` names, on its device, and its service (not started); and its model id.
    Loaded before the engines, so on a shared GPU the KV pool is sized from what the transcriber leaves."""
    assert settings.transcribe is not None
    device = settings.transcribe_device or settings.devices[0]
    dtype = weight_dtype(settings, device)
    streams = settings.transcribe_streams or settings.max_sessions * len(settings.devices)
    try:
        folder = model_folder(settings.transcribe)
        started = time.perf_counter()
        free = torch.cuda.mem_get_info(torch.device(device))[0] if torch.device(device).type == "cuda" else None
        transcriber = Transcriber.from_pretrained(
            folder, device=device, dtype=dtype, max_slots=streams + 1, max_new_tokens=settings.transcribe_max_tokens
        )
    except CheckpointError as e:
        raise CheckpointError(_one_line(settings.transcribe, e), "transcribe") from None
    except torch.cuda.OutOfMemoryError as e:
        raise CheckpointError(
            f"{settings.transcribe}: does not fit on {device} ({_one_line('', e)}); give --transcribe-device another",
            "transcribe",
        ) from None
    except Exception as e:  # noqa: BLE001 - transformers' refusals (OSError, ValueError, KeyError...) of a folder
        logger.debug("loading the transcriber failed", exc_info=True)
        raise CheckpointError(
            f"{settings.transcribe}: cannot load it as a Gemma 4 checkpoint ({type(e).__name__}: {_one_line('', e)})",
            "transcribe",
        ) from None
    size = sum(p.numel() * p.element_size() for m in (transcriber.encoder, transcriber.decoder) for p in m.parameters())
    logger.info(
        "transcriber %s on %s (%s): %.2f GiB of weights, loaded in %.1f s; %d streams",
        folder,
        device,
        dtype,
        size / 2**30,
        time.perf_counter() - started,
        streams,
    )
    if free is not None:
        logger.info(
            "the transcriber took %.2f GiB of %s's memory", (free - torch.cuda.mem_get_info(device)[0]) / 2**30, device
        )
    config = TranscriptionConfig(max_streams=streams, max_queued=settings.transcribe_queue)
    name = "gemma4-demo" if settings.transcribe == "demo" else settings.transcribe.rstrip("/").rsplit("/", 1)[-1]
    return TranscriptionService(transcriber, config), name


def _one_line(ref: str, error: BaseException, limit: int = 400) -> str:
    """An error's message on one line (transformers' span several), at most `limit` characters, led by `ref`
    unless it already names it."""
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text if not ref or text.startswith(ref) else f"{ref}: {text}"


def load_runtime(settings: ServerSettings) -> Runtime:
    """Load the weights onto every device and build the engines (not started). Raises `CheckpointError` (tagged
    with the option of the file at fault) with a message naming the problem; `server.preflight` checks first."""
    threads = torch.get_num_threads()
    if any(torch.device(d).type == "cpu" for d in settings.devices):
        # The engine's loop thread does all the torch work with `threads` intra-op threads; other threads that touch
        # torch keep one, or the OpenMP pools oversubscribe the cores and every step slows (engine.engine docs).
        torch.set_num_threads(1)
    preset = settings.random_weights
    if preset is not None:
        files = ModelFiles(
            f"random:{preset}",
            f"random:{RANDOM_WEIGHTS_MIMI[preset]}",
            str(ensure_demo().tokenizer),
            None,
            RANDOM_WEIGHTS_MIMI[preset],
        )
        tokenizer_path: str | Path = files.tokenizer
        stretched = RandomTextTokenizer(tokenizer_path, PRESETS[preset].text_card)
        logger.warning(
            "serving %s with RANDOM weights (no checkpoint): it speaks noise, and its text ids are read "
            "with the demo tokenizer (%d pieces; others show as <id>)",
            preset,
            stretched.pieces,
        )
        tokenizer: TextTokenizer = stretched
    else:
        files = resolve_files(settings)
        tokenizer_path = resolve_file(files.tokenizer, TOKENIZER_NAME)
        tokenizer = TextTokenizer(tokenizer_path)
    transcription, transcriber_id = load_transcription(settings) if settings.transcribe else (None, None)
    speech = None
    if settings.tts is not None:
        tts_device = settings.tts_device or settings.devices[0]
        speech = load_speech(settings, tts_device, weight_dtype(settings, tts_device))
    cloning = load_cloning(settings, speech.model.tts if speech is not None else None)
    engines = []
    models: list[tuple[LMModel, MimiModel]] = []
    for index, device in enumerate(settings.devices):
        step = f"[{index + 1}/{len(settings.devices)}] {device}"
        started = time.perf_counter()
        dtype = weight_dtype(settings, device)
        if preset is not None:
            logger.info("%s: drawing random weights for the %s LM (%s) and Mimi", step, preset, dtype)
            lm, mimi = random_models(preset, device, dtype, seed=index, weights_dtype=settings.weights_dtype)
        else:
            logger.info("%s: loading the LM from %s", step, files.moshi)
            try:
                lm = load_lm(
                    files.moshi, files.config, device=device, dtype=dtype, weights_dtype=settings.weights_dtype
                )
            except CheckpointError as e:
                raise CheckpointError(str(e), e.option or "moshi_weight") from None
            logger.info("%s: loading Mimi from %s", step, files.mimi)
            try:
                mimi_cfg = mimi_ring_rule(MIMI_PRESETS[files.mimi_preset], lm.cfg)
                mimi = load_mimi(files.mimi, mimi_cfg, device=device, dtype=torch.float32)
            except CheckpointError as e:
                raise CheckpointError(str(e), e.option or "mimi_weight") from None
        check_tokenizer(tokenizer, lm.cfg, tokenizer_path)
        use_int8_kernel(lm, settings.w8a16_kernel)
        models.append((lm, mimi))
        config = EngineConfig(
            max_sessions=settings.max_sessions,
            kv_memory=settings.kv_memory,
            kv_dtype=settings.kv_dtype,
            attention_kernel=settings.attention_kernel,
            max_session_frames=settings.session_frames(lm.cfg.text_only),
            max_pending_frames=settings.max_pending_frames,
            max_output_frames=settings.max_output_frames,
            device=device,
            cuda_graphs=settings.cuda_graphs,
            threads=threads,
        )
        try:
            engines.append(Engine(lm, mimi, tokenizer, config))
        except ConfigError as e:
            if transcription is None or (settings.transcribe_device or settings.devices[0]) != device:
                raise
            raise ConfigError(
                f"{e}; the transcriber shares {device}: give it another with --transcribe-device, or a smaller model"
            ) from None
        logger.info("%s: loaded in %.1f s", step, time.perf_counter() - started)
    if speech is not None:  # the speech service takes turns with the engine on its device
        shared = next((e for e in engines if e.device == torch.device(speech.device)), None)
        if shared is not None:
            shared.turns = speech.service.turns = DeviceTurns()
            logger.info("%s: the engine and the text-to-speech model take turns (engine first)", shared.device)
    first, (lm, mimi) = engines[0], models[0]
    voices = load_voices(settings, lm, mimi)
    model_id = _model_id(settings, files)
    try:
        personas = Personas(lm.cfg, tokenizer, voices, model_id)
    except PersonaRefused as e:  # the default persona does not fit this model's window
        raise CheckpointError(f"{settings.voices}: the default persona cannot be run: {e}", "voices") from None
    info = ModelInfo(
        model_id,
        str(files.moshi),
        str(files.mimi),
        str(tokenizer_path),
        settings.demo_model,
        first.sample_rate,
        first.frame_size,
        tuple(settings.devices),
        preset,
        transcriber_id,
        settings.transcribe == "demo",
        persona=lm.cfg.predicts_user_audio,
        voices=tuple(voices.names) if voices is not None else (),
        asr_delay_tokens=asr_delay_tokens(settings, files) if lm.cfg.text_only else None,
        pause_heads=lm.cfg.extra_heads_num_heads,
    )
    agents = load_agents(settings, lm.cfg.text_only, model_id)
    return Runtime(engines, info, transcription, voices, personas, tokenizer, speech, cloning, agents)


def asr_delay_tokens(settings: ServerSettings, files: ModelFiles) -> int:
    """A speech-to-text model's `asr_delay_in_tokens`: `--asr-delay-tokens`, else from its config.json's
    `stt_config` (Kyutai's values for its models), else 0 (word times not shifted), said in the log."""
    if settings.asr_delay_tokens is not None:
        return settings.asr_delay_tokens
    stt = None
    try:
        if files.config:
            path = resolve_file(files.config, CONFIG_NAME)
        elif files.hf_repo:
            path = resolve_file(f"hf://{files.hf_repo}/{CONFIG_NAME}", CONFIG_NAME)
        else:
            path = resolve_file(files.moshi, MOSHI_NAME).parent / CONFIG_NAME
        stt = read_stt_settings(path) if path.is_file() else None
    except CheckpointError as e:
        logger.warning("no speech-to-text settings: %s", e)
    if stt is None:
        logger.warning("a speech-to-text model without stt_config: word times are not shifted (--asr-delay-tokens)")
        return 0
    tokens = delay_tokens(stt.audio_delay_seconds)
    logger.info("speech to text: the text lags the audio by %g s, %d steps", stt.audio_delay_seconds, tokens)
    return tokens


def load_voices(settings: ServerSettings, lm: LMModel, mimi: MimiModel) -> VoiceLibrary | None:
    """The `--voices` folder, every file checked against the LM and the audio ones encoded by `mimi` (once, for
    every device: codes are tokens). Raises `VoiceError` (option `voices`) naming a bad file and why: one bad
    file refuses the start, so no session finds it missing later."""
    if settings.voices is None:
        return None
    if not lm.cfg.predicts_user_audio:  # preflight says so first; random weights are never PersonaPlex
        raise CheckpointError(f"{settings.voices}: voices need a PersonaPlex model, and this LM is not one", "voices")
    started = time.perf_counter()
    library = VoiceLibrary.scan(settings.voices, mimi, lm.cfg)
    logger.info("%d voices ready in %.1f s", len(library.names), time.perf_counter() - started)
    return library
