"""What 8-bit activations save in the products: ``python -m tooling.bench.int8_products``.

For the model's stored weights, one pass over every quantized layer (all 30 of SmolLM2's, so
the weights come from memory as in a step) at 1, 2, 3, 5, 8 and 16 rows of x: the product the
engine's autotuner chose (exact float32) against the 8-bit-activation product
(``int8_activations``), interleaved, fastest of ``--rounds``. Prints milliseconds per pass and
the ratio; the LM head is timed on its own.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.toolkit import (
    ThreadGovernor,
    cpu_identity,
    int8_isas,
    int8_packed,
    int8_unsupported,
    load_model,
    product_by_name,
    quantized_groups,
    resolve_model,
)

ROWS = (1, 2, 3, 5, 8, 16)


def _layers(model):
    """(the decoder layers' quantized products, the LM head's) that 8-bit activations take."""
    found = [
        m
        for group in quantized_groups(model).values()
        for m in group
        if int8_unsupported(m.stored) is None
    ]
    heads = [m for m in found if m is model.lm_head]
    return [m for m in found if m is not model.lm_head], heads


def _pass_seconds(layers, product_of, rows: int, rounds: int) -> dict[str, float]:
    """Fastest pass over ``layers`` per named product; ``product_of[name](layer, rows)`` is the
    product that layer runs at that row count."""
    xs = {k: torch.randn(rows, k) for k in {m.in_features for m in layers}}
    best = dict.fromkeys(product_of, float("inf"))
    for _ in range(rounds):
        for name, product in product_of.items():
            started = time.perf_counter()
            for m in layers:
                product(m, rows)(xs[m.in_features], m.stored)
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    isas = [isa for isa in int8_isas() if isa != "portable"]
    if not isas:
        print("no vector path for 8-bit activations on this CPU (the portable one is a reference)")
        return 1
    ThreadGovernor(None)
    model, _ = load_model(resolve_model(args.model), torch.float32, "cpu", None)
    layers, heads = _layers(model)
    for m in layers + heads:
        int8_packed(m.stored)  # packed at load in the engine, not inside a timed pass
    int8 = product_by_name(f"kernel-int8-{isas[0]}")
    product_of = {
        "exact (autotuned)": lambda m, rows: product_by_name(m.product_for(rows)),
        f"int8 ({isas[0]})": lambda m, rows: int8,
    }
    print(f"{cpu_identity()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{len(layers)} layer products, {sum(m.nbytes for m in layers) / 1e6:.1f} MB; LM head "
        f"{sum(m.nbytes for m in heads) / 1e6:.1f} MB; ms a pass, fastest of {args.rounds}\n"
    )
    print("| rows | layers exact | layers int8 | ratio | head exact | head int8 | ratio |")
    print("|---|---|---|---|---|---|---|")
    for rows in ROWS:
        body = _pass_seconds(layers, product_of, rows, args.rounds)
        head = _pass_seconds(heads, product_of, rows, args.rounds) if heads else {}
        e, i = body.values()
        cells = [f"{e * 1e3:.2f}", f"{i * 1e3:.2f}", f"{e / i:.2f}x"]
        if head:
            he, hi = head.values()
            cells += [f"{he * 1e3:.2f}", f"{hi * 1e3:.2f}", f"{he / hi:.2f}x"]
        else:
            cells += ["-"] * 3
        print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
