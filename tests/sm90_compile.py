"""Compile every Triton kernel the engine launches for sm_90a (H200) with the engine's real arguments, no GPU.

The interpreter the unit tests use does not specialise arguments; the GPU compiler does (an int argument equal to
1 becomes a compile-time constant, ints divisible by 16 and 16-byte-aligned pointers get hints), so a kernel can
pass every interpreter test and still fail to compile for the engine. This script installs a stand-in driver
that reports an sm_90 device, steps `LMGen` over a Moshi 7B model with bf16 and with int8 weights (and with each
other decode attention kernel), and over Kyutai
STT 2.6B (head dim 64, batches up to 400), on the `meta`
device (no memory, no data; a meta view's `data_ptr()` is its byte offset, so alignment hints come out as on the
GPU) and, instead of launching, compiles each launch exactly as Triton would (specialisation, front end, ptxas)
and records the result. Then it compiles each kernel once more with every integer argument set to 1, so an
argument that is never 1 in today's engine but could be tomorrow cannot hide a constexpr bug. ptxas reports
registers and spills.

Positions reach the kernels only as tensor data (lengths, rotary angles, frames), never as Python ints, so the
static arguments, and therefore the compiled variants, depend on the batch size, the DepFormer stream and the
sizes of the model and pool alone; the `meta` device cannot hold positions anyway.

Must run without TRITON_INTERPRET (kernels decorated in interpreter mode are not JITFunctions):
`python tests/sm90_compile.py [--json report.json] [--sass]` prints a table; tests/test_sm90_compile.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

SM90_SMS = 132  # streaming multiprocessors of an H200 (and an H100 SXM)
BATCHES = (1, 3, 64)  # a single session, an odd (unbucketed) batch, a large bucket
# Kyutai STT 2.6B (head dim 64, no DepFormer): the step at a bucket of hundreds too, its 8-bit pool at that bucket only.
STT_PRESET = "stt-2.6b"
STT_BATCHES = (1, 3, 64, 400)
STT_KV_DTYPES = {"bf16": STT_BATCHES, "int8": (400,)}
# Kyutai TTS 1.6B's step halves (head dim 128 over 16 heads, cross-attention, a 1024-wide DepFormer of 32 steps).
TTS_BATCHES = (1, 3, 64)
ONES = "every int argument = 1"
WEIGHTS_DTYPES = ("bf16", "int8")  # int8 weights run with a bf16 pool only: the KV formats' kernels are the same


class Sm90Driver:
    """Stand-in for Triton's CUDA driver: targets sm_90, launches nothing."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers, spills and stack of a kernel's PTX, from `ptxas -v` run the way Triton runs it for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        cmd = [
            get_ptxas(90).path,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            "--gpu-name=sm_90a",
            str(src),
            "-o",
            str(Path(tmp, "kernel.cubin")),
        ]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr

    def grab(pattern: str) -> int:
        match = re.search(pattern, text)
        if match is None:
            raise RuntimeError(f"no {pattern!r} in the ptxas log:\n{text}")
        return int(match.group(1))

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
    }


