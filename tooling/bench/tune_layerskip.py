"""``specserve tune layerskip``: search the layerskip draft for measured tokens/s.

The objective is what a user gets: greedy, batch-1 tokens/s of the ``layerskip`` decoder on
calibration prompts (the chat and grounded sets by default, rendered with the chat
template), over autoregressive decoding's tokens/s measured in the same pass. Each trial is
timed as ``specserve bench offline`` times its variants (``measure_set``): autoregressive
decoding and the draft take turns prompt by prompt on one engine, so that a change of the
machine's load hits both alike and trials measured minutes apart stay comparable. Every
run's tokens must equal the first autoregressive run's (they are the target's greedy tokens
whatever the draft; a difference is a bug and stops the search).

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
upward. The best few distinct drafts are measured again after the study, in one pass
interleaved with autoregressive decoding, and only these confirmation speedups decide
whether a draft beats autoregressive (by more than ``min_speedup``). Trials are
deterministic given the seed except for timing noise: TPE's proposals after its random
start-up trials follow the measured values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from engine.toolkit import LLM, DecoderConfig, EngineConfig
from tooling.bench.bench_decoders import (
    PROMPT_SETS,
    DecoderResult,
    StepTimer,
    load_prompt_set,
    losing_reason,
    measure_set,
)

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
class Comparison:
    """A draft and autoregressive decoding, measured in one interleaved pass."""

    draft: DecoderResult
    autoregressive: DecoderResult

    @property
    def speedup(self) -> float:
        return self.draft.tokens_per_s / self.autoregressive.tokens_per_s


@dataclass
class TrialResult:
    number: int
    skip_set: SkipSet
    study: Comparison
    confirmation: Comparison | None = None  # the re-measurement after the study


@dataclass
class TuneResult:
    trials: list[TrialResult]  # measured trials, best study speedup first
    num_pruned: int
    min_speedup: float = 1.0
    confirmed: list[TrialResult] = field(default_factory=list)  # best confirmed speedup first

    @property
    def best(self) -> TrialResult | None:
        """The draft with the best confirmed speedup (None: none was confirmed)."""
        return self.confirmed[0] if self.confirmed else None

    @property
    def speedup(self) -> float | None:
        return None if self.best is None else self.best.confirmation.speedup

    @property
    def beats_autoregressive(self) -> bool:
        return self.speedup is not None and self.speedup > self.min_speedup


def suggest_skip_set(trial, num_layers: int, k_range: tuple[int, int], early_exit: bool) -> SkipSet:
    """Draw a draft from an optuna trial (see the module docstring for the parametrisation)."""

    def span(kind: str) -> tuple[int, ...]:
        # count + 1 on a log scale: spans of 1-2 sublayers, the ones likely to agree with
        # the target, are drawn about as often as spans of 8-16.
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


def tuning_llm(config: EngineConfig) -> LLM:
    """The engine a search measures on: ``config`` decoding autoregressively, with the prefix
    cache off so that every pass prefills its prompts (as in ``specserve bench offline``)."""
    return LLM(
        config=config.with_overrides(
            decoder={"method": "autoregressive", "extra_methods": []},
            kv_cache={"enable_prefix_caching": False},
        )
    )


class LayerSkipTuner:
    """Measures drafts against autoregressive decoding on fixed calibration prompts, with
    one engine (from ``tuning_llm``).

    Only the engine's speculator changes between runs, built the way the engine builds its
    own (as ``specserve bench offline`` does): the model, the KV cache and the scheduler are
    the same for every draft and for autoregressive decoding.
    """

    def __init__(self, llm: LLM, prompts: list[list[int]], max_tokens: int):
        if not prompts:
            raise ValueError("no calibration prompts")
        if llm.engine.speculator is not None:
            raise ValueError("the tuner's engine must decode autoregressively (tuning_llm)")
        self.llm = llm
        self.engine = llm.engine
        self.timer = StepTimer(self.engine)
        self.decoder = llm.config.decoder
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.reference: list[list[int]] | None = None  # the first autoregressive tokens

    @property
    def num_layers(self) -> int:
        return self.engine.model.arch.num_layers

    def compare(self, skip_sets: list[SkipSet]) -> list[Comparison]:
        """Each draft against autoregressive decoding, all in one interleaved pass."""
        speculators: dict = {"autoregressive": None}
        for i, skip_set in enumerate(skip_sets):
            fields = {**self.decoder.model_dump(), **skip_set.decoder_overrides()}
            fields["load_shipped_drafters"] = False  # each speculator loads its draft alone
            fields["draft_policy"] = "fixed"  # a skip set is judged at the k it is tuned for
            spec = self.engine.build_speculator(DecoderConfig.model_validate(fields))
            self.timer.watch(spec)
            speculators[i] = spec
        results = measure_set(
            self.llm, self.timer, speculators, None, self.prompts, self.max_tokens
        )
        ar = results["autoregressive"]
        self.reference = self.reference or ar.token_ids
        self._check_identical("autoregressive", ar.token_ids)
        for i, skip_set in enumerate(skip_sets):
            self._check_identical(f"layerskip ({skip_set.describe()})", results[i].token_ids)
        return [Comparison(results[i], ar) for i in range(len(skip_sets))]

    def _check_identical(self, name: str, token_ids: list[list[int]]) -> None:
        for i, (got, want) in enumerate(zip(token_ids, self.reference, strict=True)):
            if got != want:
                n = min(len(got), len(want))
                at = next((j for j in range(n) if got[j] != want[j]), n)
                raise GreedyMismatchError(
                    f"{name} differs from the first autoregressive greedy decoding on "
                    f"calibration prompt {i} at generated token {at}: "
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
    """Run the study (objective: speedup over autoregressive) until ``num_trials`` drafts
    are measured, then confirm the best drafts.

    ``min_speedup`` is the confirmed speedup a draft must exceed to count as beating
    autoregressive decoding. ``log`` receives one progress line per measurement.
    """
    import optuna

    trials: dict[int, TrialResult] = {}
    measured: dict[SkipSet, Comparison] = {}  # a draft TPE proposes again is not re-timed

    def objective(trial: optuna.Trial) -> float:
        skip_set = suggest_skip_set(trial, tuner.num_layers, k_range, early_exit)
        if skip_set.is_empty:
            log(f"trial {trial.number}: skips nothing (the target itself), pruned")
            raise optuna.TrialPruned()
        if skip_set not in measured:
            (measured[skip_set],) = tuner.compare([skip_set])
        c = measured[skip_set]
        trials[trial.number] = TrialResult(trial.number, skip_set, c)
        log(
            f"trial {trial.number}: {skip_set.describe()}: {c.draft.tokens_per_s:.1f} tok/s, "
            f"autoregressive {c.autoregressive.tokens_per_s:.1f} ({c.speedup:.2f}x), "
            f"acceptance {c.draft.acceptance_rate:.0%}"
        )
        return c.speedup

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Fewer random start-up trials than optuna's 10 when the budget is small, so that TPE
    # proposes at least two thirds of them.
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(3, num_trials // 3))
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def enough_measured(study: optuna.Study, _trial) -> None:
        if len(trials) >= num_trials:
            study.stop()

    # Pruned trials cost no time: ``num_trials`` counts measured ones (within a bound).
    study.optimize(objective, n_trials=4 * num_trials, callbacks=[enough_measured])
    ranked = sorted(trials.values(), key=lambda t: t.study.speedup, reverse=True)
    result = TuneResult(ranked, len(study.trials) - len(trials), min_speedup)
    _confirm(tuner, result, confirm_top, log)
    return result


def _confirm(tuner: LayerSkipTuner, result: TuneResult, top: int, log) -> None:
    """Re-measure the ``top`` best distinct drafts with autoregressive decoding, in one pass."""
    candidates: dict[SkipSet, TrialResult] = {}
    for t in result.trials:  # best first; a draft proposed twice is confirmed once
        candidates.setdefault(t.skip_set, t)
    chosen = list(candidates.values())[:top]
    if not chosen:
        return
    for t, c in zip(chosen, tuner.compare([t.skip_set for t in chosen]), strict=True):
        t.confirmation = c
        log(
            f"confirmation: trial {t.number}: {c.draft.tokens_per_s:.1f} tok/s, "
            f"autoregressive {c.autoregressive.tokens_per_s:.1f} ({c.speedup:.2f}x)"
        )
    result.confirmed = sorted(chosen, key=lambda t: t.confirmation.speedup, reverse=True)


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
    check_prompt_sets(list(options.prompt_sets))  # before the model loads
    llm = tuning_llm(config)
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
    why = _why_it_loses(result)
    if why:
        print(f"why: {why}")
    if result.best is None or options.output is None:
        return result
    if result.beats_autoregressive or options.write_anyway:
        header = f"specserve tune layerskip: {verdict(result)}\n{context}"
        write_config(options.output, tuned_config(config, result.best.skip_set), header)
        print(f"wrote {options.output}")
    else:
        print(f"nothing written to {options.output} (--write-anyway writes the best skip set)")
    return result


def _why_it_loses(result: TuneResult) -> str | None:
    """The best losing draft's measured step costs, in autoregressive decode steps."""
    if result.best is None or result.speedup >= 1:
        return None
    c = result.best.confirmation
    if not (c.draft.costs and c.draft.costs.steps and c.autoregressive.costs.steps):
        return None
    return losing_reason(c.draft, {"autoregressive": c.autoregressive})


