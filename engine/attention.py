"""Attention over a paged KV cache for a flattened, variable-length batch.

Every step writes the new tokens' K/V into their cache slots, then each query attends to
its own sequence's keys. Sequences are put into *groups* that run as one padded
``scaled_dot_product_attention`` call each:

- a fresh prefill (nothing of the sequence in the cache yet) attends only to its own new
  keys with a plain causal mask, without reading the cache back;
- all short query runs (decode tokens, draft tokens to verify) share one padded group that
  gathers each sequence's keys from the cache through its block table;
- a long chunk that continues a prefill gets a group of its own, so its padding does not
  multiply the cost of the short ones.

This plain PyTorch path runs everywhere (CPU, tests) and is the reference for any faster path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.build import load_kernels
from engine.token_tree import ancestry, depths, is_chain

# Query runs up to this long share one padded group; longer ones get their own.
SHORT_QUERY_LIMIT = 32


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: what is already cached and what is new.

    The new tokens are a chain (each follows the previous), or, with ``tree_parents``, a token
    tree to verify: ``tree_parents[i]`` is the new token that token i follows (-1: it follows
    the cached tokens). New token i's K/V go to the sequence's slot ``num_cached + i`` either way;
    in a tree it sits at position ``num_cached + depth(i)`` and sees the cached tokens and its
    own ancestors only.
    """

    num_cached: int  # tokens whose K/V were in the cache before this step
    num_new: int  # tokens computed (and whose K/V are written) this step
    block_table: Sequence[int]
    tree_parents: Sequence[int] | None = None


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [b, q] rows of the flattened batch; padding repeats a row
    kv_slots: torch.Tensor | None  # [b, L] cache slots to read; None: only this step's keys
    mask: torch.Tensor | None  # [b, 1, q, L], True = attend; None: see ``causal``
    valid: torch.Tensor | None  # [b * q] non-padding results; None: all are real
    output_rows: torch.Tensor  # rows of the flattened output this group fills
    # The only group, its queries the whole batch in order (all decode, or one prefill):
    # q and the output are then reshaped, not gathered and scattered.
    whole_batch: bool = False
    # With no mask: causal over this step's keys (fresh prefill), or every key visible.
    causal: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    scale: float
    # Every group reads the cache through the C++ kernel, which computes each query row on its
    # own: a row's result then does not depend on the step (engine/batch_invariance.py).
    invariant: bool = False


