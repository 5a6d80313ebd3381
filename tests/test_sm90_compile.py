"""Every Triton kernel compiles for sm_90a (H200) with the arguments the engine passes it, and spills nothing.

The other kernel tests run Triton's interpreter, which never specialises an argument, so a kernel that breaks
when an int argument is 1 (and becomes a compile-time constant) passes them all. tests/sm90_compile.py compiles
what `LMGen.step` and a PersonaPlex `LMGen.prefill` launch on the `meta` device for sm_90a (bf16 weights with each
KV format, and int8 weights), front end and ptxas, with no GPU; it runs in a subprocess because the kernels must
be decorated without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sm90_compile import (
    ONES,
    attention_context,
    engine_variants,
    step_context,
    store_context,
    stt_context,
    tts_context,
    w8a16_context,
)

HELPER = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend (and its ptxas) is needed")
    tmp = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")  # compile for real, never from a previous run's cache
    out = tmp / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HELPER), "--json", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{HELPER.name} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()) | {"table": proc.stdout}


def _describe(variant: dict[str, Any]) -> str:
    return f"{variant['kernel']} [{variant['signature']}] from {'; '.join(variant['contexts'])}"


def test_every_launch_compiles(report):
    by_error: dict[str, list[str]] = {}  # one error often fails several variants: show it once
    for v in report["variants"]:
        if v["error"]:
            by_error.setdefault(v["error"], []).append(_describe(v))
    assert not by_error, "\n\n".join("\n".join(where) + f":\n{error}" for error, where in by_error.items())


def test_no_register_spills(report):
    spilled = [
        f"{_describe(v)}: {v['spill_stores']} B spill stores, {v['spill_loads']} B spill loads"
        for v in engine_variants(report)
        if not v["error"] and v["spill_stores"] + v["spill_loads"]
    ]
    assert not spilled, "\n".join(spilled) + "\n" + report["table"]


# Kernels whose design keeps each tile in the layout it was loaded in: their loops convert no layout (a conversion
# there moves the tile between threads, through shared memory, on every step)
IN_PLACE = ("_w8a16_gemv_kernel", "_paged_kernel")


def test_the_streaming_kernels_convert_no_layout_in_their_loops(report):
    """The W8A16 GEMV meets x and the codes in the registers they were loaded into; the paged decode attention
    converts nothing in its loop either. Which layout Triton gives a load can turn on how it breaks ties between
    dims: the GEMV's first 4-D loads compiled with no conversion here (Triton 3.9) and 7 a step under the GPU
    image's Triton 3.6."""
    variants = engine_variants(report)
    assert {v["kernel"] for v in variants} >= set(IN_PLACE)
    moved = [
        f"{_describe(v)}: {v['loop_shuffles']}" for v in variants if v["kernel"] in IN_PLACE and v["loop_shuffles"]
    ]
    assert not moved, "\n".join(moved) + "\n" + report["table"]


def test_every_kernel_is_exercised(report):
    """A new kernel that the engine's step never launches would escape this test: fail until it is driven."""
    assert len(report["kernels"]) >= 6, report["kernels"]
    assert not report["never_compiled"], f"not launched by LMGen.step: {report['never_compiled']}"
    contexts = {c for v in report["variants"] for c in v["contexts"]}
    assert {step_context(b, kv) for b in report["batches"] for kv in report["kv_dtypes"]} <= contexts
    assert set(report["kv_dtypes"]) == {"bf16", "int8", "fp8"}
    assert {tts_context(b, greedy) for b in report["tts"]["batches"] for greedy in (True, False)} <= contexts


def test_every_kv_dtype_compiles_its_own_variants(report):
    """The 8-bit pools' kernels are their own variants: the decode kernel with SCALED on int8 and fp8 pointers and
    RoPE fused with the quantized store for each format, at every batch the step runs (and in the prefill); the
    standalone store (`store_quantized`, which the step no longer launches) for each format at those batches."""
    for kv, ptr in (("int8", "*i8"), ("fp8", "*fp8e4nv")):
        for kernel, flag, pages, contexts in (
            ("_split_kernel", "SCALED=True", "k_ptr", step_context),
            ("_rope_kv_store_kernel", f"INT8={kv == 'int8'}", "kc_ptr", step_context),
            ("_store_kv_kernel", f"INT8={kv == 'int8'}", "kc_ptr", store_context),
        ):
            seen = {
                c
                for v in engine_variants(report)
                if v["kernel"] == kernel and flag in v["signature"].split() and f" {pages}:{ptr}" in v["signature"]
                for c in v["contexts"]
            }
            want = {contexts(b, kv) for b in report["batches"]}
            assert want <= seen, (kernel, kv, sorted(seen))
            assert (kernel == "_store_kv_kernel") != any("prefill" in c for c in seen), (kernel, kv, sorted(seen))


def test_the_step_fuses_the_8bit_store_into_rope(report):
    """With an 8-bit pool the step and the prefill launch `_rope_kv_store_kernel` and neither `_rope_qk_kernel` nor
    the standalone `_store_kv_kernel`; with a bf16 pool the opposite (RoPE alone, the pages written by torch)."""
    by_kernel: dict[str, set[str]] = {}
    for v in engine_variants(report):
        by_kernel.setdefault(v["kernel"], set()).update(c for c in v["contexts"] if c != ONES)
    for kernel, kv_formats in (
        ("_rope_kv_store_kernel", {"int8", "fp8"}),
        ("_rope_qk_kernel", {"bf16"}),
        ("_store_kv_kernel", set()),
    ):
        lm = {c for c in by_kernel.get(kernel, set()) if c.startswith("LMGen.")}
        formats = {next((f for f in ("int8", "fp8") if f"kv={f}" in c), "bf16") for c in lm}
        assert formats == kv_formats, (kernel, sorted(lm))


