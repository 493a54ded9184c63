"""``specserve bench constraints``: what constrained decoding costs, and what speculation
gives back, on the machine at hand.

1. The mask cost per token of each grammar library installed (llguidance, which the engine
   uses; outlines-core and xgrammar when present), on schemas of our own with one valid
   document each: compile time, then median and worst time per mask along the document.
2. JSON-schema requests through the engine: tok/s with autoregressive decoding and with each
   named decoder, greedy, in one run (ratios against the autoregressive run), and whether the
   outputs are identical and parse.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch

from engine.toolkit import ConstraintSpec, EngineConfig

# Schemas and documents written for this benchmark (no public benchmark data).
SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"],
                },
            },
            "required": ["name", "age", "email", "tags", "address"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com",
         "tags": ["math", "poetry"], "address": {"city": "London", "zip": "W1"}},
    ),
    "inventory": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "count": {"type": "integer"},
                            "status": {"enum": ["in_stock", "backorder", "retired"]},
                        },
                        "required": ["sku", "count", "status"],
                    },
                }
            },
            "required": ["items"],
        },
        {"items": [{"sku": "A-1", "count": 3, "status": "in_stock"},
                   {"sku": "B-22", "count": 0, "status": "backorder"},
                   {"sku": "C-333", "count": 12, "status": "retired"}]},
    ),
}  # fmt: skip
PROMPTS = [
    "Describe a fictional person as JSON with name, age, email, tags and address.",
    "Give me a JSON record of a person who lives in Paris.",
    "Write the JSON for a small bookshop's inventory of three items.",
    "List three items of a hardware store's stock as JSON.",
]


@dataclass
class MaskTiming:
    library: str
    schema: str
    compile_ms: float
    median_us: float
    worst_us: float
    tokens: int


def mask_timings(tokenizer, vocab_size: int, eos: list[int]) -> list[MaskTiming]:
    results = []
    for name, (schema, document) in SCHEMAS.items():
        ids = tokenizer.encode(json.dumps(document), add_special_tokens=False)
        results.append(_llguidance_timing(tokenizer, vocab_size, eos, name, schema, ids))
        for other in (_outlines_timing, _xgrammar_timing):
            timing = other(tokenizer, vocab_size, eos, name, schema, ids)
            if timing is not None:
                results.append(timing)
    return results


def _llguidance_timing(tokenizer, vocab_size, eos, name, schema, ids) -> MaskTiming:
    from engine.toolkit import ConstraintFactory

    factory = ConstraintFactory(lambda: tokenizer, vocab_size, eos)
    factory.state(ConstraintSpec("json_schema", schema))  # the tokenizer, built once
    spec = ConstraintSpec("json_schema", schema)
    started = time.perf_counter()
    state = factory.state(spec)
    compile_ms = (time.perf_counter() - started) * 1e3
    times = []
    for n in range(len(ids) + 1):
        started = time.perf_counter()
        allowed = state.allowed(ids[:n])
        times.append(time.perf_counter() - started)
        assert allowed is not None and (n == len(ids) or allowed[ids[n]])
    return _timing("llguidance", name, compile_ms, times)


def _outlines_timing(tokenizer, vocab_size, eos, name, schema, ids) -> MaskTiming | None:
    try:
        import outlines_core
    except ImportError:
        return None
    vocabulary = outlines_core.Vocabulary(eos[0], _byte_vocabulary(tokenizer, set(eos)))
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    started = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_ms = (time.perf_counter() - started) * 1e3
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in [*ids, None]:
        started = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - started)
        if token is not None:
            guide.advance(token)
    return _timing("outlines-core", name, compile_ms, times)


def _xgrammar_timing(tokenizer, vocab_size, eos, name, schema, ids) -> MaskTiming | None:
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    compile_ms = (time.perf_counter() - started) * 1e3
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in [*ids, None]:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        if token is not None:
            assert matcher.accept_token(token)
    return _timing("xgrammar", name, compile_ms, times)


def _byte_vocabulary(tokenizer, eos: set[int]) -> dict[bytes, list[int]]:
    """Token bytes -> ids, from byte-level BPE's printable stand-ins (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    vocabulary: dict[bytes, list[int]] = {}
    for token_id in range(len(tokenizer)):
        if token_id in eos:
            continue
        text = tokenizer.convert_ids_to_tokens(token_id)
        key = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode()
        vocabulary.setdefault(key, []).append(token_id)
    return vocabulary


def _timing(library, name, compile_ms, times) -> MaskTiming:
    us = [t * 1e6 for t in times]
    return MaskTiming(library, name, compile_ms, statistics.median(us), max(us), len(us))


def generation_rows(config: EngineConfig, decoders: list[str], max_tokens: int) -> list[list]:
    """Greedy JSON-schema chats through the engine: per decoder tok/s, ratio, identical, parses."""
    from engine import LLM, SamplingParams

    rows, base_tps, base_texts = [], None, None
    for decoder in ["autoregressive", *decoders]:
        # The config's draft policy (goodput unless --draft-policy fixed): what users get.
        llm = LLM(config=config.with_overrides(decoder={"method": decoder}))
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        schemas = [SCHEMAS["person"][0], SCHEMAS["person"][0]] + [SCHEMAS["inventory"][0]] * 2
        params = [
            SamplingParams(temperature=0, max_tokens=max_tokens,
                           constraint=ConstraintSpec("json_schema", s))
            for s in schemas
        ]  # fmt: skip
        llm.chat(chats[:1], params[0])  # warm-up: kernels, the llguidance tokenizer
        texts, tokens, seconds, finished = [], 0, 0.0, []
        for chat, p in zip(chats, params, strict=True):  # one at a time: batch-1 latency
            started = time.perf_counter()
            out = llm.chat([chat], p)[0]
            seconds += time.perf_counter() - started
            texts.append(out.text)
            tokens += len(out.token_ids)
            finished.append(out.finish_reason == "stop")
        tps = tokens / seconds
        base_tps = base_tps or tps
        base_texts = base_texts or texts
        # A greedy model may loop inside a valid document (digits of an integer) until
        # max_tokens: only finished outputs must parse.
        parses = sum(_parses(t) for t, done in zip(texts, finished, strict=True) if done)
        rows.append([decoder, f"{tps:.1f}", f"{tps / base_tps:.2f}x",
                     "yes" if texts == base_texts else "no", f"{sum(finished)}/{len(texts)}",
                     f"{parses}/{sum(finished)}"])  # fmt: skip
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def run_constraints_bench(config: EngineConfig, decoders: list[str], max_tokens: int) -> None:
    from engine.toolkit import eos_token_ids_of, load_tokenizer, resolve_model

    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    eos = sorted(eos_token_ids_of(model_dir, hf_config))
    print(f"model {model_dir}, vocabulary {hf_config.vocab_size}, torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    print("\n| library | schema | compile ms | mask us/token, median | worst | masks |")
    print("|---|---|---|---|---|---|")
    for t in mask_timings(tokenizer, hf_config.vocab_size, eos):
        print(f"| {t.library} | {t.schema} | {t.compile_ms:.1f} | {t.median_us:.1f} | "
              f"{t.worst_us:.0f} | {t.tokens} |")  # fmt: skip
    print("\nJSON-schema chats, greedy, one request at a time (tok/s over 4 requests):")
    print("| decoder | tok/s | vs autoregressive | identical | finished | finished that parse |")
    print("|---|---|---|---|---|---|")
    for row in generation_rows(config, decoders, max_tokens):
        print("| " + " | ".join(row) + " |")
