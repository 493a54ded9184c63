"""CUDA graphs for the short steps: decode and draft verification (vLLM's approach).

A 135M-parameter model on a GPU is launch-bound: one eager decode step is about 900 small
kernels, each paying PyTorch's dispatch and a launch on the host, so the GPU idles most of the
step (measured in docs/benchmarks.md). A CUDA graph records one step's kernels once and replays
them with a single launch.

A graph has fixed shapes, so a step is padded to a *bucket*: ``batch`` sequences (a power of
two) of ``queries`` new tokens each (rounded up to ``QUERY_BUCKETS``: every verification width
a decoder or the goodput policy can ask for, 1 to k + 1, has one), attending to ``keys`` cache
slots (a power of two). Padding
is harmless by construction: padding rows write their K/V into the cache's scratch slot (a
block no sequence holds), their mask lets them see one key, and their outputs are dropped. A
short sequence's real rows come first in its run of ``queries``. Every step of a bucket thus
runs the same kernels over the same buffers; only the buffers' contents change, copied in
before each replay.

Steps that do not fit a bucket (prefill chunks, long query runs, prompt-logprob rows) run
eagerly, as do CPU engines and ``enforce_eager``. The padded step itself is plain PyTorch, so
the CPU tests check that it computes exactly what the eager path does (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionGroup, AttentionMetadata
from engine.speculative_options import MAX_SPECULATIVE_TOKENS
from engine.token_tree import ancestry, depths

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Query runs per sequence: a decode token (1) and a verification of 1 + k tokens for every k a
# step may draft (the goodput policy picks any k up to the configured or requested one, and a
# tree of k drafts is as wide as a chain). Exact up to 6 (k <= 5 covers most configurations),
# then a few wider buckets whose padding costs little on a GPU. Longer runs (prefill chunks)
# run eagerly.
QUERY_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 1 + MAX_SPECULATIVE_TOKENS)
MAX_GRAPH_QUERIES = QUERY_BUCKETS[-1]
# Rows (batch x queries) of the largest graph: beyond it a step runs eagerly, as its launches
# no longer dominate it (and each graph's activations take memory).
MAX_GRAPH_ROWS = 1024
MIN_KEY_BUCKET = 128
# Beyond this many buckets, new ones run eagerly (each graph holds memory). A default engine
# drafting k = 4 with a feature-reading decoder plans 350 (5 key x 7 batch x 5 width x 2
# option buckets); unmeasured on a GPU since widths got buckets of their own (was 256).
MAX_GRAPHS = 512
# Buckets captured when the engine starts, up to this key length: capturing one mid-run stalls
# every stream for a few passes' time (longer contexts are captured when first met).
PRECAPTURE_MAX_KEYS = 2048


@dataclass(frozen=True)
class GraphKey:
    batch: int
    queries: int
    keys: int
    options: tuple  # the model options (layer subsets, hidden states) as a hashable tuple


@dataclass
class PaddedStep:
    """One step laid out at a bucket's shape, on the CPU."""

    input_ids: torch.Tensor  # [B * q]
    positions: torch.Tensor  # [B * q]
    slot_mapping: torch.Tensor  # [B * q]
    kv_slots: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, 1, q, L] bool
    real_rows: torch.Tensor  # [T]: the padded row of each real token, in the items' order


