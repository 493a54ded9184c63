"""What every public drafter layout reads and writes with: the layout's table entry, its
config and tensors, and the shape check whose refusal names the tensor and both shapes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.decoders.drafter_files import CONFIG_FILE, TrainedDrafter

TOP_K = 4
ACCURACIES_KEY = "specserve_accuracies"  # an extra config key: held-out accuracies, if ours


def prior_accuracies(num_heads: int) -> list[list[float]]:
    return [[0.6 * 0.6**h * 0.5**i for i in range(TOP_K)] for h in range(num_heads)]


@dataclass(frozen=True)
class Layout:
    """One public layout: ``matches(directory)``, ``load(directory, model, network_class)``
    -> our drafter (the decoder names its network class), ``save(drafter, model, directory)``."""

    name: str
    kind: str  # the decoder it drafts for
    matches: Callable[[Path], bool]
    load: Callable[[Path, object, type], TrainedDrafter]
    save: Callable[[TrainedDrafter, object, Path], None] | None


def config_of(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k.removeprefix("medusa_head."): v for k, v in state.items()}


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple, source: Path) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{source}: tensor {name} has shape {list(tensor.shape)}, this model needs "
            f"{list(shape)}"
        )


def has_key(path: Path, key: str) -> bool:

    with safe_open(str(path), "pt") as f:
        return key in f.keys()
