"""Does the engine accept what the drafter's offline scoring promises? EAGLE-3, one draft a step.

    python -m tooling.bench.acceptance_check [--data DIR] [--conversations 40] [--drafter DIR]

On the first turns of ``--conversations`` greedy answers of a ``specserve train data`` set's
held-out split (spread over it), this prints

1. offline: the drafter's top-1 at every answer position (depth 1, the target's own layer
   outputs, as ``train evaluate`` scores it), and the acceptance a one-draft decoder would get
   walking the answer with those predictions (a right draft is taken with the target's next
   token, so the position after it is not drafted; a wrong one is replaced);
2. the engine: eagle3 with one draft a step (``eagle3-k1``) generating the same answers
   greedily from the same prompts, its acceptance, and whether its answers are the stored ones.

Equal acceptances say the engine hands the drafter what it learnt from; a gap between the
walk and the engine would be a mismatch in the engine (features, positions, caches), a gap
between this set and the bench's prompts is the prompts' (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def _first_turns(split, count: int):
    from tooling.training.self_distillation import FeatureSplit

    greedy = [i for i, t in enumerate(split.temperatures or []) if t == 0]
    if not greedy:
        raise ValueError("the held-out split has no greedy answers")
    pick = greedy[:: max(1, len(greedy) // count)][:count]
    sequences, starts, features, spans = [], [], [], []
    for i in pick:
        a, b = split.spans[i][0]
        sequences.append(list(split.sequences[i][:b]))
        starts.append(a)
        features.append(split.features[i][:b])
        spans.append([(a, b)])
    return FeatureSplit(sequences, starts, features, spans, temperatures=[0.0] * len(pick))


def offline(llm, turns, drafter_dir: str | None) -> tuple[float, float]:
    """(top-1 over answer positions, a one-draft walk's acceptance)."""
    from engine.toolkit import Eagle3Network, load_drafter
    from tooling.training.self_distillation import padded
    from tooling.training.train_eagle import _batch, padded_rope, unrolled_outputs
    from tooling.training.train_eagle3 import layer_features

    model = llm.engine.model
    drafter = load_drafter(drafter_dir, "eagle3", Eagle3Network, model)
    network, vocab = drafter.network.float(), drafter.draft_vocab
    layers = tuple(network.shape["feature_layers"])
    inputs = layer_features(model, turns, layers, "held-out first turns")
    to_row = torch.full((model.arch.vocab_size,), -2, dtype=torch.long)
    to_row[vocab] = torch.arange(len(vocab))
    rope_of = padded_rope(model)
    hits = positions = drafts = accepted = 0
    with torch.no_grad():
        for j in range(len(turns.sequences)):
            embeddings, features, following, answer = _batch(turns, [j], model.embed)
            reads = network.fuse(padded([inputs[j]]).float())
            out = unrolled_outputs(network, rope_of(features.shape[:2]), embeddings, reads, 1)[0]
            right = (network.logits(out[0]).argmax(-1) == to_row[following[0].clamp_min(0)])
            right = right[answer[0]].tolist()
            hits, positions = hits + sum(right), positions + len(right)
            p = 0
            while p < len(right):
                drafts += 1
                accepted += right[p]
                p += 2 if right[p] else 1
    return hits / max(1, positions), accepted / max(1, drafts)


def engine_acceptance(llm, turns, drafter_dir: str | None) -> tuple[float, int]:
    """(eagle3-k1's acceptance, answers identical to the stored ones)."""
    from engine.toolkit import SamplingParams, SpecDecodeStats

    settings = llm.config.decoder.model_dump()
    settings.update(method="eagle3", num_speculative_tokens=1, draft_policy="fixed",
                    load_shipped_drafters=False)  # fmt: skip
    settings["eagle3"]["drafter"] = drafter_dir  # None: the shipped one
    decoder = type(llm.config.decoder).model_validate(settings)
    speculator = llm.engine.build_speculator(decoder)
    llm.engine.use_speculator(speculator)
    speculator.stats = SpecDecodeStats()
    same = 0
    for tokens, start in zip(turns.sequences, turns.starts, strict=True):
        stored = tokens[start:]
        params = SamplingParams(temperature=0, max_tokens=len(stored))
        same += llm.generate([tokens[:start]], params)[0].token_ids == stored
    llm.engine.use_speculator(None)
    return speculator.stats.acceptance_rate, same


def main(argv: list[str] | None = None) -> None:
    from engine.toolkit import LLM, EngineConfig, cpu_identity
    from tooling.training.shards import load_split

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(
        Path.home() / ".cache/specserve/training-data/smollm2-135m-instruct"))  # fmt: skip
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--drafter", help="EAGLE-3 drafter directory (default: the shipped one)")
    args = parser.parse_args(argv)
    turns = _first_turns(load_split(Path(args.data) / "held_out"), args.conversations)
    plain = {"method": "autoregressive", "extra_methods": []}
    llm = LLM(config=EngineConfig().with_overrides(decoder=plain))
    top1, walk = offline(llm, turns, args.drafter)
    rate, same = engine_acceptance(llm, turns, args.drafter)
    n = len(turns.sequences)
    print(f"{cpu_identity()}; {n} greedy held-out first turns of {args.data}")
    print(f"offline: top-1 {top1:.1%} of answer positions; a one-draft walk accepts {walk:.1%}")
    print(f"engine (eagle3-k1): acceptance {rate:.1%}; {same} of {n} answers as stored")


if __name__ == "__main__":
    main()
