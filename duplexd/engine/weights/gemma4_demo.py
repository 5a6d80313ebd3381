"""A tiny random Gemma 4 (audio tower + 2-layer text decoder + tokenizer) in Hugging Face layout, built offline.

It stands in for `google/gemma-4-E2B-it` in tests and demos: same file layout, same special tokens and prompt
format, a few hundred thousand parameters. It has learnt nothing, so its transcripts are word pieces at random.
HF's init leaves norm weights at 1, `per_dim_scale` at 0 and clip bounds at +-inf, values that would hide a
dropped parameter, so every one of them is perturbed. Needs `transformers` (the `gemma` extra).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .demo import cache_root

logger = logging.getLogger(__name__)

GEMMA4_DEMO_VERSION = 1
GEMMA4_DEMO_SEED = 0  # its transcripts vary with the audio (tests/test_transcriber.py)
DEMO_VOCAB = 400

# Ids 0-2 are Gemma's pad / eos / bos; the multimodal markers follow, as named in Gemma 4's tokenizer.
SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "bos_token": "<bos>",
    "unk_token": "<unk>",
}
MULTIMODAL_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
TURN_TOKENS = ["<|turn>", "<turn|>", "<|video|>"]

# Gemma-style turns; audio parts render as one `<|audio|>`, which the processor expands to the soft-token span.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'audio' %}<|audio|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def build_tokenizer(corpus: list[str], vocab_size: int = DEMO_VOCAB) -> Any:
    """A byte-level BPE trained on `corpus`, wrapped as a `transformers` fast tokenizer with Gemma 4's markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS.values(), *TURN_TOKENS, *MULTIMODAL_TOKENS.values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        extra_special_tokens=dict(MULTIMODAL_TOKENS),
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        **SPECIAL_TOKENS,
    )


def tiny_config(tokenizer: Any) -> Any:
    """Audio tower as in the parity tests (2 x 64, 128 mel bins) and a 2-layer text decoder (sliding + full)."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig

    vocab = len(tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in MULTIMODAL_TOKENS.items()}
    text = Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=32,  # type: ignore[call-arg]  # read by __post_init__, not a declared field
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    audio = Gemma4AudioConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        subsampling_conv_channels=[128, 8],
        output_proj_dims=48,
    )
    return Gemma4Config(
        text_config=text,
        audio_config=audio,
        vision_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"),
    )


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Weights at the scale of a trained model's init, and no parameter left at a value that hides it."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("per_dim_scale"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "norm" in name or name.endswith("scale"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            # Small, as HF's init: larger tied embeddings make the random decoder repeat its last token forever.
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        elif "embed" in name and p.dim() == 2 and "projection" not in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    for name, b in model.named_buffers():
        r = float(torch.rand((), generator=gen))
        if name.endswith(("input_min", "output_min")):
            b.fill_(-1.5 - r)
        elif name.endswith(("input_max", "output_max")):
            b.fill_(1.5 + r)
        elif name.endswith("layer_scalar"):
            b.fill_(0.5 + r)


def build_model(tokenizer: Any, seed: int = GEMMA4_DEMO_SEED) -> Any:
    """The tiny random `Gemma4ForConditionalGeneration`, perturbed, in eval mode."""
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(tiny_config(tokenizer)).eval()
    perturb_(model, seed)
    return model


def write_demo(folder: Path, seed: int = GEMMA4_DEMO_SEED) -> Path:
    """Write model, tokenizer and chat template into `folder` (HF layout: loadable by path)."""
    from transformers import Gemma4AudioFeatureExtractor

    corpus = (resources.files(__package__) / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    tokenizer = build_tokenizer(corpus.splitlines())
    build_model(tokenizer, seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Gemma4AudioFeatureExtractor().save_pretrained(folder)
    return folder


def ensure_gemma4_demo(root: Path | None = None) -> Path:
    """The demo folder, written once into the cache (into a temporary folder renamed into place, so concurrent
    first runs never see half a model)."""
    folder = (root or cache_root()) / f"gemma4-demo-v{GEMMA4_DEMO_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing the Gemma 4 demo model (random weights, it transcribes nonsense) to %s", folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        write_demo(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process won the race
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
