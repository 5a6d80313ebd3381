"""Device names checked against this machine before anything is loaded onto them.

torch only fails on a missing device when the first tensor lands there (`Torch not compiled with CUDA enabled`,
`invalid device ordinal`), deep in model loading; these checks say which devices exist instead.
"""

from __future__ import annotations

import torch

from .errors import DeviceError


def available_devices() -> list[str]:
    """Every device this machine can run an engine on, `cpu` first."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(_cuda_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(name: str, option: str = "device") -> str:
    """`name` as torch spells it, if this machine has that device; else `DeviceError` naming the ones it has."""
    pick = f"pick one of {', '.join(available_devices())}"
    try:
        device = torch.device(name.strip())
    except (RuntimeError, ValueError):
        raise DeviceError(f"{name}: not a device name; {pick}", option) from None
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        count = _cuda_count()
        if count == 0:
            why = "has no CUDA device" if torch.backends.cuda.is_built() else "runs a torch built without CUDA"
            raise DeviceError(f"{name}: this machine {why}; {pick}", option)
        if device.index is not None and device.index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count))
            raise DeviceError(
                f"{name}: this machine has {count} CUDA device{'s' * (count > 1)} ({have}); {pick}", option
            )
        return str(device)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"{name}: this machine has no MPS device; {pick}", option)
        return str(device)
    raise DeviceError(f"{name}: duplexd does not run on {device.type} devices; {pick}", option)


def check_devices(names: list[str], option: str = "device") -> list[str]:
    """Each device checked, and none given twice (two engines would share one device's memory)."""
    checked = [check_device(name, option) for name in names]
    for i, device in enumerate(checked):
        if device in checked[:i]:
            raise DeviceError(f"{names[i]}: given twice; one engine per device", option)
    return checked


FP8_CAPABILITY = (8, 9)  # e4m3 conversions in hardware, and Triton's fp8e4nv: Ada, Hopper and newer


def check_kv_dtype(kv_dtype: str, device: str, option: str = "kv_dtype") -> None:
    """An fp8 KV cache runs on the CPU (torch) and on CUDA devices of compute capability 8.9 and up; elsewhere a
    `DeviceError` naming the device and the way out (int8 runs everywhere)."""
    if kv_dtype != "fp8":
        return
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise DeviceError(
            f"fp8 needs the CPU or a CUDA GPU of compute capability 8.9 or newer, not {device}; use int8", option
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_CAPABILITY:
        raise DeviceError(
            f"fp8 needs compute capability 8.9 or newer; {device} ({torch.cuda.get_device_name(device)}) is "
            f"{major}.{minor}: use int8",
            option,
        )
