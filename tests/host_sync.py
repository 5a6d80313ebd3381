"""Find host work inside a device step without a GPU: run it on the `meta` device under `HostWork`.

On a GPU, a step that reads a value back (`.item()`, `int()`/`bool()` of a tensor, `.tolist()`, `nonzero`, a
copy to the CPU) stalls until the device catches up, and a CUDA graph cannot capture it at all; a tensor made on
the CPU inside the step is a host op and, when it feeds the device, a pageable copy. On `meta` tensors none of
this can run, so `HostWork` intercepts each such op, records it with the line of duplexd code that made it, and
answers with a stand-in value (distinct integers, True) so one run lists every offender.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]

aten = torch.ops.aten

# Ops that only describe existing memory differently; a view of a CPU staging buffer allocates nothing.
_VIEWS = {
    aten.slice.Tensor,
    aten.select.int,
    aten.view.default,
    aten.alias.default,
    aten.as_strided.default,
    aten.t.default,
    aten.transpose.int,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.detach.default,
    aten._reshape_alias.default,
    aten.permute.default,
    aten.squeeze.dim,
    aten.unbind.int,
}


@dataclass(frozen=True)
class HostOp:
    kind: str  # "sync" (the host waits for the device, or feeds it a pageable tensor) or "cpu" (a CPU tensor is made)
    op: str
    where: str  # the innermost duplexd source line that made it

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


def _from_root(path: str) -> str:
    """`path` from the repository root (duplexd/engine/kv/paged.py), or its last two parts outside it."""
    root = f"{ROOT.as_posix()}/"
    return path.removeprefix(root) if path.startswith(root) else "/".join(path.rsplit("/", 2)[-2:])


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/tests/" not in path and "/duplexd/" in path:
            return f"{_from_root(path)}:{frame.lineno} {frame.line}"
    return "?"


def _flat_tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_flat_tensors(a))
    return out


def _stand_in(t: torch.Tensor, device: str) -> torch.Tensor:
    return torch.arange(t.numel(), device=device).view(t.shape).to(t.dtype)


class HostWork(TorchDispatchMode):
    """Records every host sync and every CPU tensor created while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[HostOp] = []

    def __enter__(self):
        self._setitem = torch.Tensor.__setitem__

        def setitem(tensor: torch.Tensor, index, value) -> None:  # a function: the class calls it with the tensor
            self._check_setitem(tensor, index, value)
            self._setitem(tensor, index, value)

        torch.Tensor.__setitem__ = setitem  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.__setitem__ = self._setitem  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def _check_setitem(self, tensor: torch.Tensor, index, value) -> None:
        """`t[tensor_index] = False` on a CUDA tensor makes the value on the host and index_put copies it over (from
        pageable memory, which a graph cannot capture); on `meta` torch makes it on `meta`, so no dispatched op shows
        it: it is caught here, from the Python side."""
        parts = index if isinstance(index, tuple) else (index,)
        if (
            tensor.device.type != "cpu"
            and isinstance(value, (bool, int, float))
            and any(isinstance(part, torch.Tensor) or isinstance(part, list) for part in parts)
        ):
            self.ops.append(HostOp("sync", "t[tensor index] = Python scalar (a host value copied over)", _caller()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        if func is aten._local_scalar_dense.default and on_device:
            self.ops.append(HostOp("sync", "item / int / bool of a device tensor", _caller()))
            return True if tensors[0].dtype == torch.bool else 0
        if (
            func
            in (
                aten.nonzero.default,
                aten.masked_select.default,
                aten.unique_consecutive.default,
                aten._unique2.default,
            )
            and on_device
        ):
            self.ops.append(HostOp("sync", str(func), _caller()))
            return torch.zeros(1, tensors[0].dim(), dtype=torch.long, device=tensors[0].device)
        wants_cpu = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        if (
            func in (aten._to_copy.default, aten.copy_.default)
            and on_device
            and (wants_cpu or (func is aten.copy_.default and args[0].device.type == "cpu"))
        ):
            self.ops.append(HostOp("sync", "copy to the host", _caller()))
            return _stand_in(tensors[0], "cpu")
        if (
            func not in (aten._to_copy.default, aten.copy_.default)
            and on_device
            and any(t.device.type == "cpu" and t.dim() > 0 for t in _flat_tensors(args))
        ):  # a device op reading a host tensor copies it over first, from pageable memory
            self.ops.append(HostOp("sync", f"{func} on a host tensor", _caller()))
        out = func(*args, **kwargs)
        if func not in _VIEWS and any(
            isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in (out if isinstance(out, tuple) else (out,))
        ):
            self.ops.append(HostOp("cpu", str(func), _caller()))
        return out
