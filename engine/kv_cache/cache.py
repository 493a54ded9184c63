"""The K/V tensors themselves, sized from the config."""

from __future__ import annotations

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class KVCache:
    """Per-layer (K, V) tensors of shape [num_blocks * block_size, num_kv_heads, head_dim].

    A token's flat *slot* is ``block_id * block_size + offset``; attention writes and reads
    through slots, so the block layout is invisible to the model beyond that mapping.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch_blocks: int = 0,
    ):
        """``scratch_blocks`` more blocks follow the ``num_blocks`` that sequences get: the
        padding rows of a CUDA graph's fixed-shape step write their K/V there."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_blocks = scratch_blocks
        total = num_blocks + scratch_blocks
        shape = (num_layers, 2, total * block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]

    @property
    def scratch_slot(self) -> int | None:
        """A slot no sequence ever holds (None without scratch blocks)."""
        return self.num_blocks * self.block_size if self.scratch_blocks else None

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V of slots ``src`` into slots ``dst`` in every layer (the accepted path of a
        verified token tree moved into the sequence's consecutive slots). Overlap is safe:
        the sources are read before any destination is written."""
        self.storage[:, :, dst] = self.storage[:, :, src]
