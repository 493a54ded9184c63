"""Speculative decoders against autoregressive decoding, in one run, on two prompt sets
(``specserve bench offline --decoder all``).

Every variant (a decoder with its settings: draft precision, window policy, gate) runs on one
engine: the target, its KV cache and scheduler are loaded once and only the speculator is
swapped. Methods are interleaved prompt by prompt, so a change in the machine's load hits all
alike; the prefix cache is off, so every pass prefills as transformers does. Per variant and
prompt set: batch-1 greedy tokens/s, speedup over ``autoregressive``, acceptance rate, mean
acceptance length, whether the tokens equal autoregressive's (they must), and where a decode
step's time went (drafting, the target's verification pass, the rest), from which a variant
slower than autoregressive gets its measured reason. transformers' ``generate()`` runs on the
same prompts: plain, with ``prompt_lookup_num_tokens`` and with ``assistant_model``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from engine.toolkit import (
    DECODERS,
    LLM,
    DecoderConfig,
    EngineConfig,
    ForwardItem,
    LayerSkipConfig,
    SamplingParams,
    SpecDecodeStats,
)
from tooling.bench.bench_report import (
    losing_reason,
    plot_decoder_bench,
    print_header,
    print_rows,
    print_summary,
)

REPO = Path(__file__).resolve().parents[2]  # tooling/bench/ -> the repository
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

    def add(self, other: StepCosts) -> None:
        for name in ("steps", "tokens", "rows", "step_s", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class DecoderResult:
    tokens_per_s: float
    token_ids: list[list[int]]
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    draft_tokens: int = 0
    costs: StepCosts | None = None  # ours only
    repeatable: bool = True  # the same tokens in every repeat
    spread: float = 0.0  # the largest (slowest / fastest - 1) of a prompt's repeats


@dataclass
class DecoderBenchOptions:
    decoders: str = "all"  # "all", or comma-separated variant names
    k: int = 4
    max_tokens: int = 64
    prompts_per_set: int | None = None  # None: every prompt of each set
    repeats: int = 1  # rounds over all prompts and methods; each one's fastest run counts
    with_hf: bool = True
    layerskip_config: str | None = None  # YAML from `specserve tune layerskip`
    plot: str | Path | None = DEFAULT_PLOT
    prompt_sets: tuple[str, ...] = ("chat", "grounded")
    results: dict = field(default_factory=dict)  # filled: {set: {method: DecoderResult}}


def load_prompt_set(name: str) -> list[str]:
    return json.loads((PROMPT_SETS / f"{name}.json").read_text())


# ---- variants ----------------------------------------------------------------------------
def default_layerskip(num_layers: int) -> dict:
    """A fixed skip set: the MLP of every other layer in the last third, short of the end."""
    late = range((2 * num_layers) // 3, num_layers - 2, 2)
    return {"layerskip": {"skip_mlp": list(late) or [0], "skip_attention": [], "exit_layer": None}}


def load_layerskip(path: str | Path) -> dict:
    """The layerskip variant's settings from a YAML file: an engine config as `specserve tune
    layerskip` writes (its ``decoder.layerskip``, and the k and window it tuned with), a
    mapping with ``layerskip``, or the LayerSkipConfig fields themselves."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"layerskip config {str(path)!r} not found")
    data = yaml.safe_load(path.read_text()) or {}
    tuned = {}
    if isinstance(data, dict) and isinstance(data.get("decoder"), dict):
        data = data["decoder"]
        tuned = {k: data[k] for k in ("num_speculative_tokens", "window") if k in data}
    if isinstance(data, dict) and isinstance(data.get("layerskip"), dict):
        data = data["layerskip"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with skip_attention/skip_mlp/exit_layer")
    fields = {k: v for k, v in data.items() if k in LayerSkipConfig.model_fields}
    try:
        return {"layerskip": LayerSkipConfig.model_validate(fields).model_dump(), **tuned}
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def all_variants(num_layers: int, layerskip: dict | None = None) -> list[Variant]:
    """Every decoder's registered bench variants (engine/decoder_registry.py), and the two
    that depend on the model: the draft truncated to its first layers, and layerskip with the
    tuned (or a default) set of skipped layers."""
    truncated = max(1, min(TRUNCATED_LAYERS, num_layers - 1))
    model_dependent = {
        "draft": Variant(
            f"draft-int8-{truncated}layers",
            {"method": "draft", "draft": {"model": "self", "quantization": "int8",
                                          "num_layers": truncated}},
        ),
        "layerskip": Variant(
            "layerskip" if layerskip is None else "layerskip-tuned",
            {"method": "layerskip", **(layerskip or default_layerskip(num_layers))},
        ),
    }  # fmt: skip
    variants = []
    for name, spec in DECODERS.items():
        variants += [Variant(v, overrides) for v, overrides in spec.bench.items()]
        if name in model_dependent:
            variants.append(model_dependent[name])
    return variants


def select_variants(spec: str, variants: list[Variant]) -> list[Variant]:
    """``all`` or comma-separated names (``autoregressive`` is always measured anyway)."""
    if spec.strip() == "all":
        return variants
    by_name = {v.name: v for v in variants}
    by_name.setdefault("layerskip", by_name.get("layerskip-tuned"))
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
    # A variant drafts its k every step unless it names the policy: "eagle-k2" means k = 2.
    fields = _merged(
        base.model_dump(),
        {"num_speculative_tokens": k, "draft_policy": "fixed", **variant.decoder},
    )
    fields["extra_methods"] = []
    return DecoderConfig.model_validate(fields)


# ---- instrumentation ---------------------------------------------------------------------
class StepTimer:
    """Times the engine's decode steps, split into drafting and the target's forward pass.

    Instrumentation only: it wraps ``engine.step``, ``engine.runner.forward`` (the target's
    runner, whose ``run`` calls it; drafters have their own) and each speculator's ``propose``
    on the instances.
    """

    def __init__(self, engine):
        self.costs = StepCosts()
        self._draft = self._forward = 0.0
        self._rows = 0
        self._decode = False
        step, forward = engine.step, engine.runner.forward

        def timed_forward(items, **options):
            start = time.perf_counter()
            out = forward(items, **options)
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

        engine.step, engine.runner.forward = timed_step, timed_forward

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
            engine.runner.run([item]).sum().item()  # .item(): a GPU finishes the pass first
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
    return costs


# ---- measured passes ---------------------------------------------------------------------
def hf_generate(hf, prompt: list[int], max_tokens: int, options: dict) -> list[int]:
    """transformers' greedy generate() of one prompt; returns the new token ids."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=hf.generation_config.eos_token_id,
            **options,
        )
    return out[0, len(prompt) :].tolist()


@dataclass
class _Run:
    seconds: float
    token_ids: list[int]
    costs: StepCosts | None = None
    stats: SpecDecodeStats | None = None


def _warm_up(llm: LLM, speculators: dict, hf, prompt: list[int]) -> None:
    """One short generation per method; then the speculators count from zero."""
    for spec in speculators.values():
        if spec is not None and spec.policy is not None:
            spec.policy.ensure_calibrated()  # as a fresh engine does, outside the timing
        llm.engine.use_speculator(spec)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
        if spec is not None:
            spec.stats = SpecDecodeStats()
    for options in hf[1].values() if hf else ():
        hf_generate(hf[0], prompt, 4, options)


def measure_set(llm, timer, speculators: dict, hf, prompts, max_tokens: int, repeats: int = 1):
    """Every method on every prompt, interleaved: prompt by prompt, each method in turn, so
    that a change in the machine's load hits all methods alike; with ``repeats``, the whole
    round again, keeping each (method, prompt)'s fastest run. ``speculators`` maps our methods
    to their speculator (None: autoregressive); ``hf`` is (model, {name: options}) or None."""
    engine, (target, hf_options) = llm.engine, hf or (None, {})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    _warm_up(llm, speculators, hf, prompts[0])
    best: dict[tuple[str, int], _Run] = {}
    slowest: dict[tuple[str, int], float] = {}
    differs: set[str] = set()  # methods whose tokens changed between repeats

    def keep(name: str, i: int, run: _Run) -> None:
        old = best.setdefault((name, i), run)
        if old.token_ids != run.token_ids:
            differs.add(name)
        if run.seconds < old.seconds:
            best[(name, i)] = run
        slowest[(name, i)] = max(slowest.get((name, i), 0.0), run.seconds)

    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for name, spec in speculators.items():
                engine.use_speculator(spec)
                timer.costs = StepCosts()
                if spec is not None:
                    spec.stats = SpecDecodeStats()  # this run's
                start = time.perf_counter()
                ids = llm.generate([prompt], params)[0].token_ids
                stats = spec.stats if spec is not None else None
                keep(name, i, _Run(time.perf_counter() - start, ids, timer.costs, stats))
            for name, options in hf_options.items():
                start = time.perf_counter()
                ids = hf_generate(target, prompt, max_tokens, options)
                keep(name, i, _Run(time.perf_counter() - start, ids))
    engine.use_speculator(None)
    results = {}
    for name in [*speculators, *hf_options]:
        runs = [best[(name, i)] for i in range(len(prompts))]
        results[name] = _result(runs)
        results[name].repeatable = name not in differs
        # How far the machine's load moved one method's time on one prompt between repeats.
        results[name].spread = max(slowest[(name, i)] / r.seconds - 1 for i, r in enumerate(runs))
    return results


def _result(runs: list[_Run]) -> DecoderResult:
    seconds = sum(r.seconds for r in runs)
    result = DecoderResult(
        sum(len(r.token_ids) for r in runs) / seconds, [r.token_ids for r in runs]
    )
    if runs[0].costs is not None:
        result.costs = StepCosts()
        for r in runs:
            result.costs.add(r.costs)
    if runs[0].stats is not None:
        stats = SpecDecodeStats()
        for r in runs:
            stats.num_drafts += r.stats.num_drafts
            stats.num_draft_tokens += r.stats.num_draft_tokens
            stats.num_accepted_tokens += r.stats.num_accepted_tokens
        result.acceptance_rate = stats.acceptance_rate
        result.mean_acceptance_length = stats.mean_acceptance_length
        result.draft_tokens = stats.num_draft_tokens
    return result


def hf_methods(model_dir: Path, k: int, num_layers: int):
    """transformers' target (float32, our weights) and its generate() settings by row name."""
    import transformers

    from engine.toolkit import load_hf_model

    transformers.logging.set_verbosity_error()  # the truncated copy's unused-weights notice

    def load(dtype, **config):
        return load_hf_model(model_dir, dtype, **config)

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
        f"{HF} assistant_model=bf16 first {truncated} layers": {"assistant_model": short},
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
    speculators = {"autoregressive": None}
    for name, decoder in configs.items():
        # The engine's own construction: the variant is exactly what its config loads (and
        # not the shipped drafters besides).
        only = decoder.model_copy(update={"load_shipped_drafters": False})
        speculators[name] = engine.build_speculator(only)
        timer.watch(speculators[name])
    hf = hf_methods(llm.model_dir, k, num_layers) if options.with_hf else None
    print_header(llm, options, configs, len(context), forward_s)
    losing = []
    for set_name, prompts in sets.items():
        results = measure_set(
            llm, timer, speculators, hf, prompts, options.max_tokens, options.repeats
        )
        print_rows(set_name, results)
        base = results["autoregressive"].tokens_per_s
        losing += [
            f"- {set_name} {name}: {r.tokens_per_s / base:.2f}x. {losing_reason(r, results)}"
            for name, r in results.items()
            if r.costs is not None and r.tokens_per_s < base
        ]
        options.results[set_name] = results
    print_summary(options.results, losing)
    if options.plot:
        print(f"\nplot: {plot_decoder_bench(options, llm.model_dir.name)}")
    return options.results
