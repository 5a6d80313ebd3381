"""A Triton cache compiled here for sm_90 (H100, H200) that travels to the lent GPU machine, and its checks there.

Usage:
  python3 bench/gpu_triton_cache.py [--batches 1 2 3 ...]   # here, with network: fills .triton-sm90/
  python bench/gpu_triton_cache.py --check                  # there, first: does the cache's key match that machine?
  python bench/gpu_triton_cache.py --report                 # there, last: kernels read from the cache, compiled there

Every Triton kernel the engine launches is compiled at its first launch (graph capture of every batch bucket), which
on the lent machine spends its few minutes of device time. Here: a scratch venv (TRITON_VENV, default
/tmp/duplexd-triton36) with Python 3.12 (CACHE_PYTHON names another interpreter) and `triton==$TRITON_VERSION`
(default 3.6.0) beside duplexd's dependencies, then tests/sm90_compile.py's collection, which compiles every launch
of `LMGen.step` (at the engine's batch buckets up to 128), a PersonaPlex prefill, STT and TTS steps for sm_90 with
no GPU, into .triton-sm90/ (git-ignored). Each kernel's C launcher and Triton's driver module are built too (gcc,
against a stub libcuda.so.1), so the GPU machine compiles nothing the collection reached.

A cached kernel is found when the key Triton 3.6 hashes (runtime/cache.py `get_cache_key`) is the same there:
- `triton_key()`: Triton's version, its compiler, backend and language sources and its `libtriton.so`, which each
  Python's wheel builds apart (cp311 and cp312 differ), hence the image's Python 3.12 here;
- the kernel: its source, line number, the jit functions it calls and constexpr globals, the argument types, the
  specialisation (ints equal to 1 or divisible by 16, 16-byte-aligned pointers; on `meta` a view's `data_ptr()` is
  its byte offset, as on the GPU's aligned allocations) and constexpr values: the same repository tree there;
- the backend: the bundled ptxas's `--version` and the target's arch, 90 for an H100 and an H200 (capability 9.0:
  tests/sm90_compile.py's stand-in driver reports `GPUTarget("cuda", 90, 32)` as the real one does; sm_90a is only
  what ptxas is given); the options (num_warps, num_stages, the libdevice file's hash, the fp8 types of arch 90);
- the cache-invalidating environment variables that are set (none, checked here).
Triton's cache index (`__grp__*.json`) names each file by the absolute path it was written under, so both machines
reach the cache through LINK, a symlink to the repository's copy. Only what a cached launch reads is kept (the
cubin and its metadata, not the IR: a quarter of the size).

`--check` compares the key's parts, the target and the kernel sources with the manifest and marks every carried
file unread (atime 0); `--report` counts the carried kernels read since and those compiled there. Both print, last,
one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".triton-sm90"
LINK = Path("/tmp/duplexd-triton-sm90")  # the one absolute path both machines read and write the cache through
MANIFEST = "manifest.json"
TRITON_VERSION = os.environ.get("TRITON_VERSION", "3.6.0")  # the GPU image's
PYTHON_VERSION = "3.12"  # the GPU image's: libtriton.so, hashed into every key, differs from one Python to another
VENV = Path(os.environ.get("TRITON_VENV", f"/tmp/duplexd-triton{''.join(TRITON_VERSION.split('.')[:2])}"))
TARGET = ("cuda", 90, 32)  # what Triton's CUDA driver reports on an H100 or an H200: capability 9.0, 32-wide warps
KEPT = (".cubin", ".json")  # what a cache hit reads (compiler.py `CompiledKernel`): the binary and its metadata
LIMIT_MIB = 32  # the device tool carries 64 MiB in all, the wheels of bench/gpu_wheels.sh (~22 MiB) included


def find_python() -> str:
    """An interpreter of `PYTHON_VERSION`: CACHE_PYTHON, python3.12 on PATH, or pyenv's."""
    candidates = [os.environ.get("CACHE_PYTHON"), shutil.which(f"python{PYTHON_VERSION}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += [str(p) for p in sorted(pyenv.glob(f"{PYTHON_VERSION}.*/bin/python{PYTHON_VERSION}"), reverse=True)]
    for python in filter(None, candidates):
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True)
        if done.returncode == 0 and done.stdout.decode().strip() == PYTHON_VERSION:
            return python
    raise SystemExit(f"no Python {PYTHON_VERSION} found (CACHE_PYTHON=/path/to/python{PYTHON_VERSION})")


def running_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def key_parts(target: tuple[str, int, int]) -> dict[str, Any]:
    """Everything in a kernel's cache key that is not the kernel itself, for `target`."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.cache import triton_key

    backend = CUDABackend(GPUTarget(*target))
    return {
        "triton": triton.__version__,
        "python": running_python(),
        "target": list(target),
        "triton_key": hashlib.sha256(triton_key().encode()).hexdigest(),
        "libtriton": sha256(Path(triton.__file__).parent / "_C" / "libtriton.so"),
        "backend": backend.hash(),  # the ptxas version and the arch
        "options": backend.parse_options({}).hash(),  # default options: arch, libdevice's hash, fp8 types
        "env_vars": get_cache_invalidating_env_vars(),
    }


def kernel_sources() -> dict[str, str]:
    """sha256 of each file of duplexd/kernels: a kernel's key hashes its source and line number."""
    return {str(p.relative_to(REPO)): sha256(p) for p in sorted((REPO / "duplexd" / "kernels").glob("*.py"))}


def entries(cache: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(kernels, modules) in a cache: entry folder -> kernel name, entry folder -> the built module's file name."""
    kernels, modules = {}, {}
    for entry in sorted(p for p in cache.iterdir() if p.is_dir()):
        if groups := list(entry.glob("__grp__*.json")):
            kernels[entry.name] = groups[0].name.removeprefix("__grp__").removesuffix(".json")
        elif built := list(entry.glob("*.so")):
            modules[entry.name] = built[0].name
    return kernels, modules


def carried_files(cache: Path, manifest: dict[str, Any]) -> list[Path]:
    """The files a launch reads of each carried entry: a kernel's cubin, a module's .so."""
    files = [p for entry in manifest["kernels"] for p in (cache / entry).glob("*.cubin")]
    return files + [cache / entry / name for entry, name in manifest["modules"].items()]


def prune(cache: Path) -> None:
    """Keep of each compiled kernel what a cache hit reads (`KEPT`), its group index rewritten to match."""
    for group in cache.glob("*/__grp__*.json"):
        children = json.loads(group.read_text())["child_paths"]
        for name, path in children.items():
            if not name.endswith(KEPT):
                Path(path).unlink(missing_ok=True)
        group.write_text(json.dumps({"child_paths": {k: v for k, v in children.items() if k.endswith(KEPT)}}))


def build_modules(kernels: list[Any]) -> list[str]:
    """Build each kernel's launcher and Triton's `cuda_utils` into the cache (their key: the C source and the
    platform), linked against a stub libcuda.so.1 (TRITON_LIBCUDA_PATH, CC): loading one here fails, on the GPU
    machine the real libcuda.so.1 serves it. Returns the problems (a module that does not name libcuda.so.1 among
    its needs is removed: that machine builds its own)."""
    from triton.backends.nvidia import driver

    # One build per launcher source (`make_launcher` reads the argument types and tensor descriptors alone): a second
    # build of a source would find the first in the cache, fail to load it and build it again.
    launchers = {
        driver.make_launcher({}, k.src.signature, getattr(k.metadata, "tensordesc_meta", None)): k for k in kernels
    }
    builds = [
        driver.CudaUtils,
        *(functools.partial(driver.CudaLauncher, k.src, k.metadata) for k in launchers.values()),
    ]
    for build in builds:
        try:
            build()
        except ImportError:  # built and cached; loading it needs the real libcuda.so.1
            pass
    problems = []
    for entry, name in entries(LINK)[1].items():
        needed = subprocess.run(["readelf", "-d", str(LINK / entry / name)], capture_output=True, text=True).stdout
        if "[libcuda.so.1]" not in needed:
            problems.append(f"{name} ({entry}) does not name libcuda.so.1: removed")
            shutil.rmtree(LINK / entry)
    return problems


def compile_cache(batches: list[int]) -> int:
    """In the scratch venv: the collection into the (empty) cache, the launchers, the pruning, the manifest."""
    parts = key_parts(TARGET)
    if parts["env_vars"]:
        raise SystemExit(f"unset these first, they change every key: {parts['env_vars']}")
    from triton.runtime.jit import JITFunction

    compiled: list[Any] = []
    do_compile = JITFunction._do_compile

    def keep(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = do_compile(self, *args, **kwargs)
        if kernel is not None:
            compiled.append(kernel)
        return kernel

    JITFunction._do_compile = keep
    from tests import sm90_compile

    t0 = time.monotonic()
    report = sm90_compile.collect(tuple(batches))
    problems = [f"{v['kernel']} [{v['signature']}]: {v['error']}" for v in report["variants"] if v["error"]]
    problems += [f"never compiled: {name}" for name in report["never_compiled"]]
    problems += build_modules(compiled)
    prune(LINK)
    kernels, modules = entries(LINK)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    manifest = {
        **parts,
        "commit": commit.stdout.strip(),
        "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - t0),
        "batches": batches,
        "variants": len(report["variants"]),
        "sources": kernel_sources(),
        "kernels": kernels,
        "modules": modules,
    }
    (LINK / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    sys.stdout.write(sm90_compile.table(report) + "\n")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def build(batches: list[int]) -> int:
    """Here: the venv (created, then this script re-run in it), its packages, the cache."""
    venv_python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() != VENV.resolve():
        if not venv_python.exists():
            subprocess.run([find_python(), "-m", "venv", str(VENV)], check=True)
        os.execv(venv_python, [str(venv_python), str(Path(__file__).resolve()), "--batches", *map(str, batches)])
    if running_python() != PYTHON_VERSION:
        raise SystemExit(f"{VENV} runs Python {sys.version.split()[0]}, not {PYTHON_VERSION}: remove it")
    import tomllib

    # duplexd's own dependencies (torch, as PyPI has it for Linux, brings its CUDA libraries: a few GB once) and
    # Triton at the image's version; duplexd itself comes from the tree (PYTHONPATH), as the kernels' keys need.
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *requirements, f"triton=={TRITON_VERSION}"], check=True)

    # The launchers link against libcuda.so.1: a stub of that name here, and a compiler that records it as needed
    # although the stub defines nothing (gcc's --as-needed, this machine's default, would drop it).
    stub = VENV / "libcuda-stub"
    stub.mkdir(exist_ok=True)
    cc = ["gcc", "-Wl,--no-as-needed"]
    subprocess.run(
        [*cc, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so.1"), "-xc", "/dev/null"], check=True
    )
    (stub / "cc").write_text(f'#!/bin/sh\nexec {" ".join(cc)} "$@"\n')
    (stub / "cc").chmod(0o755)
    shutil.rmtree(CACHE, ignore_errors=True)
    CACHE.mkdir()
    if LINK.is_symlink() or LINK.is_file():
        LINK.unlink()
    shutil.rmtree(LINK, ignore_errors=True)
    LINK.symlink_to(CACHE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    env |= {
        "PYTHONPATH": str(REPO),
        "TRITON_CACHE_DIR": str(LINK),
        "TRITON_LIBCUDA_PATH": str(stub),
        "CC": str(stub / "cc"),
    }
    t0 = time.monotonic()
    rc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--compile", "--batches", *map(str, batches)], env=env
    ).returncode
    manifest = json.loads((CACHE / MANIFEST).read_text()) if (CACHE / MANIFEST).exists() else {}
    size = sum(p.stat().st_size for p in CACHE.rglob("*") if p.is_file())
    kernels, modules = len(manifest.get("kernels", ())), len(manifest.get("modules", ()))
    print(
        f"{kernels} kernels and {modules} launcher modules for sm_90, {size / 2**20:.1f} MiB in "
        f"{CACHE.relative_to(REPO)} ({time.monotonic() - t0:.0f} s)"
    )
    if size > LIMIT_MIB * 2**20:
        print(f"error: over {LIMIT_MIB} MiB: too much to carry to the GPU machine", file=sys.stderr)
        rc = rc or 1
    summary = {"bench": "gpu_triton_cache", "kernels": kernels, "modules": modules, "mib": round(size / 2**20, 1)}
    print(json.dumps(summary | {"triton": TRITON_VERSION, "rc": rc}))
    return rc


def load(cache: Path) -> dict[str, Any] | None:
    path = cache / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def check(cache: Path) -> dict[str, Any]:
    """There, before the stages: the manifest's key parts against this machine's, the kernel sources against the
    tree's; every carried file marked unread (atime 0) for `report`."""
    manifest = load(cache)
    if manifest is None:
        return {"bench": "gpu_triton_cache", "cache": None}
    print(
        f"Triton cache {cache}: {len(manifest['kernels'])} kernels, {len(manifest['modules'])} launcher modules, "
        f"Triton {manifest['triton']} (Python {manifest['python']}) for {manifest['target']}, built "
        f"{manifest['built']} at {manifest['commit']}"
    )
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
        here = key_parts((target.backend, target.arch, target.warp_size))
    except Exception as e:  # no GPU (a dry run): the key's own parts still compare
        print(f"no GPU target ({type(e).__name__}: {e}): comparing against the cache's own target")
        here = key_parts(tuple(manifest["target"]))
    differ = [
        k
        for k in ("triton", "python", "target", "triton_key", "backend", "options", "env_vars")
        if here[k] != manifest[k]
    ]
    if "triton_key" in differ and here["libtriton"] != manifest["libtriton"]:
        differ.append("libtriton")
    changed = sorted(k for k, v in kernel_sources().items() if manifest["sources"].get(k) != v)
    print(
        "key: "
        + ("matches this machine" if not differ else f"DIFFERS in {', '.join(differ)}: every kernel compiles here")
    )
    if changed:
        print(f"kernel sources changed since: {', '.join(changed)} (their kernels compile here)")
    mark_unread(cache, manifest)
    return {"bench": "gpu_triton_cache", "key_matches": not differ, "differs": differ, "sources_changed": changed}


def mark_unread(cache: Path, manifest: dict[str, Any]) -> None:
    """Every carried file's atime set to 0, so that `report` sees which ones a launch read; whether this file
    system records reads at all (relatime does when atime is not after mtime) goes into the manifest."""
    for path in carried_files(cache, manifest):
        os.utime(path, (0, path.stat().st_mtime))
    probe = cache / MANIFEST
    os.utime(probe, (0, probe.stat().st_mtime))
    probe.read_bytes()
    manifest["reads_recorded"] = probe.stat().st_atime > 0
    probe.write_text(json.dumps(manifest, indent=1) + "\n")


def report(cache: Path) -> dict[str, Any]:
    """There, after the stages: carried kernels and modules read (atime set since `check`), new ones built there."""
    manifest = load(cache)
    if manifest is None:
        return {"bench": "gpu_triton_cache", "cache": None}
    kernels, modules = entries(cache)
    new_kernels = sorted({name for entry, name in kernels.items() if entry not in manifest["kernels"]})
    read = [p for p in carried_files(cache, manifest) if p.stat().st_atime > 0]
    kernels_read = sum(p.suffix == ".cubin" for p in read)
    result = {
        "bench": "gpu_triton_cache",
        "kernels_carried": len(manifest["kernels"]),
        "kernels_read": kernels_read if manifest.get("reads_recorded") else None,
        "kernels_compiled": sum(entry not in manifest["kernels"] for entry in kernels),
        "modules_carried": len(manifest["modules"]),
        "modules_read": len(read) - kernels_read if manifest.get("reads_recorded") else None,
        "modules_built": sum(entry not in manifest["modules"] for entry in modules),
    }
    print(
        f"Triton cache: {result['kernels_read']} of {result['kernels_carried']} carried kernels read, "
        f"{result['kernels_compiled']} compiled here ({', '.join(new_kernels) or 'none'}); launcher modules: "
        f"{result['modules_read']} of {result['modules_carried']} read, {result['modules_built']} built here"
        + ("" if manifest.get("reads_recorded") else " (this file system records no reads: read counts unknown)")
    )
    return result


def main(argv: list[str]) -> int:
    sm90_batches = [1, 2, 3, 4, 8, 16, 32, 64, 128]  # the engine's buckets up to 128 (graphs.py) and an odd one
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="on the GPU machine, before the stages")
    mode.add_argument("--report", action="store_true", help="on the GPU machine, after the stages")
    mode.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # build's step in the venv
    parser.add_argument("--batches", type=int, nargs="+", default=sm90_batches, help="LMGen.step's batch sizes")
    args = parser.parse_args(argv)
    if args.compile:
        return compile_cache(args.batches)
    if args.check or args.report:
        cache = Path(os.environ.get("TRITON_CACHE_DIR", LINK))
        print(json.dumps(check(cache) if args.check else report(cache)))
        return 0
    return build(args.batches)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