def _context(llm: LLM, options: TuneOptions, num_prompts: int) -> str:
    import torch

    low, high = options.k_range
    return (
        f"model {llm.model_dir} ({llm.engine.model.arch.num_layers} layers, "
        f"{llm.config.dtype}), torch threads {torch.get_num_threads()} of {os.cpu_count()} "
        f"cores (load average {os.getloadavg()[0]:.1f} at the start); calibration: "
        f"{num_prompts} prompts ({','.join(options.prompt_sets)}), chat template, greedy, "
        f"batch 1, max_tokens {options.max_tokens}, prefix cache off; search: "
        f"{options.num_trials} measured trials, TPE seed {options.seed}, "
        f"k {low if low == high else f'{low}-{high}'}, "
        f"early exit {'on' if options.early_exit else 'off'}; every measurement interleaved "
        f"with autoregressive decoding prompt by prompt; the best {options.confirm_top} "
        "re-measured after the search"
    )


def check_prompt_sets(sets: list[str]) -> None:
    known = sorted(p.stem for p in PROMPT_SETS.glob("*.json"))
    unknown = [name for name in sets if name not in known]
    if unknown or not sets:
        raise ValueError(f"unknown prompt sets {unknown}; known: {', '.join(known)}")


def calibration_prompts(llm: LLM, sets: list[str], num_prompts: int | None) -> list[list[int]]:
    """The first ``num_prompts`` prompts of each set, as chat-template token ids."""
    check_prompt_sets(sets)
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
    """Markdown table of the best trials: tok/s against autoregressive's in the same pass, in
    the study and in the confirmation, and acceptance."""
    lines = [
        "| trial | skip set | tok/s | AR tok/s | vs AR | confirmation tok/s | AR tok/s | "
        "vs AR | acceptance rate | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown = result.confirmed + [t for t in result.trials if t.confirmation is None]
    for t in shown[:rows]:
        cells = [str(t.number), t.skip_set.describe()]
        for c in (t.study, t.confirmation):
            if c is None:
                cells += ["-", "-", "-"]
            else:
                cells += [
                    f"{c.draft.tokens_per_s:.1f}",
                    f"{c.autoregressive.tokens_per_s:.1f}",
                    f"{c.speedup:.2f}x",
                ]
        d = t.study.draft
        cells += [f"{d.acceptance_rate:.0%}", f"{d.mean_acceptance_length:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(result: TuneResult) -> str:
    """One line: which draft won, or that none beat autoregressive."""
    best = result.best
    if best is None:
        if result.trials:
            return "no skip set was re-measured (confirm_top 0): nothing decided"
        return "no skip set was measured (every trial was pruned): nothing to compare"
    c = best.confirmation
    ar, tps = c.autoregressive.tokens_per_s, c.draft.tokens_per_s
    if result.beats_autoregressive:
        return (
            f"best skip set: {best.skip_set.describe()} ({tps:.1f} tok/s = "
            f"{c.speedup:.2f}x of autoregressive's {ar:.1f} tok/s)"
        )
    need = "" if result.min_speedup == 1.0 else f" by more than {result.min_speedup:.2f}x"
    return (
        f"no skip set beat autoregressive{need} (best {tps:.1f} tok/s = {c.speedup:.2f}x: "
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
