"""bench/gpu_triton_cache.py's bookkeeping on a made-up cache (the build itself needs the package index and Triton
3.6 in a scratch venv; the device checks a GPU): pruning keeps what a cache hit reads, and the report tells the
carried kernels read from those compiled there."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_triton_cache", BENCH / "gpu_triton_cache.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_triton_cache"] = module
    spec.loader.exec_module(module)
    return module


def _kernel(cache: Path, entry: str, name: str, exts=("source", "ttir", "ttgir", "llir", "ptx", "cubin", "json")):
    """A compiled kernel's entry as Triton 3.6 writes it: its files and a group index naming them by absolute path."""
    folder = cache / entry
    folder.mkdir()
    children = {f"{name}.{ext}": str(folder / f"{name}.{ext}") for ext in exts}
    for path in children.values():
        Path(path).write_text("x")
    (folder / f"__grp__{name}.json").write_text(json.dumps({"child_paths": children}))
    return folder


def test_prune_then_check_and_report(tmp_path):
    gtc = _module()
    carried = _kernel(tmp_path, "AAAA", "_split_kernel")
    (tmp_path / "BBBB").mkdir()
    launcher = tmp_path / "BBBB" / "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
    launcher.write_bytes(b"\x7fELF")

    gtc.prune(tmp_path)
    assert sorted(p.name for p in carried.iterdir()) == [
        "__grp___split_kernel.json",
        "_split_kernel.cubin",
        "_split_kernel.json",
    ]
    group = json.loads((carried / "__grp___split_kernel.json").read_text())["child_paths"]
    assert group == {n: str(carried / n) for n in ("_split_kernel.cubin", "_split_kernel.json")}

    kernels, modules = gtc.entries(tmp_path)
    assert kernels == {"AAAA": "_split_kernel"} and modules == {"BBBB": launcher.name}
    manifest = {"kernels": kernels, "modules": modules}
    (tmp_path / gtc.MANIFEST).write_text(json.dumps(manifest))
    gtc.mark_unread(tmp_path, manifest)
    assert all(p.stat().st_atime == 0 for p in gtc.carried_files(tmp_path, manifest))

    # There: the carried kernel read (a file system's own atime update is the device's business), one compiled anew.
    cubin = carried / "_split_kernel.cubin"
    os.utime(cubin, (time.time(), cubin.stat().st_mtime))
    _kernel(tmp_path, "CCCC", "_sample_kernel", ("cubin", "json"))
    result = gtc.report(tmp_path)
    recorded = json.loads((tmp_path / gtc.MANIFEST).read_text())["reads_recorded"]
    assert result["kernels_carried"] == 1 and result["kernels_compiled"] == 1
    assert (result["kernels_read"], result["modules_read"]) == ((1, 0) if recorded else (None, None))
    assert result["modules_carried"] == 1 and result["modules_built"] == 0