def loop_instructions(cubin: bytes) -> int:
    """SASS instructions in the kernel's longest loop (from a backward branch to its target; 0 without a loop), read
    with the `cuobjdump` beside Triton's ptxas: what one step of its main loop issues per warp."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        cuobjdump = Path(get_ptxas(90).path).with_name("cuobjdump")
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    at: dict[int, int] = {}  # address -> instruction index
    longest = 0
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if found is None:
            continue
        address = int(found.group(1), 16)
        index = at[address] = len(at)
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", found.group(2))
        target = int(branch.group(1), 16) if branch else address
        if target < address and target in at:  # backward: a loop (not the branch to itself that ends every kernel)
            longest = max(longest, index - at[target] + 1)
    return longest


def loop_shuffles(ttgir: str) -> int:
    """Layout conversions inside the kernel's loops (`ttg.convert_layout` in an `scf.for` body, TTGIR): each moves
    a tile between threads, through shared memory where it crosses warps, on every step of the loop."""
    regions: list[bool] = []  # per open region: is it a loop body
    count = 0
    for line in ttgir.splitlines():
        if "ttg.convert_layout" in line and any(regions):
            count += 1
        opened = line.count("{") - line.count("}")
        if opened > 0:
            regions += ["scf.for" in line] * opened
        elif opened < 0:
            del regions[opened:]
    return count


def _signature(jit_fn, specialization: list[tuple[str, Any]]) -> str:
    """`name:type` per argument: `/16` marks a divisibility (or alignment) hint, `=v` a compile-time constant."""
    parts = []
    for param, (kind, attr) in zip(jit_fn.params, specialization, strict=True):
        if kind == "constexpr":
            parts.append(f"{param.name}={attr}")
        else:
            parts.append(f"{param.name}:{kind}{'/16' if attr == 'D' else ''}")
    return " ".join(parts)


class Recorder:
    """Stands in for `JITFunction.run`: a launch compiles (once per specialisation), is recorded, runs nothing."""

    def __init__(self, sass: bool = False) -> None:
        from triton.runtime.jit import JITFunction

        self.sass = sass  # also count each variant's longest loop in SASS (a cuobjdump run each, ~0.8 s of CPU)
        self.compile_only = JITFunction.run  # the real one, called with warmup=True: compiles, launches nothing
        # Compiles run on worker threads while the engine is driven on (ptxas is a subprocess; each variant is its own
        # compile): `finish` waits for them.
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        # CPython 3.11 builds AST objects with a recursion-depth check that is not thread-safe: compiles parsing
        # kernels on several threads at once failed now and then with "AST constructor recursion depth mismatch".
        # Parsing takes turns until `finish` (the compiles' other stages, ptxas above all, still overlap).
        self._parse = ast.parse
        lock = threading.Lock()

        def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return self._parse(*args, **kwargs)

        ast.parse = one_at_a_time
        self.pending: list[Future] = []
        self.variants: dict[tuple, dict[str, Any]] = {}
        self.first_launch: dict[str, tuple[Any, tuple, dict]] = {}
        self.context = ""

    @contextmanager
    def installed(self) -> Iterator[None]:
        from triton.runtime.jit import JITFunction

        JITFunction.run = lambda jit_fn, *args, grid, warmup, **kwargs: self.launch(jit_fn, args, kwargs, grid)
        try:
            yield
        finally:
            JITFunction.run = self.compile_only

    def launch(self, jit_fn, args: tuple, kwargs: dict, grid: Any) -> None:
        self.first_launch.setdefault(f"{jit_fn.module}.{jit_fn.__name__}", (jit_fn, args, kwargs))
        self.compile(jit_fn, args, kwargs, grid, self.context)

    def compile(self, jit_fn, args: tuple, kwargs: dict, grid: Any, context: str) -> None:
        from triton.runtime import driver

        binder = jit_fn.device_caches[driver.active.get_current_device()][4]
        _, specialization, options = binder(*args, **kwargs)
        key = (jit_fn.module, jit_fn.__name__, tuple(map(str, specialization)), tuple(sorted(options.items())))
        record = self.variants.get(key)
        if record is None:
            record = self.variants[key] = {
                "kernel": jit_fn.__name__,
                "module": jit_fn.module,
                "signature": _signature(jit_fn, specialization),
                "options": {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))},
                "contexts": [],
                "grids": [],
                "error": None,
            }
            self.pending.append(self.pool.submit(self._compile, record, jit_fn, args, kwargs, grid))
        if context not in record["contexts"]:
            record["contexts"].append(context)
        grid = list(grid) if isinstance(grid, tuple) else repr(grid)
        if grid not in record["grids"]:
            record["grids"].append(grid)

    def _compile(self, record: dict[str, Any], jit_fn, args: tuple, kwargs: dict, grid: Any) -> None:
        try:
            kernel = self.compile_only(jit_fn, *args, grid=grid, warmup=True, **kwargs)
            record.update(
                num_warps=kernel.metadata.num_warps,
                shared=kernel.metadata.shared,
                loop_shuffles=loop_shuffles(kernel.asm["ttgir"]),
                **ptxas_usage(kernel.asm["ptx"]),
                **({"loop_instructions": loop_instructions(kernel.asm["cubin"])} if self.sass else {}),
            )
        except Exception as e:  # the report carries every failure; the test asserts there are none
            record["error"] = f"{type(e).__name__}: {e}"

    def finish(self) -> None:
        try:
            for future in self.pending:
                future.result()
            self.pool.shutdown()
        finally:
            ast.parse = self._parse


def kernel_inventory() -> tuple[list[str], list[str]]:
    """(kernels, device functions) among the `@triton.jit` functions defined in `duplexd.kernels`: a jit function
    that another one calls is a device function, every other one is a kernel that some launch must compile."""
    from triton.runtime.jit import JITFunction

    import duplexd.kernels as package

    jit_fns = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                jit_fns[f"{value.fn.__module__}.{name}"] = value
    called = set()
    for jit_fn in jit_fns.values():
        for node in ast.walk(ast.parse(jit_fn.src)):
            target = jit_fn.fn.__globals__.get(node.id) if isinstance(node, ast.Name) else None
            if isinstance(target, JITFunction) and target is not jit_fn:
                called.add(f"{target.fn.__module__}.{target.fn.__name__}")
    return sorted(set(jit_fns) - called), sorted(called)


def moshi_models(layers: int | None) -> dict[str, Any]:
    """Moshi 7B on `meta` (`layers` temporal and DepFormer layers if given), by `WEIGHTS_DTYPES`."""
    from duplexd.engine.models.config import PRESETS
    from duplexd.engine.weights.checkpoint import build_lm, int8_plan

    cfg = PRESETS["moshi-7b"]
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers, depformer_num_layers=layers)
    return {
        w: build_lm(cfg, device="meta", dtype=torch.bfloat16, int8=int8_plan(cfg, set(), w)) for w in WEIGHTS_DTYPES
    }


def step_on_meta(recorder: Recorder, model, batch: int, context: str, kv_dtype: str = "bf16", attention: str = "split"):
    """One `LMGen.step` of `model` at `batch` rows under `force_triton`, its launches recorded as `context`; the
    LMGen."""
    from duplexd.engine.dialogue.lm_gen import LMGen
    from duplexd.kernels.dispatch import force_triton

    gen = LMGen(model, num_slots=batch, kv_dtype=kv_dtype)
    gen.kv.attention_kernel = attention
    user_codes = torch.zeros(batch, model.cfg.num_user_codebooks, dtype=torch.long, device="meta")
    recorder.context = context
    with force_triton():
        gen.step(torch.arange(batch, device="meta"), user_codes)
    return gen


def drive_engine(recorder: Recorder, models: dict[str, Any], batches: tuple[int, ...], layers: int | None) -> None:
    """`LMGen.step` under `force_triton` at each batch size and KV format (`--kv-dtype`): Moshi 7B (`models`),
    bf16 weights, on `meta` (with an 8-bit pool, the standalone store at the same batch too); then with int8 weights
    (`--weights-dtype int8`: every projection through the W8A16 kernel) at each batch size with a bf16 pool, and
    its prefill."""
    from duplexd.engine.kv.dtypes import KV_DTYPES

    for weights, kv_dtype in [*(("bf16", kv) for kv in KV_DTYPES), ("int8", "bf16")]:
        for batch in batches:
            gen = step_on_meta(recorder, models[weights], batch, step_context(batch, kv_dtype, weights), kv_dtype)
            if gen.kv.k_scales is not None:
                drive_standalone_store(recorder, gen.kv, batch)
        drive_prefill(recorder, models[weights].cfg, kv_dtype, weights)
    drive_stt(recorder, layers)
    drive_tts(recorder, layers)


def attention_context(batch: int, kv_dtype: str, kernel: str) -> str:
    return step_context(batch, kv_dtype) + f" attention={kernel}"


def drive_attention_kernels(recorder: Recorder, model, batches: tuple[int, ...]) -> None:
    """`LMGen.step` of Moshi 7B (`model`, bf16 weights) with each decode attention other than the default
    (`--attention-kernel`) at each batch and KV format: the step's other kernels are the default step's variants."""
    from duplexd.engine.kv.dtypes import KV_DTYPES
    from duplexd.kernels.decode_attention import ATTENTION_KERNELS

    for kernel in ATTENTION_KERNELS[1:]:
        for kv_dtype in KV_DTYPES:
            for batch in batches:
                step_on_meta(recorder, model, batch, attention_context(batch, kv_dtype, kernel), kv_dtype, kernel)


def stt_context(batch: int, kv_dtype: str) -> str:
    return f"LMGen.step {STT_PRESET} B={batch}" + _suffix(kv_dtype, "bf16")


def drive_stt(recorder: Recorder, layers: int | None) -> None:
    """`LMGen.step` of Kyutai STT 2.6B (head dim 64, text only) at `STT_KV_DTYPES`' batches, bf16 weights."""
    from duplexd.engine.dialogue.lm_gen import LMGen
    from duplexd.engine.models.config import PRESETS
    from duplexd.engine.weights.checkpoint import build_lm
    from duplexd.kernels.dispatch import force_triton

    cfg = PRESETS[STT_PRESET]
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    model = build_lm(cfg, device="meta", dtype=torch.bfloat16)
    for kv_dtype, batches in STT_KV_DTYPES.items():
        for batch in batches:
            gen = LMGen(model, num_slots=batch, kv_dtype=kv_dtype)
            user_codes = torch.zeros(batch, cfg.num_user_codebooks, dtype=torch.long, device="meta")
            recorder.context = stt_context(batch, kv_dtype)
            with force_triton():
                gen.step(torch.arange(batch, device="meta"), user_codes)


