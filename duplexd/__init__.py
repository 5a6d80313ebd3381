"""duplexd: a full-duplex speech-dialogue server serving many conversations from one batched engine."""
