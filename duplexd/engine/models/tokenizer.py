"""The text tokenizer (sentencepiece), and training the small one the demo model uses."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from ..errors import CheckpointError

WORD_START = "\u2581"  # sentencepiece's word-boundary marker


class TextTokenizer:
    """Maps the LM's text tokens to text; the raw piece per token, as the reference server sends it."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"tokenizer file not found: {path}")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a sentencepiece model ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def piece(self, token: int) -> str:
        """The text of one token with the word-start marker turned into a space."""
        return self.sp.IdToPiece(int(token)).replace(WORD_START, " ")

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, with no BOS or EOS (as a prompt is fed to the LM)."""
        return [int(t) for t in self.sp.EncodeAsIds(text)]

    def decode(self, tokens: Iterable[int]) -> str:
        return self.sp.Decode([int(t) for t in tokens])


def train_tokenizer(lines: Iterable[str], path: str | Path, vocab_size: int) -> None:
    """Train a unigram model with the LM's special ids: 0 = end of padding (unk slot), 3 = PAD."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(list(lines)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        hard_vocab_limit=False,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    Path(path).write_bytes(model.getvalue())
