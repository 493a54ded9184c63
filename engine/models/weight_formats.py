"""Stored weight formats: one table entry per format, in the spirit of ggml's type traits.

Each GGUF format is described once (``FORMATS``): its block size and bytes per block, and how
its blocks become a ``StoredWeight`` — integer codes plus per-block scales (and mins) that the
product kernels read directly, so weights stay at (about) their stored size in memory:

| format | codes                  | scale, min per block   | bytes/weight at rest (stored) |
|--------|------------------------|------------------------|-------------------------------|
| Q4_0   | 4-bit, blocks of 32    | float16 d, -8d         | 0.625 (0.5625)                |
| Q4_1   | 4-bit, blocks of 32    | float16 d, m           | 0.625 (0.625)                 |
| Q4_K   | 4-bit, blocks of 32    | float32 d*sc, -dmin*m  | 0.75  (0.5625)                |
| Q5_K   | 8-bit, blocks of 32    | float32 d*sc, -dmin*m  | 1.25  (0.6875)                |
| Q6_K   | 8-bit, blocks of 16    | float32 d*sc           | 1.25  (0.8203)                |
| Q8_0   | 8-bit, blocks of 32    | float16 d              | 1.0625 (1.0625)               |
| F16, BF16 | the half words      | -                      | 2                             |

The K-quants' 6-bit sub-block scales are multiplied out once at load (exactly: the products
fit in float32's mantissa), which costs some bytes but lets three code layouts serve every
format. Every weight dequantizes to exactly the value gguf-py (and so transformers) computes.
F32 tensors stay dense float32 and use ``engine.models.linear.Linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StoredWeight:
    """An [out_features, in_features] weight in a kernel layout (see the module table)."""

    format: str  # the GGUF format it came from, e.g. "Q4_1"
    codes: torch.Tensor  # uint8 [N, K/2] (4-bit), int8 [N, K] (8-bit), float16/bfloat16 [N, K]
    scales: torch.Tensor  # [N, K / block] float16 or float32; empty for half formats
    mins: torch.Tensor  # like scales, or empty (no min)

    @property
    def shape(self) -> tuple[int, int]:
        k = self.codes.shape[1] * (2 if self.codes.dtype == torch.uint8 else 1)
        return self.codes.shape[0], k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))

    @property
    def layout(self) -> str:
        """What the kernels see: code type (8-bit codes with their block size), scale type,
        min or not (formats may share one)."""
        codes = str(self.codes.dtype).replace("torch.", "")
        if self.codes.dtype == torch.int8:
            codes += f"x{self.shape[1] // self.scales.shape[1]}"
        mins = "min" if self.mins.numel() else "nomin"
        return f"{codes}-{self.scales.dtype}-{mins}".replace("torch.", "")

    def to(self, device: torch.device | str) -> StoredWeight:
        if self.codes.device == torch.device(device):
            return self
        return StoredWeight(
            self.format, self.codes.to(device), self.scales.to(device), self.mins.to(device)
        )

    def select_rows(self, rows: torch.Tensor) -> StoredWeight:
        def pick(t):
            return t.index_select(0, rows) if t.numel() else t

        return StoredWeight(self.format, pick(self.codes), pick(self.scales), pick(self.mins))


def cat_rows(parts: list[StoredWeight]) -> StoredWeight | None:
    """Stack weights along the output dimension (fused q/k/v, gate/up); None if layouts differ."""
    if len({p.layout for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        return None
    if len(parts) == 1:
        return parts[0]  # no copy: a tied LM head shares the embedding's storage

    def cat(ts):
        return torch.cat(ts) if ts[0].numel() else ts[0]

    fmt = "+".join(dict.fromkeys(p.format for p in parts))
    return StoredWeight(
        fmt,
        torch.cat([p.codes for p in parts]),
        cat([p.scales for p in parts]),
        cat([p.mins for p in parts]),
    )


def dequantize_torch(w: StoredWeight) -> torch.Tensor:
    """Float32 [N, K] in plain PyTorch: the fallback product and the kernels' reference."""
    n, k = w.shape
    if w.codes.dtype in (torch.float16, torch.bfloat16):
        return w.codes.float()
    if w.codes.dtype == torch.uint8:
        packed = w.codes.reshape(n, -1, 16)
        codes = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [N, blocks, 32]
    else:  # 8-bit codes in blocks of 16 or 32: as many blocks as scales
        codes = w.codes.reshape(n, w.scales.shape[1], -1).float()
    out = codes * w.scales.float()[..., None]  # exact: scale * code fits float32
    if w.mins.numel():
        out = out + w.mins.float()[..., None]
    return out.reshape(n, k)


