"""A session's PersonaPlex persona, from what the client asked for: a role text and a voice, or the defaults.

One place turns (text, voice name) into the prompt the engine prefills, for both protocols (Kyutai's
`text_prompt` / `voice_prompt` query parameters, Realtime's `session.instructions` / `session.voice`), so they
default and refuse alike. Defaults are PersonaPlex's own client's: its "wise and friendly teacher" role text and
the voice `NATF0.pt` (the library's first voice when it has no such file).

A refusal is one `PersonaRefused` whose message starts with the parameter's name in the protocol that carried it,
and whose `option` is that name: the model is not PersonaPlex, the server has no voices, the voice is unknown,
the text is empty, or the prompt does not fit the model's window.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from duplexd.engine.errors import InputRefused
from duplexd.engine.models.config import LMConfig
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.persona.prompt import PersonaPrompt, role_prompt
from duplexd.engine.persona.voices import VoiceError, VoiceLibrary

logger = logging.getLogger(__name__)

# PersonaPlex's web client's defaults (its useModelParams.ts): what a session gets when it names neither.
DEFAULT_TEXT = "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."
DEFAULT_VOICE = "NATF0.pt"
LISTED_VOICES = 10  # an unknown voice's refusal names this many of the voices there are
CACHED_PROMPTS = 32  # prompts kept by (text, voice): a prompt is built on the event loop, most sessions reuse one


class PersonaRefused(InputRefused):
    """A persona this server cannot give: `option` is the parameter at fault, as the client named it."""


@dataclass(frozen=True)
class Persona:
    """The persona a session runs with: the role text as given (not yet wrapped in `<system>`), the voice's file
    name, and the prompt built from them."""

    text: str
    voice: str
    prompt: PersonaPrompt


@dataclass(frozen=True)
class Names:
    """How a protocol names the two parameters, for its refusals."""

    text: str
    voice: str


KYUTAI = Names("text_prompt", "voice_prompt")
REALTIME = Names("session.instructions", "session.voice")


class Personas:
    """The personas this server can give; built once at start-up (`default` is checked then)."""

    def __init__(
        self, cfg: LMConfig | None, tokenizer: TextTokenizer | None, voices: VoiceLibrary | None, model: str = ""
    ) -> None:
        """`cfg` None or not PersonaPlex: no persona (every request refused); `voices` None: a PersonaPlex model
        served without `--voices`, whose sessions run without one."""
        self.cfg, self.tokenizer, self.voices, self.model = cfg, tokenizer, voices, model
        self._cache: OrderedDict[tuple[str, str], PersonaPrompt] = OrderedDict()
        self.default: Persona | None = None
        if self.available:
            assert voices is not None
            names = voices.names
            voice = DEFAULT_VOICE if DEFAULT_VOICE in names else names[0]
            self.default = self._persona(DEFAULT_TEXT, voice, KYUTAI)
            if voice != DEFAULT_VOICE:
                logger.info("persona: no %s among the voices; the default voice is %s", DEFAULT_VOICE, voice)
            logger.info(
                "persona defaults: voice %s, role text %r (%d prompt frames)",
                voice,
                DEFAULT_TEXT,
                self.default.prompt.calls,
            )
        elif self.persona_model:
            logger.warning("a PersonaPlex model without --voices: sessions run without a persona and cannot ask one")

    @classmethod
    def off(cls) -> Personas:
        """No persona at all (a model that takes none)."""
        return cls(None, None, None)

    @property
    def persona_model(self) -> bool:
        """The model takes a persona (PersonaPlex)."""
        return self.cfg is not None and self.cfg.predicts_user_audio

    @property
    def available(self) -> bool:
        """Sessions get a persona: a PersonaPlex model with voices."""
        return self.persona_model and self.voices is not None and bool(self.voices.names)

    def voice_name(self, name: str, names: Names) -> str:
        """The file name of the voice `name` (a file name, or its stem when unambiguous)."""
        assert self.voices is not None
        try:
            return self.voices.get(name).name
        except VoiceError:
            known = self.voices.names
            listed = ", ".join(known[:LISTED_VOICES])
            more = f" and {len(known) - LISTED_VOICES} more (GET /v1/models)" if len(known) > LISTED_VOICES else ""
            raise PersonaRefused(
                f"{names.voice}: unknown voice {name[:80]!r}; this server has {listed}{more}", names.voice
            ) from None

    def resolve(self, text: str | None, voice: str | None, names: Names) -> Persona | None:
        """The persona for a session that asked for `text` and `voice` (None: not given, the default), or None when
        it runs without one (a model that takes none, asked for nothing). Raises `PersonaRefused`."""
        if not self.persona_model:
            if text is None and voice is None:
                return None
            raise PersonaRefused(
                f"{names.text} and {names.voice} need a PersonaPlex model; this server's model"
                f"{f' ({self.model})' if self.model else ''} takes no persona",
                names.text if text is not None else names.voice,
            )
        if not self.available:
            if text is None and voice is None:
                return None
            raise PersonaRefused(
                f"{names.text if text is not None else names.voice}: this server has no voices, so it gives no "
                "persona (start it with --voices DIR)",
                names.text if text is not None else names.voice,
            )
        assert self.default is not None
        return self._persona(
            self.default.text if text is None else text, self.default.voice if voice is None else voice, names
        )

    def _persona(self, text: str, voice: str, names: Names) -> Persona:
        voice = self.voice_name(voice, names)
        return Persona(text, voice, self._prompt(text, voice, names))

    def _prompt(self, text: str, voice: str, names: Names) -> PersonaPrompt:
        key = (text, voice)
        prompt = self._cache.get(key)
        if prompt is not None:
            self._cache.move_to_end(key)
            return prompt
        assert self.cfg is not None and self.tokenizer is not None and self.voices is not None
        try:
            prompt = role_prompt(self.cfg, self.voices.get(voice), text, self.tokenizer.encode)
        except InputRefused as e:
            raise PersonaRefused(f"{names.text} {e}", names.text) from None
        self._cache[key] = prompt
        if len(self._cache) > CACHED_PROMPTS:
            self._cache.popitem(last=False)
        return prompt
