"""bench/weights_dtype.py on the CPU: the command line as the GPU suite's dry run makes it (demo preset, a few
frames) in a subprocess, its JSON checked (moshi-7b's capacity on a 24 GB card, agreement of int8 weights with the
text head int8 and float, the CUDA-only stages skipped), and the CUDA-only stages' code run here on the CPU
(the kernel table with wall-clock timing at toy shapes, a row per W8A16 kernel, shown able to fail; one engine
step per weights format).

The figures themselves come from the bench's own command line on a GPU; here they are bounded."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "weights_dtype.py"


def _module():
    spec = importlib.util.spec_from_file_location("weights_dtype", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["weights_dtype"] = module
    spec.loader.exec_module(module)
    return module


bench = _module()


@pytest.fixture
def run(capsys, one_thread):
    """The bench's command line in this process (the suite's dry run runs it as a script, tests/test_bench_smoke.py):
    its output and the JSON of its last line."""

    def run(*args: str) -> tuple[str, dict]:
        capsys.readouterr()
        assert bench.main(list(args)) == 0
        out = capsys.readouterr().out
        return out, json.loads(out.strip().splitlines()[-1])

    return run


def _unit(x: float) -> bool:
    return 0.0 <= x <= 1.0


def test_cpu_run(tmp_path, run):
    args = ("--device", "cpu", "--preset", "demo", "--frames", "20", "--rows", "2", "--out", str(tmp_path))
    args += ("--batches", "1", "--steps", "2")
    out, report = run(*args)
    assert report == json.loads((tmp_path / "weights_dtype.json").read_text())  # "partial" gone at the end
    assert report["bench"] == "weights_dtype" and report["ok"] and report["preset"] == "demo"

    # capacity: moshi-7b, every weights x KV format, the 24 GB card's headline
    cap = report["capacity"]
    assert cap["model"] == "moshi-7b" and set(cap["by_memory"]) == {"22GiB", "23028MiB"}
    for by in cap["by_memory"].values():
        for weights in ("bf16", "int8"):
            assert set(by[weights]) == {"bf16", "int8"}
            assert all(cell["sessions"] >= 1 for cell in by[weights].values())
        assert by["int8"]["int8"]["sessions"] > by["bf16"]["int8"]["sessions"] >= by["bf16"]["bf16"]["sessions"]
        assert 0.45 < by["int8"]["bf16"]["lm_weights_gib"] / by["bf16"]["bf16"]["lm_weights_gib"] < 0.55
    assert cap["by_memory"]["23028MiB"]["int8"]["int8"]["sessions"] >= 12
    assert cap["by_memory"]["22GiB"]["int8"]["int8"]["sessions"] >= 11  # test_capacity.py's figure: 11 at 22 GiB
    assert cap["headline"]["met"]["23028MiB"] and cap["headline"]["goal"] == 12

    # agreement: both text-head settings, every figure a fraction, the text head's error visible
    agree = report["agreement"]
    assert agree["frames"] == 20 and agree["rows"] == 2
    for variant in ("text_head_int8", "text_head_float"):
        for part in ("text", "audio"):
            figures = agree[variant][part]
            assert all(_unit(v) for v in figures.values()), (variant, part, figures)
            assert figures["top1_agreement"] >= 0.8 and 0 < figures["logit_rel_err_mean"] < 0.05
    head_int8, head_float = agree["text_head_int8"], agree["text_head_float"]
    assert head_float["text"]["logit_rel_err_mean"] < head_int8["text"]["logit_rel_err_mean"]
    assert head_float["audio"] == head_int8["audio"]  # teacher-forced: the text head does not reach the DepFormer
    assert head_int8["int8_projections"] == head_float["int8_projections"] + 1
    sizes = agree["lm_weights_gib"]
    assert sizes["text_head_int8"] < sizes["text_head_float"] < sizes["float"]

    # steps: the int8 step once on a CPU, with the first W8A16 kernel
    assert report["steps"]["kernels"] == ["tiles"] and "steps int8 (tiles) / bf16 at batch 1" in out

    # the CUDA-only stages
    assert report["skipped"] == {"kernel": "needs CUDA"}
    assert "kernel" not in report
    assert "kernel: skipped (needs CUDA" in out
    assert "agreement text head switch" in out and "capacity headline" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_cuda_asked_for_without_one(run):
    out, report = run("--device", "cuda", "--stages", "kernel")
    assert report == {"bench": "weights_dtype", "skipped": "no CUDA device"} and "no CUDA device" in out


def test_kernel_table_on_the_cpu(capsys):
    """A row per kernel, shape and row count; each kernel's time against the tiles kernel's at the same shape."""
    r = bench.kernel_table("cpu", repeats=2, shapes=[(64, 96), (96, 32)], rows=(1, 8), streamed=1 << 14)
    assert r["ok"] and r["timing"] == ["wall clock"] and r["kernels"] == ["tiles", "gemv"] and len(r["cases"]) == 8
    for cell in r["cases"]:
        assert cell["max_rel_err"] <= 1e-2 and cell["int8_ms"] > 0 and cell["bf16_ms"] > 0 and cell["copy_ms"] > 0
        assert cell["speedup"] == pytest.approx(cell["bf16_ms"] / cell["int8_ms"], rel=1e-2, abs=1e-3)
        tiles = next(c for c in r["cases"] if c["kernel"] == "tiles" and c["K"] == cell["K"] and c["M"] == cell["M"])
        assert cell["vs_tiles"] == pytest.approx(cell["int8_ms"] / tiles["int8_ms"], rel=1e-2, abs=1e-3)
    assert {"speedup_geomean_m1", "of_copy_geomean_m8"} <= set(r["by_kernel"]["tiles"])
    assert {"speedup_geomean_m1", "vs_tiles_geomean_m1", "vs_tiles_geomean_m8"} <= set(r["by_kernel"]["gemv"])
    out = capsys.readouterr().out
    assert out.count("\nkernel ") >= 8 and "kernel gemv: M=1 speedup" in out and "/ tiles" in out


def test_kernel_table_fails_a_wrong_kernel(monkeypatch):
    def off(x, codes, scale, kernel):
        return bench.int8_matmul_reference(x, codes, scale) * 1.05

    monkeypatch.setattr(bench, "int8_matmul", off)
    r = bench.kernel_table("cpu", repeats=1, shapes=[(64, 96)], rows=(1,), streamed=1)
    assert not r["ok"] and r["max_rel_err"] > bench.MAX_REL_ERR and "int8_ms" not in r["cases"][0]


def test_steps_on_the_cpu():
    """bf16 and int8 weights; the int8 step once (the first kernel): the torch reference runs whatever the kernel."""
    torch.set_num_threads(1)
    with torch.no_grad():
        r = bench.step_times("demo", "bf16", [1], 1, "cpu", torch.float32)
    for weights in ("bf16", "int8"):
        assert r[weights]["fit"] >= 1 and r[weights]["1"]["p50_ms"] > 0
    assert r["int8"]["lm_weights_gib"] < r["bf16"]["lm_weights_gib"]
    assert r["ratio"]["1"]["p50"] > 0 and r["met"] in (True, False)
    assert r["kernels"] == ["tiles"] and r["int8_by_kernel"] == {"tiles": r["int8"]}
    assert r["ratio_by_kernel"] == {"tiles": r["ratio"]} and r["met_by_kernel"] == {"tiles": r["met"]}
