"""The user items of a Realtime session's transcript: each utterance of the user's speech is one item.

Both kinds of session that transcribe share this: a conversation with `input_audio_transcription` (its
utterances found by the transcription service's VAD) and a transcription session on a speech-to-text model
(`transcription_session`). Each gets `TranscriptEvent`s numbered by utterance and sends what `events` makes of
them: `input_audio_buffer.speech_started`, `.speech_stopped`, the commit (`.committed`, `conversation.item.added`,
`.done`, chained by `previous_item_id`), the transcript's deltas and `.completed` (or `.failed`). Every item
announced stays retrievable (`conversation.item.retrieve`), with its transcript once it is known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from duplexd.engine.transcription.service import (
    SpeechBegan,
    SpeechEnded,
    TranscriptDelta,
    TranscriptDone,
    TranscriptEvent,
    TranscriptFailed,
)

from . import events as ev


@dataclass
class UserItem:
    """One utterance's user item: its id from speech_started on; created (committed) when speech stops."""

    id: str
    committed: bool = False
    ended: bool = False  # speech stopped
    failed: bool = False


class UserItems:
    """One session's items, by utterance number. `to_ms` turns a time on the transcript's timeline into
    milliseconds of the session's input audio. `commit_on_delta`: a delta commits its item first (the service
    transcribes an utterance once it has ended); a streaming transcriber's deltas come while the user speaks."""

    def __init__(self, to_ms: Callable[[float], int], commit_on_delta: bool = True) -> None:
        self.to_ms, self.commit_on_delta = to_ms, commit_on_delta
        self.items: dict[int, UserItem] = {}
        self.last: str | None = None  # the last committed item's id
        self.transcripts: dict[str, str | None] = {}  # of every committed item, by id (None: not known)

    def clear(self) -> None:
        """Forget the utterances under way (the items already announced stay)."""
        self.items.clear()

    def retrieved(self, item_id: str) -> dict | None:
        """The item `item_id` as `conversation.item.retrieved` gives it; None if this session has no such item."""
        if item_id not in self.transcripts:
            return None
        return ev.user_audio_item(item_id, self.transcripts[item_id])

    def item(self, number: int) -> UserItem:
        """The item of utterance `number` (one never announced gets an id now, so that every event names one)."""
        if number not in self.items:
            self.items[number] = UserItem(ev.new_id("item"))
        return self.items[number]

    def commit(self, number: int) -> list[str]:
        item = self.item(number)
        if item.committed:
            return []
        item.committed = True
        self.transcripts[item.id] = None
        previous, self.last = self.last, item.id
        return ev.item_committed(item.id, previous)

    def events(self, event: TranscriptEvent) -> list[str]:
        """The server events of one transcript event."""
        messages: list[str] = []
        if isinstance(event, SpeechBegan):
            item = self.items[event.item] = UserItem(ev.new_id("item"))
            messages.append(ev.speech_started(item.id, self.to_ms(event.start_s)))
        elif isinstance(event, SpeechEnded):
            item = self.item(event.item)
            item.ended = True
            messages.append(ev.speech_stopped(item.id, self.to_ms(event.end_s)))
            messages += self.commit(event.item)
            if item.failed:  # it failed while it was spoken: nothing more will come for it
                del self.items[event.item]
        elif isinstance(event, TranscriptDelta):
            if self.commit_on_delta:
                messages += self.commit(event.item)
            messages.append(ev.input_transcript_delta(self.item(event.item).id, event.text))
        elif isinstance(event, TranscriptDone):
            messages += self.commit(event.item)
            item = self.item(event.item)
            self.transcripts[item.id] = event.text
            messages.append(ev.input_transcript_completed(item.id, event.text, event.end_s - event.start_s))
            del self.items[event.item]
        elif isinstance(event, TranscriptFailed):
            messages += self.fail(event)
        return messages

    def fail(self, event: TranscriptFailed) -> list[str]:
        """A failed utterance: committed now if speech goes on (its speech_stopped still comes, for the same
        item). A failure for an utterance that never began means the transcriber itself failed: every open item
        fails with it, and the client also gets a non-fatal `error`."""
        item = self.items.get(event.item)
        if item is not None:
            item.failed = True
            if item.ended:
                del self.items[event.item]
            return [*self.commit(event.item), ev.input_transcript_failed(item.id, event.reason)]
        messages = []
        for number, item in self.items.items():
            messages += [*self.commit(number), ev.input_transcript_failed(item.id, event.reason)]
        self.items.clear()
        messages.append(ev.error_event("transcription_failed", event.reason, kind="server_error"))
        return messages
