"""Constrained decoding: output held to a JSON schema, a regex, a list of choices or a grammar.

``ConstraintSpec`` is what a request asks for (picklable, checked before the request starts);
``ConstraintState`` is one sequence's matcher in the engine, which masks a row of logits given
the tokens the row follows. Sampling applies the mask to every row it processes, so the same
mask reaches the target's p and a drafter's q at every draft position and along every tree
path: rejection sampling stays lossless for the constrained distribution, and a draft that
breaks the constraint has probability zero and is rejected. The grammars run on llguidance
(docs/decoders.md says why it won over outlines-core on our machines).
"""

from engine.constraints.banned import BannedPhrasesState, normalize_phrase
from engine.constraints.spec import ConstraintSpec
from engine.constraints.state import AllConstraints, ConstraintFactory, ConstraintState

__all__ = [
    "AllConstraints",
    "BannedPhrasesState",
    "ConstraintFactory",
    "ConstraintSpec",
    "ConstraintState",
    "normalize_phrase",
]
