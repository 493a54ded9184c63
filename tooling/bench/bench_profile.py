"""Where a decode step's time goes: ``specserve bench profile``.

Issue 35 asks to profile before fusing anything: how long a step takes, how many operators the
host dispatches for it and how many kernels the device runs (on a GPU, a graph replay is one
launch however many kernels it holds), and which operators take the time. For each decoder
variant this runs one greedy chat request on one engine and, after the prefill and a warm-up,

1. times ``steps`` decode steps unprofiled (wall time, tokens, drafting and the target's
   forward pass, as ``bench offline --decoder`` splits them), then
2. runs ``steps`` more under ``torch.profiler`` and counts, per step, the operators called
   from Python (top-level events), the kernels the device ran and the kernel and graph
   launches, with the operators that took the most self time; ``--trace DIR`` also writes
   each variant's Chrome trace there.

With ``--python N`` a third pass runs under cProfile: the time the interpreter itself spent a
step (self time of Python functions, the operators' own calls left out) and the N functions
with the most self time. Where the device waits on the host (a GPU step far from its bandwidth
floor), this says which Python code the step waits for.

The profilers slow every call, so times come from the first pass and counts and shares from
the others.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.toolkit import LLM, EngineConfig, SamplingParams
from tooling.bench.bench_decoders import (
    StepTimer,
    all_variants,
    decoder_config,
    load_prompt_set,
    select_variants,
)

# Host-side calls that start device work: one each per kernel launched, or per graph replayed.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
WARM_UP_STEPS = 8


@dataclass
class ProfileOptions:
    decoders: str = "autoregressive"  # comma-separated bench variants (bench offline --decoder)
    steps: int = 32
    top: int = 12
    trace_dir: Path | None = None
    prompt: str | None = None  # default: the first prompt of the chat set
    python_top: int = 0  # > 0: a cProfile pass, listing this many Python functions


@dataclass
class PythonShare:
    name: str  # file:line(function), or {built-in ...}
    calls: float  # a step
    self_us: float  # a step
    cumulative_us: float  # a step


@dataclass
class OperatorShare:
    name: str
    calls: float  # a step
    self_cpu_us: float  # a step
    self_device_us: float  # a step


@dataclass
class StepProfile:
    decoder: str
    steps: int
    ms_a_step: float  # unprofiled
    tokens_a_step: float
    draft_ms: float  # a step, unprofiled
    forward_ms: float  # a step, unprofiled: the target's pass (verification included)
    operator_calls: float  # a step: operators called from Python
    device_kernels: float  # a step: kernels the device ran (0 on a CPU)
    launches: float  # a step: kernel and graph launches (0 on a CPU)
    top: list[OperatorShare] = field(default_factory=list)
    python_us: float | None = None  # a step: self time of interpreted Python functions
    python_top: list[PythonShare] = field(default_factory=list)


def _decode_request(llm: LLM, prompt: list[int], steps: int, k: int) -> None:
    """One greedy request long enough for the warm-up and both passes, prefilled."""
    engine = llm.engine
    budget = (WARM_UP_STEPS + 3 * steps) * (k + 1) + 1
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    engine.add_request("profile", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()
    for _ in range(WARM_UP_STEPS):
        engine.step()


def _synchronize(llm: LLM) -> None:
    device = llm.engine.model.final_norm.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(llm: LLM, timer: StepTimer, steps: int) -> tuple[float, float, float, float]:
    """(ms, tokens, drafting ms, forward ms) a step over ``steps`` unprofiled steps."""
    before = timer.costs.steps, timer.costs.tokens, timer.costs.draft_s, timer.costs.verify_s
    _synchronize(llm)
    started = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    _synchronize(llm)
    elapsed = time.perf_counter() - started
    c = timer.costs
    counted = max(1, c.steps - before[0])
    return (
        1e3 * elapsed / steps,
        (c.tokens - before[1]) / counted,
        1e3 * (c.draft_s - before[2]) / counted,
        1e3 * (c.verify_s - before[3]) / counted,
    )


def _activities(llm: LLM) -> list[ProfilerActivity]:
    on_gpu = llm.engine.model.final_norm.device.type == "cuda"
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]


def count_events(events, steps: int, top: int) -> tuple[float, float, float, list[OperatorShare]]:
    """(operator calls, device kernels, launches) a step and the ``top`` operators by self
    time (host plus device), from a profile's events over ``steps`` steps."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    operators = [e for e in host if e.cpu_parent is None and not e.is_user_annotation]
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    launches = [e for e in host if e.name in LAUNCHES]
    shares: dict[str, list[float]] = {}
    for e in host:
        share = shares.setdefault(e.name, [0.0, 0.0, 0.0])
        share[0] += 1
        share[1] += e.self_cpu_time_total
    for e in kernels:  # a kernel's time counts for the operator that launched it, if known
        owner = e.cpu_parent.name if e.cpu_parent is not None else e.name
        shares.setdefault(owner, [0.0, 0.0, 0.0])[2] += e.device_time_total
    ranked = sorted(shares.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]
    return (
        len(operators) / steps,
        len(kernels) / steps,
        len(launches) / steps,
        [OperatorShare(n, c / steps, cpu / steps, dev / steps) for n, (c, cpu, dev) in ranked],
    )


CHECKOUT = str(Path(__file__).resolve().parents[2]) + "/"


