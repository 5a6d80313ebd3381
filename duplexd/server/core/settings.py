"""Server settings: one pydantic-settings model, filled from `duplexd serve` flags and `DUPLEXD_*` variables.

Flags win over the environment, the environment over the defaults, so containers can be configured without a
command line and a developer can still override one value. Each field is written once: `server.cli` derives its
flag (name, help, choices, default) from the field, so a new setting is a new field and nothing else.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import ByteSize, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from duplexd.wire import FRAME_RATE

ENV_PREFIX = "DUPLEXD_"
# The LM presets `--random-weights` serves, each with the Mimi preset its codebooks match.
RANDOM_WEIGHTS_MIMI = {"moshi-7b": "mimi", "demo": "demo"}
_WEIGHT_FILES = ("moshi_weight", "mimi_weight", "tokenizer", "config", "hf_repo")


class SettingsError(ValueError):
    """A start-up setting that cannot work; the message names the flag (or variable) and the fix."""


def opt(
    default: Any = None,
    description: str = "",
    group: str = "",
    flag: str | None = None,
    metavar: str | None = None,
    **constraints: Any,
) -> Any:
    """A settings field and its command-line form: `group` of the help, and `flag`/`metavar` where they differ
    from the field's name (a `list` default is a factory; a `--no-x` flag turns a bool off)."""
    extra: JsonDict = {key: value for key, value in (("group", group), ("flag", flag), ("metavar", metavar)) if value}
    if isinstance(default, list):
        return Field(
            default_factory=lambda: list(default), description=description, json_schema_extra=extra, **constraints
        )
    return Field(default, description=description, json_schema_extra=extra, **constraints)


_NET, _MODEL, _CAP, _ACCESS = "network", "model (default: the demo model, on the CPU)", "capacity and limits", "access"
_ASR = "transcription of the users' speech (Gemma 4; needs the gemma extra)"
_TTS = "text to speech (a Kyutai TTS model beside the main one: /api/tts_streaming, /v1/audio/speech)"
_RTC = "WebRTC calls of the Realtime API (/v1/realtime/calls; needs the webrtc extra)"
_AGENT = "voice agents (/v1/realtime on a Kyutai STT model with --tts: speech to an LLM, its words to the TTS)"
_VOICE = "voice cloning (POST /api/voice, as moshi-server's voice module: a voice for the --tts model from a recording)"