def tts_context(batch: int, greedy: bool) -> str:
    return f"TTSGen.listen+speak tts-1.6b B={batch}" + ("" if greedy else " sampled")


def drive_tts(recorder: Recorder, layers: int | None) -> None:
    """The device halves of a Kyutai TTS 1.6B step (`TTSGen.listen`, `TTSGen.speak`: cross-attention, the 32-step
    DepFormer with its schedule) at `TTS_BATCHES`, greedy and sampled, bf16 weights and pool."""
    from duplexd.engine.models.config import TTS_1_6B
    from duplexd.engine.tts.config import TTSConfig
    from duplexd.engine.tts.generate import TTSGen
    from duplexd.engine.weights.checkpoint import build_lm
    from duplexd.kernels.dispatch import force_triton

    cfg = TTS_1_6B
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers, depformer_num_layers=layers)
    model = build_lm(cfg, device="meta", dtype=torch.bfloat16)
    tts = TTSConfig({}, (), 512, True, 1.0, 1.28, 2, ".safetensors")
    for batch in TTS_BATCHES:
        gen = TTSGen(model, None, tts, num_slots=batch)  # type: ignore[arg-type]  # no session: no conditioner
        index = torch.arange(batch, device="meta")
        text = torch.zeros(batch, dtype=torch.long, device="meta")
        for greedy in (True, False):
            recorder.context = tts_context(batch, greedy)
            with force_triton():
                hidden, _, _ = gen.listen(index, greedy)
                gen.speak(index, text, hidden, greedy)