def _next_power_of_two(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _freeze(value):
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return tuple(_freeze(v) for v in items)
    return value


def _frozen(options: dict) -> tuple:
    return tuple(sorted((name, _freeze(value)) for name, value in options.items()))


def fits_a_graph(item) -> bool:
    """Whether a ``ForwardItem`` can be part of a replayed step."""
    return len(item.token_ids) <= MAX_GRAPH_QUERIES and not item.extra_logit_rows


def query_bucket(width: int) -> int | None:
    """The bucket of query runs up to ``width`` tokens (None: wider than any graph)."""
    return next((q for q in QUERY_BUCKETS if q >= width), None)


def graph_key(items: Sequence, options: dict) -> GraphKey | None:
    """The bucket of a step of ``items`` (``ForwardItem``s), or None if it runs eagerly."""
    if not items or len(items) > BATCH_BUCKETS[-1] or not all(map(fits_a_graph, items)):
        return None
    queries = query_bucket(max(len(item.token_ids) for item in items))
    keys = max(item.num_cached + len(item.token_ids) for item in items)
    batch = next(b for b in BATCH_BUCKETS if b >= len(items))
    if batch * queries > MAX_GRAPH_ROWS:
        return None
    return GraphKey(batch, queries, _next_power_of_two(keys, MIN_KEY_BUCKET), _frozen(options))


def capture_plan(max_batch: int, max_width: int, options: Sequence[dict]) -> list[GraphKey]:
    """The buckets to capture at start-up for steps of up to ``max_batch`` sequences whose
    query runs are at most ``max_width`` tokens (1: decoding only; 1 + k with drafting), with
    each set of model ``options``, keys up to PRECAPTURE_MAX_KEYS: every bucket ``graph_key``
    can give such a step there. Short contexts and small batches first, each with every
    width: what ``MAX_GRAPHS`` leaves out (captured later when met, while room is left) is
    what speculative steps need least."""
    batches = [b for b in BATCH_BUCKETS if b < max_batch] + [
        next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
    ]
    widths = [q for q in QUERY_BUCKETS if q <= (query_bucket(max_width) or MAX_GRAPH_QUERIES)]
    keys = []
    while not keys or keys[-1] < PRECAPTURE_MAX_KEYS:
        keys.append(MIN_KEY_BUCKET << len(keys))
    plan = [
        GraphKey(b, q, length, _frozen(option))
        for length in keys
        for b in batches
        for q in widths
        if b * q <= MAX_GRAPH_ROWS
        for option in options
    ]
    return plan[:MAX_GRAPHS]


def plan_padded_step(
    items: Sequence, key: GraphKey, block_size: int, scratch_slot: int
) -> PaddedStep:
    """Lay ``items`` out at ``key``'s shape (see the module docstring)."""
    b, q, length = key.batch, key.queries, key.keys
    input_ids = torch.zeros(b * q, dtype=torch.long)
    positions = torch.zeros(b * q, dtype=torch.long)
    slot_mapping = torch.full((b * q,), scratch_slot, dtype=torch.long)
    kv_slots = torch.full((b, length), scratch_slot, dtype=torch.long)
    mask = torch.zeros(b, 1, q, length, dtype=torch.bool)
    mask[..., 0] = True  # every padding row sees one key: softmax stays finite
    real_rows = []
    for i, item in enumerate(items):
        n, cached = len(item.token_ids), item.num_cached
        total = cached + n
        rows = slice(i * q, i * q + n)
        real_rows.extend(range(i * q, i * q + n))
        input_ids[rows] = torch.tensor(item.token_ids, dtype=torch.long)
        table = torch.tensor(item.block_table, dtype=torch.long)
        every = torch.arange(total)
        slots = table[every // block_size] * block_size + every % block_size
        kv_slots[i, :total] = slots
        slot_mapping[rows] = slots[cached:]
        if item.tree_parents is None:
            new_positions = torch.arange(cached, total)
            mask[i, 0, :n, :total] = every[None, :] <= new_positions[:, None]
        else:
            new_positions = cached + torch.tensor(depths(item.tree_parents))
            mask[i, 0, :n, :cached] = True
            mask[i, 0, :n, cached:total] = ancestry(item.tree_parents)
        positions[rows] = new_positions
    return PaddedStep(input_ids, positions, slot_mapping, kv_slots, mask, torch.tensor(real_rows))


def run_padded(model, kv_cache, step: PaddedStep, scale: float, options: dict):
    """The model over a padded step (tensors on the model's device): logits and hidden states
    of every padded row."""
    b, length = step.kv_slots.shape
    q = step.mask.shape[2]
    rows = torch.arange(b * q, device=step.input_ids.device)
    group = AttentionGroup(
        query_index=rows.view(b, q),
        kv_slots=step.kv_slots,
        mask=step.mask,
        valid=None,
        output_rows=rows,
        whole_batch=True,
    )
    attn = AttentionMetadata(step.slot_mapping, [group], scale)
    return model(step.input_ids, step.positions, kv_cache.layers, attn, **options)


class _Graph:
    """One bucket's captured step: its input buffers, the graph and its outputs."""

    def __init__(self, model, kv_cache, key: GraphKey, scale: float, pool, dummy: PaddedStep):
        device = model.final_norm.device
        self.inputs = PaddedStep(
            *(t.to(device) for t in (
                dummy.input_ids, dummy.positions, dummy.slot_mapping, dummy.kv_slots, dummy.mask
            )),
            real_rows=dummy.real_rows,
        )  # fmt: skip
        options = dict(key.options)
        # Warm-up off the capturing stream (cuBLAS and allocator set-up must not be recorded).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run_padded(model, kv_cache, self.inputs, scale, options)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = run_padded(model, kv_cache, self.inputs, scale, options)

    def replay(self, step: PaddedStep):
        for name in ("input_ids", "positions", "slot_mapping", "kv_slots", "mask"):
            getattr(self.inputs, name).copy_(getattr(step, name), non_blocking=True)
        self.graph.replay()
        return self.output


class CudaGraphs:
    """A runner's graphs, one per bucket: captured at start-up (``precapture``) or when a step
    first needs one."""

    def __init__(self, model, kv_cache):
        self.model = model
        self.kv_cache = kv_cache
        self.scale = model.arch.head_dim**-0.5
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, _Graph] = {}

    @staticmethod
    def usable(model, kv_cache) -> bool:
        # The padded masks are plain causal (or tree) masks: a sliding window runs eagerly.
        return (
            model.final_norm.device.type == "cuda"
            and kv_cache.scratch_slot is not None
            and model.arch.sliding_window is None
        )

    def precapture(self, plan: Sequence[GraphKey]) -> int:
        """Capture the buckets of ``plan`` (``capture_plan``; vLLM captures at start-up too).
        Returns how many graphs were captured."""
        before = len(self.graphs)
        for key in plan:
            self._graph(key)
        return len(self.graphs) - before

    def _graph(self, key: GraphKey) -> _Graph | None:
        graph = self.graphs.get(key)
        if graph is None and len(self.graphs) < MAX_GRAPHS:
            dummy = plan_padded_step([], key, self.kv_cache.block_size, self.kv_cache.scratch_slot)
            graph = _Graph(self.model, self.kv_cache, key, self.scale, self.pool, dummy)
            self.graphs[key] = graph
        return graph

    def run(self, items: Sequence, options: dict):
        """(the model's output over every padded row, the real rows) for a step that fits a
        bucket; None for one that runs eagerly."""
        key = graph_key(items, options)
        if key is None:
            return None
        graph = self._graph(key)
        if graph is None:
            return None
        step = plan_padded_step(items, key, self.kv_cache.block_size, self.kv_cache.scratch_slot)
        return graph.replay(_pinned(step)), step.real_rows


def _pinned(step: PaddedStep) -> PaddedStep:
    """Page-locked copies, so the copies into the graph's buffers do not block the host."""
    return PaddedStep(*(t.pin_memory() for t in (
        step.input_ids, step.positions, step.slot_mapping, step.kv_slots, step.mask, step.real_rows
    )))  # fmt: skip