def test_int8_weights_compile_the_w8a16_kernel_at_every_batch_without_spills(report):
    """With int8 weights every projection runs through `_w8a16_kernel` (int8 codes, fp32 scales, bf16
    activations): compiled at every batch the step runs and in the prefill, spilling nothing; bf16 weights never
    launch it."""
    assert report["weights_dtypes"] == ["bf16", "int8"]
    variants = [v for v in engine_variants(report) if v["kernel"] == "_w8a16_kernel"]
    for v in variants:
        sig = v["signature"].split()
        assert {"x_ptr:*bf16/16", "w_ptr:*i8/16", "s_ptr:*fp32/16", "y_ptr:*bf16/16"} <= set(sig), _describe(v)
        assert not v["error"], f"{_describe(v)}:\n{v['error']}"
        assert v["spill_stores"] + v["spill_loads"] == 0, f"{_describe(v)}: spills\n{report['table']}"
    seen = {c for v in variants for c in v["contexts"] if c != ONES}
    want = {step_context(b, "bf16", "int8") for b in report["batches"]}
    assert want <= seen, sorted(seen)
    assert any(c.startswith("LMGen.prefill") for c in seen), sorted(seen)
    assert all("weights=int8" in c for c in seen), sorted(seen)


def test_the_gemv_kernel_compiles_where_it_runs_without_spills(report):
    """With `--w8a16-kernel gemv` the step runs `_w8a16_gemv_kernel` at every batch of up to `GEMV_ROWS` rows
    (split along K, its partial sums added by `_w8a16_split_sum_kernel`, for the DepFormer's 1024 columns; whole
    for the temporal projections) and `_w8a16_kernel` above, each without spills."""
    from duplexd.kernels.w8a16_matmul import GEMV_ROWS

    small = sorted({b for b in report["batches"] if b <= GEMV_ROWS} | {GEMV_ROWS})
    above = min(b for b in report["batches"] if b > GEMV_ROWS)
    by_kernel: dict[str, set[str]] = {}
    splits = set()
    for v in engine_variants(report):
        contexts = {c for c in v["contexts"] if c.endswith("w8a16=gemv")}
        if not contexts:
            continue
        assert not v["error"] and v["spill_stores"] + v["spill_loads"] == 0, _describe(v)
        by_kernel.setdefault(v["kernel"], set()).update(contexts)
        if v["kernel"] == "_w8a16_gemv_kernel":
            splits.add(next(t for t in v["signature"].split() if t.startswith("SPLIT=")))
    want = {w8a16_context(b, "gemv") for b in small}
    assert by_kernel["_w8a16_gemv_kernel"] == by_kernel["_w8a16_split_sum_kernel"] == want
    assert by_kernel["_w8a16_kernel"] == {w8a16_context(above, "gemv")}
    assert splits == {"SPLIT=True", "SPLIT=False"}


def test_stt_compiles_at_head_dim_64_up_to_hundreds_of_rows(report):
    """Kyutai STT 2.6B (32 heads of 64, no DepFormer): its step compiles the decode attention at BLOCK_D=64, RoPE
    (alone with a bf16 pool, fused with the 8-bit store with an int8 one) and the text sampling, at every batch it
    is driven at (up to a bucket of 400 sessions), without errors or spills."""
    stt = report["stt"]
    want = {stt_context(b, kv) for kv, batches in stt["kv_batches"].items() for b in batches}
    by_kernel: dict[str, set[str]] = {}
    for v in engine_variants(report):
        stt_contexts = {c for c in v["contexts"] if c in want}
        if not stt_contexts:
            continue
        assert not v["error"], f"{_describe(v)}:\n{v['error']}"
        assert v["spill_stores"] + v["spill_loads"] == 0, _describe(v)
        if v["kernel"] == "_split_kernel":
            assert "BLOCK_D=64" in v["signature"].split(), _describe(v)
        by_kernel.setdefault(v["kernel"], set()).update(stt_contexts)
    assert by_kernel.get("_split_kernel") == want, sorted(by_kernel.get("_split_kernel", ()))
    assert by_kernel.get("_rope_qk_kernel") == {c for c in want if "kv=" not in c}
    assert by_kernel.get("_rope_kv_store_kernel") == {c for c in want if "kv=int8" in c}
    assert by_kernel.get("_sample_kernel") == want
    assert not {k for k in by_kernel if "w8a16" in k}


def test_the_paged_attention_kernel_compiles_at_every_batch_and_kv_dtype(report):
    """`--attention-kernel paged`: the step launches `_paged_kernel`, never `_split_kernel`, at every batch and KV
    format (SCALED exactly for the 8-bit pools), a tile a whole 64-frame page, without errors or spills."""
    want = {attention_context(b, kv, "paged") for b in report["batches"] for kv in report["kv_dtypes"]}
    seen: set[str] = set()
    for v in engine_variants(report):
        contexts = want & set(v["contexts"])
        if not contexts or v["kernel"] not in ("_paged_kernel", "_split_kernel"):
            continue
        sig = v["signature"].split()
        assert v["kernel"] == "_paged_kernel" and {"PAGE_SIZE=64", "BLOCK_N=64"} <= set(sig), _describe(v)
        assert all(("kv=" in c) == ("SCALED=True" in sig) for c in contexts), _describe(v)
        assert not v["error"], f"{_describe(v)}:\n{v['error']}"
        assert v["spill_stores"] + v["spill_loads"] == 0, f"{_describe(v)}: spills\n{report['table']}"
        seen |= contexts
    assert seen == want, sorted(want - seen)