def w8a16_context(batch: int, kernel: str) -> str:
    return step_context(batch, "bf16", "int8") + f" w8a16={kernel}"


def drive_w8a16_kernels(recorder: Recorder, model, batches: tuple[int, ...]) -> None:
    """`LMGen.step` of Moshi 7B on int8 weights (`model`) with each W8A16 kernel other than the default
    (`--w8a16-kernel`), bf16 pool: at the batches of up to `GEMV_ROWS` rows and at `GEMV_ROWS` (its widest
    variant), where "gemv" runs (split along K for the DepFormer's 1024 columns), and the first batch above, where
    it runs the tiles; the model goes back to the default kernel after. The prefill's rows are past `GEMV_ROWS`:
    the tiles there whatever the kernel."""
    from duplexd.engine.models.int8_weights import use_int8_kernel
    from duplexd.kernels.w8a16_matmul import GEMV_ROWS, W8A16_KERNELS

    driven = (
        sorted({b for b in batches if b <= GEMV_ROWS} | {GEMV_ROWS}) + sorted(b for b in batches if b > GEMV_ROWS)[:1]
    )
    for kernel in W8A16_KERNELS[1:]:
        use_int8_kernel(model, kernel)
        for batch in driven:
            step_on_meta(recorder, model, batch, w8a16_context(batch, kernel))
    use_int8_kernel(model, W8A16_KERNELS[0])