def _function_name(key: tuple[str, int, str]) -> str:
    """file:line(function), the file relative to the checkout or to site-packages."""
    filename, line, function = key
    if filename == "~":  # a built-in: C code, operators included
        return function
    if filename.startswith(CHECKOUT):
        filename = filename[len(CHECKOUT) :]
    elif "/site-packages/" in filename:
        filename = filename.split("/site-packages/", 1)[1]
    return f"{filename}:{line}({function})"


def python_shares(stats: pstats.Stats, steps: int, top: int) -> tuple[float, list[PythonShare]]:
    """(self time of interpreted functions a step in us, the ``top`` functions by self time,
    built-ins included) from a cProfile run over ``steps`` steps."""
    # (file, line, function) -> (primitive calls, calls, self, cumulative, callers)
    entries = stats.stats
    interpreted = sum(tt for key, (_, _, tt, _, _) in entries.items() if key[0] != "~")
    ranked = sorted(entries.items(), key=lambda kv: -kv[1][2])[:top]
    shares = [PythonShare(_function_name(key), nc / steps, 1e6 * tt / steps, 1e6 * ct / steps)
              for key, (_, nc, tt, ct, _) in ranked]  # fmt: skip
    return 1e6 * interpreted / steps, shares


def profile_variant(llm: LLM, name: str, prompt: list[int], options: ProfileOptions,
                    timer: StepTimer, k: int) -> StepProfile:  # fmt: skip
    _decode_request(llm, prompt, options.steps, k)
    ms, tokens, draft_ms, forward_ms = _timed_steps(llm, timer, options.steps)
    with profile(activities=_activities(llm)) as prof:
        for _ in range(options.steps):
            llm.engine.step()
        _synchronize(llm)
    python_us, python_top = None, []
    if options.python_top > 0:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(options.steps):
            llm.engine.step()
        _synchronize(llm)
        profiler.disable()
        python_us, python_top = python_shares(
            pstats.Stats(profiler), options.steps, options.python_top
        )
    llm.engine.abort("profile")
    if options.trace_dir is not None:
        options.trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(options.trace_dir / f"{name}.json"))
    calls, kernels, launches, top = count_events(prof.events(), options.steps, options.top)
    return StepProfile(name, options.steps, ms, tokens, draft_ms, forward_ms, calls, kernels,
                       launches, top, python_us, python_top)  # fmt: skip


def run_profile_bench(config: EngineConfig, options: ProfileOptions) -> list[StepProfile]:
    """Each variant of ``options.decoders`` on one engine (its speculator swapped, as
    ``bench offline --decoder`` does), profiled; prints the tables and returns them."""
    if options.steps < 1:
        raise ValueError("--steps must be at least 1")
    if options.python_top < 0:
        raise ValueError("--python must be at least 0")
    plain = {"method": "autoregressive", "extra_methods": []}
    llm = LLM(config=config.with_overrides(decoder=plain))
    engine = llm.engine
    names = [n.strip() for n in options.decoders.split(",") if n.strip()]
    variants = {v.name: v for v in select_variants(
        ",".join(names), all_variants(engine.model.arch.num_layers)
    )}  # fmt: skip
    text = options.prompt or load_prompt_set("chat")[0]
    prompt = llm.render_chat([{"role": "user", "content": text}])
    timer = StepTimer(engine)
    results = []
    for name in names:
        if name == "autoregressive":
            engine.use_speculator(None)
            k = 0
        else:
            decoder = decoder_config(
                config.decoder, variants[name], config.decoder.num_speculative_tokens
            )
            # Exactly what the variant's config loads, not the shipped drafters besides.
            only = decoder.model_copy(update={"load_shipped_drafters": False})
            speculator = engine.build_speculator(only)
            timer.watch(speculator)
            engine.use_speculator(speculator)
            k = decoder.num_speculative_tokens
        results.append(profile_variant(llm, name, prompt, options, timer, k))
    print_profiles(results, llm)
    return results


def print_profiles(results: list[StepProfile], llm: LLM) -> None:
    from engine.toolkit import cpu_identity

    device = llm.engine.model.final_norm.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_identity()
    print(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{llm.config.dtype}; one greedy chat request, {results[0].steps} decode steps a pass "
          "after the prefill and a warm-up; times unprofiled, counts profiled\n")  # fmt: skip
    print("| decoder | ms a step | tokens a step | drafting ms | target forward ms | "
          "operators a step | device kernels a step | launches a step |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in results:
        print(f"| {r.decoder} | {r.ms_a_step:.2f} | {r.tokens_a_step:.2f} | {r.draft_ms:.2f} | "
              f"{r.forward_ms:.2f} | {r.operator_calls:.0f} | {r.device_kernels:.0f} | "
              f"{r.launches:.0f} |")  # fmt: skip
    for r in results:
        print(f"\n{r.decoder}: operators by self time a step (profiled)\n"
              "| operator | calls | self host us | self device us |\n"
              "|---|---|---|---|")  # fmt: skip
        for op in r.top:
            print(f"| {op.name} | {op.calls:.1f} | {op.self_cpu_us:.0f} | "
                  f"{op.self_device_us:.0f} |")  # fmt: skip
    for r in results:
        if r.python_us is None:
            continue
        print(f"\n{r.decoder}: Python functions by self time a step (cProfile): the "
              f"interpreter's own time {r.python_us:.0f} us a step\n"
              "| function | calls | self us | cumulative us |\n|---|---|---|---|")  # fmt: skip
        for f in r.python_top:
            print(f"| {f.name} | {f.calls:.1f} | {f.self_us:.0f} | {f.cumulative_us:.0f} |")
