"""Choose, on the machine at hand, which product runs each stored weight at each row count.

Layers that share a layout and shape (e.g. the 30 gate/up projections of a model) share a
plan. For each bucket of row counts, every candidate product runs over all of those layers
(so the weights stream from memory as in a real step, not from cache) and the fastest wins.
A candidate must first agree with the plain PyTorch reference, or it is never chosen.

Plans are cached per CPU model, torch version, thread count and shape in
``<cache>/autotune/products.json``, so only the first load on a machine pays for the
measurement (a few seconds). ``SPECSERVE_AUTOTUNE=0`` skips it (the first kernel runs).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.kernels.build import library_path
from engine.models.products import candidates, product_by_name
from engine.models.pull import cache_dir
from engine.models.quantized_linear import QuantizedLinear
from engine.models.weight_formats import dequantize_torch

# Row counts measured: decode (1), verification of k + 1 tokens and small batches (2-32),
# prefill chunks. 3 and 5 are the verification passes of k = 2 and k = 4.
ROW_BUCKETS = (1, 2, 3, 4, 5, 8, 16, 32, 128, 512)
# Rounds over the candidates (interleaved, so a burst of load elsewhere hits all of them).
ROUNDS = 4
# Rounds of the second measurement a candidate listed after the first one must also win.
CONFIRM_ROUNDS = 6
# Part of the cache key: a change to how candidates are measured measures them again.
PROCEDURE_VERSION = 3
# Multiply-adds per timed pass: above this, a pass uses fewer layers or a slice of one weight's
# rows (many rows make a product compute-bound, so a part ranks the candidates as the whole would).
PASS_BUDGET = 1 << 27
# Timings within this fraction of the fastest count as a tie (see _winner).
TIE_MARGIN = 0.15
# Fewest weight rows in a sliced pass: enough that x's preparation is spread as in the model.
MIN_SLICE_ROWS = 256


@dataclass
class GroupResult:
    """Seconds per candidate and bucket for one group of layers, and the chosen plan."""

    key: str
    num_layers: int
    weight_bytes: int
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    # Stored bytes one timed pass multiplied, per bucket (a slice of the weights for many rows).
    pass_bytes: dict[int, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why
    # Buckets decided by the second measurement (see measure_group), not by _winner, and the
    # two candidates it timed again (the others keep their first, unconfirmed times).
    chosen: dict[int, str] = field(default_factory=dict)
    confirmed: dict[int, tuple[str, str]] = field(default_factory=dict)

    def plan(self) -> list[tuple[int, str]]:
        plan = [
            (rows, self.chosen.get(rows) or _winner(t)) for rows, t in sorted(self.seconds.items())
        ]
        rows, name = plan[-1]
        plan[-1] = (1 << 62, name)  # the largest bucket's winner serves every larger count
        return plan


def _winner(times: dict[str, float]) -> str:
    """The fastest candidate, except that one listed earlier (wider vector instructions first)
    wins any near-tie: on a shared VM the timings of one bucket scatter by several percent, and
    in a real step, with weights streaming from memory, the narrower kernel was seen to lose
    clearly (AVX2 against AVX-512, one row, Intel Xeon: 221 against 125 us)."""
    best = min(times.values())
    return next(name for name, t in times.items() if t <= best * (1 + TIE_MARGIN))


# The flags that decide which kernels exist and win (VNNI: the 8-bit-activation products).
_ISA_FLAGS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "fma", "f16c"}


def cpu_identity() -> str:
    """The CPU model and its ISA flags, which decide which kernels win."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == platform.machine():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = ",".join(f for f in line.split(":", 1)[1].split() if f in _ISA_FLAGS)
    except OSError:
        pass
    return f"{model} [{flags}]"


def _cache_file() -> Path:

    return cache_dir() / "autotune" / "products.json"


def measurement_key(key: str, names: list[str]) -> str:
    """Measurements hold for this procedure, CPU, torch, thread count and shape, and for these
    candidates built from this kernel source (a new or changed kernel is measured again)."""

    products = ",".join(sorted(names))
    return (
        f"v{PROCEDURE_VERSION}|{cpu_identity()}|torch {torch.__version__}|"
        f"{torch.get_num_threads()} threads|"
        f"{library_path().stem}: {products}|{key}"
    )


def load_measurements() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def save_measurements(cache: dict) -> None:
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: concurrent loads read an old or a new file, never half


