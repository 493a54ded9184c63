"""Time the paged-attention kernel as a decode step uses it (not a test).

    python -m tests.attention_bench --keys 101 512 [--sequences 16] [--queries 1]

Sixteen sequences (or ``--sequences``), one query each (``--queries N``: the last N positions,
causally masked, as a verification step asks), SmolLM2's heads (9 query heads over
3 KV heads of 64), the keys of each sequence in consecutive slots, and 30 layers' caches so the
keys come from memory as they do in a step. Prints the fastest of 7 rounds of 5 steps, and the
largest difference from SDPA on the gathered keys.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.kernels.build import load_kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def time_step(keys: int, sequences: int = 16, queries: int = 1) -> tuple[float, float]:
    """(seconds per step of 30 layers, max abs difference from SDPA)."""
    torch.manual_seed(0)
    slots_per_layer = sequences * 1024
    k_caches = [torch.randn(slots_per_layer, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v_caches = [torch.randn(slots_per_layer, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    q = torch.randn(sequences * queries, HEADS, HEAD_DIM)
    query_index = torch.arange(sequences * queries).view(sequences, queries)
    slots = torch.stack([torch.arange(keys) + 1024 * i for i in range(sequences)])
    # Query j of a sequence sits at position keys - queries + j and sees the keys up to it.
    positions = torch.arange(keys - queries, keys)
    seen = torch.arange(keys)[None, :] <= positions[:, None]
    mask = None if queries == 1 else seen.expand(sequences, 1, queries, keys).contiguous()
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def step():
        for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
            torch.ops.specserve.cached_attention(
                q, k_cache, v_cache, query_index, slots, mask, None, scale, out
            )

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(5):
            step()
        best = min(best, (time.perf_counter() - start) / 5)
    k, v = k_caches[-1][slots], v_caches[-1][slots]  # out holds the last layer's result
    expected = F.scaled_dot_product_attention(
        q.view(sequences, queries, HEADS, HEAD_DIM).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=seen,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)
    return best, (out.view_as(expected) - expected).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[101, 512])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--queries", type=int, default=1, help="query rows a sequence")
    args = parser.parse_args()
    if not load_kernels():
        raise SystemExit("the C++ kernels did not build on this machine")
    print(f"torch threads {torch.get_num_threads()}")
    for keys in args.keys:
        seconds, error = time_step(keys, args.sequences, args.queries)
        print(
            f"{args.sequences} x {args.queries} queries x {keys} keys: "
            f"{seconds * 1e3:.2f} ms per step of {LAYERS} layers "
            f"({seconds / LAYERS * 1e6:.0f} us per call), max diff from SDPA {error:.1e}"
        )


if __name__ == "__main__":
    main()
