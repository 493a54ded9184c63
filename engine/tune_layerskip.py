"""``specserve tune layerskip``: search the layerskip draft for measured tokens/s.

The objective is what a user gets: greedy, batch-1 tokens/s of the ``layerskip`` decoder on
calibration prompts (the chat and grounded sets by default, rendered with the chat
template), timed like ``specserve bench decoders``. Autoregressive decoding is measured on
the same prompts in the same process first, and every trial's tokens must equal it (they
are the target's greedy tokens whatever the draft; a difference is a bug and stops the run).

**The search space.** A draft skips one contiguous span of attention sublayers and one of
MLP sublayers, each a (first layer, count) pair, and drafts k tokens per step: four or five
integers instead of one boolean per sublayer (60 for SmolLM2's 30 layers). With a budget of
tens of trials TPE cannot learn 60 independent dimensions (Draft & Verify ran about a
thousand Bayesian-optimisation steps), while the sublayers a deep, narrow model can spare
come in runs in its middle-to-late layers, which a span describes. Counts are drawn on a log
scale, so that the few-sublayer drafts that can still agree with the target are tried as
often as the cheap many-sublayer ones. k is searched too unless fixed: a weak draft wants a
short k, and the best skip set depends on it. The early exit (``--early-exit``) is off by
default: cutting after layer e is what two spans reaching the last layer already express
(both sublayers of every later layer skipped), and without LayerSkip's early-exit training
the intermediate layers are poor exits. The space is the same for every trial, so
multivariate TPE (optuna's default) can model how the parameters interact. A trial that
would skip nothing is an invalid draft (the decoder refuses it): it is pruned, not measured.

**Honesty.** The best study value is the maximum of noisy measurements, so it is biased
upward. The best few distinct drafts are measured again after the study, together with
autoregressive decoding, and only those confirmation numbers decide whether a draft beats
autoregressive (by more than ``min_speedup``). Trials are deterministic given the seed
except for timing noise: TPE's proposals after its random start-up trials follow the
measured values.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from engine.bench_decoders import PROMPT_SETS, DecoderResult, load_prompt_set, run_ours
from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM

DEFAULT_PROMPT_SETS = ("chat", "grounded")


class GreedyMismatchError(RuntimeError):
    """A layerskip run's greedy tokens differ from autoregressive decoding's."""


@dataclass(frozen=True)
class SkipSet:
    """One layerskip draft: what it skips, where it exits, and k."""

    skip_attention: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    exit_layer: int | None
    num_speculative_tokens: int

    @property
    def is_empty(self) -> bool:
        return not (self.skip_attention or self.skip_mlp or self.exit_layer is not None)

    def decoder_overrides(self) -> dict:
        """The ``decoder`` section fields that select this draft."""
        return {
            "method": "layerskip",
            "num_speculative_tokens": self.num_speculative_tokens,
            "layerskip": {
                "skip_attention": list(self.skip_attention),
                "skip_mlp": list(self.skip_mlp),
                "exit_layer": self.exit_layer,
            },
        }

    def describe(self) -> str:
        parts = [f"attn {_spans(self.skip_attention)}", f"mlp {_spans(self.skip_mlp)}"]
        if self.exit_layer is not None:
            parts.append(f"exit {self.exit_layer}")
        return ", ".join(parts) + f", k={self.num_speculative_tokens}"


@dataclass
class TrialResult:
    number: int
    skip_set: SkipSet
    result: DecoderResult
    confirmed: DecoderResult | None = None  # the re-measurement after the study

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s


@dataclass
class TuneResult:
    baseline: DecoderResult  # autoregressive, before the study
    trials: list[TrialResult]  # measured trials, best study value first
    num_pruned: int
    confirmed_baseline: DecoderResult | None = None  # autoregressive, after the study
    min_speedup: float = 1.0
    confirmed: list[TrialResult] = field(default_factory=list)  # best confirmation first

    @property
    def best(self) -> TrialResult | None:
        """The draft with the best confirmation tokens/s (None: no draft was measured)."""
        return self.confirmed[0] if self.confirmed else None

    @property
    def speedup(self) -> float | None:
        """The best draft's confirmation tokens/s over autoregressive's, measured together."""
        if self.best is None or self.confirmed_baseline is None:
            return None
        return self.best.confirmed.tokens_per_s / self.confirmed_baseline.tokens_per_s

    @property
    def beats_autoregressive(self) -> bool:
        return self.speedup is not None and self.speedup > self.min_speedup


def suggest_skip_set(trial, num_layers: int, k_range: tuple[int, int], early_exit: bool) -> SkipSet:
    """Draw a draft from an optuna trial (see the module docstring for the parametrisation)."""

    def span(kind: str) -> tuple[int, ...]:
        # count + 1 on a log scale: small spans, the ones likely to draft well, are drawn
        # as often as large ones are.
        count = trial.suggest_int(f"{kind}_count_plus_1", 1, num_layers + 1, log=True) - 1
        first = trial.suggest_int(f"{kind}_first", 0, num_layers - 1)
        return tuple(range(first, min(num_layers, first + count)))

    attention, mlp = span("attention"), span("mlp")
    exit_layer = None
    if early_exit and num_layers > 1:
        cut = trial.suggest_int("layers_cut", 0, num_layers - 1)  # 0: no early exit
        if cut:
            exit_layer = num_layers - 1 - cut
            # sublayers after the exit never run: keep the config free of them
            attention = tuple(i for i in attention if i <= exit_layer)
            mlp = tuple(i for i in mlp if i <= exit_layer)
    k = trial.suggest_int("num_speculative_tokens", *k_range)
    return SkipSet(attention, mlp, exit_layer, k)


class LayerSkipTuner:
    """Measures drafts on fixed calibration prompts, reusing one loaded model.

    Each measurement builds a fresh ``Engine`` (its own KV cache and decoders) around the
    ``LLM``'s model instead of loading the checkpoint again.
    """

    def __init__(self, llm: LLM, prompts: list[list[int]], max_tokens: int):
        if not prompts:
            raise ValueError("no calibration prompts")
        self.llm = llm
        self.model = llm.engine.model
        self.eos_token_ids = llm.engine.eos_token_ids
        self.base_config = llm.config.with_overrides(
            decoder={"method": "autoregressive", "extra_methods": []}
        )
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.reference: list[list[int]] | None = None  # autoregressive's tokens
        self._measured: dict[SkipSet, DecoderResult] = {}

    @property
    def num_layers(self) -> int:
        return self.model.arch.num_layers

    def measure(self, skip_set: SkipSet | None) -> DecoderResult:
        """Time ``skip_set``'s draft (None: autoregressive) on the calibration prompts."""
        config = self.base_config
        if skip_set is not None:
            config = config.with_overrides(decoder=skip_set.decoder_overrides())
        self.llm.engine = None  # free the previous engine's KV cache before allocating one
        gc.collect()
        self.llm.engine = Engine(config, self.model, self.eos_token_ids)
        self.llm.config = config
        result = run_ours(self.llm, self.prompts, self.max_tokens)
        if skip_set is None and self.reference is None:
            self.reference = result.token_ids
        elif skip_set is not None:
            self._check_identical(skip_set, result.token_ids)
        return result

    def measure_once(self, skip_set: SkipSet) -> DecoderResult:
        """``measure``, but a draft TPE proposes again is not timed again."""
        if skip_set not in self._measured:
            self._measured[skip_set] = self.measure(skip_set)
        return self._measured[skip_set]

    def _check_identical(self, skip_set: SkipSet, token_ids: list[list[int]]) -> None:
        assert self.reference is not None, "measure autoregressive decoding first"
        for i, (got, want) in enumerate(zip(token_ids, self.reference, strict=True)):
            if got != want:
                n = min(len(got), len(want))
                at = next((j for j in range(n) if got[j] != want[j]), n)
                raise GreedyMismatchError(
                    f"layerskip ({skip_set.describe()}) differs from autoregressive greedy "
                    f"decoding on calibration prompt {i} at generated token {at}: "
                    f"{got[at : at + 4]} vs {want[at : at + 4]}"
                )


