"""Offline benchmark: our engine against Hugging Face ``generate()`` and llama.cpp in one run.

Prints decode tokens/s at batch 1 and batch N, time to first token for a long prompt, the
same figures for transformers and for llama.cpp (on the model's GGUF file,
tooling/bench/bench_llamacpp.py) on the same prompts, their ratios, and the memory-bandwidth floor
of a decode step (weight bytes / measured read bandwidth).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.toolkit import LLM, SamplingParams, find_gguf
from tooling.bench.bench_llamacpp import LlamaCppFigures, llamacpp_baseline

TOPICS = [
    "a robot who learns to paint",
    "the history of tea",
    "how rain forms",
    "a lighthouse keeper",
    "why the sky is blue",
    "a trip to Mars",
    "the rules of chess",
    "a city under the sea",
    "how bread rises",
    "a talking cat",
    "the first computers",
    "a winter festival",
    "how bees make honey",
    "a lost map",
    "the speed of light",
    "a garden on a rooftop",
]


@dataclass
class Result:
    name: str
    tokens_per_s: float
    ttft_s: float | None = None


def measure_read_bandwidth(
    num_bytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Bytes/s of a streaming read (a sum over a tensor far larger than the caches)."""
    device = torch.device(device)
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        data.sum()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    return [
        llm.render_chat([{"role": "user", "content": f"Tell me a story about {TOPICS[i % 16]}."}])
        for i in range(count)
    ]


def long_prompt(llm: LLM, length: int) -> list[int]:
    text = " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 400))
    ids = llm.tokenizer.encode(text)
    assert len(ids) >= length, "long prompt text too short"
    return ids[:length]


def ours_decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s: tokens after the first of each sequence, over the time they took."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{len(prompts)}-{i}", p, params)
    scheduler = engine.scheduler
    # Prefill until every sequence has its first token; decode is timed from there.
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()
    start, decoded = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        decoded += sum(o.num_new_tokens for r in engine.step() for o in r.outputs)
    return decoded / (time.perf_counter() - start)