def slots_for_positions(
    block_table: Sequence[int], positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Map token positions of one sequence to flat cache slots through its block table."""
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def build_attention_metadata(
    slices: Sequence[SequenceSlice],
    block_size: int,
    head_dim: int,
    device: torch.device,
    sliding_window: int | None = None,
    invariant: bool = False,
) -> AttentionMetadata:
    """Plan the attention of one step (slot writes and query groups) on the CPU.

    With ``sliding_window`` W (Mistral), a query at position p sees keys in (p - W, p].
    ``invariant``: every group reads its keys back from the cache, fresh prefills too (see
    ``AttentionMetadata.invariant``).
    """
    if _all_short_chains(slices) and load_kernels():
        attn = _chain_plan_in_cpp(slices, block_size, head_dim, device, sliding_window)
        attn.invariant = invariant
        return attn
    short, groups = [], []
    row = 0
    for s in slices:
        rows = torch.arange(row, row + s.num_new)
        # A tree always reads its keys back from the cache, with its own mask (_tree_visible).
        fresh = s.num_cached == 0 and s.num_new > 1 and s.tree_parents is None
        if fresh and not invariant:
            groups.append(_fresh_prefill_group(rows, sliding_window))
        elif s.num_new <= SHORT_QUERY_LIMIT:
            short.append((s, rows))
        else:
            groups.append(_cached_group([(s, rows)], block_size, sliding_window))
        row += s.num_new
    if short:
        groups.append(_cached_group(short, block_size, sliding_window))
    if len(groups) == 1 and groups[0].valid is None:
        g = groups[0]
        g.whole_batch = torch.equal(g.query_index.flatten(), torch.arange(row))
    slot_mapping = _new_token_slots(slices, block_size)
    groups = [_to_device(g, device) for g in groups]
    return AttentionMetadata(slot_mapping.to(device), groups, head_dim**-0.5, invariant)


def _all_short_chains(slices: Sequence[SequenceSlice]) -> bool:
    """Every slice a short chain that reads its keys back from the cache: the one padded group
    ``_cached_chains_group`` plans (decode and chain verification steps)."""
    return all(
        (s.tree_parents is None or is_chain(s.tree_parents))
        and s.num_new <= SHORT_QUERY_LIMIT
        and (s.num_cached > 0 or s.num_new == 1)
        for s in slices
    )


def _chain_plan_in_cpp(
    slices: Sequence[SequenceSlice],
    block_size: int,
    head_dim: int,
    device: torch.device,
    window: int | None,
) -> AttentionMetadata:
    """The plan of ``_cached_chains_group`` and ``_new_token_slots`` built in one C++ call
    (engine/kernels/attention_plan.cpp): the same tensors, without twenty tensor calls."""
    tables = [block for s in slices for block in s.block_table]
    plan = torch.ops.specserve.chain_attention_plan(
        [s.num_cached for s in slices],
        [s.num_new for s in slices],
        tables,
        [len(s.block_table) for s in slices],
        block_size,
        -1 if window is None else window,
    )
    slots, query_index, kv_slots, mask, valid, output_rows = plan
    group = AttentionGroup(
        query_index,
        kv_slots,
        mask if mask.numel() else None,
        valid if valid.numel() else None,
        output_rows,
        whole_batch=not valid.numel(),  # no padding: the queries are rows 0 .. T - 1 in order
    )
    return AttentionMetadata(slots.to(device), [_to_device(group, device)], head_dim**-0.5)


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, L] bool: causal, and within the sliding window when there is one."""
    seen = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        seen &= key_pos[None, :] > query_pos[:, None] - window
    return seen


def _tree_visible(s: SequenceSlice, window: int | None) -> torch.Tensor:
    """[n, num_cached + n] bool for a tree step: every cached key, plus each token's own
    ancestors among the new ones; the sliding window counts tree positions (cached + depth)."""
    n = s.num_new
    if len(s.tree_parents) != n:
        raise ValueError(f"{len(s.tree_parents)} tree parents for {n} new tokens")
    depth = torch.tensor(depths(s.tree_parents))
    cached = torch.ones(n, s.num_cached, dtype=torch.bool)
    seen = torch.cat([cached, ancestry(s.tree_parents)], 1)
    if window is not None:
        key_pos = torch.cat([torch.arange(s.num_cached), s.num_cached + depth])
        seen &= key_pos[None, :] > (s.num_cached + depth)[:, None] - window
    return seen


def _fresh_prefill_group(rows: torch.Tensor, window: int | None) -> AttentionGroup:
    """A prefill with nothing cached attends to its own new keys only."""
    n = len(rows)
    if window is None or n <= window:
        return AttentionGroup(rows[None], None, None, None, rows, causal=True)
    positions = torch.arange(n)
    mask = _visible(positions, positions, window)[None, None]
    return AttentionGroup(rows[None], None, mask, None, rows)


def _new_token_slots(slices: Sequence[SequenceSlice], block_size: int) -> torch.Tensor:
    """[T] the cache slot of every new token, slice after slice: slot ``num_cached + i`` of
    its sequence for new token i. Plain integer arithmetic, one tensor at the end: tensor
    calls per slice cost about 45 microseconds a sequence, 0.7 ms a step at 16 sequences."""
    slots = []
    for s in slices:
        table = s.block_table
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(s.num_cached, s.num_cached + s.num_new)]  # fmt: skip
    return torch.tensor(slots, dtype=torch.long)


def _cached_group(
    members: list[tuple[SequenceSlice, torch.Tensor]], block_size: int, window: int | None
) -> AttentionGroup:
    """A padded group whose queries read their keys back from the cache."""
    if all(s.tree_parents is None for s, _ in members):
        return _cached_chains_group(members, block_size, window)
    q_len = max(s.num_new for s, _ in members)
    kv_len = max(s.num_cached + s.num_new for s, _ in members)
    b = len(members)
    query_index = torch.zeros(b, q_len, dtype=torch.long)
    kv_slots = torch.zeros(b, kv_len, dtype=torch.long)
    mask = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    valid = torch.zeros(b, q_len, dtype=torch.bool)
    key_pos = torch.arange(kv_len)
    for i, (s, rows) in enumerate(members):
        n, total = s.num_new, s.num_cached + s.num_new
        query_index[i, :n] = rows
        query_index[i, n:] = rows[0]
        kv_slots[i, :total] = slots_for_positions(s.block_table, key_pos[:total], block_size)
        if s.tree_parents is None:
            query_pos = torch.arange(s.num_cached, total)
            mask[i, 0, :n] = _visible(query_pos, key_pos, window)
        else:
            mask[i, 0, :n, :total] = _tree_visible(s, window)
        mask[i, 0, n:, 0] = True  # padding rows see one key so softmax stays finite
        valid[i, :n] = True
    output_rows = torch.cat([rows for _, rows in members])
    all_valid = bool(valid.all())
    if bool(mask.all()):
        mask = None  # e.g. decode tokens of equally long sequences: SDPA's unmasked path
    return AttentionGroup(
        query_index, kv_slots, mask, None if all_valid else valid.flatten(), output_rows
    )


