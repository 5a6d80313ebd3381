"""The demo model: written once in the reference's format, loadable by the reference, runnable from the CLI."""

from __future__ import annotations

import json

import torch
from moshi.models.lm import LMModel as RefLMModel
from safetensors.torch import load_file

from duplexd.commands.cli import main
from duplexd.engine.models.config import DEMO, DEMO_MIMI
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.checkpoint import load_lm, load_mimi
from duplexd.engine.weights.config_file import lm_config_from_dict
from duplexd.engine.weights.demo import ensure_demo

from .ref_models import reference_kwargs


def test_demo_files_are_reference_format(tmp_path):
    files = ensure_demo(tmp_path)
    cfg = lm_config_from_dict(json.loads(files.config.read_text()))
    tokenizer = TextTokenizer(files.tokenizer)
    assert cfg.text_card == tokenizer.vocab_size > 100
    assert tokenizer.piece(cfg.text_padding_token_id) == "<pad>"
    assert cfg.num_layers == DEMO.num_layers and cfg.dep_q == 8
    ref = RefLMModel(device="cpu", dtype=torch.float32, **reference_kwargs(cfg))
    ref.load_state_dict(load_file(str(files.lm)), strict=True)
    ours = load_lm(files.root)
    assert torch.equal(ours.text_head.t(), ref.text_linear.weight)
    mimi = load_mimi(files.mimi, DEMO_MIMI)
    assert mimi.cfg.frame_size == 1920 and mimi.cfg.card == cfg.card


def test_demo_is_written_once_and_deterministic(tmp_path):
    first = ensure_demo(tmp_path / "a")
    stamp = first.lm.stat().st_mtime_ns
    assert ensure_demo(tmp_path / "a").lm.stat().st_mtime_ns == stamp
    second = ensure_demo(tmp_path / "b")
    a, b = load_file(str(first.lm)), load_file(str(second.lm))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_generate_on_the_demo(capsys):
    assert main(["generate", "--frames", "12", "--text-temperature", "1.0", "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--frames", "12", "--text-temperature", "1.0", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["generate", "--weights", str(tmp_path / "missing.safetensors")]) == 2
    assert "file not found" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_text("junk")
    assert (
        main(["generate", "--weights", str(tmp_path / "junk.safetensors"), "--config", str(ensure_demo().config)]) == 2
    )
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert main(["generate", "--frames", "0"]) == 2
    assert "--frames" in capsys.readouterr().err
