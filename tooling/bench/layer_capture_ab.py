"""What capturing EAGLE-3's three layers costs a decode step, in one process, interleaved:

    python -m tooling.bench.layer_capture_ab [--model M] [--rounds 30]

Times the target's decode step (one new token after a 130-token context) with no capture,
with three layers captured inside the C++ stack's one call (what the engine does), and with
the stack run in segments between the captures (what it did before), as medians and minimums
over rounds of 20 steps each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.toolkit import (
    LLM,
    KVCache,
    SequenceSlice,
    build_attention_metadata,
    default_feature_layers,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--context", type=int, default=130)
    args = parser.parse_args(argv)
    llm = LLM(**({"model": args.model} if args.model else {}),
              decoder={"load_shipped_drafters": False})  # fmt: skip
    model = llm.engine.model
    arch = model.arch
    cache = KVCache(arch.num_layers, 64, 16, arch.num_kv_heads, arch.head_dim, model.dtype, "cpu")
    table, ctx = list(range(64)), args.context
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (ctx + 1,), generator=seeded)
    n = arch.num_layers
    layers = tuple(default_feature_layers(n))  # EAGLE-3's low, middle and high layer
    with torch.inference_mode():
        prefill = build_attention_metadata([SequenceSlice(0, ctx, table)], 16, arch.head_dim, "cpu")
        model(tokens[:ctx], torch.arange(ctx), cache.layers, prefill)
        meta = build_attention_metadata([SequenceSlice(ctx, 1, table)], 16, arch.head_dim, "cpu")
        ids, positions = tokens[ctx:], torch.tensor([ctx])

        def plain():
            model(ids, positions, cache.layers, meta)

        def one_call():
            model(ids, positions, cache.layers, meta, hidden_layer=layers, all_hidden=True)

        def segments():
            hidden, rope = model.embed(ids), model.rope.lookup(positions)
            kept, first = {}, 0
            for last in sorted(layers) + [n - 1]:
                model.stack.run(hidden, rope, cache.layers, meta, range(first, last + 1), None,
                                frozenset(), frozenset())  # fmt: skip
                if last in layers:
                    kept[last] = hidden.clone()
                first = last + 1
            torch.cat([kept[i] for i in layers], dim=-1)
            model.logits(hidden)

        variants = {"no capture": plain, "three layers, one call": one_call,
                    "three layers, four segments": segments}  # fmt: skip
        if model.stack is None:
            raise SystemExit("the C++ decoder stack does not run this model here")
        for f in variants.values():
            for _ in range(20):
                f()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, f in variants.items():
                start = time.perf_counter()
                for _ in range(20):
                    f()
                times[name].append((time.perf_counter() - start) / 20 * 1e3)
    for name, ms in times.items():
        print(f"{name}: median {statistics.median(ms):.3f} ms, min {min(ms):.3f} ms")


if __name__ == "__main__":
    main()