def _cached_chains_group(
    members: list[tuple[SequenceSlice, torch.Tensor]], block_size: int, window: int | None
) -> AttentionGroup:
    """``_cached_group`` for members that are all chains (decode and verification steps),
    built with a fixed number of tensor calls whatever the number of members. Same layout:
    padding queries repeat the member's first row and see key 0 only; padding keys read
    slot 0 and are never seen."""
    new = [s.num_new for s, _ in members]
    totals = [s.num_cached + s.num_new for s, _ in members]
    firsts = [int(rows[0]) for _, rows in members]
    q_len, kv_len = max(new), max(totals)
    query_index = torch.tensor(
        [[r + (j if j < n else 0) for j in range(q_len)] for r, n in zip(firsts, new, strict=True)]
    )
    output_rows = torch.tensor([r + j for r, n in zip(firsts, new, strict=True) for j in range(n)])
    width = max(len(s.block_table) for s, _ in members)
    tables = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table))
                           for s, _ in members])  # fmt: skip
    key_pos = torch.arange(kv_len)
    kv_slots = tables[:, (key_pos // block_size).clamp_(max=width - 1)] * block_size
    kv_slots += key_pos % block_size
    if min(totals) < kv_len:
        kv_slots.masked_fill_(key_pos >= torch.tensor(totals)[:, None], 0)
    all_valid = min(new) == q_len
    valid = None
    if q_len == 1 and min(totals) == kv_len and window is None:
        mask = None  # one query each over equally many keys: everything is seen
    else:
        query_pos = torch.tensor(
            [[t - n + j for j in range(q_len)] for t, n in zip(totals, new, strict=True)]
        )
        seen = key_pos <= query_pos[:, :, None]
        if window is not None:
            seen &= key_pos > query_pos[:, :, None] - window
        if not all_valid:
            padding = torch.tensor([[j >= n for j in range(q_len)] for n in new])
            seen.masked_fill_(padding[:, :, None], False)
            seen[:, :, 0] |= padding  # padding rows see one key so softmax stays finite
            valid = (~padding).flatten()
        mask = None if bool(seen.all()) else seen[:, None]
    return AttentionGroup(query_index, kv_slots, mask, valid, output_rows)


def _to_device(g: AttentionGroup, device: torch.device) -> AttentionGroup:
    def move(t):
        return None if t is None else t.to(device, non_blocking=True)

    return AttentionGroup(
        move(g.query_index),
        move(g.kv_slots),
        move(g.mask),
        move(g.valid),
        move(g.output_rows),
        g.whole_batch,
        g.causal,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    attn: AttentionMetadata,
    write_cache: bool = True,
    cpu_kernel: bool = False,
) -> torch.Tensor:
    """Write k/v [T, KVH, D] into the cache (unless the caller already has) and attend
    q [T, H, D]; returns [T, H, D]. ``cpu_kernel``: short query runs read the cache in place
    with the C++ kernel (float32 on the CPU, engine/kernels/paged_attention.cpp)."""
    k_cache, v_cache = kv_cache
    if write_cache:
        k_cache.index_copy_(0, attn.slot_mapping, k)
        v_cache.index_copy_(0, attn.slot_mapping, v)
    out = None if attn.groups[0].whole_batch else q.new_empty(q.shape)
    for g in attn.groups:
        short = g.query_index.shape[1] <= SHORT_QUERY_LIMIT
        if (attn.invariant or (cpu_kernel and short)) and g.kv_slots is not None:
            if out is None:
                out = q.new_empty(q.shape)
            torch.ops.specserve.cached_attention(
                q, k_cache, v_cache, g.query_index, g.kv_slots, g.mask, g.valid, attn.scale, out
            )
            continue
        qg = _group_rows(q, g)
        if g.kv_slots is None:  # a fresh prefill: its keys are exactly this step's
            kg, vg = _group_rows(k, g), _group_rows(v, g)
        else:
            slots = g.kv_slots.flatten()
            kg = k_cache.index_select(0, slots).unflatten(0, g.kv_slots.shape)
            vg = v_cache.index_select(0, slots).unflatten(0, g.kv_slots.shape)
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2),
            kg.transpose(1, 2),
            vg.transpose(1, 2),
            attn_mask=g.mask,
            is_causal=g.causal,
            scale=attn.scale,
            enable_gqa=True,
        )
        o = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
        if g.whole_batch:
            return o
        out[g.output_rows] = o if g.valid is None else o[g.valid]
    return out


def _group_rows(t: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """The group's rows of a flattened [T, ...] tensor, shaped [b, q, ...]."""
    if g.whole_batch:
        return t.unflatten(0, g.query_index.shape)
    return t[g.query_index]
