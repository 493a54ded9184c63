"""Token trees in one forward pass: each tree token sees the cached tokens and its own
ancestors, at position cached + depth, so its logits equal those of its path run as a plain
sequence; the accepted path's K/V, moved into consecutive slots, continue the sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import SequenceSlice, build_attention_metadata, paged_attention
from engine.kernels.build import load_kernels
from engine.kv_cache import KVCache
from engine.model_runner import ForwardItem, ModelRunner
from engine.models.loader import load_model
from engine.token_tree import ancestry as tree_ancestry
from engine.token_tree import depths as tree_depths
from tests.test_decoder_stack import gguf_model, stack_runs  # noqa: F401  (fixture)

# Two alternatives for the first new token (0 and 5), branches below 0, and a chain 1 -> 3 -> 6.
PARENTS = [-1, 0, 0, 1, 2, -1, 3]


def test_tree_depths_and_ancestry():
    assert tree_depths(PARENTS) == [0, 1, 1, 2, 2, 0, 3]
    seen = tree_ancestry(PARENTS)
    assert seen[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert seen[5].nonzero().flatten().tolist() == [5]
    with pytest.raises(ValueError, match="parents must come first"):
        tree_depths([-1, 2, 0])



@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_tree_attention_equals_dense_attention_over_each_path(cpu_kernel):
    if cpu_kernel and not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    cached, n = 5, len(PARENTS)
    k_cache = torch.zeros(64, kv_heads, dim)
    v_cache = torch.zeros(64, kv_heads, dim)
    table = [7, 2, 11, 5]  # 16 slots, out of order
    prefix_k, prefix_v = torch.randn(2, cached, kv_heads, dim, generator=g)
    for pos in range(cached):
        slot = table[pos // block] * block + pos % block
        k_cache[slot], v_cache[slot] = prefix_k[pos], prefix_v[pos]
    q = torch.randn(n, heads, dim, generator=g)
    k, v = torch.randn(2, n, kv_heads, dim, generator=g)
    meta = build_attention_metadata([SequenceSlice(cached, n, table, PARENTS)], block, dim, "cpu")
    out = paged_attention(q, k, v, (k_cache, v_cache), meta, cpu_kernel=cpu_kernel)
    ancestry = tree_ancestry(PARENTS)
    for i in range(n):
        path = ancestry[i].nonzero().flatten()
        keys = torch.cat([prefix_k, k[path]]).repeat_interleave(heads // kv_heads, 1)
        values = torch.cat([prefix_v, v[path]]).repeat_interleave(heads // kv_heads, 1)
        want = F.scaled_dot_product_attention(
            q[i : i + 1].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        ).transpose(0, 1)
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-5)


def path_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits after ``tokens`` run as a plain sequence on a fresh cache."""
    a = model.arch
    cache = KVCache(a.num_layers, 16, 16, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, cache, "cpu")
    return runner.run([ForwardItem(tokens, 0, list(range(16)), 1)])[0]


def check_tree_step_and_compaction(model, vocab: int):
    a = model.arch
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, vocab, (9,), generator=g).tolist()
    tree = torch.randint(0, vocab, (len(PARENTS),), generator=g).tolist()
    cache = KVCache(a.num_layers, 16, 4, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, cache, "cpu")
    table = [9, 3, 14, 0, 6, 12]  # 24 slots
    runner.run([ForwardItem(prefix, 0, table, 1)])
    logits = runner.run([ForwardItem(tree, len(prefix), table, len(tree), PARENTS)])
    ancestry = tree_ancestry(PARENTS)
    for i in range(len(tree)):
        path = [tree[j] for j in ancestry[i].nonzero().flatten().tolist()]
        torch.testing.assert_close(
            logits[i], path_logits(model, prefix + path), rtol=1e-4, atol=1e-4
        )
    # Accept the path 0 -> 1 -> 3 -> 6: move its K/V from slots cached + [0, 1, 3, 6] to
    # cached + [0, 1, 2, 3], then decode one more token after it.
    accepted = [0, 1, 3, 6]

    def slots(offsets):
        return torch.tensor(
            [table[(len(prefix) + o) // 4] * 4 + (len(prefix) + o) % 4 for o in offsets]
        )

    cache.copy_slots(slots(accepted), slots(range(len(accepted))))
    path = [tree[j] for j in accepted]
    nxt = int(torch.randint(0, vocab, (1,), generator=g))
    got = runner.run([ForwardItem([nxt], len(prefix) + len(path), table, 1)])[0]
    torch.testing.assert_close(got, path_logits(model, prefix + path + [nxt]), rtol=1e-4, atol=1e-4)


def test_tree_step_on_dense_python_layers(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, torch.float32, "cpu", None)
    assert model.stack is None  # dense weights: the Python layers
    check_tree_step_and_compaction(model, model.arch.vocab_size)


def test_tree_step_through_the_decoder_stack(gguf_model):  # noqa: F811
    assert gguf_model.stack is not None
    with stack_runs(gguf_model) as ran:
        check_tree_step_and_compaction(gguf_model, gguf_model.arch.vocab_size)
    # The prefix prefill and the fresh runs of each path stay in Python; the tree step and the
    # decode after the compaction go through the stack.
    assert ran[:2] == [False, True] and ran.count(True) == 2
