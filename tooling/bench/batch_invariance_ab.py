"""What ``batch_invariant`` costs, in one process, interleaved:

    python -m tooling.bench.batch_invariance_ab [--model M] [--decoder ngram] [--rounds 3]

Two engines on the same weights, one with ``batch_invariant: true``; each generates greedy
answers to the bench's chat and grounded prompts (configs/prompts/) plainly and with
``--decoder`` (fixed k), in alternating rounds. Prints tokens/s (median over rounds) of each,
the ratio invariant / default, and whether each engine's speculative output equals its own
plain output (and, under invariance, its logprobs bit for bit).
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.toolkit import LLM, SamplingParams, SpeculativeOptions
from tooling.bench.bench_decoders import load_prompt_set


def _run(llm: LLM, prompts, params, speculative=None):
    started = time.perf_counter()
    outputs = [llm.generate([p], params, speculative)[0] for p in prompts]  # batch 1
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    logprobs = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs] for o in outputs]
    return tokens / seconds, logprobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--decoder", default="ngram")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    common = {"model": args.model} if args.model else {}
    decoder = {"method": "autoregressive", "extra_methods": [args.decoder],
               "draft_policy": "fixed", "load_shipped_drafters": False}  # fmt: skip
    engines = {
        "default": LLM(**common, decoder=decoder),
        "invariant": LLM(**common, decoder=decoder, batch_invariant=True),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0)
    speculative = SpeculativeOptions(args.decoder)
    for name in ("chat", "grounded"):
        prompts = [
            engines["default"].render_chat([{"role": "user", "content": text}])
            for text in load_prompt_set(name)
        ]
        speeds = {(e, mode): [] for e in engines for mode in ("plain", args.decoder)}
        outputs = {}
        for _ in range(args.rounds):
            for engine_name, llm in engines.items():
                for mode, options in (("plain", None), (args.decoder, speculative)):
                    rate, logprobs = _run(llm, prompts, params, options)
                    speeds[(engine_name, mode)].append(rate)
                    outputs[(engine_name, mode)] = logprobs
        for mode in ("plain", args.decoder):
            default = statistics.median(speeds[("default", mode)])
            invariant = statistics.median(speeds[("invariant", mode)])
            print(f"{name} {mode}: default {default:.1f} tok/s, invariant {invariant:.1f} "
                  f"tok/s = {invariant / default:.3f}x")  # fmt: skip
        for engine_name in engines:
            plain, spec = outputs[(engine_name, "plain")], outputs[(engine_name, args.decoder)]
            same_tokens = [[t for t, _ in p] for p in plain] == [[t for t, _ in s] for s in spec]
            print(f"{name} {engine_name}: {args.decoder} tokens equal plain: {same_tokens}; "
                  f"logprobs bit for bit: {plain == spec}")  # fmt: skip


if __name__ == "__main__":
    main()
