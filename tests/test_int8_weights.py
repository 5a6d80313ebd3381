"""8-bit weights: the quantizer against bitsandbytes, Kyutai's q8 files (written by moshi's own `QLinear`) in both
namings, quantize-at-load giving the same tensors, the loader's refusals, and sessions on int8 weights against the
reference `moshi` on the dequantized weights (fp32), batched at different positions past the window."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import LMConfig
from duplexd.engine.models.int8_weights import Int8Weight, int8_names, project, quantize_rows
from duplexd.engine.weights.checkpoint import build_lm, load_lm, quantize_lm_, save_lm_weights, stored_int8
from duplexd.kernels.cpu_matmul import matmul

from .ref_models import fused_state_dict, quantized_reference, reference_lm
from .test_lm_parity import GREEDY, SMALL, TOL, ReferenceRun, _compare

CFG = LMConfig(**SMALL, context=16)


def _state(lm, naming: str) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in lm.state_dict().items()} if naming == "module" else fused_state_dict(lm, CFG)


@pytest.fixture(scope="module")
def models():
    lm = reference_lm(CFG, seed=5)
    q8, dequantized = quantized_reference(lm)
    return lm, q8, dequantized


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """The float checkpoint and moshi's q8 checkpoint of the same model, in both namings."""
    lm, q8, _ = models
    root = tmp_path_factory.mktemp("int8")
    out = {}
    for naming in ("module", "fused"):
        for kind, model in (("float", lm), ("q8", q8)):
            out[kind, naming] = root / f"{kind}_{naming}.safetensors"
            save_file(_state(model, naming), str(out[kind, naming]))
    return out


def test_the_quantizer_is_bitsandbytes_and_within_half_a_step():
    from bitsandbytes import functional as bnbF  # here, not at collection: its import takes ~1.2 s (torch's inductor)

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=gen) * torch.logspace(-3, 2, 37)[:, None]  # rows of very different ranges
    w[3, 7] = 40.0  # an outlier sets its row's scale
    for weight in (w, w.bfloat16()):
        codes, absmax = quantize_rows(weight)
        cb, scb, _ = bnbF.int8_vectorwise_quant(weight.half())
        assert codes.dtype == torch.int8 and absmax.dtype == torch.float32
        assert torch.equal(codes, cb) and torch.equal(absmax, scb)
        half = weight.half().float()
        step = (absmax / 127)[:, None]
        slack = 1e-6 * absmax[:, None]  # fp32 rounding of the check itself (bf16 rows hit exact ties)
        assert ((half - codes.float() * step).abs() <= step / 2 + slack).all()
        assert (codes.abs().amax(dim=1) == 127).all()  # every row uses its whole range
    zero = quantize_rows(torch.zeros(2, 5))
    assert torch.equal(zero[0], torch.zeros(2, 5, dtype=torch.int8)) and torch.equal(zero[1], torch.zeros(2))


def _linears(q8) -> dict[str, object]:
    from moshi.utils.quantize import QLinear

    return {name: m for name, m in q8.named_modules() if isinstance(m, QLinear)}


