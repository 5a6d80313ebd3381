"""The events of a voice agent's Realtime session (`/v1/realtime` on a Kyutai STT model with `--tts` and `--llm`):
client event parsing, the session object, the conversation's items and the events of a response.

GA names throughout (`response.output_audio.delta`, `conversation.item.added`, ...), as OpenAI's SDKs validate
them. A session reads what a cascade can honour: `instructions`, `tools`, `tool_choice`, `output_modalities`,
`max_output_tokens`, `audio.input.turn_detection` (`server_vad`, `semantic_vad` with `create_response` and
`interrupt_response`, or null: the client commits), `audio.output.voice` (a TTS voice; OpenAI's names such as
`ash` are the default voice) and the audio formats; the beta spellings (`voice`, `turn_detection`,
`modalities`, `input_audio_format`, ...) too. Fields the API defines that mean nothing here (`model`, `tracing`,
`truncation`, noise reduction, the transcription model: the STT model transcribes) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .audio_formats import BETA_NAMES, Format, format_object
from .events import (
    AudioAppend,
    AudioFormat,
    BetaFormat,
    ClientEvent,
    ItemRetrieve,
    ItemTruncate,
    OutputClear,
    RealtimeError,
    TranscriptionSettings,
    parse_with,
    server_event,
    session_update,
)
from .transcription_events import Clear, Commit, TurnDetectionSettings


class AgentTurnDetection(TurnDetectionSettings):
    """`turn_detection` of an agent: when the user's turn ends (as in a transcription session), and what then."""

    create_response: bool = True  # a response starts when the user's turn ends
    interrupt_response: bool = True  # the user speaking cancels the response under way (barge-in)
    idle_timeout_ms: int | None = Field(default=None, ge=0)

    def shown(self) -> dict[str, Any]:
        return super().shown() | {
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": self.idle_timeout_ms,
        }


DEFAULT_TURN_DETECTION = AgentTurnDetection(type="server_vad")


class Tool(BaseModel):
    """A function the LLM may call (`{type: "function", name, description, parameters}`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def chat_tool(self) -> dict[str, Any]:
        """As the chat-completions API takes it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
Modality = Literal["audio", "text"]
MaxTokens = int | Literal["inf"]


class AgentInput(BaseModel):
    format: AudioFormat | None = None
    transcription: TranscriptionSettings | None = None
    turn_detection: AgentTurnDetection | None = None
    noise_reduction: Any = None


class AgentOutput(BaseModel):
    format: AudioFormat | None = None
    voice: Any = None
    speed: float | None = None


class AgentAudio(BaseModel):
    input: AgentInput | None = None
    output: AgentOutput | None = None


