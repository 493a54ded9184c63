"""Constrained decoding: output held to a JSON schema, a regex, a list of choices or a grammar.

``ConstraintSpec`` is what a request asks for (picklable, checked before the request starts);
``ConstraintState`` is one sequence's matcher in the engine, which masks a row of logits given
the tokens the row follows. Sampling applies the mask to every row it processes, so the same
mask reaches the target's p and a drafter's q at every draft position and along every tree
path: rejection sampling stays lossless for the constrained distribution, and a draft that
breaks the constraint has probability zero and is rejected. The grammars run on llguidance
(docs/decoders.md says why it won over outlines-core on our machines).

Exports resolve lazily: the API process checks specs and builds the vocabulary without
importing torch, which only the matchers need.
"""

from engine.lazy_exports import lazy_exports

_EXPORTS = {
    "AllConstraints": "engine.constraints.state",
    "BannedPhrasesState": "engine.constraints.banned",
    "ConstraintFactory": "engine.constraints.state",
    "ConstraintSpec": "engine.constraints.spec",
    "ConstraintState": "engine.constraints.state",
    "ConstraintVocabulary": "engine.constraints.vocabulary",
    "normalize_phrase": "engine.constraints.banned",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("engine.constraints", _EXPORTS)
