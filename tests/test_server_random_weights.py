"""`duplexd serve --random-weights PRESET`: a preset with random weights and no files, saying so everywhere; and
the tokenizer check that keeps a too-small tokenizer from failing mid-session."""

from __future__ import annotations

import argparse
import dataclasses

import httpx2
import pytest

from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import DEMO
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.demo import ensure_demo
from duplexd.engine.weights.model_files import check_tokenizer
from duplexd.server.cli import settings_from_args
from duplexd.server.core.runtime import RandomTextTokenizer
from duplexd.server.core.settings import SettingsError

from .live_server import running_server


def test_serve_random_weights_answers_and_says_so(tmp_path):
    log = tmp_path / "serve.log"
    # the environment form of --random-weights
    with running_server(log, "--max-sessions", "2", env={"DUPLEXD_RANDOM_WEIGHTS": "demo"}) as live:
        model = httpx2.get(f"{live.url}/v1/models", timeout=5).json()["data"][0]
        assert model["random_weights"] is True and model["demo"] is False
        assert model["id"] == "demo-random-weights" and model["max_sessions"] == 2
        assert model["persona"] is False and model["voices"] == []
    text = log.read_text()
    assert "RANDOM weights" in text and "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize(
    "given, message",
    [
        ({"random_weights": "nope"}, "unknown preset 'nope'"),
        ({"random_weights": "demo", "tokenizer": "tok.model"}, "leave out --tokenizer"),
        ({"random_weights": "moshi-7b", "hf_repo": "a/b"}, "leave out --hf-repo"),
        ({"random_weights": "moshi-7b", "mimi_preset": "demo"}, "pairs with Mimi preset 'mimi'"),
    ],
)
def test_random_weights_settings_are_checked(given, message):
    with pytest.raises(SettingsError, match=message):
        settings_from_args(argparse.Namespace(**given))


def test_random_weights_settings():
    settings = settings_from_args(argparse.Namespace(random_weights="moshi-7b", mimi_preset="mimi"))
    assert settings.random_weights == "moshi-7b" and not settings.demo


def test_tokenizer_must_cover_the_lm_text_vocabulary():
    demo = ensure_demo()
    tokenizer = TextTokenizer(demo.tokenizer)
    check_tokenizer(tokenizer, dataclasses.replace(DEMO, text_card=tokenizer.vocab_size), demo.tokenizer)
    with pytest.raises(CheckpointError, match=f"has {tokenizer.vocab_size} pieces but the LM writes 32000"):
        check_tokenizer(tokenizer, dataclasses.replace(DEMO, text_card=32000), demo.tokenizer)
    stretched = RandomTextTokenizer(demo.tokenizer, 32000)
    check_tokenizer(stretched, dataclasses.replace(DEMO, text_card=32000), demo.tokenizer)
    assert stretched.piece(31999) == "<31999>" and stretched.piece(5) == tokenizer.piece(5)
