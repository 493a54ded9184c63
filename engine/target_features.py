"""The target's hidden states a step hands to the drafters that read them.

A step runs the target once and keeps the outputs of the layers its sequences' decoders read:
the last layer for EAGLE-1/2 and the Medusa-style heads, a low, a middle and a high layer for
EAGLE-3. Each decoder takes its own layers' columns (``of``), in the order it names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TargetFeatures:
    rows: torch.Tensor  # [tokens, len(layers) * d]: the layers' outputs side by side
    layers: tuple[int, ...]  # which layer's output each block of d columns is

    def of(self, layers: tuple[int, ...]) -> torch.Tensor:
        """[tokens, len(layers) * d]: these layers' outputs, in this order."""
        if layers == self.layers:
            return self.rows
        d = self.rows.shape[1] // len(self.layers)
        starts = [self.layers.index(i) * d for i in layers]
        blocks = [self.rows[:, a : a + d] for a in starts]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


# Drafters keep the rows they are handed (``Speculator.hand_out_features``): a step with more
# rows than this hands a sequence's few rows over as a copy, since a view of them would keep
# the whole step's (a long prefill's) alive.
HELD_STEP_ROWS = 256
