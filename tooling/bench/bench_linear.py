"""Which product is fastest for the model's projection shapes on this machine.

For a model with stored (GGUF) weights: the autotuner's own measurement
(``engine.models.autotune``) of every candidate product, for every group of same-shaped
layers and every row bucket, as GB/s of stored weight bytes, and the winner the engine runs.

For dense float32 weights (``--dense``): ``F.linear`` against the ``[out, in]`` weight
(torch's default BLAS), ``x @ W_t`` against a transposed copy, and oneDNN with the weight
prepacked once (what ``engine.models.linear.Linear`` uses). Weights are cycled through enough
copies to defeat the caches, as in a real decode step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.toolkit import ONEDNN_BATCH_HINT, onednn_available


def _seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_shape(out_features: int, in_features: int, rows: int, copies: int) -> dict[str, float]:
    """GB/s of weight read per method for ``rows`` input rows."""
    weights = [torch.randn(out_features, in_features) for _ in range(copies)]
    transposed = [w.t().contiguous() for w in weights]
    x = torch.randn(rows, in_features)
    methods = {
        "F.linear [out,in]": lambda: [F.linear(x, w) for w in weights],
        "x @ W_t [in,out]": lambda: [x @ w for w in transposed],
    }
    if onednn_available(torch.device("cpu"), torch.float32):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT) for w in weights]
        methods["oneDNN prepacked"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed
        ]
    nbytes = out_features * in_features * 4 * copies
    with torch.inference_mode():
        return {name: nbytes / _seconds(fn, 5) / 1e9 for name, fn in methods.items()}


def run_stored_linear_bench(config) -> None:
    """The autotuner's measurement of every candidate on the model's stored weights."""
    from engine.toolkit import (
        ThreadGovernor,
        cpu_identity,
        load_model,
        measure_group,
        quantized_groups,
        resolve_model,
    )

    ThreadGovernor(config.num_threads)  # the thread count the engine would start with
    model, _ = load_model(resolve_model(config.model), torch.float32, "cpu", None)
    groups = quantized_groups(model)
    print(f"{cpu_identity()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not groups:
        print("the model has no stored (quantized or half) weights; try --dense")
        return
    print(
        "GB/s of stored weight bytes per product (higher is better; with many rows a pass "
        "multiplies a slice of each weight); * = the engine's choice\n"
    )
    for key, layers in groups.items():
        result = measure_group(key, layers)
        names = sorted({n for t in result.seconds.values() for n in t})
        print(f"{key}: {result.num_layers} layers, {result.weight_bytes / 1e6:.1f} MB")
        for name, why in result.rejected.items():
            print(f"  rejected {name}: {why}")
        print("| rows | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        plan = dict(result.plan()[:-1])
        for rows, times in result.seconds.items():
            winner = plan.get(rows, result.plan()[-1][1])
            cells = [
                "-"
                if n not in times
                else f"{result.pass_bytes[rows] / times[n] / 1e9:.1f}"
                + ("*" if n == winner else "")
                for n in names
            ]
            print(f"| {rows} | " + " | ".join(cells) + " |")
        print()


def run_linear_bench(
    hidden: int = 576,
    intermediate: int = 1536,
    heads: int = 9,
    kv_heads: int = 3,
    vocab: int = 49152,
) -> None:
    head_dim = hidden // heads
    shapes = {
        "qkv": (hidden + 2 * kv_heads * head_dim, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "lm_head": (vocab, hidden),
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; GB/s of weights read "
        "(higher is better)\n"
    )
    print("| shape | rows | " + " | ".join(bench_shape(8, 8, 1, 1)) + " |")
    print("|---|---|" + "---|" * len(bench_shape(8, 8, 1, 1)))
    for name, (out_f, in_f) in shapes.items():
        copies = 1 if name == "lm_head" else 30  # 30 layers' worth, as one decode step reads
        for rows in (1, 4, 16):
            result = bench_shape(out_f, in_f, rows, copies)
            cells = " | ".join(f"{v:.1f}" for v in result.values())
            print(f"| {name} {out_f}x{in_f} | {rows} | {cells} |")
