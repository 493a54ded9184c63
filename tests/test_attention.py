"""Paged attention over a mixed batch equals dense causal attention per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import SequenceSlice, build_attention_metadata, paged_attention
from engine.kernels.build import load_kernels

H, KVH, BS = 4, 2, 4


def dense_reference(q, k, v, num_cached):
    """Causal attention of new queries over all keys of one sequence."""
    total = k.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(num_cached, total)[:, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


# Head dims: 64 and 128 take the kernel's register-held value sums, 8 and 48 its plain loops.
@pytest.mark.parametrize("D", [8, 48, 64, 128])
@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_mixed_batch_matches_dense_attention(cpu_kernel, D):
    if cpu_kernel and not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    # (cached, new): decode, short verify run, fresh prefill, long chunk over a cached prefix.
    check_mixed_batch([(9, 1), (5, 4), (0, 11), (6, 40), (0, 1)], D, cpu_kernel, fill=0.0)


# The kernel scores sixteen keys at a time: decode and verify runs over caches of 16n - 1, 16n,
# 16n + 1 and a hundred keys, and rows of more than 256 visible keys run in chunks combined
# afterwards (two of 129 and 128 at 257 keys, three uneven ones at 700). Slots no sequence wrote
# hold NaN: the padding of shorter sequences' key lists must never be read (NaN times a zero
# weight is still NaN).
@pytest.mark.parametrize("D", [48, 64, 128])
def test_kernel_over_long_caches_never_reads_unwritten_slots(D):
    if not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    shapes = [(31, 1), (32, 1), (33, 3), (100, 1), (97, 5), (3, 1), (256, 1), (699, 1), (254, 6)]
    check_mixed_batch(shapes, D, cpu_kernel=True, fill=float("nan"))


# Query heads per KV head: 4 and 8 fill the kernel's 64-wide value passes; 2, 3 (SmolLM2's), 5, 6
# and 7 leave a remainder that takes one narrower pass (or single heads).
@pytest.mark.parametrize(
    "heads, kv_heads", [(3, 1), (9, 3), (5, 1), (6, 1), (7, 1), (8, 2), (4, 1)]
)
def test_query_heads_sharing_a_kv_head_in_any_number(heads, kv_heads):
    if not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    check_mixed_batch(
        [(9, 1), (5, 4), (31, 1), (3, 2)], 64, True, fill=0.0, heads=(heads, kv_heads)
    )


def check_mixed_batch(shapes, D, cpu_kernel, fill, heads=(H, KVH)):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(0)
    num_blocks = max(96, 1 + sum(-(-(cached + new) // BS) for cached, new in shapes))
    k_cache = torch.full((num_blocks * BS, num_kv_heads, D), fill)
    v_cache = torch.full((num_blocks * BS, num_kv_heads, D), fill)
    # Block 0 stays unused: padded key lists point at slot 0, which then holds `fill`.
    free = [b for b in torch.randperm(num_blocks, generator=g).tolist() if b != 0]
    slices, full_k, full_v, queries = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BS))]
        k = torch.randn(total, num_kv_heads, D, generator=g)
        v = torch.randn(total, num_kv_heads, D, generator=g)
        for pos in range(cached):  # what earlier steps left in the cache
            slot = table[pos // BS] * BS + pos % BS
            k_cache[slot], v_cache[slot] = k[pos], v[pos]
        slices.append(SequenceSlice(cached, new, table))
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(new, num_heads, D, generator=g))
    meta = build_attention_metadata(slices, BS, D, "cpu")
    new_k = torch.cat([k[s.num_cached :] for k, s in zip(full_k, slices, strict=True)])
    new_v = torch.cat([v[s.num_cached :] for v, s in zip(full_v, slices, strict=True)])
    out = paged_attention(
        torch.cat(queries), new_k, new_v, (k_cache, v_cache), meta, cpu_kernel=cpu_kernel
    )
    row = 0
    for q, k, v, s in zip(queries, full_k, full_v, slices, strict=True):
        expected = dense_reference(q, k, v, s.num_cached)
        torch.testing.assert_close(out[row : row + s.num_new], expected, rtol=1e-5, atol=1e-5)
        row += s.num_new
    # Every new token's K landed in its slot.
    assert torch.equal(k_cache[meta.slot_mapping], new_k)


@pytest.mark.parametrize("window", [None, 6])
def test_chain_groups_equal_the_same_runs_given_as_trees(window):
    """Short chains get their group built for the whole batch at once; the per-sequence
    builder that trees take must agree with it on chains written as trees (each token's parent
    the token before): same queries, key slots, mask, padding and output rows."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        shapes = [
            (
                int(torch.randint(1, 40, (1,), generator=g)),
                int(torch.randint(1, 6, (1,), generator=g)),
            )
            for _ in range(int(torch.randint(1, 7, (1,), generator=g)))
        ]
        if trial == 0:
            shapes = [(12, 1), (12, 1)]  # equal decode rows: no mask at all
        chains, trees, base = [], [], 100
        for cached, new in shapes:
            table = list(range(base, base + -(-(cached + new) // BS) + 1))  # one spare block
            base += len(table)
            chains.append(SequenceSlice(cached, new, table))
            trees.append(SequenceSlice(cached, new, table, list(range(-1, new - 1))))
        got = build_attention_metadata(chains, BS, 8, "cpu", window)
        want = build_attention_metadata(trees, BS, 8, "cpu", window)
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        (a,), (b,) = got.groups, want.groups
        assert torch.equal(a.query_index, b.query_index) and torch.equal(a.kv_slots, b.kv_slots)
        assert torch.equal(a.output_rows, b.output_rows) and a.whole_batch == b.whole_batch

        assert torch.equal(_dense_mask(a), _dense_mask(b))
        assert (a.valid is None) == (b.valid is None)
        assert a.valid is None or torch.equal(a.valid, b.valid)
        if trial == 0 and window is None:
            assert a.mask is None


def _dense_mask(group) -> torch.Tensor:
    """The group's mask, all True where it has none."""
    b, q = group.query_index.shape
    shape = (b, 1, q, group.kv_slots.shape[1])
    return torch.ones(shape, dtype=torch.bool) if group.mask is None else group.mask


@pytest.mark.parametrize("window", [None, 3, 6, 1000])
def test_chain_plan_in_cpp_equals_the_python_plan(window, monkeypatch):
    """Decode and verification steps get their plan from one C++ call; it must build exactly
    the tensors of the Python chain builder (which runs where there are no kernels),
    including which of mask and valid are left out."""
    if not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    import engine.attention as attention

    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        shapes = [
            (
                int(torch.randint(0 if trial % 3 == 0 else 1, 40, (1,), generator=g)),
                int(torch.randint(1, 6, (1,), generator=g)),
            )
            for _ in range(int(torch.randint(1, 7, (1,), generator=g)))
        ]
        shapes = [(c, 1 if c == 0 else n) for c, n in shapes]  # nothing cached: a first token
        if trial == 0:
            shapes = [(12, 1), (12, 1)]  # equal decode rows: no mask, no padding
        if trial == 1:
            shapes = [(0, 1)]
        slices, base = [], 100
        for cached, new in shapes:
            table = list(range(base, base + -(-(cached + new) // BS) + 2))  # spare blocks
            base += len(table)
            slices.append(SequenceSlice(cached, new, table[::-1]))  # blocks in any order
        got = build_attention_metadata(slices, BS, 8, "cpu", window)
        with monkeypatch.context() as m:
            m.setattr(attention, "load_kernels", lambda: False)
            want = build_attention_metadata(slices, BS, 8, "cpu", window)
        assert torch.equal(got.slot_mapping, want.slot_mapping) and got.scale == want.scale
        (a,), (b,) = got.groups, want.groups
        for field in ("query_index", "kv_slots", "mask", "valid", "output_rows"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), (field, shapes)
            assert x is None or (x.dtype == y.dtype and torch.equal(x, y)), (field, shapes)
        assert (a.whole_batch, a.causal) == (b.whole_batch, b.causal), shapes


def test_chain_plan_in_cpp_refuses_a_short_block_table():
    if not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    with pytest.raises(RuntimeError, match="block table too short"):
        build_attention_metadata([SequenceSlice(8, 2, [3, 4])], BS, 8, "cpu")