@pytest.mark.parametrize("naming", ["module", "fused"])
def test_a_q8_file_loads_as_moshi_quantized_it_and_quantize_at_load_agrees(models, files, naming):
    _, q8, dequantized = models
    model = load_lm(files["q8", naming], CFG)
    names = int8_names(model)
    assert names == stored_int8(CFG, files["q8", naming])
    assert len(names) == 3 * 4 + 2 * 4 + 3  # temporal and DepFormer projections, dep_in, dep_heads, the text head
    linears = _linears(q8)
    # Spot checks in duplexd's layout, one per kind of projection (fused: split back per step).
    expected = {
        "text_head": (linears["text_linear"], None),
        "layers.2.wqkv": (linears["transformer.layers.2.self_attn.in_projs.0"], None),
        "dep_layers.1.wo": (linears["depformer.layers.1.self_attn.out_projs.5"], 5),
        "dep_layers.0.w_out": (linears["depformer.layers.0.gating.3.linear_out"], 3),
        "dep_in": (linears["depformer_in.7"], 7),
        "dep_heads": (linears["linears.2"], 2),
    }
    for name, (ref, step) in expected.items():
        w = model.get_submodule(name)
        assert isinstance(w, Int8Weight)
        codes, absmax = (w.codes, w.absmax) if step is None else (w.codes[step], w.absmax[step])
        assert torch.equal(codes, ref.weight) and torch.equal(absmax, ref.weight_scb), name
        assert w.scale.dtype == torch.float32
    # From the float file, quantized as it is read: the same tensors, all of them; by default the text head stays
    # float (its accuracy figures, docs/BENCHMARKS.md).
    assert int8_names(load_lm(files["float", naming], CFG, weights_dtype="int8")) == names - {"text_head"}
    quantized = load_lm(files["float", naming], CFG, weights_dtype="int8", int8_text_head=True)
    assert int8_names(quantized) == names
    for name in names:
        a, b = model.get_submodule(name), quantized.get_submodule(name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax) and torch.equal(a.scale, b.scale)
    # And quantized after a float load (random weights, `--weights-dtype int8` on a preset), the same again.
    after = quantize_lm_(load_lm(files["float", naming], CFG), "int8", text_head=True)
    assert all(torch.equal(after.get_submodule(n).codes, model.get_submodule(n).codes) for n in names)
    # Served as float: the dequantized weights, exactly as the oracle holds them.
    floats = load_lm(files["q8", naming], CFG, weights_dtype="bf16")
    assert not int8_names(floats)
    assert torch.equal(floats.dep_layers[1].wo[5].t(), dequantized.depformer.layers[1].self_attn.out_projs[5].weight)
    assert torch.equal(floats.text_head.t(), dequantized.text_linear.weight)


def test_int8_weights_write_q8_files_that_read_back_exactly(files, tmp_path):
    model = load_lm(files["float", "module"], CFG, weights_dtype="int8", int8_text_head=True)
    for naming in ("module", "fused"):
        path = tmp_path / f"{naming}.safetensors"
        save_lm_weights(model, path, naming)
        written, source = load_file(str(path)), load_file(str(files["q8", naming]))
        assert written.keys() == source.keys()
        assert all(torch.equal(written[k], source[k]) for k in source), naming


def test_bad_q8_files_are_one_line_naming_the_tensor(files, tmp_path):
    src, bad = files["q8", "fused"], tmp_path / "bad.safetensors"
    scb = "transformer.layers.1.self_attn.in_proj_weight_scb"
    cases = [
        ({scb: lambda t: t.bfloat16()}, f"{scb} is BF16, a q8 file holds it as F32"),
        ({scb: lambda t: t[:-1].contiguous()}, f"shape mismatch for {scb}"),
        ({"linears.3.weight": lambda t: t.float()}, "linears.3.weight is F32, a q8 file holds it as I8"),
    ]
    for changes, message in cases:
        tensors = load_file(str(src))
        for key, change in changes.items():
            tensors[key] = change(tensors[key])
        save_file(tensors, str(bad))
        with pytest.raises(CheckpointError) as e:
            load_lm(bad, CFG)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    tensors = load_file(str(src))
    del tensors["linears.3.weight_scb"]  # int8 codes with no scales
    save_file(tensors, str(bad))
    with pytest.raises(CheckpointError, match=r"linears\.3\.weight is I8, expected a float tensor \(or a q8 pair"):
        load_lm(bad, CFG)


