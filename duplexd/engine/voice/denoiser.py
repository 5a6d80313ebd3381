"""The speech denoiser of voice cloning: Demucs (Défossez, Synnaeve and Adi, "Real Time Speech Enhancement in the
Waveform Domain", Interspeech 2020) as Facebook's `denoiser` package trains it, the network of its `dns64` checkpoint
(`dns64-a7761ff99a7d5bb6.th`) that moshi-server's `voice.py` runs offline, the whole clip in one call.

The clip is scaled to unit deviation, padded to a length the strided convolutions divide, upsampled 4x by windowed
sinc interpolation, taken through a causal U-Net (five strided conv + 1x1 GLU encoder stages, a two-layer LSTM at
the bottom, mirrored decoder stages with skip connections), downsampled back, cut to the clip's length and
scaled back. Module names are the checkpoint's (`encoder.{i}.0`, `encoder.{i}.2`, `decoder.{i}.0`, `decoder.{i}.2`,
`lstm.lstm`), so its state dict loads as it is; the widths and depth are read from it (`dns48` is the same network,
48 wide).
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..errors import CheckpointError

SAMPLE_RATE = 16_000  # what the dns checkpoints were trained on
ZEROS = 56  # zero crossings each side of the 2x resampling kernels


def _half_sample_kernel(zeros: int = ZEROS) -> torch.Tensor:
    """[1, 1, 2 * zeros]: a Hann-windowed sinc sampled half-way between the input samples (Smith and Gossett,
    "A flexible sampling-rate conversion method", ICASSP 1984): the odd samples of a 4 * zeros + 1 window."""
    t = (torch.arange(2 * zeros, dtype=torch.float64) - zeros + 0.5) * math.pi
    window = torch.hann_window(4 * zeros + 1, periodic=False, dtype=torch.float64)[1::2]
    return (torch.sin(t) / t * window).float().view(1, 1, -1)


def upsample2(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """[..., T] → [..., 2T]: each sample followed by the interpolated value half a sample after it."""
    *lead, length = x.shape
    zeros = kernel.shape[-1] // 2
    between = F.conv1d(x.reshape(-1, 1, length), kernel, padding=zeros)[..., 1:].reshape(*lead, length)
    return torch.stack([x, between], dim=-1).reshape(*lead, 2 * length)


def downsample2(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """[..., T] → [..., ceil(T / 2)]: the even samples and the odd ones interpolated onto them, averaged."""
    if x.shape[-1] % 2:
        x = F.pad(x, (0, 1))
    even, odd = x[..., ::2], x[..., 1::2]
    *lead, length = odd.shape
    zeros = kernel.shape[-1] // 2
    between = F.conv1d(odd.reshape(-1, 1, length), kernel, padding=zeros)[..., :-1].reshape(*lead, length)
    return (even + between) * 0.5


class _Bottleneck(nn.Module):
    """The LSTM at the U-Net's bottom, as the checkpoint nests it (`lstm.lstm`)."""

    def __init__(self, dim: int, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size=dim, hidden_size=dim, num_layers=layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] → [B, C, T], causal over T."""
        out, _ = self.lstm(x.permute(2, 0, 1))
        return out.permute(1, 2, 0)


class Denoiser(nn.Module):
    """Causal Demucs: `depth` stages from `hidden` channels, each twice as wide, on a 4x-upsampled waveform."""

    sinc: torch.Tensor  # the 2x resampling kernel (a buffer, not in the checkpoint)

    def __init__(self, hidden: int = 64, depth: int = 5, kernel: int = 8, stride: int = 4, resample: int = 4) -> None:
        super().__init__()
        if resample not in (1, 2, 4):
            raise ValueError("resample must be 1, 2 or 4")
        self.hidden, self.depth, self.kernel, self.stride, self.resample = hidden, depth, kernel, stride, resample
        self.floor = 1e-3  # added to the clip's deviation before it divides
        widths = [hidden * 2**i for i in range(depth)]
        inputs = [1, *widths[:-1]]
        self.encoder = nn.ModuleList(
            nn.Sequential(nn.Conv1d(cin, w, kernel, stride), nn.ReLU(), nn.Conv1d(w, 2 * w, 1), nn.GLU(1))
            for cin, w in zip(inputs, widths, strict=True)
        )
        stages: list[nn.Module] = []
        for i, (cout, w) in enumerate(zip(inputs, widths, strict=True)):
            layers: list[nn.Module] = [nn.Conv1d(w, 2 * w, 1), nn.GLU(1), nn.ConvTranspose1d(w, cout, kernel, stride)]
            if i > 0:
                layers.append(nn.ReLU())
            stages.append(nn.Sequential(*layers))
        self.decoder = nn.ModuleList(reversed(stages))  # deepest first
        self.lstm = _Bottleneck(widths[-1])
        self.register_buffer("sinc", _half_sample_kernel(), persistent=False)
        self.requires_grad_(False)

    def padded_length(self, length: int) -> int:
        """The shortest length from `length` on that every strided stage divides exactly (none left over)."""
        n = length * self.resample
        for _ in range(self.depth):
            n = max(-((self.kernel - n) // self.stride) + 1, 1)  # ceil((n - kernel) / stride) + 1
        for _ in range(self.depth):
            n = (n - 1) * self.stride + self.kernel
        return -(-n // self.resample)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, 1, T] at 16 kHz → the speech in it [B, 1, T]."""
        deviation = wav.mean(dim=1, keepdim=True).std(dim=-1, keepdim=True)
        length = wav.shape[-1]
        x = F.pad(wav / (self.floor + deviation), (0, self.padded_length(length) - length))
        for _ in range(self.resample // 2):
            x = upsample2(x, self.sinc)
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = self.lstm(x)
        for stage in self.decoder:
            skip = skips.pop()
            x = stage(x + skip[..., : x.shape[-1]])
        for _ in range(self.resample // 2):
            x = downsample2(x, self.sinc)
        return x[..., :length] * deviation


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file or a torch file of tensors alone (the released `.th`)."""
    try:
        if path.suffix in (".safetensors", ".sft"):
            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        why = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: not a readable denoiser checkpoint ({why})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors (a Demucs checkpoint such as dns64's .th)")
    return state


def _few(keys: set[str], n: int = 4) -> str:
    listed = sorted(keys)
    return ", ".join(listed[:n]) + (f" … and {len(listed) - n} more" if len(listed) > n else "")


def load_denoiser(path: str | Path, device: torch.device | str = "cpu") -> Denoiser:
    """The denoiser in the checkpoint at `path` (its width, depth and kernel read from its tensors); every key and
    shape checked before loading, `CheckpointError` naming what does not fit."""
    path = Path(path)
    state = _read_state(path)
    first = state.get("encoder.0.0.weight")
    if first is None or first.dim() != 3 or first.shape[1] != 1:
        raise CheckpointError(f"{path}: no encoder.0.0.weight [hidden, 1, kernel]: not a Demucs denoiser checkpoint")
    if any(key.startswith("lstm.linear.") for key in state):
        raise CheckpointError(f"{path}: a non-causal (bidirectional) Demucs; voice cloning runs the causal dns64")
    depth = sum(1 for key in state if key.startswith("encoder.") and key.endswith(".0.weight"))
    hidden, kernel = int(first.shape[0]), int(first.shape[2])
    model = Denoiser(hidden=hidden, depth=depth, kernel=kernel)
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} missing denoiser key(s): {_few(missing)}")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected denoiser key(s): {_few(unexpected)}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{path}: {key} is {list(state[key].shape)}, expected {list(shape)}")
    model.load_state_dict({key: t.float() for key, t in state.items()})
    return model.to(device).eval()