# ------------------------------------------------------------------------ GGUF block readers


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes 0..15 -> [..., 16] bytes: low nibble = code j, high = code j + 16."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def _weight(fmt, codes, scales, mins=None) -> StoredWeight:
    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a))

    empty = torch.empty(0, dtype=torch.float16 if scales.dtype == np.float16 else torch.float32)
    return StoredWeight(fmt, tensor(codes), tensor(scales), empty if mins is None else tensor(mins))


def _q4_0(b: np.ndarray, n: int) -> StoredWeight:
    d = b[:, :2].copy().view(np.float16)  # [blocks, 1]
    return _weight("Q4_0", b[:, 2:].reshape(n, -1), d.reshape(n, -1), (-8 * d).reshape(n, -1))


def _q4_1(b: np.ndarray, n: int) -> StoredWeight:
    d, m = b[:, :2].copy().view(np.float16), b[:, 2:4].copy().view(np.float16)
    return _weight("Q4_1", b[:, 4:].reshape(n, -1), d.reshape(n, -1), m.reshape(n, -1))


def _q8_0(b: np.ndarray, n: int) -> StoredWeight:
    d = b[:, :2].copy().view(np.float16)
    return _weight("Q8_0", b[:, 2:].view(np.int8).reshape(n, -1), d.reshape(n, -1))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs packed in a K-quant super-block's 12 bytes."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_header(b: np.ndarray):
    """d, dmin, scale per sub-block (d * sc) and min per sub-block (-dmin * m) of Q4_K/Q5_K."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc).astype(np.float32), (-(dmin * mn)).astype(np.float32)


def _q4_k(b: np.ndarray, n: int) -> StoredWeight:
    scale, minimum = _k_header(b)  # [blocks, 8]
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8, 32)  # sub-block 2j: low nibbles, 2j + 1: high
    return _weight(
        "Q4_K", _pack_nibbles(codes).reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1)
    )  # noqa: E501


def _q5_k(b: np.ndarray, n: int) -> StoredWeight:
    scale, minimum = _k_header(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
    codes = (low.reshape(-1, 8, 32) | (high << 4)).astype(np.int8)
    return _weight("Q5_K", codes.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1))


def _q6_k(b: np.ndarray, n: int) -> StoredWeight:
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    scale = (d * sc.view(np.int8).astype(np.float32)).astype(np.float32)  # [blocks, 16]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
    return _weight("Q6_K", codes.astype(np.int8).reshape(n, -1), scale.reshape(n, -1))


def _half(np_dtype, torch_dtype) -> Callable[[np.ndarray, int], StoredWeight]:
    def read(raw: np.ndarray, n: int) -> StoredWeight:
        codes = torch.from_numpy(np.ascontiguousarray(raw).view(np_dtype).reshape(n, -1).copy())
        codes = codes.view(torch_dtype)
        return StoredWeight(torch_dtype.__repr__(), codes, torch.empty(0), torch.empty(0))

    return read


@dataclass(frozen=True)
class WeightFormat:
    name: str
    block_weights: int  # weights per stored block
    block_bytes: int  # bytes per stored block
    read: Callable[[np.ndarray, int], StoredWeight]  # (blocks [count, block_bytes], rows)


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in [
        WeightFormat("Q4_0", 32, 18, _q4_0),
        WeightFormat("Q4_1", 32, 20, _q4_1),
        WeightFormat("Q8_0", 32, 34, _q8_0),
        WeightFormat("Q4_K", 256, 144, _q4_k),
        WeightFormat("Q5_K", 256, 176, _q5_k),
        WeightFormat("Q6_K", 256, 210, _q6_k),
        WeightFormat("F16", 1, 2, _half(np.float16, torch.float16)),
        WeightFormat("BF16", 1, 2, _half(np.uint16, torch.bfloat16)),
    ]
}


def read_stored(format_name: str, raw: np.ndarray, rows: int) -> StoredWeight:
    """A GGUF tensor's raw bytes (any shape, ``rows`` output rows) as a ``StoredWeight``."""
    fmt = FORMATS.get(format_name)
    if fmt is None:
        raise ValueError(f"GGUF weight format {format_name} is not supported: {sorted(FORMATS)}")
    blocks = np.ascontiguousarray(raw).reshape(-1, fmt.block_bytes)
    w = fmt.read(blocks, rows)
    w.format = format_name
    return w
