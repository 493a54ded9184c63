"""What drafting EAGLE chains in one C++ call saves, in one process, interleaved:

    python -m tooling.bench.draft_chain_ab [--decoder eagle3-k2,hybrid-k2] [--rounds 3]
        [--max-tokens 128] [--int8-activations] [--model M]

For each bench variant (``bench offline --decoder`` names) one engine generates every chat
prompt greedily with the drafter's C++ chain (``engine/decoders/draft_chain.py``) and with the
Python drafting loop, the two in turn prompt by prompt and in alternating order round by round.
Prints, per variant and path, the output tokens a second over the fastest round of each prompt
and the median drafting time of a step, and checks that both paths gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.toolkit import LLM, EngineConfig, SamplingParams, cpu_identity
from tooling.bench.bench_decoders import (
    all_variants,
    decoder_config,
    load_prompt_set,
    select_variants,
)


def chain_drafters(decoder) -> list:
    """The EAGLE drafters under ``decoder`` (hybrid holds one through its drafting decoder)."""
    found, node = [], decoder
    while node is not None:
        if hasattr(node, "chain"):
            found.append(node)
        node = getattr(node, "drafter", None)
    return found


def _generate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return list(out[0].outputs[0].token_ids), time.perf_counter() - start


def run_ab(config: EngineConfig, names: str, rounds: int, max_tokens: int) -> list[dict]:
    llm = LLM(config=config.with_overrides(decoder={"method": "autoregressive",
                                                    "extra_methods": []}))  # fmt: skip
    engine = llm.engine
    variants = select_variants(names, all_variants(engine.model.arch.num_layers))
    prompts = [llm.render_chat([{"role": "user", "content": t}]) for t in load_prompt_set("chat")]
    results = []
    for variant in variants:
        decoder = decoder_config(config.decoder, variant, config.decoder.num_speculative_tokens)
        speculator = engine.build_speculator(
            decoder.model_copy(update={"load_shipped_drafters": False})
        )
        engine.use_speculator(speculator)
        drafters = [d for dec in speculator.decoders.values() for d in chain_drafters(dec)]
        chains = {id(d): d.chain for d in drafters}
        if not any(chains.values()):
            print(f"{variant.name}: no C++ chain applies here; skipped")
            continue
        draft_times: dict[str, list[float]] = {"cpp": [], "python": []}
        path = {"now": "cpp"}
        for dec in speculator.decoders.values():
            propose = dec.propose

            def timed(seqs, num_drafts, _propose=propose, _times=draft_times, _path=path):
                start = time.perf_counter()
                try:
                    return _propose(seqs, num_drafts)
                finally:
                    _times[_path["now"]].append(time.perf_counter() - start)

            dec.propose = timed
        best = {"cpp": [float("inf")] * len(prompts), "python": [float("inf")] * len(prompts)}
        tokens = {"cpp": [None] * len(prompts), "python": [None] * len(prompts)}
        for r in range(rounds):
            order = ("cpp", "python") if r % 2 == 0 else ("python", "cpp")
            for i, prompt in enumerate(prompts):
                for mode in order:
                    path["now"] = mode
                    for d in drafters:
                        d.chain = chains[id(d)] if mode == "cpp" else None
                    out, seconds = _generate(llm, prompt, max_tokens)
                    best[mode][i] = min(best[mode][i], seconds)
                    tokens[mode][i] = out
        for d in drafters:
            d.chain = chains[id(d)]
        engine.use_speculator(None)
        count = sum(len(t) for t in tokens["cpp"])
        row = {"variant": variant.name, "identical": tokens["cpp"] == tokens["python"]}
        for mode in ("cpp", "python"):
            row[f"{mode}_tok_s"] = count / sum(best[mode])
            row[f"{mode}_draft_ms"] = 1e3 * statistics.median(draft_times[mode])
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decoder", default="eagle3-k2,hybrid-k2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    overrides = {"int8_activations": True} if args.int8_activations else {}
    if args.model:
        overrides["model"] = args.model
    config = EngineConfig().with_overrides(**overrides)
    results = run_ab(config, args.decoder, args.rounds, args.max_tokens)
    print(f"{cpu_identity()}; greedy chat prompts, {args.max_tokens} tokens, fastest of "
          f"{args.rounds} interleaved rounds per prompt\n")  # fmt: skip
    print("| variant | C++ chain tok/s | Python loop tok/s | C++ / Python | drafting ms a step, "
          "C++ / Python | same tokens |\n|---|---|---|---|---|---|")  # fmt: skip
    for r in results:
        print(f"| {r['variant']} | {r['cpp_tok_s']:.1f} | {r['python_tok_s']:.1f} | "
              f"{r['cpp_tok_s'] / r['python_tok_s']:.2f}x | {r['cpp_draft_ms']:.2f} / "
              f"{r['python_draft_ms']:.2f} | {'yes' if r['identical'] else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