def test_build_and_move_keep_the_scales_fp32():
    model = build_lm(CFG, dtype=torch.bfloat16, int8={"layers.0.wqkv", "dep_heads"})
    model = model.to(torch.float16)  # a cast of the whole model moves int8 weights, never casts them
    w = model.layers[0].wqkv
    assert isinstance(w, Int8Weight)
    assert (w.codes.dtype, w.absmax.dtype, w.scale.dtype) == (torch.int8, torch.float32, torch.float32)
    assert model.text_head.dtype == torch.float16 and tuple(w.codes.shape) == (3 * CFG.dim, CFG.dim)
    assert tuple(model.dep_heads.codes.shape) == (CFG.dep_q, CFG.card, CFG.depformer_dim)


def test_the_projection_path_follows_the_weights_as_loaded(files):
    """A float model's projections are the float matmul itself (no per-call type check), chosen when its weights
    are laid out; any int8 weight, however it came (a q8 file, quantize-at-load, quantizing a float model), makes
    them `project`; a q8 file dequantized at load is float again."""
    float_file, q8_file = files["float", "fused"], files["q8", "fused"]
    assert build_lm(CFG).project is matmul
    assert load_lm(float_file, CFG).project is matmul
    assert load_lm(q8_file, CFG, weights_dtype="bf16").project is matmul
    assert load_lm(q8_file, CFG).project is project
    assert load_lm(float_file, CFG, weights_dtype="int8").project is project
    assert build_lm(CFG, int8={"dep_heads"}).project is project
    assert quantize_lm_(load_lm(float_file, CFG), "int8").project is project


def test_sessions_on_int8_weights_match_the_reference_on_the_dequantized_weights(models, files):
    """Two conversations, one joining at frame 5, both past the 16-frame window, logits and greedy tokens; the
    int8 model differs from the float one it was quantized from (the quantization is really applied)."""
    lm, _, dequantized = models
    model = load_lm(files["q8", "fused"], CFG)
    gen = LMGen(model, num_slots=2)
    codes = torch.randint(0, CFG.card, (2, 40, CFG.num_user_codebooks), generator=torch.Generator().manual_seed(6))
    refs = {c: ReferenceRun(dequantized) for c in (0, 1)}
    floats = ReferenceRun(lm)
    gap, texts, starts = 0.0, set(), {0: 0, 1: 5}
    for c in (0, 1):
        gen.reset(c, GREEDY)
    for frame in range(45):
        active = [c for c in (1, 0) if starts[c] <= frame < starts[c] + 40]
        out = gen.step(torch.tensor(active), torch.stack([codes[c, frame - starts[c]] for c in active]), True)
        for row, c in enumerate(active):
            _compare(frame, refs[c].step(codes[c, frame - starts[c]]), out, row)
            texts.add(int(out.tokens[row, 0]))
            if c == 0:
                gap = max(gap, float((out.text_logits[row] - floats.step(codes[0, frame])[1][0]).abs().max()))
    assert len(texts) > 3, "degenerate run"
    assert gap > 20 * TOL, f"int8 logits within {gap} of the float model's: is the quantization applied?"


def test_one_changed_code_changes_the_outputs(files, tmp_path):
    """A parity test that could not see a weight would pass anyway: one code of the first audio head changed
    changes that head's logit for that token, and only it."""
    tensors = load_file(str(files["q8", "fused"]))
    head = tensors["linears.0.weight"]
    head[5, 3] = -60 if head[5, 3] > 0 else 60
    save_file(tensors, str(tmp_path / "changed.safetensors"))
    outs = []
    for path in (files["q8", "fused"], tmp_path / "changed.safetensors"):
        gen = LMGen(load_lm(path, CFG), num_slots=1)
        gen.reset(0, GREEDY)
        codes = torch.randint(0, CFG.card, (6, CFG.num_user_codebooks), generator=torch.Generator().manual_seed(7))
        outs.append(
            torch.stack([gen.step(torch.tensor([0]), codes[f : f + 1], True).audio_logits[0] for f in range(6)])
        )
    changed = outs[0][0] != outs[1][0]  # [codebooks, card] at the first frame (later ones see its tokens)
    assert changed[0, 5] and changed[0].sum() == 1
