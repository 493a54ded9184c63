"""Speculative decoders against autoregressive decoding, in one run, on two prompt sets
(``specserve bench offline --decoder all``).

Every variant (a decoder with its settings: draft precision, window policy, gate) runs on one
engine: the target, its KV cache and its scheduler are loaded once and only the speculator is
swapped, so the variants differ in nothing else. The prefix cache is off, so every pass
prefills its prompts as transformers does. Per variant and prompt set: batch-1 greedy tokens/s
(each prompt alone), the speedup over ``autoregressive`` measured in the same run, acceptance
rate, mean acceptance length, whether the tokens equal autoregressive's (they must), and where
a decode step's time went: drafting (the speculator's ``propose``), the target's verification
forward pass, and the rest of the step. A variant slower than autoregressive is reported with
those measured costs. The same prompts also run through transformers' ``generate()``: plain,
with ``prompt_lookup_num_tokens``, and with ``assistant_model`` (SmolLM2 in bfloat16, and its
first layers), with their agreement with our greedy tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from engine.config import DecoderConfig, EngineConfig, LayerSkipConfig
from engine.llm import LLM
from engine.model_runner import ForwardItem
from engine.sampling import SamplingParams
from engine.speculation import SpecDecodeStats

REPO = Path(__file__).resolve().parent.parent
PROMPT_SETS = REPO / "configs" / "prompts"
DEFAULT_PLOT = REPO / "docs" / "decoders-benchmark.png"
TRUNCATED_LAYERS = 8  # the truncated self draft's layers (and the transformers assistant's)
HF = "transformers"


@dataclass(frozen=True)
class Variant:
    """A named decoder setting: DecoderConfig fields over the base config (mappings merge)."""

    name: str
    decoder: dict


@dataclass
class StepCosts:
    """The decode steps of one measured pass and where their time went."""

    steps: int = 0
    tokens: int = 0  # emitted by those steps
    rows: int = 0  # tokens the target's forward passes read (decode token + drafts)
    step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def per_step_ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.steps if self.steps else 0.0

    @property
    def rest_s(self) -> float:
        return self.step_s - self.draft_s - self.verify_s


@dataclass
class DecoderResult:
    tokens_per_s: float
    token_ids: list[list[int]]
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    draft_tokens: int = 0
    costs: StepCosts | None = None


@dataclass
class DecoderBenchOptions:
    decoders: str = "all"  # "all", or comma-separated variant names
    k: int = 4
    max_tokens: int = 64
    prompts_per_set: int | None = None  # None: every prompt of each set
    with_hf: bool = True
    layerskip_config: str | None = None  # YAML from `specserve tune layerskip`
    plot: str | Path | None = DEFAULT_PLOT
    prompt_sets: tuple[str, ...] = ("chat", "grounded")
    results: dict = field(default_factory=dict)  # filled: {set: {method: DecoderResult}}


def load_prompt_set(name: str) -> list[str]:
    return json.loads((PROMPT_SETS / f"{name}.json").read_text())


# ---- variants ----------------------------------------------------------------------------
def default_layerskip(num_layers: int) -> dict:
    """A fixed skip set: the MLP of every other layer in the last third (not the last)."""
    late = range(num_layers - 2, (2 * num_layers) // 3 - 1, -2)
    return {"skip_mlp": sorted(late) or [0], "skip_attention": [], "exit_layer": None}


def load_layerskip(path: str | Path) -> dict:
    """The skip set in a YAML file: an engine config (``decoder.layerskip``), a mapping with
    ``layerskip``, or the LayerSkipConfig fields themselves."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"layerskip config {str(path)!r} not found")
    data = yaml.safe_load(path.read_text()) or {}
    for key in ("decoder", "layerskip"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with skip_attention/skip_mlp/exit_layer")
    fields = {k: v for k, v in data.items() if k in LayerSkipConfig.model_fields}
    try:
        return LayerSkipConfig.model_validate(fields).model_dump()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def all_variants(num_layers: int, layerskip: dict | None = None) -> list[Variant]:
    """Every decoder and policy the benchmark knows, each with its settings."""

    def draft(quantization: str = "int8", layers: int | None = None, **extra) -> dict:
        spec = {"model": "self", "quantization": quantization, "num_layers": layers}
        return {"method": "draft", "draft": spec, **extra}

    truncated = max(1, min(TRUNCATED_LAYERS, num_layers - 1))
    return [
        Variant("ngram", {"method": "ngram"}),
        Variant("draft-int8", draft()),
        Variant("draft-bf16", draft("bfloat16")),
        Variant(f"draft-int8-{truncated}layers", draft(layers=truncated)),
        Variant(
            "layerskip",
            {"method": "layerskip", "layerskip": layerskip or default_layerskip(num_layers)},
        ),
        Variant("hierarchical", {**draft(), "method": "hierarchical", "hierarchical": {}}),
        Variant("draft-int8-adaptive", draft(window={"policy": "adaptive_exit"})),
        Variant("draft-int8-entropy", draft(window={"policy": "entropy"})),
        Variant("draft-int8-gate0.3", draft(gate={"min_target_prob": 0.3})),
    ]


def select_variants(spec: str, variants: list[Variant]) -> list[Variant]:
    """``all`` or comma-separated names (``autoregressive`` is always measured anyway)."""
    if spec.strip() == "all":
        return variants
    by_name = {v.name: v for v in variants}
    names = [n.strip() for n in spec.split(",") if n.strip() and n.strip() != "autoregressive"]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(
            f"unknown decoder variant(s) {', '.join(unknown)}; known: all, {', '.join(by_name)}"
        )
    return [by_name[n] for n in dict.fromkeys(names)]


def _merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def decoder_config(base: DecoderConfig, variant: Variant, k: int) -> DecoderConfig:
    fields = _merged(base.model_dump(), variant.decoder)
    fields.update(extra_methods=[], num_speculative_tokens=k)
    return DecoderConfig.model_validate(fields)


def describe(config: DecoderConfig) -> str:
    """The settings that make a variant what it is, in one line."""
    parts = [f"{config.method}, k={config.num_speculative_tokens}"]
    if config.method in ("draft", "hierarchical"):
        d = config.draft
        layers = "all layers" if d.num_layers is None else f"first {d.num_layers} layers"
        parts.append(f"draft {d.model} ({d.quantization}, {layers})")
    if config.method == "ngram":
        parts.append(f"n-grams {config.prompt_lookup_min}-{config.prompt_lookup_max}")
    if config.method == "layerskip":
        s = config.layerskip
        parts.append(
            f"skip_attention {s.skip_attention}, skip_mlp {s.skip_mlp}, exit_layer {s.exit_layer}"
        )
    if config.method == "hierarchical":
        h = config.hierarchical
        parts.append(f"level 1 {h.level1}, tau2 {h.tau2}")
    if config.method != "ngram":
        w = config.window
        detail = {"adaptive_exit": f" gamma {w.gamma}", "entropy": f" tau {w.tau}"}
        parts.append(f"window {w.policy}{detail.get(w.policy, '')}")
    if config.gate.min_target_prob is not None:
        parts.append(f"gate min_target_prob {config.gate.min_target_prob}")
    return "; ".join(parts)


# ---- instrumentation ---------------------------------------------------------------------
class StepTimer:
    """Times the engine's decode steps, split into drafting and the target's forward pass.

    Instrumentation only: it wraps ``engine.step``, ``engine.runner.run`` (the target's
    runner; drafters have their own) and each speculator's ``propose`` on the instances.
    """

    def __init__(self, engine):
        self.costs = StepCosts()
        self._draft = self._forward = 0.0
        self._rows = 0
        self._decode = False
        step, run = engine.step, engine.runner.run

        def timed_run(items, **options):
            start = time.perf_counter()
            out = run(items, **options)
            self._forward += time.perf_counter() - start
            # Every new token gets logits in a decode (or verification) step, not in a prefill.
            self._decode = all(len(i.token_ids) == i.num_logits for i in items)
            self._rows = sum(len(i.token_ids) for i in items)
            return out

        def timed_step():
            self._draft = self._forward = 0.0
            self._decode = False
            start = time.perf_counter()
            outputs = step()
            elapsed = time.perf_counter() - start
            if self._decode:
                c = self.costs
                c.steps += 1
                c.rows += self._rows
                c.step_s += elapsed
                c.draft_s += self._draft
                c.verify_s += self._forward
                c.tokens += sum(o.num_new_tokens for r in outputs for o in r.outputs)
            return outputs

        engine.step, engine.runner.run = timed_step, timed_run

    def watch(self, speculator) -> None:
        propose = speculator.propose

        def timed_propose(scheduled):
            start = time.perf_counter()
            try:
                return propose(scheduled)
            finally:
                self._draft += time.perf_counter() - start

        speculator.propose = timed_propose


def forward_costs(engine, context: list[int], max_rows: int, repeats: int = 7) -> list[float]:
    """Median seconds of one target forward pass over 1..``max_rows`` new tokens after
    ``context``. Writes K/V into the first blocks directly: call before any request."""
    size = engine.kv_cache.block_size
    table = list(range((len(context) + max_rows) // size + 1))
    engine.runner.run([ForwardItem(context, 0, table, 1)])
    costs = []
    for n in range(1, max_rows + 1):
        item = ForwardItem(context[-n:], len(context), table, n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.runner.run([item])
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
    return costs


# ---- measured passes ---------------------------------------------------------------------
def run_ours(llm: LLM, prompts: list[list[int]], max_tokens: int, timer: StepTimer):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    spec = llm.engine.speculator
    if spec is not None:
        spec.stats = SpecDecodeStats()  # count this pass only
    timer.costs = StepCosts()
    start, outputs = time.perf_counter(), []
    for p in prompts:
        outputs.append(llm.generate([p], params)[0].token_ids)
    elapsed = time.perf_counter() - start
    costs, timer.costs = timer.costs, StepCosts()  # nothing after this pass counts in it
    result = DecoderResult(sum(len(o) for o in outputs) / elapsed, outputs, costs=costs)
    if spec is not None:
        result.acceptance_rate = spec.stats.acceptance_rate
        result.mean_acceptance_length = spec.stats.mean_acceptance_length
        result.draft_tokens = spec.stats.num_draft_tokens
    return result


def run_hf(hf, prompts: list[list[int]], max_tokens: int, **kwargs) -> DecoderResult:
    def generate(p: list[int], n: int) -> list[int]:
        ids = torch.tensor([p])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=hf.generation_config.eos_token_id,
            **kwargs,
        )
        return out[0, len(p) :].tolist()

    with torch.inference_mode():
        generate(prompts[0], 4)  # warm-up
        start = time.perf_counter()
        outputs = [generate(p, max_tokens) for p in prompts]
    elapsed = time.perf_counter() - start
    return DecoderResult(sum(len(o) for o in outputs) / elapsed, outputs)


def hf_methods(model_dir: Path, k: int, num_layers: int):
    """transformers' target (float32, our weights) and its generate() settings by row name."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # the truncated copy's unused-weights notice

    def load(dtype, **config):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **config).eval()

    truncated = max(1, min(TRUNCATED_LAYERS, num_layers - 1))
    copy, short = load(torch.bfloat16), load(torch.bfloat16, num_hidden_layers=truncated)
    for assistant in (copy, short):
        # Our k, every step (transformers' defaults: 20 tokens, stop below confidence 0.4).
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
    methods = {
        f"{HF} generate()": {},
        f"{HF} prompt_lookup_num_tokens={k}": {"prompt_lookup_num_tokens": k},
        f"{HF} assistant_model=bf16 copy": {"assistant_model": copy},
        f"{HF} assistant_model=bf16 {truncated} layers": {"assistant_model": short},
    }
    return load(torch.float32), methods


# ---- the run -----------------------------------------------------------------------------
def run_decoder_bench(config: EngineConfig, options: DecoderBenchOptions) -> dict:
    """Measure every selected variant, autoregressive and transformers on each prompt set;
    print the table and the reasons of the variants that lose; write the plot."""
    llm = LLM(
        config=config.with_overrides(
            decoder={"method": "autoregressive", "extra_methods": []},
            kv_cache={"enable_prefix_caching": False},  # every pass prefills, as HF does
        )
    )
    engine, k = llm.engine, options.k
    num_layers = engine.model.arch.num_layers
    layerskip = load_layerskip(options.layerskip_config) if options.layerskip_config else None
    variants = select_variants(options.decoders, all_variants(num_layers, layerskip))
    configs = {v.name: decoder_config(config.decoder, v, k) for v in variants}
    sets = {
        name: [
            llm.render_chat([{"role": "user", "content": text}])
            for text in load_prompt_set(name)[: options.prompts_per_set]
        ]
        for name in options.prompt_sets
    }
    context = max((p for ps in sets.values() for p in ps), key=len)
    forward_s = forward_costs(engine, context, k + 1)  # before any request: see its docstring
    timer = StepTimer(engine)
    hf = hf_methods(llm.model_dir, k, num_layers) if options.with_hf else None
    _print_header(llm, options, configs, len(context), forward_s)
    losing, notes = [], []
    for set_name, prompts in sets.items():
        results = {"autoregressive": run_ours(llm, prompts, options.max_tokens, timer)}
        for name, decoder in configs.items():
            # The engine's own construction: the variant is exactly what its config loads.
            engine.speculator = engine._build_speculator(decoder)
            timer.watch(engine.speculator)
            results[name] = run_ours(llm, prompts, options.max_tokens, timer)
        engine.speculator = None
        again = run_ours(llm, prompts, options.max_tokens, timer).tokens_per_s
        first = results["autoregressive"].tokens_per_s
        notes.append(
            f"{set_name}: autoregressive measured again after the variants: {again:.1f} tok/s "
            f"({again / first - 1:+.0%} from the first pass)"
        )
        if hf is not None:
            target, methods = hf
            for name, kwargs in methods.items():
                results[name] = run_hf(target, prompts, options.max_tokens, **kwargs)
        _print_rows(set_name, results)
        losing += [
            f"- {set_name} {name}: {r.tokens_per_s / first:.2f}x. {losing_reason(r, results)}"
            for name, r in results.items()
            if r.costs is not None and r.tokens_per_s < first
        ]
        options.results[set_name] = results
    _print_summary(options.results, notes, losing)
    if options.plot:
        _plot(options, llm.model_dir.name)
    return options.results


def _print_header(llm, options, configs, context_len: int, forward_s: list[float]) -> None:
    print(
        f"model {llm.model_dir} ({llm.engine.model.arch.num_layers} layers, {llm.config.dtype}), "
        f"torch threads {torch.get_num_threads()}; greedy, batch 1, max_tokens "
        f"{options.max_tokens}, k={options.k}, prompt sets {', '.join(options.prompt_sets)} "
        f"({options.prompts_per_set or 'all'} prompts each), prefix cache off\n"
    )
    one = forward_s[0]
    passes = ", ".join(f"{n + 1}: {1e3 * s:.1f}" for n, s in enumerate(forward_s))
    print(
        f"target forward pass after a {context_len}-token context, ms by new tokens (median of "
        f"7): {passes}; {len(forward_s)} tokens cost {forward_s[-1] / one:.2f}x one token\n"
    )
    print("variants:")
    for name, config in configs.items():
        print(f"- {name}: {describe(config)}")
    print(
        "\n| prompts | method | tok/s | speedup vs autoregressive | acceptance rate | "
        "mean acceptance length | identical to autoregressive | tokens/step | "
        "ms/step: draft + verify + rest |\n|---|---|---|---|---|---|---|---|---|"
    )


def _print_rows(set_name: str, results: dict[str, DecoderResult]) -> None:
    reference = results["autoregressive"]
    for name, r in results.items():
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        length = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}"
        same = sum(a == b for a, b in zip(r.token_ids, reference.token_ids, strict=True))
        if same == len(reference.token_ids):
            identical = "yes"
        else:  # ours must never differ; transformers' float arithmetic may
            identical = f"{'NO, ' if r.costs else ''}{same}/{len(reference.token_ids)} prompts"
        steps = tokens = "-"
        if r.costs is not None and r.costs.steps:
            c = r.costs
            tokens = f"{c.tokens / c.steps:.2f}"
            steps = " + ".join(f"{c.per_step_ms(s):.1f}" for s in (c.draft_s, c.verify_s, c.rest_s))
        print(
            f"| {set_name} | {name} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / reference.tokens_per_s:.2f}x | {rate} | {length} | {identical} | "
            f"{tokens} | {steps} |"
        )


def losing_reason(r: DecoderResult, results: dict[str, DecoderResult]) -> str:
    """Why ``r`` is slower than autoregressive, in units of an autoregressive decode step."""
    c, a = r.costs, results["autoregressive"].costs
    unit = a.per_step_ms(a.step_s)  # ms of one autoregressive step = one token
    draft = c.per_step_ms(c.draft_s) / unit
    verify = (c.per_step_ms(c.verify_s) - a.per_step_ms(a.verify_s)) / unit
    rest = (c.per_step_ms(c.rest_s) - a.per_step_ms(a.rest_s)) / unit
    per_draft = 1e3 * c.draft_s / r.draft_tokens if r.draft_tokens else 0.0
    largest = max((draft, "drafting"), (verify, "verification"), (rest, "step overhead"))[1]
    return (
        f"A decode step emits {c.tokens / c.steps:.2f} tokens (acceptance "
        f"{r.acceptance_rate or 0:.0%}, {r.draft_tokens / c.steps:.2f} drafts per step) but "
        f"costs {c.per_step_ms(c.step_s) / unit:.2f} autoregressive steps: drafting "
        f"+{draft:.2f} ({per_draft:.1f} ms per draft token, {per_draft / unit:.2f} steps), "
        f"verifying {c.rows / c.steps:.2f} tokens {verify:+.2f}, rest {rest:+.2f}. "
        f"Largest cost: {largest}."
    )


def _print_summary(results: dict, notes: list[str], losing: list[str]) -> None:
    print()
    for set_name, per_set in results.items():
        base = per_set["autoregressive"].tokens_per_s
        ours = {n: r for n, r in per_set.items() if r.costs is not None and n != "autoregressive"}
        if ours:
            best = max(ours, key=lambda n: ours[n].tokens_per_s)
            line = f"{set_name}: best decoder {best} {ours[best].tokens_per_s / base:.2f}x"
            theirs = {n: r for n, r in per_set.items() if r.costs is None}
            if theirs:
                top = max(theirs, key=lambda n: theirs[n].tokens_per_s)
                ratio = ours[best].tokens_per_s / theirs[top].tokens_per_s
                line += f"; best {HF}: {top} {theirs[top].tokens_per_s / base:.2f}x"
                line += f" (ours is {ratio:.2f}x its tok/s)"
            print(line)
    for note in notes:
        print(note)
    if losing:
        print("\nslower than autoregressive (costs in autoregressive decode steps):")
        print("\n".join(losing))


def _plot(options: DecoderBenchOptions, model_name: str) -> None:
    from engine.bench_plot import plot_speedups

    speedups = {
        s: {n: r.tokens_per_s / per_set["autoregressive"].tokens_per_s for n, r in per_set.items()}
        for s, per_set in options.results.items()
    }
    baseline = {n for per_set in options.results.values() for n in per_set if n.startswith(HF)}
    title = (
        f"{model_name}: greedy, batch 1, {options.max_tokens} tokens, k={options.k} "
        "(bars: speedup over our autoregressive decoding in the same run)"
    )
    print(f"\nplot: {plot_speedups(speedups, options.plot, title, baseline)}")