def store_context(batch: int, kv_dtype: str) -> str:
    return f"store_quantized B={batch} kv={kv_dtype}"


def drive_standalone_store(recorder: Recorder, kv, batch: int) -> None:
    """`store_quantized_triton` on the engine's pool at `batch` rows: the step fuses the store into RoPE
    (`rope_kv_store`), so no engine launch compiles the standalone store; bench/kv_dtype.py runs it."""
    from duplexd.kernels.kv_quant import store_quantized_triton

    heads, head_dim = kv.keys.shape[-2:]
    qkv = torch.zeros(batch, 3, heads, head_dim, dtype=torch.bfloat16, device="meta")
    view = kv.batch(torch.arange(batch, device="meta"), torch.zeros(batch, dtype=torch.long, device="meta"))
    recorder.context = store_context(batch, kv.kv_dtype)
    pools = (kv.keys[0], kv.values[0], kv.k_scales[0], kv.v_scales[0])
    store_quantized_triton(qkv[:, 1], qkv[:, 2], *pools, view.write_page, view.write_offset)


def _suffix(kv_dtype: str, weights: str) -> str:
    return ("" if kv_dtype == "bf16" else f" kv={kv_dtype}") + ("" if weights == "bf16" else f" weights={weights}")


def step_context(batch: int, kv_dtype: str, weights: str = "bf16") -> str:
    return f"LMGen.step B={batch}" + _suffix(kv_dtype, weights)


def drive_prefill(recorder: Recorder, cfg, kv_dtype: str, weights: str = "bf16") -> None:
    """`LMGen.prefill` of a PersonaPlex model (`cfg` with dep_q = 16): a whole 200-frame prompt and the first
    chunk of another in one forward, as the engine plans them; `weights` "int8": its projections int8."""
    from duplexd.engine.dialogue.lm_gen import LMGen
    from duplexd.engine.persona.prompt import PromptChunk, Voice, build_prompt
    from duplexd.engine.weights.checkpoint import build_lm, int8_plan
    from duplexd.kernels.dispatch import force_triton

    cfg = dataclasses.replace(cfg, dep_q=cfg.n_q, ring_rule="personaplex")  # its window: context - 1 keys
    model = build_lm(cfg, device="meta", dtype=torch.bfloat16, int8=int8_plan(cfg, set(), weights))
    gen = LMGen(model, num_slots=2, kv_dtype=kv_dtype)
    voice = Voice("v", None, 50, codes=torch.zeros(50, cfg.agent_codebooks, dtype=torch.long))  # type: ignore[arg-type]
    prompt = build_prompt(cfg, voice, list(range(100, 238)))
    recorder.context = f"LMGen.prefill {prompt.forwards}+64 rows" + _suffix(kv_dtype, weights)
    with force_triton():
        gen.prefill([PromptChunk(0, prompt, 0, prompt.forwards), PromptChunk(1, prompt, 0, 64)])


def ints_set_to_one(recorder: Recorder) -> None:
    """Compile each launched kernel once more with every (non-constexpr) int argument equal to 1."""
    for jit_fn, args, kwargs in list(recorder.first_launch.values()):
        ones = tuple(1 if isinstance(a, int) and not isinstance(a, bool) else a for a in args)
        recorder.compile(jit_fn, ones, kwargs, None, ONES)