class ServerSettings(BaseSettings):
    """Everything `duplexd serve` can be told; each field is also `DUPLEXD_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = opt("127.0.0.1", "address to bind", _NET)
    port: int = opt(8998, "port", _NET, ge=0, le=65535)
    ssl_certfile: str | None = opt(None, "TLS certificate (PEM)", _NET, metavar="FILE")
    ssl_keyfile: str | None = opt(None, "TLS private key (PEM)", _NET, metavar="FILE")
    moshi_weight: str | None = opt(None, "LM weights: path, hf://org/repo/file or repo id", _MODEL, metavar="REF")
    mimi_weight: str | None = opt(None, "Mimi weights", _MODEL, metavar="REF")
    tokenizer: str | None = opt(None, "sentencepiece text tokenizer", _MODEL, metavar="REF")
    config: str | None = opt(None, "reference config.json for the LM", _MODEL, metavar="REF")
    hf_repo: str | None = opt(
        None,
        "take every file not given from this Hugging Face repo (or a local folder holding one), those its "
        "config.json names; demo-stt: the tiny random Kyutai STT (no download)",
        _MODEL,
        metavar="ORG/REPO",
    )
    mimi_preset: Literal["mimi", "demo", "mimi-32", "demo-32"] = opt(
        "mimi",
        "Mimi architecture (the -32 ones: all 32 codebooks, for a speech-to-text LM; default: mimi-32 for a "
        "Kyutai STT config, else mimi, or the demo's size when a local Mimi file is the demo's)",
        _MODEL,
    )
    asr_delay_tokens: int | None = opt(
        None,
        "speech-to-text LM: steps its text lags the audio (moshi-server's asr_delay_in_tokens; default: from its "
        "config.json, 6 for stt-1b-en_fr, 32 for stt-2.6b-en)",
        _MODEL,
        metavar="N",
        ge=0,
    )
    random_weights: str | None = opt(
        None,
        f"serve an LM preset ({', '.join(RANDOM_WEIGHTS_MIMI)}) and its Mimi with random weights drawn on the "
        "device: no files, no download; it speaks noise (for capacity tests)",
        _MODEL,
        metavar="PRESET",
    )
    voices: str | None = opt(
        None,
        "PersonaPlex voices: every .pt preset and WAV/FLAC sample in DIR, checked and encoded at start-up "
        "(needs a PersonaPlex LM)",
        _MODEL,
        metavar="DIR",
    )
    devices: Annotated[list[str], NoDecode] = opt(
        ["cpu"],
        "device to run an engine on; repeat or comma-separate for several",
        _MODEL,
        flag="--device",
        metavar="DEVICE",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "LM weight dtype (auto: bfloat16 on CUDA, float32 on CPU)", _MODEL
    )
    weights_dtype: Literal["bf16", "int8"] | None = opt(
        None,
        "LM projections: int8 (codes with an fp32 scale per output channel, half the weight memory; quantized as "
        "they load) or bf16 (the weights' dtype; a q8 checkpoint is dequantized); default: as the checkpoint "
        "stores them",
        _MODEL,
    )
    cuda_graphs: bool = opt(True, "run CUDA steps eagerly, not as captured graphs", _MODEL, flag="--no-cuda-graphs")
    attention_kernel: Literal["split", "paged"] = opt(
        "split",
        "the Triton decode attention a CUDA step runs (an A/B choice; bench/gpu_kernels.py): paged splits and tiles "
        "along whole KV pages and keeps the next tiles' loads in flight",
        _MODEL,
    )
    w8a16_kernel: Literal["tiles", "gemv"] = opt(
        "tiles",
        "the Triton matmul of int8 weights a CUDA step runs (an A/B choice; bench/weights_dtype.py): gemv streams "
        "the codes through the CUDA cores at up to 8 rows (the tiles above)",
        _MODEL,
    )
    max_sessions: int = opt(4, "session slots per device", _CAP, ge=1)
    kv_memory: Annotated[ByteSize, Field(gt=0)] | None = opt(
        None, "KV cache memory per device, e.g. 40GiB (default: the engine's choice)", _CAP, metavar="SIZE"
    )
    kv_dtype: Literal["bf16", "int8", "fp8"] = opt(
        "bf16",
        "KV cache format: bf16 (the weights' dtype), int8 or fp8 (e4m3; GPUs of compute capability 8.9+), 8-bit "
        "codes with a scale per token and head: about twice the sessions per GPU (duplexd capacity)",
        _CAP,
    )
    max_pending_frames: int = opt(25, "input frames queued per session (25 = 2 s)", _CAP, ge=1)
    max_output_frames: int = opt(
        50, "output frames queued per session, the oldest dropped beyond (50 = 4 s)", _CAP, ge=1
    )
    max_session_seconds: float = opt(
        360.0, "maximum session length in seconds (speech-to-text streams: no cap unless given)", _CAP, gt=0
    )
    idle_timeout: float = opt(30.0, "close a session after this many seconds without a client message", _CAP, gt=0)
    asr_idle_timeout: float = opt(
        120.0, "the same for a speech-to-text stream (moshi-server's 120 s)", _CAP, metavar="SECONDS", gt=0
    )
    send_timeout: float = opt(10.0, "close a client whose socket blocks a send this many seconds", _CAP, gt=0)
    max_message_bytes: ByteSize = opt(
        ByteSize(1 << 20), "largest client message, e.g. 1MiB (at least 1KiB)", _CAP, metavar="SIZE", ge=1024
    )
    ws_ping_interval: float = opt(10.0, "keep-alive ping interval in seconds", _CAP, gt=0)
    ws_ping_timeout: float = opt(20.0, "close when a ping is unanswered this many seconds", _CAP, gt=0)
    drain_timeout: float = opt(
        30.0, "on SIGTERM/SIGINT, seconds open sessions may go on before they are closed", _CAP, ge=0
    )
    late_frame_seconds: float = opt(
        0.08, "input-to-output delay beyond which an output frame counts as late", _CAP, gt=0
    )
    opus_profile: Literal["fast", "kyutai"] = opt(
        "fast",
        "Kyutai protocol downlink Opus: fast (CELT, complexity 0, 48 kb/s, one 80 ms packet a frame) or kyutai "
        "(the reference server's sphn bytes: VOIP, complexity 9, two 40 ms pages a frame; ~13x the CPU)",
        _CAP,
    )
    codec_threads: int = opt(
        1, "threads that run every session's Opus decoding and encoding, one batch a direction per tick", _CAP, ge=1
    )
    codec_processes: int = opt(
        0,
        "run the Opus streams in this many worker processes instead of codec threads: they scale with the cores "
        "(threads hand the GIL over at every libopus call); for the kyutai profile or sphn at many sessions",
        _CAP,
        ge=0,
    )
    header_timeout: float = opt(
        10.0,
        "close a connection whose request head (request line and headers, a WebSocket handshake too) is not "
        "complete this many seconds after it opened, or after its next request began",
        _CAP,
        gt=0,
    )
    max_connections_per_ip: int = opt(
        256,
        "connections open from one client address; more get 503 (behind a proxy all clients share the proxy's "
        "address: cap them at the proxy, and raise this)",
        _CAP,
        ge=1,
    )
    max_connections: int = opt(1024, "connections open in all; more get 503", _CAP, ge=1)
    transcribe: str | None = opt(
        None,
        "transcribe what users say with this Gemma 4: a folder in Hugging Face layout, a hub repo id, or demo "
        "(a tiny random model: no download, transcribes nonsense)",
        _ASR,
        metavar="MODEL",
    )
    transcribe_device: str | None = opt(None, "device of the transcriber (default: the first --device)", _ASR)
    transcribe_streams: int | None = opt(
        None, "sessions transcribed at once (default: every session slot)", _ASR, metavar="N", ge=1
    )
    transcribe_queue: int = opt(32, "finished utterances waiting for the decoder; more fail at once", _ASR, ge=1)
    transcribe_max_tokens: int = opt(128, "longest transcript of one utterance, in tokens", _ASR, ge=1)
    transcribe_files: int = opt(
        4, "uploads (POST /v1/audio/transcriptions) transcribed at once; more are refused with 503", _ASR, ge=1
    )
    max_upload_bytes: ByteSize = opt(
        ByteSize(25 << 20),
        "largest audio file a client may upload for transcription, e.g. 25MiB",
        _ASR,
        metavar="SIZE",
        ge=1,
    )
    max_transcribe_seconds: float = opt(600.0, "longest audio file transcribed, in seconds", _ASR, gt=0)
    tts: str | None = opt(
        None,
        "also serve this Kyutai TTS model: its folder (config.json naming its files, as kyutai/tts-1.6b-en_fr), or "
        "demo-tts (tiny, random weights: no download, speaks noise)",
        _TTS,
        metavar="MODEL",
    )
    tts_voices: str | None = opt(
        None,
        "the voices folder, laid out as kyutai/tts-voices (default: the model folder's voices/)",
        _TTS,
        metavar="DIR",
    )
    tts_default_voice: str | None = opt(
        None,
        "the voice of a stream that names none or an unknown one, as moshi-server's default_voice (default: "
        "unmute-prod-website/default_voice.wav when there is one, else the first voice)",
        _TTS,
        metavar="NAME",
    )
    tts_device: str | None = opt(None, "device of the TTS model (default: the first --device)", _TTS)
    tts_streams: int = opt(8, "speech streams said at once (slots)", _TTS, metavar="N", ge=1)
    tts_weights_dtype: Literal["bf16", "int8"] | None = opt(
        None,
        "the TTS LM's projections: int8 (quantized as they load) or bf16 (the weights' dtype; a q8 file's are "
        "dequantized); default: as the checkpoint stores them",
        _TTS,
    )
    tts_n_q: int | None = opt(
        None,
        "audio codebooks said (default: all the model's, 32 for tts-1.6b, as moshi-server's worker says them; fewer "
        "is quicker, as moshi's TTSModel(n_q=...), e.g. 24)",
        _TTS,
        metavar="N",
        ge=1,
    )
    tts_cfg_coef: float = opt(
        2.0, "the CFG coefficient of the distilled model's voices (moshi-server's cfg_coef)", _TTS, metavar="C"
    )
    tts_temperature: float | None = opt(
        None, "sampling temperature of speech (default: the model's, 0.6); 0 is greedy", _TTS, metavar="T", ge=0
    )
    tts_idle_timeout: float = opt(
        30.0, "close a speech stream after this many seconds without a client frame (moshi-server's 30 s)", _TTS, gt=0
    )
    voice_mimi: str | None = opt(
        None,
        "the voice Mimi voices are encoded with: a path, hf://org/repo/file or a repo id (Unmute's: "
        "hf://kyutai/unmute-voice-cloning/e9d43d50_500_mimi_voice.safetensors); with --voice-denoiser and --tts",
        _VOICE,
        metavar="REF",
    )
    voice_denoiser: str | None = opt(
        None,
        "the speech denoiser recordings go through first: Facebook's Demucs dns64 checkpoint "
        "(dns64-a7761ff99a7d5bb6.th, or a safetensors copy); with --voice-mimi",
        _VOICE,
        metavar="REF",
    )
    voice_threads: int = opt(
        1, "CPU threads a voice is made with (a voice at a time, as moshi-server; the others wait)", _VOICE, ge=1
    )
    llm: str | None = opt(
        None,
        "an OpenAI-compatible chat-completions API, its root URL with /v1 (vLLM, llama.cpp's server, Ollama, "
        "OpenAI), or demo: SmolLM2-135M on a llama.cpp server duplexd starts (the agent extra)",
        _AGENT,
        metavar="URL",
    )
    llm_model: str = opt("default", "the model name the LLM server serves (vLLM and OpenAI need it)", _AGENT)
    llm_api_key: str | None = opt(None, "the LLM server's API key (sent as a Bearer token)", _AGENT, metavar="KEY")
    llm_max_tokens: int = opt(400, "the longest reply, in tokens, unless a response asks for fewer", _AGENT, ge=1)
    api_key: str | None = opt(
        None, "require this key (Authorization: Bearer, kyutai-api-key, ?api_key=)", _ACCESS, metavar="KEY"
    )
    allowed_origins: Annotated[list[str], NoDecode] = opt(
        [], "comma-separated browser origins allowed to connect (default: any)", _ACCESS, metavar="ORIGINS"
    )
    client_secret_seconds: float = opt(
        600.0, "default lifetime of an ephemeral ek_ key (POST /v1/realtime/client_secrets)", _ACCESS, gt=0, le=7200
    )
    webrtc: bool = opt(
        True,
        "take no WebRTC calls, though the webrtc extra is installed: WebSocket only, e.g. where browsers cannot "
        "reach this machine over UDP (the built-in page then talks WebSocket)",
        _RTC,
        flag="--no-webrtc",
    )
    webrtc_hosts: Annotated[list[str], NoDecode] = opt(
        [],
        "comma-separated addresses offered as host candidates: this machine's public or NAT-mapped ones (default: "
        "every address of its interfaces but loopback)",
        _RTC,
        metavar="ADDRS",
    )
    webrtc_ice_servers: Annotated[list[str], NoDecode] = opt(
        [],
        "comma-separated STUN/TURN URLs the server gathers through, a TURN one as turn:USER:PASSWORD@HOST:PORT "
        "(default: none, host candidates only)",
        _RTC,
        metavar="URLS",
    )
    webrtc_jitter_frames: int = opt(
        2,
        "20 ms frames the call's receive jitter buffer holds before playing (aiortc's default 4 adds 60 ms)",
        _RTC,
        metavar="N",
        ge=0,
        le=8,
    )
    webrtc_connect_timeout: float = opt(
        20.0,
        "end a call that has not connected (ICE, DTLS, the oai-events channel) this many seconds after its offer",
        _RTC,
        gt=0,
    )
    static: str = opt("auto", "serve DIR at / (auto: the bundled web client; none: nothing)", metavar="DIR")
    instance_name: str = opt("duplexd", "name announced in the Kyutai metadata message")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "log level")

    _flags: frozenset[str] = PrivateAttr(default_factory=frozenset)  # the fields given as flags

    @classmethod
    def from_options(cls, flags: dict[str, Any]) -> ServerSettings:
        """Settings from the flags given (the rest from `DUPLEXD_*` or defaults); `SettingsError` names the flag or
        variable at fault and what it should be."""
        try:
            settings = cls(**flags)
        except ValidationError as e:
            err = e.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "byte_size":
                msg += " (give a size such as 40GiB, 500MB or a number of bytes)"
            if not err["loc"]:
                raise SettingsError(msg) from None
            field = str(err["loc"][0])
            name = option_name(field) if field in flags else env_name(field)
            given = ",".join(map(str, err["input"])) if isinstance(err["input"], list) else err["input"]
            raise SettingsError(f"{name} {given}: {msg}" if given is not None else f"{name}: {msg}") from None
        settings._flags = frozenset(flags)
        return settings

    def option_name(self, field: str) -> str:
        """How this setting was given: its flag, else its `DUPLEXD_*` variable when that is set, else its flag."""
        if field not in self._flags and field in self.model_fields_set:
            return env_name(field)
        return option_name(field)

    @field_validator("devices", "allowed_origins", "webrtc_hosts", "webrtc_ice_servers", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("webrtc_ice_servers")
    @classmethod
    def _ice_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.match(r"^stuns?:\S+$|^turns?:[^:@\s]+:[^@\s]+@\S+$", url):
                raise ValueError(
                    f"{url!r} is not a stun:HOST:PORT URL or a turn:USER:PASSWORD@HOST:PORT one (TURN needs its "
                    "credentials)"
                )
        return urls

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("random_weights")
    @classmethod
    def _preset(cls, value: str | None) -> str | None:
        if value is not None and value not in RANDOM_WEIGHTS_MIMI:
            raise ValueError(f"unknown preset {value!r} for random weights; choose from {sorted(RANDOM_WEIGHTS_MIMI)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if not self.devices:
            raise ValueError("--device: give at least one device")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile (or --ssl DIR with cert.pem and key.pem)")
        if self.random_weights is not None:
            self._check_random_weights()
        if self.codec_processes and "codec_threads" in self.model_fields_set:
            raise ValueError("--codec-threads and --codec-processes: choose one (processes replace the threads)")
        if bool(self.voice_mimi) != bool(self.voice_denoiser):
            raise ValueError("voice cloning needs both --voice-mimi and --voice-denoiser")
        if self.llm is not None and self.tts is None:
            raise ValueError("a voice agent (--llm) speaks through a text-to-speech model: give --tts too")
        if self.voice_mimi and self.tts is None:
            raise ValueError("voice cloning (--voice-mimi) makes voices for a text-to-speech model: give --tts too")
        return self

    def _check_random_weights(self) -> None:
        """A preset with random weights takes no files, and only the Mimi its LM's codebooks match."""
        preset = self.random_weights
        given = [name for name in _WEIGHT_FILES if getattr(self, name)]
        if given:
            flags = ", ".join(option_name(name) for name in given)
            raise ValueError(f"--random-weights needs no files; leave out {flags}")
        mimi = RANDOM_WEIGHTS_MIMI[preset]  # type: ignore[index]
        if "mimi_preset" in self.model_fields_set and self.mimi_preset != mimi:
            raise ValueError(f"the {preset} LM pairs with Mimi preset {mimi!r}, not {self.mimi_preset!r}")

    @property
    def demo(self) -> bool:
        given = (self.hf_repo, self.moshi_weight, self.mimi_weight, self.tokenizer, self.random_weights)
        return not any(given)

    @property
    def demo_model(self) -> bool:
        """The main model is one of the embedded demos (the dialogue demo, or `--hf-repo demo-stt`)."""
        return self.demo or self.hf_repo == "demo-stt"

    def session_seconds(self, speech_to_text: bool) -> float | None:
        """The cap on a session's length: `--max-session-seconds`, except on a speech-to-text model's streams
        unless it was given (moshi-server has no cap: a meeting's transcript runs for hours). None: no cap."""
        if speech_to_text and "max_session_seconds" not in self.model_fields_set:
            return None
        return self.max_session_seconds

    def session_frames(self, speech_to_text: bool) -> int | None:
        seconds = self.session_seconds(speech_to_text)
        return None if seconds is None else math.ceil(seconds * FRAME_RATE)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


def option_name(field: str) -> str:
    """The command-line flag of a settings field."""
    extra = ServerSettings.model_fields[field].json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return str(flag) if flag else "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()
