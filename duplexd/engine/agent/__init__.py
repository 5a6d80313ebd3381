"""The voice agent's language model: a streaming client of an OpenAI-compatible chat-completions server, its replies
as plain events (`events.py`), the text cut into words for the TTS as it arrives (`words.py`), and the demo server
that `--llm demo` runs (`demo_llm.py`).

It stands apart from the speech engines: a cascade (speech to text, this, text to speech) uses it through the plain
data it yields, so it imports nothing of duplexd but the engine's shared modules."""
