"""The engine on a CUDA GPU, on the real SmolLM2: greedy output of every decoder equals the
GPU's own autoregressive output (float32), CUDA graphs replay what eager steps compute, float32
greedy output equals transformers' on the same GPU, every decoder samples in both dtypes,
constrained output (a JSON schema, choices, banned words) keeps to its constraint with every
decoder, and no KV block outlives its request.

CI has no GPU: every test here is skipped there, with the reason. The CPU suite covers the
same code paths on the CPU; these catch what only a GPU shows (device placement, dtypes).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, ConstraintSpec, SamplingParams
from engine.decoders import SpeculativeOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODERS = ["ngram", "draft", "layerskip", "hierarchical", "medusa", "hydra", "eagle", "kangaroo"]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
# Several engines live in one test process: each gets a small cache, not 90% of the GPU, and
# few sequences, so that capturing their CUDA graphs at start-up stays short.
SMALL_CACHE = {"num_blocks": 2048}
FEW_SEQUENCES = {"max_num_seqs": 8}
TOPICS = ["the history of tea", "how rain forms", "a lighthouse keeper", "the rules of chess"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gpu_llm(request, smollm2_path) -> LLM:
    return LLM(
        model=str(smollm2_path),
        device="cuda",
        dtype=request.param,
        kv_cache=SMALL_CACHE,
        scheduler=FEW_SEQUENCES,
        decoder={
            "method": "autoregressive",
            "extra_methods": ["ngram", "draft", "layerskip", "hierarchical"],
            "draft": {"model": "self", "quantization": "none", "num_layers": 12},
            "layerskip": {"exit_layer": 18},
            "hierarchical": {"level1": "ngram"},
        },
    )


def prompts(llm: LLM) -> list[list[int]]:
    chats = [
        llm.render_chat([{"role": "user", "content": f"Tell me about {topic}."}])
        for topic in TOPICS
    ]
    repetitive = llm.tokenizer.encode("one two three four, one two three four, one two three")
    return [*chats, repetitive]


# bfloat16 rounds a verification pass (1 + k rows) differently from a decode pass, so greedy
# output can flip at near-ties (docs/benchmarks.md): exact identity is a float32 promise.
@pytest.mark.parametrize("gpu_llm", ["float32"], indirect=True)
def test_every_decoder_is_greedy_identical_on_the_gpu(gpu_llm):
    batch = prompts(gpu_llm)
    expected = [out.token_ids for out in gpu_llm.generate(batch, GREEDY)]
    for name in DECODERS:
        got = gpu_llm.generate(batch, GREEDY, SpeculativeOptions(name))
        assert [out.token_ids for out in got] == expected, name
        one = gpu_llm.generate(batch[:1], GREEDY, SpeculativeOptions(name))
        assert one[0].token_ids == expected[0], f"{name} alone"
    manager = gpu_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("gpu_llm", ["float32"], indirect=True)
def test_no_decode_or_verification_step_runs_eagerly(gpu_llm):
    """Every width a decoder or the goodput policy asks for has a graph captured at start-up
    (engine.cuda_graphs.capture_plan): the runner's count of eager short steps stays 0."""
    runner = gpu_llm.engine.runner
    before = runner.eager_short_steps
    for name in DECODERS:
        gpu_llm.generate(prompts(gpu_llm), GREEDY, SpeculativeOptions(name))
    assert runner.eager_short_steps == before


def test_engine_state_lives_on_the_gpu(gpu_llm):
    engine = gpu_llm.engine
    assert engine.kv_cache.storage.device.type == "cuda"
    assert engine.model.final_norm.device.type == "cuda"
    assert str(engine.model.dtype).endswith(gpu_llm.config.dtype)


def test_float32_greedy_matches_transformers_on_the_gpu(smollm2_path):
    from engine.models.loader import load_hf_model

    llm = LLM(
        model=str(smollm2_path), device="cuda", dtype="float32", kv_cache=SMALL_CACHE,
        scheduler=FEW_SEQUENCES,
    )  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = load_hf_model(llm.model_dir, torch.float32).to("cuda")
    for prompt in prompts(llm)[:2]:
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
        ids = torch.tensor([prompt], device="cuda")
        theirs = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
        )[0, len(prompt) :].tolist()
        assert ours.token_ids == theirs[: len(ours.token_ids)]


def test_sampling_runs_with_every_decoder_on_the_gpu(gpu_llm):
    batch = prompts(gpu_llm)[:2]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    for name in ["autoregressive", *DECODERS]:
        got = gpu_llm.generate(batch, params, SpeculativeOptions(name))
        assert all(len(out.token_ids) == 24 for out in got), name


def test_constraints_mask_the_logits_on_the_gpu(gpu_llm):
    """A constraint's mask is built on the CPU and must reach logits on the GPU: a JSON schema,
    choices and banned words in one batch, greedy and sampled, with every decoder (the
    drafters' q is masked too); in float32, greedy output is the same with every decoder."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    prompt = gpu_llm.render_chat([{"role": "user", "content": "Is tea good? Answer in JSON."}])
    greedy = {}
    for name in ["autoregressive", *DECODERS]:
        for temperature in (0.0, 0.8):
            common = {"temperature": temperature, "seed": 5, "max_tokens": 128}
            batch = [
                SamplingParams(**common, constraint=ConstraintSpec("json_schema", schema)),
                SamplingParams(**common, constraint=ConstraintSpec("choice", ["yes", "no"])),
                SamplingParams(**common, banned_words=["tea"]),
            ]
            outs = gpu_llm.generate([prompt] * 3, batch, SpeculativeOptions(name))
            document, choice, free = (out.outputs[0] for out in outs)
            assert document.finish_reason == "stop", (name, document.text)
            assert set(json.loads(document.text)) == {"ok"}, name
            assert choice.text in ("yes", "no"), (name, choice.text)
            assert not re.search(r"(?<!\w)tea(?!\w)", free.text, re.IGNORECASE), name
            if temperature == 0:
                greedy[name] = [out.outputs[0].token_ids for out in outs]
    if gpu_llm.config.dtype == "float32":
        for name, ids in greedy.items():
            assert ids == greedy["autoregressive"], name
    manager = gpu_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_cuda_graphs_replay_what_eager_steps_compute(smollm2_path):
    small = {"kv_cache": SMALL_CACHE, "scheduler": FEW_SEQUENCES}
    graphs = LLM(model=str(smollm2_path), device="cuda", dtype="float32", **small)
    eager = LLM(
        model=str(smollm2_path), device="cuda", dtype="float32", enforce_eager=True, **small
    )
    batch = prompts(graphs)
    got = [out.token_ids for out in graphs.generate(batch, GREEDY)]
    assert got == [out.token_ids for out in eager.generate(batch, GREEDY)]
    # Decode steps of 1, 2, 4 and 8 sequences up to 2048 keys were captured at start-up.
    assert len(graphs.engine.runner.graphs.graphs) >= 4 * 5
    assert eager.engine.runner.graphs is None