def tune_layerskip(
    tuner: LayerSkipTuner,
    num_trials: int,
    seed: int = 0,
    k_range: tuple[int, int] = (1, 6),
    early_exit: bool = False,
    confirm_top: int = 3,
    min_speedup: float = 1.0,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Measure autoregressive decoding, run the study, then re-measure the best drafts.

    ``min_speedup`` is the confirmation speedup a draft must exceed to count as beating
    autoregressive decoding. ``log`` receives one progress line per measurement.
    """
    import optuna

    baseline = tuner.measure(None)
    log(f"autoregressive: {baseline.tokens_per_s:.1f} tok/s")
    trials: dict[int, TrialResult] = {}

    def objective(trial: optuna.Trial) -> float:
        skip_set = suggest_skip_set(trial, tuner.num_layers, k_range, early_exit)
        if skip_set.is_empty:
            log(f"trial {trial.number}: skips nothing (the target itself), pruned")
            raise optuna.TrialPruned()
        result = tuner.measure_once(skip_set)
        trials[trial.number] = TrialResult(trial.number, skip_set, result)
        log(
            f"trial {trial.number}: {skip_set.describe()}: {result.tokens_per_s:.1f} tok/s "
            f"({result.tokens_per_s / baseline.tokens_per_s:.2f}x), "
            f"acceptance {result.acceptance_rate:.0%}"
        )
        return result.tokens_per_s

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Fewer random start-up trials than optuna's 10 when the budget is small, so that TPE
    # proposes at least two thirds of them.
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(3, num_trials // 3))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(objective, n_trials=num_trials)
    ranked = sorted(trials.values(), key=lambda t: t.tokens_per_s, reverse=True)
    result = TuneResult(baseline, ranked, num_trials - len(trials), min_speedup=min_speedup)
    _confirm(tuner, result, confirm_top, log)
    return result


def _confirm(tuner: LayerSkipTuner, result: TuneResult, top: int, log) -> None:
    """Re-measure autoregressive decoding and the ``top`` best distinct drafts."""
    candidates: dict[SkipSet, TrialResult] = {}
    for t in result.trials:  # best first; a draft proposed twice is confirmed once
        candidates.setdefault(t.skip_set, t)
    candidates = list(candidates.values())[:top]
    if not candidates:
        return
    result.confirmed_baseline = tuner.measure(None)
    log(f"confirmation: autoregressive {result.confirmed_baseline.tokens_per_s:.1f} tok/s")
    for t in candidates:
        t.confirmed = tuner.measure(t.skip_set)
        log(f"confirmation: trial {t.number}: {t.confirmed.tokens_per_s:.1f} tok/s")
    result.confirmed = sorted(candidates, key=lambda t: t.confirmed.tokens_per_s, reverse=True)


@dataclass
class TuneOptions:
    prompt_sets: tuple[str, ...] = DEFAULT_PROMPT_SETS
    num_prompts: int | None = 3  # from each set; None: all
    max_tokens: int = 64
    num_trials: int = 20
    seed: int = 0
    k_range: tuple[int, int] = (1, 6)
    early_exit: bool = False
    confirm_top: int = 3
    min_speedup: float = 1.0
    output: Path | None = Path("configs/layerskip-tuned.yaml")
    write_anyway: bool = False


def run_tune_layerskip(config: EngineConfig, options: TuneOptions) -> TuneResult:
    """``specserve tune layerskip``: search, print the results, write the config if it won."""
    llm = LLM(
        config=config.with_overrides(decoder={"method": "autoregressive", "extra_methods": []})
    )
    prompts = calibration_prompts(llm, list(options.prompt_sets), options.num_prompts)
    context = _context(llm, options, len(prompts))
    print(context + "\n")
    tuner = LayerSkipTuner(llm, prompts, options.max_tokens)
    result = tune_layerskip(
        tuner,
        options.num_trials,
        options.seed,
        options.k_range,
        options.early_exit,
        options.confirm_top,
        options.min_speedup,
    )
    print("\n" + format_table(result) + "\n")
    print(verdict(result))
    if result.best is None or options.output is None:
        return result
    if result.beats_autoregressive or options.write_anyway:
        header = f"specserve tune layerskip: {verdict(result)}\n{context}"
        write_config(options.output, tuned_config(config, result.best.skip_set), header)
        print(f"wrote {options.output}")
    else:
        print(f"nothing written to {options.output} (--write-anyway writes the best skip set)")
    return result


def _context(llm: LLM, options: TuneOptions, num_prompts: int) -> str:
    import torch

    k = options.k_range
    return (
        f"model {llm.model_dir}; {llm.config.dtype}, {torch.get_num_threads()} threads; "
        f"calibration: {num_prompts} prompts ({','.join(options.prompt_sets)}), chat template, "
        f"greedy, batch 1, max_tokens {options.max_tokens}; search: {options.num_trials} "
        f"trials, TPE seed {options.seed}, k {k[0] if k[0] == k[1] else f'{k[0]}-{k[1]}'}, "
        f"early exit {'on' if options.early_exit else 'off'}, best {options.confirm_top} "
        "re-measured with autoregressive"
    )


def calibration_prompts(llm: LLM, sets: list[str], num_prompts: int | None) -> list[list[int]]:
    """The first ``num_prompts`` prompts of each set, as chat-template token ids."""
    known = sorted(p.stem for p in PROMPT_SETS.glob("*.json"))
    unknown = [name for name in sets if name not in known]
    if unknown or not sets:
        raise ValueError(f"unknown prompt sets {unknown}; known: {', '.join(known)}")
    prompts = []
    for name in sets:
        texts = load_prompt_set(name)[:num_prompts]
        prompts += [llm.render_chat([{"role": "user", "content": t}]) for t in texts]
    return prompts


def tuned_config(config: EngineConfig, skip_set: SkipSet) -> EngineConfig:
    """``config`` with ``skip_set``'s layerskip draft as its decoder."""
    return config.with_overrides(decoder=skip_set.decoder_overrides())


def write_config(path: str | Path, config: EngineConfig, header: str) -> None:
    """Write ``config`` as YAML that ``EngineConfig.from_yaml`` loads, after ``header``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(comment + yaml.safe_dump(config.model_dump(), sort_keys=False))


def format_table(result: TuneResult, rows: int = 5) -> str:
    """Markdown table of the best trials: study and confirmation tok/s, ratio, acceptance."""
    base, confirm_base = result.baseline.tokens_per_s, None
    if result.confirmed_baseline is not None:
        confirm_base = result.confirmed_baseline.tokens_per_s
    lines = [
        "| trial | skip set | tok/s (study) | vs AR | tok/s (confirmed) | vs AR | "
        "acceptance rate | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|",
        f"| - | autoregressive | {base:.1f} | 1.00x | "
        + ("-" if confirm_base is None else f"{confirm_base:.1f}")
        + " | "
        + ("-" if confirm_base is None else "1.00x")
        + " | - | - |",
    ]
    shown = result.confirmed + [t for t in result.trials if t.confirmed is None]
    for t in shown[:rows]:
        r, c = t.result, t.confirmed
        confirmed = "- | -" if c is None else f"{c.tokens_per_s:.1f} | "
        if c is not None:
            confirmed += f"{c.tokens_per_s / confirm_base:.2f}x"
        lines.append(
            f"| {t.number} | {t.skip_set.describe()} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / base:.2f}x | {confirmed} | {r.acceptance_rate:.0%} | "
            f"{r.mean_acceptance_length:.2f} |"
        )
    return "\n".join(lines)


def verdict(result: TuneResult) -> str:
    """One line: which draft won, or that none beat autoregressive."""
    best = result.best
    if best is None:
        return "no skip set was measured (every trial was pruned): nothing to compare"
    ar, tps = result.confirmed_baseline.tokens_per_s, best.confirmed.tokens_per_s
    numbers = f"{tps:.1f} tok/s = {result.speedup:.2f}x of autoregressive's {ar:.1f} tok/s"
    if result.beats_autoregressive:
        return f"best skip set: {best.skip_set.describe()} ({numbers})"
    need = "" if result.min_speedup == 1.0 else f" by more than {result.min_speedup:.2f}x"
    return (
        f"no skip set beat autoregressive{need} (best {tps:.1f} tok/s = {result.speedup:.2f}x: "
        f"{best.skip_set.describe()}, autoregressive {ar:.1f} tok/s)"
    )


def _spans(layers: tuple[int, ...]) -> str:
    """``(3, 4, 5, 9)`` -> ``"3-5,9"``; ``()`` -> ``"-"``."""
    if not layers:
        return "-"
    runs, start = [], layers[0]
    for prev, cur in zip(layers, [*layers[1:], math.inf], strict=True):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)
