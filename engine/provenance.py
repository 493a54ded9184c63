"""Where each output token came from, for a request that asks (``return_provenance``).

- ``plain``: a step without drafts for this sequence (autoregressive decoding);
- ``accepted``: a draft token that verification accepted;
- ``resampled``: the token after a rejected draft, drawn from the target's residual
  distribution (greedy: the target's argmax where the draft differed);
- ``bonus``: the token after a run of drafts that were all accepted (a chain's last draft or a
  tree's leaf), drawn from the target.
"""

from __future__ import annotations

from collections.abc import Sequence

PLAIN, ACCEPTED, RESAMPLED, BONUS = "plain", "accepted", "resampled", "bonus"


def sources_of_run(
    num_drafts: int, path: Sequence[int], parents: Sequence[int] | None
) -> list[str]:
    """The sources of a verified run's tokens: the accepted drafts, then one more token."""
    if num_drafts == 0:
        return [PLAIN]
    if parents is None:
        complete = len(path) == num_drafts
    else:  # the accepted path ends at a leaf: nothing was left to reject below it
        last = path[-1] if path else -1
        complete = bool(path) and last not in parents
    return [ACCEPTED] * len(path) + [BONUS if complete else RESAMPLED]