def ours_ttft(llm: LLM, prompt: list[int], repeats: int = 3) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for i in range(repeats):
        # Distinct first token per repeat so the prefix cache cannot serve the prompt.
        p = [prompt[0] + i + 1] + prompt[1:]
        start = time.perf_counter()
        llm.generate([p], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_decode(hf, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """transformers generate(): left-padded batch; decode rate excludes the first token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device
    )
    kwargs = dict(do_sample=False, attention_mask=mask, pad_token_id=pad_id)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up (GPU kernels)
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        _synchronize(hf.device)
        first = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        _synchronize(hf.device)
        total = time.perf_counter() - start
    return len(prompts) * (max_tokens - 1) / max(total - first, 1e-9)


def hf_ttft(hf, prompt: list[int], repeats: int = 3) -> float:
    ids = torch.tensor([prompt], device=hf.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(ids))
            _synchronize(hf.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_baseline(llm: LLM, prompts, max_tokens: int, prompt_len: int) -> list[float]:
    """The same three figures for transformers on the same weights (a GGUF dequantized to
    float32), dtype, device and prompts."""
    from engine.toolkit import load_hf_model

    dtype = llm.engine.model.dtype
    hf = load_hf_model(llm.model_dir, dtype).to(llm.config.device)
    pad = llm.tokenizer.pad_token_id or 0
    return [
        hf_decode(hf, prompts[:1], max_tokens, pad),
        hf_decode(hf, prompts, max_tokens, pad),
        hf_ttft(hf, long_prompt(llm, prompt_len)),
    ]


@dataclass
class LlamaCppOptions:
    """The llama.cpp column: ``gguf`` overrides the model directory's GGUF file; ``n_batch`` is
    its prompt batch (1 where multi-token prompt evaluation crashes, as on some AMX machines)."""

    enabled: bool = True
    gguf: str | None = None
    n_batch: int = 512


def llamacpp_figures(config, llm: LLM, prompts, max_tokens, prompt_len, options) -> LlamaCppFigures:
    """llama.cpp on --gguf, else the .gguf the engine was given, else the model directory's."""
    if not options.enabled:
        return LlamaCppFigures(notes=["llama.cpp skipped: --no-llamacpp"])
    if config.device != "cpu":
        # llama-cpp-python's wheel here is a CPU build: no fair GPU column.
        return LlamaCppFigures(notes=[f"llama.cpp skipped: the engine runs on {config.device}"])
    gguf = Path(options.gguf) if options.gguf else None
    if gguf is None and str(config.model).endswith(".gguf"):
        gguf = Path(config.model)  # the file the engine itself was given
    gguf = gguf or find_gguf(llm.model_dir)
    long_ids = long_prompt(llm, prompt_len)
    threads = torch.get_num_threads()
    return llamacpp_baseline(gguf, prompts, long_ids, max_tokens, threads, options.n_batch)


def _versus(ours: float, theirs: float | None, lower_is_better: bool) -> str:
    """A baseline's cell and how many times better ours is ('-' where it was not measured)."""
    if theirs is None:
        return "- | -"
    # Higher is better for tokens/s, lower for TTFT: the ratio is always "times better".
    ratio = theirs / ours if lower_is_better else ours / theirs
    return f"{theirs:.3f} | {ratio:.2f}x"


def print_table(names: list[str], ours, hf: list[float] | None, lcpp: LlamaCppFigures) -> None:
    print(
        "\n| metric | specserve | transformers generate() | x transformers | llama.cpp "
        "| x llama.cpp |\n|---|---|---|---|---|---|"
    )
    for i, name in enumerate(names):
        versus_hf = _versus(ours[i], hf[i] if hf else None, lower_is_better=i == 2)
        versus_lcpp = _versus(ours[i], lcpp.rows()[i], lower_is_better=i == 2)
        print(f"| {name} | {ours[i]:.3f} | {versus_hf} | {versus_lcpp} |")
    for note in lcpp.notes:
        print(note)


def run_offline(
    config,
    batch: int,
    max_tokens: int,
    prompt_len: int,
    with_hf: bool,
    llamacpp: LlamaCppOptions | None = None,
) -> None:
    """``config`` is the EngineConfig to benchmark (model, decoder, cache sizes)."""
    llm = LLM(config=config)
    arch = llm.engine.model.arch
    weight_bytes = llm.engine.model.weight_bytes_per_token
    device = torch.device(llm.config.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"model {llm.model_dir} ({arch.num_layers} layers, {weight_bytes / 1e6:.0f} MB weights, "
        f"{llm.config.dtype}) on {where}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )
    bandwidth = measure_read_bandwidth(device=llm.config.device)
    floor_tps = bandwidth / weight_bytes
    print(
        f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s -> decode floor "
        f"{1e3 / floor_tps:.1f} ms/token = {floor_tps:.1f} tokens/s at batch 1"
    )
    prompts = chat_prompts(llm, batch)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    ours_1 = ours_decode(llm, prompts[:1], max_tokens)
    ours_n = ours_decode(llm, prompts, max_tokens)
    ttft = ours_ttft(llm, long_prompt(llm, prompt_len))
    theirs = hf_baseline(llm, prompts, max_tokens, prompt_len) if with_hf else None
    options = llamacpp or LlamaCppOptions()
    lcpp = llamacpp_figures(config, llm, prompts, max_tokens, prompt_len, options)
    names = [
        "decode tok/s, batch 1",
        f"decode tok/s, batch {batch}",
        f"TTFT s, {prompt_len}-token prompt",
    ]
    print_table(names, [ours_1, ours_n, ttft], theirs, lcpp)
    print(
        f"\nbatch-1 decode = {ours_1 / floor_tps:.0%} of the bandwidth floor; "
        f"batch {batch} = {ours_n / ours_1:.1f}x batch-1 tokens/s"
    )
