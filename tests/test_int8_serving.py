"""8-bit weights through the front doors: `duplexd serve` on a local q8 folder (Kyutai's layout: `model.q8.safetensors`
named by its config.json, `"quantize": true`) answering a Kyutai session over a real socket, and a q8 repo from
the Hugging Face cache by `--hf-repo`, offline."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from websockets.asyncio.client import connect

from duplexd.engine.models.int8_weights import int8_names
from duplexd.engine.weights.checkpoint import MIMI_NAME, load_lm, save_lm_weights
from duplexd.engine.weights.demo import ensure_demo
from duplexd.engine.weights.model_files import TOKENIZER_NAME, check_model_files, model_files

from .live_server import running_server
from .test_server_e2e import AUTH, KEY, kyutai_exchange, kyutai_greeting

Q8_NAME = "model.q8.safetensors"


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory):
    """The demo model as a Kyutai q8 folder (its int8 tensors written as moshi's QLinear writes them: checked in
    test_int8_weights)."""
    demo = ensure_demo()
    root = tmp_path_factory.mktemp("q8")
    save_lm_weights(load_lm(demo.lm, demo.config, weights_dtype="int8"), root / Q8_NAME)
    config = json.loads(demo.config.read_text())
    names = {"moshi_name": Q8_NAME, "mimi_name": MIMI_NAME, "tokenizer_name": TOKENIZER_NAME}
    (root / "config.json").write_text(json.dumps({**config, **names, "quantize": True}))
    shutil.copy(demo.mimi, root / MIMI_NAME)  # the file names of Kyutai's repos
    shutil.copy(demo.tokenizer, root / TOKENIZER_NAME)
    return root


def test_serve_a_local_q8_folder(q8_folder, tmp_path):
    args = ["--moshi-weight", str(q8_folder), "--mimi-weight", str(q8_folder / MIMI_NAME)]
    args += [
        "--tokenizer",
        str(q8_folder / TOKENIZER_NAME),
        "--max-sessions",
        "2",
        "--api-key",
        KEY,
        "--mimi-preset",
        "demo",
    ]

    async def session(port: int) -> tuple[int, list[str]]:
        async with connect(f"ws://127.0.0.1:{port}/api/chat", additional_headers=AUTH) as ws:
            await kyutai_greeting(ws)
            pcm, texts, messages = await kyutai_exchange(ws, 12)
            assert len(pcm) > 0 and float(abs(pcm).max()) > 0
            return messages, texts

    log = tmp_path / "serve.log"
    with running_server(log, *args) as live:
        messages, _ = asyncio.run(asyncio.wait_for(session(live.port), 90))
    assert messages == 11
    text = log.read_text()
    assert "q8" in text and "Traceback" not in text, text[-3000:]


def test_a_q8_repo_from_the_hub_cache_by_hf_repo(q8_folder, tmp_path, monkeypatch):
    """The file is the one the repo's config.json names (moshi's rule), and loads as int8 without being told."""
    import huggingface_hub.constants as constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--acme--tiny-moshi-q8"
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(q8_folder, snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    files = model_files(hf_repo="acme/tiny-moshi-q8", mimi_preset="demo")
    assert files.moshi == f"hf://acme/tiny-moshi-q8/{Q8_NAME}"
    check_model_files(files)
    model = load_lm(files.moshi, files.config)
    assert int8_names(model) and model.layers[0].wqkv.codes.dtype == torch.int8