class AgentSession(BaseModel):
    """The fields of a `session.update` an agent reads (GA and beta names); others are accepted and ignored."""

    type: Literal["realtime", "transcription"] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    output_modalities: list[Modality] | None = None
    max_output_tokens: MaxTokens | None = Field(default=None, alias="max_response_output_tokens")
    audio: AgentAudio | None = None
    # the beta spellings
    modalities: list[Modality] | None = None
    voice: Any = None
    turn_detection: AgentTurnDetection | None = None
    input_audio_format: BetaFormat | None = None
    output_audio_format: BetaFormat | None = None
    input_audio_transcription: TranscriptionSettings | None = None

    model_config = ConfigDict(populate_by_name=True)


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: AgentSession


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "text", "output_text", "input_audio", "output_audio", "audio"]
    text: str | None = None
    transcript: str | None = None

    @property
    def words(self) -> str:
        return self.text if self.text is not None else (self.transcript or "")


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ItemReference(BaseModel):
    type: Literal["item_reference"]
    id: str


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]
InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ItemReference, Field(discriminator="type")
]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ItemDelete(ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ResponseParams(BaseModel):
    """`response.create`'s `response`: overrides of the session's for this response alone."""

    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    output_modalities: list[Modality] | None = None
    modalities: list[Modality] | None = None  # beta
    max_output_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    conversation: Literal["auto", "none"] | str | None = None
    input: list[InputItem] | None = None
    voice: Any = None
    audio: AgentAudio | None = None


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams = Field(default_factory=ResponseParams)


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


class TranscriptionSessionUpdate(ClientEvent):
    type: Literal["transcription_session.update"]


Event = (
    AudioAppend
    | SessionUpdate
    | Commit
    | Clear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel
    | OutputClear
    | TranscriptionSessionUpdate
)
EVENTS: TypeAdapter[Event] = TypeAdapter(Annotated[Event, Field(discriminator="type")])


def parse_event(text: str) -> Event:
    """A client event of an agent session; `Close` or `RealtimeError` as in a conversation."""
    return parse_with(EVENTS, text)


def parse_session(session: dict[str, Any]) -> SessionUpdate:
    """An agent's configuration given outside an event, as its `session.update` (`session_update`)."""
    return session_update(parse_event, SessionUpdate, session)


def max_tokens(value: MaxTokens | None) -> int | None:
    return None if value is None or value == "inf" else value


def beta_format(value: BetaFormat | None) -> Format | None:
    return BETA_NAMES[value] if value is not None else None


def item_not_found(item_id: str, event_id: str | None) -> RealtimeError:
    return RealtimeError("item_not_found", f"no item {item_id!r} in this conversation", event_id, "item_id")


# ----------------------------------------------------------------------------------------------- the session


def session_object(
    session_id: str,
    model: str,
    instructions: str,
    tools: list[Tool],
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    modalities: list[Modality],
    max_output_tokens: MaxTokens,
    turn_detection: AgentTurnDetection | None,
    voice: str,
    transcription: dict[str, Any],
    formats: tuple[Format, Format],
) -> dict[str, Any]:
    detection = turn_detection.shown() if turn_detection is not None else None
    return {
        "id": session_id,
        "object": "realtime.session",
        "type": "realtime",
        "model": model,
        "instructions": instructions,
        "tools": [tool.model_dump(exclude_none=True) for tool in tools],
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel_tool_calls,
        "output_modalities": modalities,
        "max_output_tokens": max_output_tokens,
        "audio": {
            "input": {
                "format": format_object(formats[0]),
                "transcription": transcription,
                "turn_detection": detection,
                "noise_reduction": None,
            },
            "output": {"format": format_object(formats[1]), "voice": voice, "speed": 1.0},
        },
        "tracing": None,
        "truncation": "disabled",
        "include": None,
    }


# ----------------------------------------------------------------------------------------------- items


def message_item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status, "role": role,
            "content": content}  # fmt: skip


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}  # fmt: skip


def function_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}  # fmt: skip


def item_added(item: dict[str, Any], previous_item_id: str | None) -> list[str]:
    """A client's item joins the conversation: `conversation.item.added`, then `.done` (it is complete)."""
    return [
        server_event("conversation.item.added", previous_item_id=previous_item_id, item=item),
        server_event("conversation.item.done", previous_item_id=previous_item_id, item=item),
    ]


# ----------------------------------------------------------------------------------------------- a response


def response_object(
    response_id: str,
    status: str,
    modalities: list[Modality],
    max_output_tokens: MaxTokens,
    metadata: dict[str, str] | None,
    conversation: bool,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    status_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "conversation_id": "conv_default" if conversation else None,
        "output_modalities": modalities,
        "max_output_tokens": max_output_tokens,
        "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": None}},
        "metadata": metadata,
        "usage": usage,
    }


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "total_tokens": prompt_tokens + completion_tokens,
        "input_tokens": prompt_tokens,
        "output_tokens": completion_tokens,
        "input_token_details": {"cached_tokens": 0, "text_tokens": prompt_tokens, "audio_tokens": 0},
        "output_token_details": {"text_tokens": completion_tokens, "audio_tokens": 0},
    }


def part_object(audio: bool, text: str) -> dict[str, Any]:
    return {"type": "audio", "transcript": text} if audio else {"type": "text", "text": text}


def content_object(audio: bool, text: str) -> dict[str, Any]:
    return {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
