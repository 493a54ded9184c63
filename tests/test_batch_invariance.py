"""Batch-invariant execution (``batch_invariant``): a row's logits are bitwise the same
whatever else its step holds, so speculative decoding reproduces plain decoding exactly, its
logprobs included; the attention kernel's per-row independence (which holds in every mode);
the product check; and the configurations the switch refuses."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.batch_invariance import RowByRow, make_batch_invariant, rows_agree
from engine.kernels.build import load_kernels
from engine.kv_cache import KVCache
from engine.model_runner import ForwardItem, ModelRunner
from engine.models.linear import Linear
from engine.models.loader import load_model
from engine.models.quantized_linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not load_kernels(), reason="needs the C++ kernels")

BLOCK = 16


# ------------------------------------------------------------------------ the attention kernel


def _attend(q, caches, slots, mask):
    out = torch.empty_like(q)
    rows = torch.arange(q.shape[0])[None]
    torch.ops.specserve.cached_attention(q, *caches, rows, slots[None], mask, None, 0.125, out)
    return out


@pytest.mark.parametrize("visible", [1, 17, 64, 65, 100, 203])
def test_a_row_attends_the_same_alone_padded_or_among_hidden_keys(visible):
    """The kernel sums over exactly the keys a row sees: padding a step's keys past them (a
    longer batch mate) or scattering hidden keys between them (a token tree's siblings) leaves
    the row's output bitwise unchanged."""
    torch.manual_seed(visible)
    caches = (torch.randn(512, 3, 64), torch.randn(512, 3, 64))
    q = torch.randn(1, 9, 64)
    alone = _attend(q, caches, torch.arange(visible), None)
    for extra in (1, 7, 16, 40):
        mask = torch.zeros(1, 1, 1, visible + extra, dtype=torch.bool)
        mask[..., :visible] = True
        assert torch.equal(_attend(q, caches, torch.arange(visible + extra), mask), alone)
    # The same keys with hidden ones interleaved (their slots hold other keys).
    spread = torch.arange(2 * visible) % 2 == 0
    slots = torch.where(spread, torch.arange(2 * visible) // 2, 300 + torch.arange(2 * visible))
    mask = spread[None, None, None]
    assert torch.equal(_attend(q, caches, slots % 512, mask), alone)


# ----------------------------------------------------------------------- the products' check


def test_rows_agree_tells_invariant_products_from_others():
    weight = torch.randn(24, 40)
    assert rows_agree(lambda x: x @ weight.T if x.shape[0] == 1 else torch.cat(
        [r @ weight.T for r in x.split(1)]), 40, 64)  # fmt: skip
    # A product whose rows shift with the row count (as a different summation order does).
    assert not rows_agree(lambda x: x @ weight.T + 1e-6 * x.shape[0], 40, 64)
    # Only the largest count differs: still caught (prefill chunks are checked too).
    assert not rows_agree(lambda x: x @ weight.T + (x.shape[0] == 100) * 1e-6, 40, 100)


def test_row_by_row_wraps_a_product_that_is_not_invariant():
    class Drifting(torch.nn.Module):
        in_features, out_features = 8, 4

        def forward(self, x):
            return x[:, :4] + 1e-6 * x.shape[0]

    wrapped = RowByRow(Drifting())
    x = torch.randn(9, 8)
    assert rows_agree(wrapped, 8, 32)
    assert torch.equal(wrapped(x)[3], wrapped(x[3:4])[0])


# ------------------------------------------------------------------------- the whole model


def _runner(model):
    arch = model.arch
    cache = KVCache(
        arch.num_layers, 64, BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu"
    )
    return ModelRunner(model, cache, "cpu")


def _row_layouts(model, context: list[int], new: list[int]) -> dict[str, torch.Tensor]:
    """The logits of the context's last token and of each new token, computed in the ways a
    step can hold them: decoded one at a time, verified at once, in one prefill, in a chunked
    prefill, beside a batch mate, and as the trunk of a token tree with a side branch."""
    table, other = list(range(10)), list(range(10, 20))
    n = len(new)

    def decode(runner):
        first = runner.run([ForwardItem(context, 0, table, 1)])
        rows = [runner.run([ForwardItem([t], len(context) + i, table, 1)]) for i, t in
                enumerate(new)]  # fmt: skip
        return torch.cat([first, *rows])

    def verify(runner):
        first = runner.run([ForwardItem(context, 0, table, 1)])
        return torch.cat([first, runner.run([ForwardItem(new, len(context), table, n)])])

    def beside_a_batch_mate(runner):
        first = runner.run([ForwardItem(context, 0, table, 1), ForwardItem(new * 5, 0, other, 1)])
        rest = runner.run([ForwardItem(new, len(context), table, n),
                           ForwardItem(new[:2], 5 * n, other, 2)])  # fmt: skip
        return torch.cat([first[:1], rest[:n]])

    def chunked(runner):
        runner.run([ForwardItem(context[:7], 0, table, 0)])  # a mid-prefill chunk: no logits
        return runner.run([ForwardItem(context[7:] + new, 7, table, n + 1)])

    def tree(runner):
        first = runner.run([ForwardItem(context, 0, table, 1)])
        # The chain ``new`` with a one-token branch off its first token, placed second.
        tokens = [new[0], 7, *new[1:]]
        parents = [-1, 0, 0, *range(2, n)]
        logits = runner.run([ForwardItem(tokens, len(context), table, n + 1, parents)])
        return torch.cat([first, logits[[0, *range(2, n + 1)]]])

    layouts = {
        "decode": decode,
        "verify": verify,
        "one prefill": lambda r: r.run([ForwardItem(context + new, 0, table, n + 1)]),
        "chunked prefill": chunked,
        "beside a batch mate": beside_a_batch_mate,
        "tree": tree,
    }
    return {name: build(_runner(model)) for name, build in layouts.items()}


def _assert_rows_identical(layouts: dict[str, torch.Tensor]) -> None:
    reference = layouts["decode"]
    for name, rows in layouts.items():
        different = [i for i in range(len(reference)) if not torch.equal(rows[i], reference[i])]
        assert not different, f"{name}: rows {different} differ from decoding"


def test_tiny_model_rows_are_identical_in_every_layout(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, torch.float32, "cpu", None)
    chosen = make_batch_invariant(model, 128)
    assert model.batch_invariant and set(chosen.values()) <= {"dense", "row by row"}
    for module in model.modules():  # every product either passed the check or is wrapped
        if isinstance(module, Linear):
            assert rows_agree(module, module.in_features, 128) or any(
                isinstance(m, RowByRow) and m.inner is module for m in model.modules()
            )
    torch.manual_seed(0)
    context = torch.randint(5, 300, (45,)).tolist()
    _assert_rows_identical(_row_layouts(model, context, [11, 12, 13, 14, 15]))


def test_real_model_rows_are_identical_in_every_layout(smollm2_path):
    """SmolLM2's quantized products: the invariant form chosen on this machine computes each
    row the same at every row count, and the whole model's rows agree in every layout."""
    model, _ = load_model(smollm2_path, torch.float32, "cpu", None)
    chosen = make_batch_invariant(model, 512)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            assert module.plan == [(1 << 62, chosen[module.tune_key])]
    torch.manual_seed(1)
    context = torch.randint(100, 40000, (70,)).tolist()
    _assert_rows_identical(_row_layouts(model, context, [504, 1326, 314, 260, 9018, 28]))


# --------------------------------------------------------------------------------- the engine

LOGPROBS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [20 + i % 7 for i in range(40)]]


def _tokens_and_logprobs(outputs):
    return [
        [(t.token_id, t.logprob, t.top_logprobs) for t in out.outputs[0].logprobs]
        for out in outputs
    ]


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize(
    "decoder",
    [
        {"method": "ngram", "prompt_lookup_min": 1},
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_candidates": 3},
        {"method": "draft", "draft": {"model": "self", "quantization": "int8"}},
    ],
    ids=["ngram-chain", "ngram-tree", "draft"],
)
def test_speculative_logprobs_equal_plain_decoding_bit_for_bit(tiny_model_dir, decoder):
    """Not only the tokens: every logprob of a speculative run equals plain decoding's exactly,
    batched together, since a verified row is computed as its decode row would be."""
    common = {"batch_invariant": True, "kv_cache": {"num_blocks": 256}}
    plain = LLM(model=str(tiny_model_dir), **common).generate(PROMPTS, LOGPROBS)
    speculative = LLM(
        model=str(tiny_model_dir), decoder=decoder | {"draft_policy": "fixed"}, **common
    )
    outputs = speculative.generate(PROMPTS, LOGPROBS)
    assert _tokens_and_logprobs(outputs) == _tokens_and_logprobs(plain)
    assert speculative.engine.speculator is not None


def test_real_model_speculative_logprobs_equal_plain_decoding(smollm2_path):
    prompt = "List the days of the week, then list them again in the same order:"
    common = {"batch_invariant": True}
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    plain = LLM(model=str(smollm2_path), **common).generate([prompt], params)
    ngram = LLM(
        model=str(smollm2_path),
        decoder={"method": "ngram", "draft_policy": "fixed"},
        **common,
    ).generate([prompt], params)
    assert _tokens_and_logprobs(ngram) == _tokens_and_logprobs(plain)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [({"dtype": "bfloat16"}, "needs dtype float32"), ({"device": "cuda"}, "runs on the CPU")],
)
def test_configurations_without_the_guarantee_are_refused(tiny_model_dir, overrides, reason):
    from engine.batch_invariance import unsupported_reason

    assert reason in unsupported_reason(
        overrides.get("device", "cpu"), overrides.get("dtype", "float32"), True
    )
    if "device" not in overrides:  # no GPU here: the engine's own refusal on the CPU case
        with pytest.raises(ValueError, match=reason):
            LLM(model=str(tiny_model_dir), batch_invariant=True, **overrides)
