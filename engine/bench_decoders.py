"""Speculative decoders against autoregressive decoding, in one run, on two prompt sets.

For each decoder: batch-1 greedy tokens/s over the prompt set (each prompt alone), the speedup
over ``autoregressive`` measured in the same run, the acceptance rate and the mean acceptance
length, and whether the tokens were identical to autoregressive decoding (they must be). The
same prompts also run through transformers' ``generate()``, plain and with
``prompt_lookup_num_tokens`` (its n-gram assisted generation), for comparison.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.speculation import SpecDecodeStats

PROMPT_SETS = Path(__file__).resolve().parent.parent / "configs" / "prompts"


@dataclass
class DecoderResult:
    tokens_per_s: float
    token_ids: list[list[int]]
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


def load_prompt_set(name: str) -> list[str]:
    return json.loads((PROMPT_SETS / f"{name}.json").read_text())


def run_ours(llm: LLM, prompts: list[list[int]], max_tokens: int) -> DecoderResult:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    spec = llm.engine.speculator
    if spec is not None:
        spec.stats = SpecDecodeStats()  # count this prompt set only
    start, outputs = time.perf_counter(), []
    for p in prompts:
        outputs.append(llm.generate([p], params)[0].token_ids)
    elapsed = time.perf_counter() - start
    result = DecoderResult(sum(len(o) for o in outputs) / elapsed, outputs)
    if spec is not None:
        result.acceptance_rate = spec.stats.acceptance_rate
        result.mean_acceptance_length = spec.stats.mean_acceptance_length
    return result


def run_hf(hf, prompts: list[list[int]], max_tokens: int, **kwargs) -> DecoderResult:
    outputs, start = [], time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                **kwargs,
            )
            outputs.append(out[0, len(p) :].tolist())
    elapsed = time.perf_counter() - start
    return DecoderResult(sum(len(o) for o in outputs) / elapsed, outputs)


def run_decoder_bench(
    config: EngineConfig, decoders: list[str], k: int, max_tokens: int, with_hf: bool
) -> None:
    base = LLM(config=config.with_overrides(decoder={"method": "autoregressive"}))
    llms = {"autoregressive": base}
    for name in decoders:
        if name != "autoregressive":
            llms[name] = LLM(
                config=config.with_overrides(decoder={"method": name, "num_speculative_tokens": k})
            )
    hf = None
    if with_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(base.model_dir, dtype=torch.float32).eval()
    print(f"model {base.model_dir}; greedy, batch 1, max_tokens {max_tokens}, k={k}\n")
    print(
        "| prompts | method | tok/s | speedup vs autoregressive | acceptance rate | "
        "mean acceptance length | identical to autoregressive |\n|---|---|---|---|---|---|---|"
    )
    for set_name in ("chat", "grounded"):
        prompts = [
            base.render_chat([{"role": "user", "content": t}]) for t in load_prompt_set(set_name)
        ]
        results = {name: run_ours(llm, prompts, max_tokens) for name, llm in llms.items()}
        if hf is not None:
            results["transformers generate()"] = run_hf(hf, prompts, max_tokens)
            results[f"transformers prompt_lookup_num_tokens={k}"] = run_hf(
                hf, prompts, max_tokens, prompt_lookup_num_tokens=k
            )
        _print_rows(set_name, results)


def _print_rows(set_name: str, results: dict[str, DecoderResult]) -> None:
    reference = results["autoregressive"]
    for name, r in results.items():
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        length = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}"
        same = "yes" if r.token_ids == reference.token_ids else "no"
        print(
            f"| {set_name} | {name} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / reference.tokens_per_s:.2f}x | {rate} | {length} | {same} |"
        )
