"""Where a trained decoder's drafter comes from: the directory it is given (ours, or a public
layout: ``public_drafters``) or the one shipped for the model; checked against the model."""

from __future__ import annotations

from pathlib import Path

from engine.decoders.drafter_files import TrainedDrafter, find_shipped_drafter, target_signature
from engine.decoders.public_drafters import find_layout


def load_drafter(path: str | None, kind: str, network_class: type, model) -> TrainedDrafter:
    """The drafter at ``path``, or the one shipped for ``model``; checked against its shape."""
    found = Path(path) if path else find_shipped_drafter(kind, model)
    if found is None:
        raise ValueError(
            f"no {kind} drafter ships for this model's shape: train one with "
            f"`specserve train {kind}` and set decoder.{kind}.drafter (or --drafter)"
        )
    if not found.is_dir():
        raise ValueError(f"{kind} drafter {found}: no such directory")
    layout = find_layout(found)
    if layout is not None:
        if layout.kind != kind:
            raise ValueError(f"{found} holds a {layout.kind} drafter ({layout.name}), not {kind}")
        return layout.load(found, model, network_class)  # checked tensor by tensor
    drafter = TrainedDrafter.load(found, kind, network_class)
    if drafter.target != target_signature(model):
        raise ValueError(
            f"{kind} drafter {found} was trained for {drafter.target}, "
            f"not this model ({target_signature(model)})"
        )
    return drafter
