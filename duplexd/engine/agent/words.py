"""Streamed text cut into words as it arrives, for the TTS, which is fed one word a message.

duplexd's TTS stream (`engine/tts/words.py`, `StreamWords`) splits each text message at whitespace (Python's
`str.split`) and never joins a word across two messages, so a word must reach it whole: a word is released as soon
as the whitespace after it arrives, and the last one when the reply ends (`flush`). A pause tag
`<break time="1.5s"/>` is a pause only when it reaches `StreamWords` whole, so it stays one piece though it holds a
space (a tag still open waits for its `>`, at most `MAX_TAG` characters). Nothing else is changed: the TTS
normalises the text itself, so the words it makes of these pieces are those it would make of the whole reply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WHITESPACE = re.compile(r"\s+")  # \s is str.isspace, what str.split cuts at
BREAK_TAG = re.compile(r'<break\s+time="[0-9.]+s"\s*/>')  # the tag StreamWords makes a pause of
TAG_START = "<break"
MAX_TAG = 64  # longer than any real tag: an open "<break" longer than this is only text


@dataclass
class WordCutter:
    """One reply's words: `push` each text delta as it comes, then `flush` at the reply's end."""

    pending: str = ""

    def push(self, text: str) -> list[str]:
        """The words that `text` completes, in order (none while a word is still open)."""
        self.pending += text
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """The words still held (the reply's last word), at the reply's end; the cutter is then empty."""
        return self._cut(final=True)

    def _cut(self, final: bool) -> list[str]:
        words = []
        while (end := self._next_end(final)) is not None:
            words.append(self.pending[:end])
            self.pending = self.pending[end:]
        self.pending = self.pending.lstrip()
        return words

    def _next_end(self, final: bool) -> int | None:
        """Drop leading whitespace; the end of the first whole word, or None while it may still grow (or, `final`,
        when nothing is left)."""
        text = self.pending = self.pending.lstrip()
        if not text:
            return None
        at = 0
        while True:
            space = WHITESPACE.search(text, at)
            end = space.start() if space is not None else (len(text) if final else None)
            tag = text.find(TAG_START, at)
            if tag == -1 or (space is not None and space.start() < tag):
                return end
            close = text.find(">", tag)
            if close == -1:
                return None if not final and len(text) - tag < MAX_TAG else end  # open: may still become a tag
            whole = BREAK_TAG.match(text, tag)
            if whole is None or whole.end() != close + 1:
                return end  # not a pause tag: only text
            at = whole.end()  # the tag belongs to this word, which ends at the whitespace after it
