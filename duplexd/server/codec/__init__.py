"""Ogg/Opus streams for the Kyutai protocol on libopus through ctypes, so encoding and decoding release the GIL."""