def collect(
    batches: tuple[int, ...] = BATCHES, layers: int | None = None, sms: int = SM90_SMS, sass: bool = False
) -> dict[str, Any]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: interpreted kernels do not compile")
    from triton.runtime import driver

    from duplexd.engine.kv.dtypes import KV_DTYPES
    from duplexd.kernels import decode_attention

    driver.set_active(Sm90Driver())
    decode_attention.multiprocessor_count = lambda device: sms
    recorder = Recorder(sass)
    with recorder.installed():
        models = moshi_models(layers)
        drive_engine(recorder, models, batches, layers)
        drive_attention_kernels(recorder, models["bf16"], batches)
        drive_w8a16_kernels(recorder, models["int8"], batches)
    ints_set_to_one(recorder)
    recorder.finish()
    kernels, device_functions = kernel_inventory()
    compiled = {f"{r['module']}.{r['kernel']}" for r in recorder.variants.values()}
    return {
        "target": "sm_90a",
        "sass": sass,
        "sms": sms,
        "batches": list(batches),
        "stt": {"preset": STT_PRESET, "kv_batches": {k: list(v) for k, v in STT_KV_DTYPES.items()}},
        "tts": {"preset": "tts-1.6b", "batches": list(TTS_BATCHES)},
        "kv_dtypes": list(KV_DTYPES),
        "weights_dtypes": list(WEIGHTS_DTYPES),  # int8 weights: with a bf16 pool (`step_context(b, "bf16", "int8")`)
        "layers": layers,
        "kernels": kernels,
        "device_functions": device_functions,
        "never_compiled": sorted(set(kernels) - compiled),
        "variants": list(recorder.variants.values()),
    }


def engine_variants(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The variants some engine launch compiles (not only the every-int-is-1 sweep, whose code is degenerate)."""
    return [v for v in report["variants"] if any(c != ONES for c in v["contexts"])]


# The table's columns after the counts: each the worst over a kernel's engine variants
WORST = {
    "regs": lambda v: v["registers"],
    "spill B": lambda v: v["spill_stores"] + v["spill_loads"],
    "stack B": lambda v: v["stack"],
    "smem B": lambda v: v["shared"],
    "loop cvt": lambda v: v["loop_shuffles"],  # layout conversions in a loop
}
SASS_COLUMN = {"loop ins": lambda v: v["loop_instructions"]}  # SASS instructions in the longest loop (`--sass`)


def table(report: dict[str, Any]) -> str:
    """Per kernel: errors over all variants; over the engine's variants, their count and the `WORST` columns (and
    `SASS_COLUMN` where the report has it)."""
    worst_of = WORST | (SASS_COLUMN if report["sass"] else {})
    rows: dict[str, dict[str, int]] = {}
    for v in report["variants"]:
        row = rows.setdefault(v["kernel"], dict.fromkeys(["variants", "errors", *worst_of], 0))
        row["errors"] += bool(v["error"])
    for v in engine_variants(report):
        row = rows[v["kernel"]]
        row["variants"] += 1
        if not v["error"]:
            row.update({column: max(row[column], worst(v)) for column, worst in worst_of.items()})
    columns = ["variants", "errors", *worst_of]
    lines = [f"{'kernel':<26} " + " ".join(f"{c:>8}" for c in columns)]
    lines += [f"{name:<26} " + " ".join(f"{r[c]:>8}" for c in columns) for name, r in sorted(rows.items())]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--layers", type=int, help="temporal and DepFormer layers (default: the real 32 and 6)")
    parser.add_argument("--sass", action="store_true", help="count each variant's longest loop in SASS (slower)")
    args = parser.parse_args()
    report = collect(tuple(args.batches), args.layers, sass=args.sass)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.stdout.write(table(report) + "\n")
    for v in report["variants"]:
        if v["error"]:
            sys.stdout.write(f"\n{v['kernel']} [{v['signature']}] ({'; '.join(v['contexts'])}):\n{v['error']}\n")
    if report["never_compiled"]:
        sys.stdout.write(f"\nnever compiled: {', '.join(report['never_compiled'])}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
