"""Gemma 4 speech-to-text: duplexd's streaming audio tower feeding the Gemma 4 text decoder of `transformers`.

While the user speaks, `feed` runs the tower on each whole 80 ms step as it arrives (one step is held back until
a sample after it exists, see below), so at the end of the utterance only the prompt prefill and the decoding
remain. `finish` builds the prompt as `Gemma4Processor` does (the chat template with one audio part, expanded to
`<|audio>` + n x `<|audio|>` + `<audio|>`), splices the soft tokens where the audio tokens are, as
`Gemma4Model.forward` does, and decodes greedily with `generate`; `finish_many` decodes several utterances as one
left-padded batch.

End of utterance: the reference feature extractor counts mel frame i as valid only if sample 160 i + 160 exists,
zeroes invalid frames, and keeps a token while its first frame is valid. The stream reproduces that exactly: a
step runs only once the audio goes past it, and the last, partial step is zero-padded with its invalid frames
masked (`encode_step(valid_frames=...)`). So every soft token, the last ones included, equals the whole-file
reference, and the token count equals the processor's. Like the reference, audio past 30 s is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..errors import CheckpointError
from ..models.gemma4_audio import Gemma4AudioEncoder, Gemma4AudioStreamState
from ..weights.gemma4_checkpoint import load_gemma4_audio
from ..weights.hub import hub_folder

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
STEP_SAMPLES = 1280  # 80 ms: 8 mel frames, 2 soft tokens
FRAME_HOP = 160
MAX_SAMPLES = 480_000  # the feature extractor's default truncation (30 s)
DEFAULT_PROMPT = "Transcribe the following speech segment in its original language."
GEMMA_EXTRA = "the Gemma 4 transcriber needs transformers: pip install 'duplexd[gemma]'"


# ISO-639-1 codes Gemma is asked for by name; another two-letter code is named as a code (`instruction`).
LANGUAGES = {
    "ar": "Arabic", "bg": "Bulgarian", "bn": "Bengali", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian",
    "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian",
    "ms": "Malay", "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sr": "Serbian", "sv": "Swedish", "sw": "Swahili",
    "ta": "Tamil", "th": "Thai", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese",
    "zh": "Chinese",
}  # fmt: skip


def instruction(language: str | None = None, hint: str | None = None) -> str:
    """The instruction that follows the audio, as OpenAI's `language` and `prompt` ask: `DEFAULT_PROMPT` (the
    original language), or "Transcribe the following speech segment in <language>." for an ISO-639-1 code or a
    language's name; a hint (words or context to expect) follows as "Hint: <hint>"."""
    if not language:
        text = DEFAULT_PROMPT
    else:
        code = language.strip().lower()
        name = LANGUAGES.get(code) or (f"the language with ISO 639-1 code '{code}'" if len(code) == 2 else language)
        text = f"Transcribe the following speech segment in {name.strip()}."
    hint = (hint or "").strip()
    return f"{text} Hint: {hint}" if hint else text


