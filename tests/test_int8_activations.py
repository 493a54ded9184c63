"""8-bit activations (``int8_activations``): the integer-dot-product kernel computes what its
definition says (activations rounded per block of 32, then an exact product), the vector and
portable paths agree bit for bit, every row is computed alone, unsupported weights keep the
exact products, and speculative decoding under these numerics equals plain decoding under
them, logprobs included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.batch_invariance import make_batch_invariant, rows_agree
from engine.kernels.build import load_kernels
from engine.models.draft_copies import draft_copy, quantized_dense
from engine.models.int8_activations import int8_isas, int8_product, pack, reference
from engine.models.int8_activations import unsupported_reason as int8_unsupported
from engine.models.loader import load_model
from engine.models.quantized_linear import QuantizedLinear
from engine.models.weight_formats import dequantize_torch, read_stored
from tests.quant_blocks import random_blocks
from tests.test_batch_invariance import (
    LOGPROBS,
    PROMPTS,
    _assert_rows_identical,
    _row_layouts,
    _tokens_and_logprobs,
)
from tests.test_gguf_model import write_pair
from tests.test_model_reference import chunked_forward
from tooling.bench import int8_products

pytestmark = pytest.mark.skipif(not load_kernels(), reason="needs the C++ kernels")

VECTOR = [isa for isa in int8_isas() if isa != "portable"]
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"]


def _weight(fmt: str, rows: int = 48, cols: int = 512, seed: int = 0):
    return read_stored(fmt, random_blocks(fmt, rows, cols, seed), rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_product_is_the_exact_product_of_the_rounded_activations(fmt):
    w = _weight(fmt)
    x = torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(1))
    x[2] = 0.0  # an all-zero row: scale 0, no division by it
    x[3, :32] *= 1e3  # one block far larger than the rest: its own scale
    want = reference(x, w)
    for isa in int8_isas():
        got = int8_product(isa)(x, w).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.equal(got[2], torch.zeros_like(got[2]))
    # Not the float32 product: the activations were rounded (else the opt-in would be a no-op).
    exact = x.double() @ dequantize_torch(w).double().T
    assert (int8_product("portable")(x, w).double() - exact).abs().max() > 1e-4


@pytest.mark.skipif(not VECTOR, reason="no vector path for 8-bit activations on this CPU")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("fmt", FORMATS)
def test_vector_and_portable_paths_agree_bit_for_bit(fmt, isa):
    w = _weight(fmt, seed=3)
    x = torch.randn(11, w.shape[1], generator=torch.Generator().manual_seed(2))
    assert torch.equal(int8_product(isa)(x, w), int8_product("portable")(x, w))


def _extreme_weight(fmt: str, code: int, rows: int = 16, cols: int = 256):
    """Every weight of a Q8_0 / Q4_0 tensor at one code, scale 1: the largest byte products
    the kernels' integer sums can meet (AVX2 adds byte products pairwise into 16 bits)."""
    raw = random_blocks(fmt, rows, cols)
    scale = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    raw = raw.reshape(-1, raw.shape[1] // (cols // 32), order="C").copy()
    raw[:, 0:2] = scale
    raw[:, 2:] = code
    return read_stored(fmt, raw.reshape(rows, -1), rows)


@pytest.mark.parametrize("isa", int8_isas())
@pytest.mark.parametrize(
    "fmt,code",
    [("Q8_0", 0x80), ("Q8_0", 0x7F), ("Q4_0", 0xFF), ("Q4_0", 0x00)],
    ids=["q8-minus128", "q8-plus127", "q4-all15", "q4-all0"],
)
def test_the_largest_byte_products_sum_exactly(fmt, code, isa):
    """Weights at their extreme codes against activations at +-127 in every slot: the
    integer sums (up to 32 * 128 * 127 a block) come out exact on every path, no 16-bit
    pair sum saturating."""
    w = _extreme_weight(fmt, code)
    x = torch.ones(4, w.shape[1])
    x[1] = -1.0
    x[2, ::2] = -1.0  # signs alternating inside each byte pair
    x[3] = torch.where(torch.arange(w.shape[1]) % 3 == 0, -1.0, 1.0)
    want = x.double() @ dequantize_torch(w).double().T  # +-1 rounds to codes +-127 exactly
    assert torch.equal(int8_product(isa)(x, w).double(), want)


@pytest.mark.parametrize("isa", int8_isas())
def test_every_row_is_computed_alone(isa):
    """A row's result is bitwise the same at every row count (decode, verification, batches,
    prefill chunks): the property that keeps speculation exact under 8-bit rounding."""
    w = _weight("Q4_1", rows=32, cols=256)
    product = int8_product(isa)
    assert rows_agree(lambda x: product(x, w), w.shape[1], 64)


def test_weights_the_kernel_cannot_take_are_named_and_refused():
    assert int8_unsupported(_weight("Q6_K", cols=256)) == "Q6_K has blocks of 16 inputs, not 32"
    assert "half precision" in int8_unsupported(_weight("F16", cols=64))
    assert "multiple of 16" in int8_unsupported(_weight("Q4_1", rows=40, cols=64))
    with pytest.raises(ValueError, match="blocks of 16 inputs"):
        pack(_weight("Q6_K", cols=256))


def test_the_kernel_refuses_a_malformed_packed_weight():
    codes, scales, mins = pack(_weight("Q4_1", rows=16, cols=64))
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        torch.ops.specserve.int8_matmul(x[:, :32], codes, scales, mins, "portable")
    with pytest.raises(RuntimeError, match="mins must be empty or shaped"):
        torch.ops.specserve.int8_matmul(x, codes, scales, mins[:, :1].contiguous(), "portable")
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        torch.ops.specserve.int8_matmul(x, codes, scales, mins, "sse9")


# ------------------------------------------------------------------- a whole (tiny) GGUF model


@pytest.fixture(scope="module")
def tiny_gguf_dir(tmp_path_factory):
    """A random tiny Llama in GGUF, projections in Q4_0 / Q8_0 / Q4_1 and F16 (which keeps the
    exact product)."""
    gguf_dir, _ = write_pair(tmp_path_factory.mktemp("int8"), "llama")
    return gguf_dir


def test_quantized_projections_run_int8_and_half_ones_stay_exact(tiny_gguf_dir):
    model, _ = load_model(tiny_gguf_dir, torch.float32, "cpu", None)
    chosen = make_batch_invariant(model, 128, int8=True)
    plans = {
        m.stored.format: m.plan[0][1] for m in model.modules() if isinstance(m, QuantizedLinear)
    }
    isa = int8_isas()[0]
    assert plans["Q4_0"] == plans["Q4_1"] == plans["Q8_0"] == f"kernel-int8-{isa}"
    assert not plans["F16"].startswith("kernel-int8")
    assert any(name.startswith("kernel-int8") for name in chosen.values())


def test_tiny_model_rows_are_identical_in_every_layout_with_int8(tiny_gguf_dir):
    """Decoded, verified, prefilled in one piece or in chunks, beside a batch mate, inside a
    tree: the same row gives bitwise the same logits (the decoder stack runs the int8 parts
    in decode and verification; prefills run the Python layers)."""
    model, _ = load_model(tiny_gguf_dir, torch.float32, "cpu", None)
    make_batch_invariant(model, 128, int8=True)
    torch.manual_seed(0)
    context = torch.randint(5, 300, (45,)).tolist()
    _assert_rows_identical(_row_layouts(model, context, [11, 12, 13, 14, 15]))


INT8 = {"int8_activations": True, "kv_cache": {"num_blocks": 256}}


@pytest.fixture(scope="module")
def plain_int8_run(tiny_gguf_dir):
    """Plain decoding's tokens and logprobs on the tiny GGUF model with 8-bit activations (one
    thread, as the speculative runs below)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = LLM(model=str(tiny_gguf_dir), **INT8)
        assert plain.engine.model.batch_invariant  # the switch turns batch invariance on
        return _tokens_and_logprobs(plain.generate(PROMPTS, LOGPROBS))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize(
    "decoder",
    [
        {"method": "ngram", "prompt_lookup_min": 1},
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_candidates": 3},
        {"method": "draft", "draft": {"model": "self", "quantization": "int4"}},
    ],
    ids=["ngram-chain", "ngram-tree", "draft"],
)
def test_speculation_equals_plain_decoding_bit_for_bit_with_int8(
    tiny_gguf_dir, plain_int8_run, decoder
):
    speculative = LLM(model=str(tiny_gguf_dir), decoder=decoder, **INT8)
    assert _tokens_and_logprobs(speculative.generate(PROMPTS, LOGPROBS)) == plain_int8_run


def test_int8_is_another_model_close_to_the_exact_one(tiny_gguf_dir, plain_int8_run):
    exact = _tokens_and_logprobs(
        LLM(model=str(tiny_gguf_dir), kv_cache={"num_blocks": 256}).generate(PROMPTS, LOGPROBS)
    )
    assert exact != plain_int8_run
    first = [(run[0][0], run[0][1]) for run in plain_int8_run]
    assert [t for t, _ in first] == [run[0][0] for run in exact]
    assert all(abs(lp - run[0][1]) < 0.05 for (_, lp), run in zip(first, exact, strict=True))


def test_real_model_int8_agrees_with_float32_on_most_next_tokens(smollm2_path):
    """SmolLM2 with 8-bit activations is a slightly different model: teacher-forced over a
    text, its next-token argmax is the float32 model's at almost every position."""
    exact, _ = load_model(smollm2_path, torch.float32, "cpu", None)
    int8, _ = load_model(smollm2_path, torch.float32, "cpu", None)
    make_batch_invariant(int8, 512, int8=True)
    text = (
        "The sea is vast and deep. Sailors have crossed it for thousands of years, guided by "
        "the stars, the winds and the currents. Today ships carry most of the world's goods "
        "from port to port, and scientists still map the ocean floor."
    )
    ids = AutoTokenizer.from_pretrained(smollm2_path)(text, return_tensors="pt").input_ids[0]
    want = chunked_forward(exact, ids, [len(ids)]).argmax(-1)
    got = chunked_forward(int8, ids, [len(ids)]).argmax(-1)
    assert (want == got).float().mean() >= 0.9


def test_int8_activations_in_bfloat16_is_refused_by_name(tiny_gguf_dir):
    with pytest.raises(ValueError, match="int8_activations needs dtype float32"):
        LLM(model=str(tiny_gguf_dir), int8_activations=True, dtype="bfloat16")


def test_drafters_of_an_int8_target_take_int8_products_too(tiny_gguf_dir):
    """A drafter's own projections (and a self-draft copy) follow the target onto 8-bit
    activations, with 8-bit codes in the blocks of 32 those products take: drafts then cost
    what the target's rows cost (drafts never change the output)."""
    model, _ = load_model(tiny_gguf_dir, torch.float32, "cpu", None)
    make_batch_invariant(model, 128, int8=True)
    name = f"kernel-int8-{int8_isas()[0]}"
    head = quantized_dense(torch.randn(32, 64), None, "int8", model)
    assert head.stored.scales.shape == (32, 2) and head.plan == [(1 << 62, name)]
    copy = draft_copy(model, "int4", num_layers=1)
    plans = {m.plan[0][1] for m in copy.modules() if isinstance(m, QuantizedLinear)}
    assert plans == {name}
    # An exact target keeps its drafters exact (blocks of 16, autotuned kernels).
    exact, _ = load_model(tiny_gguf_dir, torch.float32, "cpu", None)
    plain = quantized_dense(torch.randn(32, 64), None, "int8", exact)
    assert plain.stored.scales.shape == (32, 4) and not plain.plan[0][1].startswith("kernel-int8")


REAL_PROMPTS = ["What is the capital of France?", "Write a short poem about the sea."]
REAL_GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def real_plain_int8(smollm2_path):
    plain = LLM(model=str(smollm2_path), int8_activations=True)
    return [o.outputs[0].token_ids for o in plain.generate(REAL_PROMPTS, REAL_GREEDY)]


@pytest.mark.parametrize(
    "decoder",
    [
        {"method": "eagle3", "num_speculative_tokens": 1, "draft_policy": "fixed"},
        {"method": "hybrid", "draft_policy": "fixed", "hybrid": {"drafter_max_tokens": 1}},
    ],
    ids=["eagle3-k1", "hybrid-k1"],
)
def test_real_model_trained_drafters_stay_greedy_identical_with_int8(
    smollm2_path, real_plain_int8, decoder
):
    """SmolLM2 with 8-bit activations: the shipped EAGLE-3 (and the hybrid over it) give
    exactly the tokens plain decoding under the same numerics gives."""
    speculative = LLM(model=str(smollm2_path), int8_activations=True, decoder=decoder)
    got = speculative.generate(REAL_PROMPTS, REAL_GREEDY)
    assert [o.outputs[0].token_ids for o in got] == real_plain_int8
    assert speculative.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.skipif(not VECTOR, reason="no vector path for 8-bit activations on this CPU")
def test_the_int8_products_bench_prints_both_products_per_row_count(smollm2_path, capsys):
    assert int8_products.main(["--model", str(smollm2_path), "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2", "3", "5", "8", "16"]
    assert all(r.count("x |") == 2 for r in rows[1:])  # layers' and the head's ratios