def _agrees(name: str, layer: QuantizedLinear) -> str | None:
    """None if the candidate matches the float64 reference on random rows, else why not."""
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    w = layer.stored.to("cpu")
    weight = dequantize_torch(w).double()
    reference = x.double() @ weight.T
    scale = x.abs().double() @ weight.abs().T  # bounds the rounding error
    got = product_by_name(name)(x.to(w.codes.device), layer.stored).double().cpu()
    error = ((got - reference).abs() / (scale + 1e-30)).max().item()
    return None if error < 1e-5 else f"relative error {error:.1e} against the reference"


@torch.inference_mode()
def measure_group(key: str, layers: list[QuantizedLinear]) -> GroupResult:
    """Time every candidate product for every row bucket over all ``layers``."""
    device = layers[0].stored.codes.device
    result = GroupResult(key, len(layers), sum(layer.nbytes for layer in layers))
    names = list(candidates(device))
    for name in names:
        if (why := _agrees(name, layers[0])) is not None:
            result.rejected[name] = why
    live = [n for n in names if n not in result.rejected] or ["torch"]
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, layers[0].in_features, device=device)
        weights = _pass_weights(layers, rows)
        result.pass_bytes[rows] = sum(w.nbytes for w in weights)
        products = {name: product_by_name(name) for name in live}
        for product in products.values():
            [product(x, w) for w in weights]  # warm-up
        times = _time_candidates(products, x, weights, ROUNDS)
        # A later-listed candidate must win twice: a noisy first pass had picked the AVX2
        # kernel over AVX-512 for one row (a second measurement and `bench linear` put AVX-512
        # 15-20% ahead), and in the real step that cost a quarter of decode speed.
        first, best = live[0], _winner(times)
        if best != first:
            again = _time_candidates(
                {n: products[n] for n in (first, best)}, x, weights, CONFIRM_ROUNDS
            )
            times.update(again)  # the second measurement stands for both
            # Only the confirmed pair decides (a third candidate's first pass was not
            # confirmed): the later-listed one wins only if it won again.
            result.chosen[rows] = best if _winner(again) == best else first
            result.confirmed[rows] = (first, best)
        # Every candidate is measured at every bucket: the one far behind with one row
        # (dequantize-then-BLAS) is the one that wins with hundreds.
        result.seconds[rows] = times
    return result


def _time_candidates(products: dict, x: torch.Tensor, weights: list, rounds: int) -> dict:
    """Fastest of ``rounds`` passes per candidate, interleaved (a burst of load elsewhere hits
    all of them)."""
    times = dict.fromkeys(products, float("inf"))
    for _ in range(rounds):
        for name, product in products.items():
            start = time.perf_counter()
            [product(x, w) for w in weights]
            times[name] = min(times[name], time.perf_counter() - start)
    return times


def _pass_weights(layers: list[QuantizedLinear], rows: int) -> list:
    """The weights one timed pass multiplies: all of them; else whole weights of fewer layers;
    else a slice of one weight's rows. Whole weights where possible, so a product's fixed cost
    per call (preparing x) weighs in the measurement as it does in the model."""
    per_layer = rows * layers[0].out_features * layers[0].in_features
    if per_layer * len(layers) <= PASS_BUDGET:
        return [layer.stored for layer in layers]
    if per_layer <= PASS_BUDGET:
        return [layer.stored for layer in layers[: PASS_BUDGET // per_layer]]
    keep = max(MIN_SLICE_ROWS, int(layers[0].out_features * PASS_BUDGET / per_layer))
    index = torch.arange(min(keep, layers[0].out_features), device=layers[0].stored.codes.device)
    return [layers[0].stored.select_rows(index)]


def quantized_groups(model: nn.Module) -> dict[str, list[QuantizedLinear]]:
    groups: dict[str, list[QuantizedLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            groups[module.tune_key].append(module)
    return dict(groups)


def autotune(model: nn.Module, force: bool = False) -> list[GroupResult]:
    """Give every quantized layer of ``model`` its plan, from the cache or measured now.

    Returns the groups measured in this call (none when all came from the cache)."""
    groups = quantized_groups(model)
    if not groups or (os.environ.get("SPECSERVE_AUTOTUNE") == "0" and not force):
        return []
    cache, measured = load_measurements(), []
    for key, layers in groups.items():
        available = candidates(layers[0].stored.codes.device)
        cache_key = measurement_key(key, list(available))
        # The key names every candidate, so a cached plan only names products we have.
        cached = None if force else cache.get(cache_key)
        if cached is None:
            result = measure_group(key, layers)
            measured.append(result)
            cached = result.plan()
            cache[cache_key] = cached
        for layer in layers:
            layer.set_plan([(int(rows), name) for rows, name in cached])
    if measured:
        save_measurements(cache)
    return measured
