"""The C++ decoder stack computes exactly what the Python layers compute, and runs only where
it applies (engine/models/decoder_stack.py)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch

from engine.attention import SequenceSlice, build_attention_metadata
from engine.kv_cache import KVCache
from engine.models.loader import load_model
from tests.test_gguf_model import write_pair
from tests.tiny_models import TINY_VOCAB


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_model(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"stack-{request.param}")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSERVE_CACHE_DIR", str(tmp / "cache"))
    gguf_dir, _ = write_pair(tmp, request.param)
    model, _ = load_model(gguf_dir, torch.float32, "cpu", None)
    yield model
    mp.undo()


@contextmanager
def stack_runs(model):
    """Record, per forward of ``model``, whether its decoder stack ran."""
    stack, ran = model.stack, []
    run = stack.run

    def spy(*args):
        result = run(*args)
        ran.append(result[0])
        return result

    stack.run = spy
    try:
        yield ran
    finally:
        del stack.run  # the class's method again


def run_steps(model, tokens, chunks, use_stack: bool, **options):
    """Logits and captured hidden states of each chunk fed through ``model``, and whether the
    stack ran for each (with ``use_stack=False`` the model has no stack)."""
    a = model.arch
    cache = KVCache(a.num_layers, 64, 16, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    table = list(range(63, 0, -1))
    outs, done = [], 0
    stack = model.stack
    model.stack = stack if use_stack else None
    try:
        with stack_runs(model) if use_stack else nullcontext([]) as ran, torch.inference_mode():
            for n in chunks:
                meta = build_attention_metadata(
                    [SequenceSlice(done, n, table)], 16, a.head_dim, "cpu"
                )
                ids, positions = tokens[done : done + n], torch.arange(done, done + n)
                out = model(ids, positions, cache.layers, meta, **options)
                outs.append((out.logits, out.hidden_states))
                done += n
    finally:
        model.stack = stack
    return outs, ran


def test_stack_equals_python_layers_on_decode_and_verification(gguf_model):
    assert gguf_model.stack is not None
    tokens = torch.randint(0, TINY_VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    chunks = [11, 1, 1, 5, 6]  # fresh prefill, decode, decode, verification, short chunk
    with_stack, ran = run_steps(gguf_model, tokens, chunks, use_stack=True)
    python, _ = run_steps(gguf_model, tokens, chunks, use_stack=False)
    assert ran == [False, True, True, True, True]  # a fresh prefill stays in Python
    for (got, _), (want, _) in zip(with_stack, python, strict=True):
        assert torch.equal(got, want)


def test_stack_runs_layer_skips_and_captures_hidden_states(gguf_model):
    tokens = torch.randint(0, TINY_VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    last = gguf_model.arch.num_layers - 1
    options = dict(
        layer_ids=[0, last], hidden_layer=0, skip_attention=frozenset([last]),
        skip_mlp=frozenset([0]),
    )  # fmt: skip
    with_stack, ran = run_steps(gguf_model, tokens, [12, 1, 3], use_stack=True, **options)
    python, _ = run_steps(gguf_model, tokens, [12, 1, 3], use_stack=False, **options)
    assert ran == [False, True, True]
    for (got, got_hidden), (want, want_hidden) in zip(with_stack, python, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got_hidden, want_hidden)


def test_stack_captures_several_layers_in_one_call(gguf_model):
    # EAGLE-3's features: the outputs of several layers side by side, in the order asked,
    # captured inside the one C++ call, equal to the Python layers'.
    tokens = torch.randint(0, TINY_VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    last = gguf_model.arch.num_layers - 1
    options = dict(hidden_layer=(last, 0, last), all_hidden=True)
    with_stack, ran = run_steps(gguf_model, tokens, [12, 1, 3], use_stack=True, **options)
    python, _ = run_steps(gguf_model, tokens, [12, 1, 3], use_stack=False, **options)
    assert ran == [False, True, True]  # one stack call a step, not one per captured layer
    d = gguf_model.arch.hidden_size
    for (got, got_hidden), (want, want_hidden) in zip(with_stack, python, strict=True):
        assert torch.equal(got, want)
        assert got_hidden.shape[1] == 3 * d
        assert torch.equal(got_hidden, want_hidden)
        assert torch.equal(got_hidden[:, :d], got_hidden[:, 2 * d :])


def test_a_plan_without_a_kernel_falls_back_to_python(gguf_model):
    layer = gguf_model.layers[0]
    part = layer.gate_up
    saved = part.plan
    tokens = torch.randint(0, TINY_VOCAB, (13,), generator=torch.Generator().manual_seed(5))
    try:
        part.set_plan([(1, "torch"), (1 << 62, saved[-1][1])])  # no kernel for one row
        with_stack, ran = run_steps(gguf_model, tokens, [12, 1], use_stack=True)
        assert ran == [False, False]
        part.set_plan(saved)  # the stack is rebuilt with the kernel again
        _, ran = run_steps(gguf_model, tokens, [12, 1], use_stack=True)
        assert ran == [False, True]
    finally:
        part.set_plan(saved)
