"""The target's hidden states a step hands to the drafters that read them.

A step runs the target once and keeps the outputs of the layers its sequences' decoders read:
the last layer for EAGLE-1/2 and the Medusa-style heads, a low, a middle and a high layer for
EAGLE-3. Each decoder takes its own layers' columns (``of``), in the order it names them.

A step's hidden states are new tensors that nothing writes again, so a drafter may keep a
decode row as it is rather than copy it (``held``): under the goodput policy most steps do not
draft, and the copies were a third of what a plain step spent handing features over.
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


# A kept row of a step with more rows than this is copied: holding a view of one row of a long
# prefill would keep all of that step's rows alive.
HELD_STEP_ROWS = 256


def held(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (of one step's hidden states) to keep past the step: as they are when the
    step's tensor is small, else a copy of their own."""
    limit = HELD_STEP_ROWS * rows.shape[-1] * rows.element_size()
    return rows if rows.untyped_storage().nbytes() <= limit else rows.clone()
