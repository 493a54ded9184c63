"""EAGLE-3's fused features against EAGLE's last-layer feature on this model: held-out accuracy.

    python -m tooling.bench.eagle_fusion_ab DIR [--train 1200] [--epochs 2] [--layers 2,15]

DIR is a ``specserve train eagle`` directory (its ``answers.pt`` and ``features.pt``). The
first ``--train`` training sequences train one drafter per variant, from the same seed, with
train_eagle's unrolled training-time test (depth 3, batch 8, AdamW 1e-3, 5% feature noise,
gradients clipped at 1); each prints its held-out top-1 accuracy per depth after every epoch:

- ``eagle``: what ships, depth 1 reads the target's final-normed feature; loss = smooth L1 to
  the feature + 0.1 x distillation.
- ``eagle-ce``: the same input, distillation alone (EAGLE-3's loss).
- ``fused``: EAGLE-3 (Li et al. 2025): depth 1 reads a learned projection of the hidden states
  after ``--layers`` (each RMS-normalised) and the final feature, 3d -> d; distillation alone.

The layers' hidden states come from a teacher-forced pass over every sequence. Nothing here
ships: it measures whether fusing layers pays on the target before the engine would hand a
drafter more than one layer's states (docs/benchmarks.md, fifteenth session).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from engine.toolkit import LLM, EagleNetwork, dense_weight, rms_norm
from tooling.training.epochs import TrainingRun, train_epochs
from tooling.training.self_distillation import (
    FEATURES_FILE,
    FeatureSplit,
    padded,
    sequence_features,
)
from tooling.training.train_eagle import _batch, _losses, held_out_accuracies, unrolled_outputs
from tooling.training.train_heads import draft_vocabulary

VARIANTS = ("eagle", "eagle-ce", "fused")


class Drafter(nn.Module):
    """An EAGLE layer, and for ``fused`` the projection of the layers' states onto its input."""

    def __init__(self, variant: str, arch, num_layers: int):
        super().__init__()
        self.variant = variant
        self.network = EagleNetwork(
            arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.intermediate_size, arch.rms_norm_eps,
        )  # fmt: skip
        if variant == "fused":
            self.fuse = nn.Linear((num_layers + 1) * arch.hidden_size, arch.hidden_size, bias=False)

    def inputs(self, layers: list[torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """What depth 1 reads: [B, T, d]."""
        if self.variant != "fused":
            return features
        return self.fuse(torch.cat([*layers, features], dim=-1))


def layer_states(model, split: FeatureSplit, layers: list[int]) -> list[list[torch.Tensor]]:
    """Per layer, per sequence: [len, d] RMS-normalised hidden states after that layer."""
    unit = torch.ones(model.arch.hidden_size)
    out = []
    for layer in layers:
        started = time.perf_counter()
        states = sequence_features(model, split.sequences, layer=layer)
        out.append([rms_norm(h, unit, model.arch.rms_norm_eps).half() for h in states])
        print(f"hidden states after layer {layer}: {time.perf_counter() - started:.0f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--train", type=int, default=1200, help="training sequences used")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--layers", default="2,15", help="layers fused besides the last")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = args.variants.split(",")
    layers = [int(v) for v in args.layers.split(",")]
    llm = LLM()
    model, arch = llm.engine.model, llm.engine.model.arch
    splits = torch.load(args.dir / FEATURES_FILE, weights_only=False)
    full, held_out = splits["train"], splits["held_out"]
    n = min(args.train, len(full.sequences))
    train = FeatureSplit(full.sequences[:n], full.starts[:n], full.features[:n])
    fusing = "fused" in variants
    states = {"train": layer_states(model, train, layers) if fusing else [],
              "held_out": layer_states(model, held_out, layers) if fusing else []}  # fmt: skip
    labels = torch.cat(
        [torch.tensor(seq[a:]) for seq, a in zip(train.sequences, train.starts, strict=True)]
    )
    vocab = draft_vocabulary(labels, 4096)
    readout = dense_weight(model.lm_head)[vocab].float()

    def rope_of(shape) -> torch.Tensor:
        batch, width = shape
        return model.rope.lookup(torch.arange(width).repeat(batch))

    scratch = tempfile.mkdtemp()  # train_epochs' checkpoints, not kept
    for variant in variants:
        torch.manual_seed(0)
        drafter = Drafter(variant, arch, len(layers))
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)

        def inputs_of(split, index, features, drafter=drafter) -> torch.Tensor:
            return drafter.inputs([padded([s[i] for i in index]) for s in states[split]], features)

        def loss_of(index, drafter=drafter, variant=variant) -> torch.Tensor:
            embeddings, features, _, answer = _batch(train, index, model.embed)
            outputs = unrolled_outputs(
                drafter.network, rope_of(features.shape[:2]), embeddings,
                inputs_of("train", index, features), 3, 0.05,
            )  # fmt: skip
            return sum(_losses(outputs, features, readout, answer, variant == "eagle"))

        started = time.perf_counter()
        for epoch in range(args.epochs):  # one at a time, to read the held-out accuracy after each
            epoch_options = SimpleNamespace(
                output=scratch, resume=False, epochs=epoch + 1, batch_size=8
            )
            train_epochs(drafter, optimizer, epoch_options, n, loss_of, 1.0, TrainingRun(epoch))
            with torch.no_grad():
                accuracies = held_out_accuracies(
                    drafter.network, rope_of, held_out, model.embed, readout, vocab,
                    arch.vocab_size, 3, 1, inputs_of=lambda i, f: inputs_of("held_out", i, f),
                )  # fmt: skip
            print(f"{variant} epoch {epoch + 1} ({time.perf_counter() - started:.0f} s): held-out "
                  "top-1 at depths 1 / 2 / 3: " + " / ".join(f"{row[0]:.1%}" for row in accuracies),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