def import_transformers() -> Any:
    """`transformers`, or a `CheckpointError` naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(GEMMA_EXTRA) from None
    return transformers


def model_folder(ref: str) -> Path:
    """A Gemma 4 checkpoint in Hugging Face layout as a local folder: `demo` (the tiny random model, written once
    into the cache), a folder, or a hub repo id (its config, tokenizer and weights, through the HF cache)."""
    if ref == "demo":
        from ..weights.gemma4_demo import ensure_gemma4_demo

        logger.warning("using the Gemma 4 demo model: random weights, its transcripts are a jumble of word pieces")
        return ensure_gemma4_demo()
    return hub_folder(ref, ["*.json", "*.safetensors", "*.jinja", "tokenizer*"], "a Gemma 4 checkpoint")


def valid_frames(num_samples: int) -> int:
    """Mel frames the reference counts as valid for `num_samples` samples (frame i needs sample 160 i + 160)."""
    return max((num_samples - FRAME_HOP - 1) // FRAME_HOP + 1, 0)


def num_audio_tokens(num_samples: int) -> int:
    """Soft tokens (= `<|audio|>` placeholders) for an utterance, as `Gemma4Processor.replace_audio_token`."""
    return -(-valid_frames(min(num_samples, MAX_SAMPLES)) // 4)


@dataclass
class _Stream:
    """One utterance in progress: samples not yet encoded and the soft tokens so far."""

    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    samples: int = 0  # accepted so far (at most MAX_SAMPLES)
    soft: list[torch.Tensor] = field(default_factory=list)
    truncated: bool = False
    finished: bool = False  # the last step was padded: the tower state cannot continue


class Transcriber:
    """Streaming Gemma 4 transcriber: per-slot tower state, batched greedy decoding of finished utterances."""

    def __init__(
        self,
        encoder: Gemma4AudioEncoder,
        decoder: Any,
        tokenizer: Any,
        *,
        max_slots: int = 16,
        max_new_tokens: int = 128,
    ) -> None:
        if encoder.embed_audio is None:
            raise CheckpointError("the audio tower has no embed_audio: cannot feed a text decoder")
        self.encoder = encoder
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.state: Gemma4AudioStreamState = encoder.new_stream_state(max_slots)
        self.streams: dict[int, _Stream] = {}
        cfg = decoder.config
        self.audio_token_id = int(cfg.audio_token_id)
        self.pad_token_id = int(cfg.get_text_config().pad_token_id)
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> list[int]:
        eos = self.decoder.generation_config.eos_token_id
        if eos is None:
            eos = self.decoder.config.get_text_config().eos_token_id
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        **kw: Any,
    ) -> Transcriber:
        """Tower and `embed_audio` (duplexd's) and the text decoder and tokenizer (transformers') from one HF folder.

        The decoder is built without its towers, so the audio and vision weights are read once, by duplexd.
        """
        transformers = import_transformers()
        encoder = load_gemma4_audio(path, device=device, dtype=dtype)
        config = transformers.AutoConfig.from_pretrained(path)
        config.audio_config = None
        config.vision_config = None
        hf_log = transformers.utils.logging
        verbosity, bar = hf_log.get_verbosity(), hf_log.is_progress_bar_enabled()
        hf_log.set_verbosity_error()  # else it lists every tower tensor it skips
        hf_log.disable_progress_bar()
        try:
            decoder = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, config=config, dtype=dtype)
        finally:
            hf_log.set_verbosity(verbosity)
            if bar:
                hf_log.enable_progress_bar()
        decoder.to(device).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return cls(encoder, decoder, tokenizer, **kw)

    # -- streams
    def open_stream(self) -> int:
        """A free slot, its tower state reset."""
        free = next((s for s in range(self.state.max_slots) if s not in self.streams), None)
        if free is None:
            raise RuntimeError(f"all {self.state.max_slots} transcriber slots are in use")
        self.state.reset([free])
        self.streams[free] = _Stream()
        return free

    def close(self, slot: int) -> None:
        self.streams.pop(slot, None)

    def feed(self, slot: int, pcm: np.ndarray | torch.Tensor) -> int:
        """Append 16 kHz mono samples; encode every whole step the audio has gone past. Returns soft tokens so far."""
        return self.feed_many([(slot, pcm)])[0]

    def feed_many(self, chunks: Sequence[tuple[int, np.ndarray | torch.Tensor]]) -> list[int]:
        """`feed` for several slots at once: the slots with the same number of whole steps ready share one tower
        call (live sessions each bring 80 ms, so one call per round). Returns each slot's soft tokens so far."""
        slots = [slot for slot, _ in chunks]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one feed: {slots}")
        groups: dict[int, list[int]] = {}
        for slot, pcm in chunks:
            steps = self._append(slot, pcm)
            if steps:
                groups.setdefault(steps, []).append(slot)
        for steps, group in groups.items():
            n = steps * STEP_SAMPLES
            pcm_t = torch.from_numpy(np.stack([self.streams[s].pending[:n] for s in group])).to(self.encoder.device)
            out = self.encoder.encode_step(self.state, group, pcm_t)
            assert out.soft_tokens is not None
            for i, s in enumerate(group):
                st = self.streams[s]
                st.soft.append(out.soft_tokens[i])
                st.pending = st.pending[n:]
        return [sum(int(t.shape[0]) for t in self.streams[s].soft) for s in slots]

    def _append(self, slot: int, pcm: np.ndarray | torch.Tensor) -> int:
        """Queue samples on `slot` (up to 30 s in all); how many whole steps are ready to encode."""
        st = self.streams[slot]
        if st.finished:
            raise RuntimeError(f"slot {slot}: the utterance is finished; open a new stream")
        chunk: npt.NDArray[np.float32] = np.asarray(
            pcm.cpu() if isinstance(pcm, torch.Tensor) else pcm, dtype=np.float32
        ).reshape(-1)
        room = MAX_SAMPLES - st.samples
        if chunk.size > room:
            if not st.truncated:
                logger.warning("slot %d: utterance longer than 30 s, the rest is dropped (as the reference does)", slot)
            st.truncated = True
            chunk = chunk[:room]
        st.samples += chunk.size
        st.pending = np.concatenate([st.pending, chunk]) if st.pending.size else chunk
        # Strictly more than a step: the step's last frame is valid only if a sample follows it.
        return (st.pending.size - 1) // STEP_SAMPLES

    def flush(self, slot: int) -> torch.Tensor:
        """End the utterance: encode the held-back tail as the reference pads it; all its soft tokens [n, hidden].
        The slot can be closed at once: decoding needs only these."""
        st = self.streams[slot]
        tail = st.pending.size
        if tail:
            frames = valid_frames(tail)
            pcm = np.zeros(STEP_SAMPLES, dtype=np.float32)
            pcm[:tail] = st.pending
            out = self.encoder.encode_step(
                self.state, [slot], torch.from_numpy(pcm).to(self.encoder.device)[None], valid_frames=[frames]
            )
            assert out.soft_tokens is not None
            st.soft.append(out.soft_tokens[0, : -(-frames // 4)])
            st.pending = st.pending[:0]
        soft = torch.cat(st.soft) if st.soft else self._empty_soft()
        st.soft, st.finished = [soft], True
        assert soft.shape[0] == num_audio_tokens(st.samples), (soft.shape, st.samples)
        return soft

    def _empty_soft(self) -> torch.Tensor:
        w = self.decoder.get_input_embeddings().weight
        return torch.zeros(0, w.shape[1], dtype=w.dtype, device=w.device)

    # -- decoding
    def prompt_ids(self, num_audio: int, prompt: str = DEFAULT_PROMPT) -> list[int]:
        """Token ids of the user turn (audio, then the instruction) and the model turn's opening."""
        tok = self.tokenizer
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": prompt}]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.count(tok.audio_token) != 1:
            raise CheckpointError(f"the chat template renders {text.count(tok.audio_token)} audio tokens, not 1")
        text = text.replace(tok.audio_token, f"{tok.boa_token}{tok.audio_token * num_audio}{tok.eoa_token}")
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def finish(self, slot: int, prompt: str = DEFAULT_PROMPT) -> list[int]:
        """Transcript token ids of one utterance (the slot stays open until `close`)."""
        return self.finish_many([slot], prompt)[0]

    @torch.inference_mode()
    def finish_many(self, slots: Sequence[int], prompt: str = DEFAULT_PROMPT) -> list[list[int]]:
        """Transcript token ids of several utterances, decoded as one left-padded batch."""
        return self.decode([self.flush(s) for s in slots], [prompt] * len(slots))

    @torch.inference_mode()
    def decode(self, softs: Sequence[torch.Tensor], prompts: Sequence[str]) -> list[list[int]]:
        """Transcript token ids of utterances given by their soft tokens (from `flush`), one left-padded batch."""
        rows = [self.prompt_ids(int(s.shape[0]), p) for s, p in zip(softs, prompts, strict=True)]
        width = max(len(r) for r in rows)
        dev = self.decoder.device
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        # As Gemma4Model.forward: audio positions embed the pad token (for the per-layer inputs too), then the soft
        # tokens (not scaled by sqrt(hidden)) replace them.
        is_audio = ids == self.audio_token_id
        text_ids = ids.masked_fill(is_audio, self.pad_token_id)
        embeds = self.decoder.get_input_embeddings()(text_ids)
        soft = torch.cat(list(softs)).to(embeds.device, embeds.dtype)
        if int(is_audio.sum()) != soft.shape[0]:
            raise AssertionError(f"{int(is_audio.sum())} audio tokens for {soft.shape[0]} soft tokens")
        embeds = embeds.masked_scatter(is_audio[..., None], soft)
        lm = self.decoder.model.language_model
        per_layer = lm.get_per_layer_inputs(text_ids, None) if lm.config.hidden_size_per_layer_input else None
        tokens = self._greedy(embeds, per_layer, mask)
        return [self._strip(row) for row in tokens.tolist()]

    def _greedy(self, embeds: torch.Tensor, per_layer: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """Greedy decoding through the decoder's own forward, positions counted from each row's first real token
        (as `generate` does for left padding). Rows that ended keep decoding pads until all have; [B, <= max]."""
        batch = embeds.shape[0]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.decoder(
            inputs_embeds=embeds,
            per_layer_inputs=per_layer,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        eos = torch.tensor(self.eos_token_ids, device=mask.device)
        done = torch.zeros(batch, dtype=torch.bool, device=mask.device)
        steps: list[torch.Tensor] = []
        last = positions[:, -1:]
        for _ in range(self.max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1).masked_fill(done, self.pad_token_id)
            steps.append(nxt)
            done |= torch.isin(nxt, eos)
            if bool(done.all()) or len(steps) == self.max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last = last + 1
            out = self.decoder(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=last, cache=out.cache, use_cache=True
            )
        return torch.stack(steps, dim=1)

    def _strip(self, tokens: list[int]) -> list[int]:
        """Up to (not including) the first end-of-turn token."""
        for i, t in enumerate(tokens):
            if t in self.eos_token_ids:
                return tokens[:i]
        return tokens

    def text(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def transcribe(self, pcm: np.ndarray, prompt: str = DEFAULT_PROMPT) -> list[int]:
        """A whole 16 kHz utterance through the stream, 80 ms at a time, as a live session would feed it."""
        slot = self.open_stream()
        try:
            for start in range(0, len(pcm), STEP_SAMPLES):
                self.feed(slot, pcm[start : start + STEP_SAMPLES])
            return self.finish(slot, prompt)
        finally:
            self.close(slot)
