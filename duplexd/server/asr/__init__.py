"""moshi-server's speech-to-text protocol (`/api/asr-streaming`) over duplexd's engine, for a Kyutai STT model."""
