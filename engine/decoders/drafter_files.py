"""Trained drafters on disk, and what every trained drafter reads out through.

A drafter directory (``specserve train KIND`` writes one) holds ``config.json`` (its kind, the
network's shape, held-out accuracies, the target's shape, how it was trained) and
``drafter.safetensors`` (the network's weights in float16 and the draft vocabulary). Drafters
trained for the shipped model(s) live in ``engine/drafters/<model>/<kind>`` and are found by the
target's shape.

The readout is the target's own LM head cut to the draft vocabulary (the tokens the target
writes most: the full head is a fifth of SmolLM2's weights, and reading its 49152 rows per draft
would cost a quarter of a target step), int8 in the kernels' layout where the target runs the
C++ kernels. A drafter's numerics only decide how often it is right, never the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.draft_copies import dense_weight, quantized_dense
from engine.models.linear import Linear

CONFIG_FILE, WEIGHTS_FILE = "config.json", "drafter.safetensors"
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


@dataclass
class TrainedDrafter:
    """A trained drafter: its network, draft vocabulary, and what it was trained for. The
    network's ``shape`` (a dict of its constructor's arguments) rebuilds it on load."""

    kind: str  # "medusa", "hydra" or "eagle"
    network: nn.Module
    draft_vocab: torch.Tensor  # [V'] int64: token id of each readout row
    # Held-out: [head or depth][i] P(the i-th candidate is the token).
    accuracies: list[list[float]]
    target: dict  # hidden_size, vocab_size, num_layers of the model it was trained on
    info: dict  # how it was trained (command, data, time), for the record

    def save(self, directory: str | Path) -> None:

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"network.{name}": value.detach().to(torch.float16).contiguous()
            for name, value in self.network.state_dict().items()
        }
        tensors["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        save_file(tensors, str(directory / WEIGHTS_FILE))
        config = {
            "type": self.kind,
            "shape": self.network.shape,
            "draft_vocab_size": len(self.draft_vocab),
            "accuracies": self.accuracies,
            "target": self.target,
            "training": self.info,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, kind: str, network_class: type) -> TrainedDrafter:

        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{directory} is not a drafter directory (no {CONFIG_FILE})")
        config = json.loads(config_path.read_text())
        if config.get("type") != kind:
            raise ValueError(f"{directory} holds a {config.get('type')!r} drafter, not {kind}")
        tensors = load_file(str(directory / WEIGHTS_FILE))
        network = network_class(**config["shape"])
        state = {
            name.removeprefix("network."): value.float()
            for name, value in tensors.items()
            if name.startswith("network.")
        }
        network.load_state_dict(state)
        return cls(
            kind,
            network.eval(),
            tensors["draft_vocab"],
            config["accuracies"],
            config["target"],
            config.get("training", {}),
        )


def target_signature(model) -> dict:
    arch = model.arch
    return {
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "num_layers": arch.num_layers,
    }


def find_shipped_drafter(kind: str, model) -> Path | None:
    """The shipped drafter of ``kind`` trained on a model of ``model``'s shape, if any."""
    wanted = target_signature(model)
    for config in sorted(SHIPPED_DRAFTERS.glob(f"*/{kind}/{CONFIG_FILE}")):
        if json.loads(config.read_text()).get("target") == wanted:
            return config.parent
    return None


def drafter_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, model
) -> nn.Module:
    """A trained drafter's own projection as the engine runs it, on the model's device and in
    its dtype: int8 or int4 in the kernels' layout (``quantization``; drafts only set the
    speed) or unquantized (``none``)."""
    device, dtype = model.final_norm.device, model.dtype
    weight = weight.detach().to(device=device, dtype=dtype)
    bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
    if quantization in ("int8", "int4"):
        return quantized_dense(weight, bias, quantization, model)
    return Linear(weight, bias, pack=True)


def build_readout(model, draft_vocab: torch.Tensor, quantization: str = "int8") -> nn.Module:
    """The target's LM head rows of the draft vocabulary, int8 (int4 where the drafter runs
    at int4)."""

    rows = dense_weight(model.lm_head)[draft_vocab.to(model.final_norm.device)]
    if rows.device.type != "cpu":
        # On a GPU, bfloat16 rows run on the tensor cores; int8 would be dequantized per call.
        return quantized_dense(rows, None, "bfloat16", model)
    return quantized_dense(rows, None, "int4" if quantization == "int4" else "int8", model)
