"""bench/kv_dtype.py on the CPU: the error budget of an 8-bit KV cache (teacher-forced text logits and attention
outputs of int8 and fp8 against the weights' dtype, on a sharpened random model, past the window), shown able to
fail (a pool whose value scales are dropped blows it); the GPU suite's dry run of it is in test_bench_smoke.

The figures themselves (docs/BENCHMARKS.md) come from the bench's own command line; here they are bounded."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from duplexd.engine.kv import paged
from duplexd.engine.models.config import DEMO
from duplexd.engine.weights.demo import random_lm

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kv_bench = _module("kv_dtype")
summary = _module("gpu_summary")

CFG = dataclasses.replace(DEMO, context=96)  # a short window, so 150 frames run well past it
FRAMES = 150


@pytest.fixture(scope="module")
def lm():
    return kv_bench.sharpened(random_lm(CFG, seed=4), 3.0)


@pytest.mark.parametrize(("kv_dtype", "logit_err", "kl"), [("int8", 0.01, 1e-4), ("fp8", 0.05, 1e-3)])
def test_error_budget_past_the_window(lm, kv_dtype, logit_err, kl):
    r = kv_bench.agreement(lm, kv_dtype, FRAMES, rows=2)
    assert 0 < r["logit_rel_err_mean"] < logit_err and 0 < r["kl_mean"] < kl
    assert 0 < r["attention_rel_err_mean"] < 10 * logit_err
    assert r["top1_agreement"] >= 0.9 and r["top1_agreement_past_window"] is not None


def test_the_budget_catches_a_scale_plumbing_bug(lm, monkeypatch):
    good = kv_bench.agreement(lm, "int8", 40, rows=2)
    attend = paged.decode_attention

    def values_unscaled(*args, v_scales=None, **kwargs):
        return attend(*args, v_scales=None if v_scales is None else torch.ones_like(v_scales), **kwargs)

    monkeypatch.setattr(paged, "decode_attention", values_unscaled)
    bad = kv_bench.agreement(lm, "int8", 40, rows=2)
    assert bad["logit_rel_err_mean"] > 20 * good["logit_rel_err_mean"]
    assert bad["attention_rel_err_mean"] > 10


def test_summary_without_a_result():
    """A kv_dtype stage that wrote nothing is said so (the dry run's summary is checked in test_bench_smoke)."""
    assert summary.kv_table(None) == ("no result (see kv_dtype.log)", "kv dtype: no result")
