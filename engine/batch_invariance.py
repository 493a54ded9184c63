"""Batch-invariant execution: a row's logits do not depend on what else is in its step.

Speculative decoding is greedy-identical to plain decoding only if the target computes a
verified token's logits as a decode step would. Mathematically it does; in floating point a
product's summation order may change with the number of rows it multiplies (a one-row kernel
keeps more accumulators than a six-row one; BLAS blocks a prefill differently from a decode),
and so may attention's (the PyTorch path pads a group and runs SDPA; the C++ kernel reads the
cache in place). On SmolLM2 the logits of a token verified among six differ from its decode
logits by about 2e-5: greedy identity then holds unless two logits lie that close.

With ``batch_invariant`` on, every row is computed the same way however many rows share its
step (batch mates, verification width, prefill chunk), so identity holds by construction
(the same aim as Thinking Machines' batch-invariant kernels on GPUs):

- each weight's product is one that computes every row with the same operations whatever the
  row count, *checked on this machine at load* (``rows_agree``) and the fastest such for
  decode and verification rows; a product where none agrees runs one row at a time;
- attention always runs in the C++ kernel that reads the cache in place, which computes each
  query row on its own (prefills included, which otherwise take SDPA).

Float32 on the CPU with the C++ kernels: where those are missing the engine refuses the switch
at start rather than run without the guarantee.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.models.autotune import load_measurements, measurement_key, save_measurements
from engine.models.int8_activations import int8_isas
from engine.models.int8_activations import unsupported_reason as int8_unsupported
from engine.models.linear import Linear, dense_weight
from engine.models.products import candidates, product_by_name
from engine.models.quantized_linear import QuantizedLinear

log = logging.getLogger(__name__)

# Row counts a product's rows are compared at: decode, verification widths, batches, and
# prefill chunks up to the engine's largest step (added by the caller).
CHECKED_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 33, 64)


def unsupported_reason(device: str, dtype: str, kernels: bool) -> str | None:
    """Why batch-invariant execution cannot run in this configuration (None: it can)."""
    if not device.startswith("cpu"):
        return "batch_invariant runs on the CPU (no batch-invariant GPU kernels yet)"
    if dtype != "float32":
        return f"batch_invariant needs dtype float32 (the C++ attention kernel's), not {dtype}"
    if not kernels:
        return "batch_invariant needs the C++ kernels, which could not be built here"
    return None


def rows_agree(product: Callable[[torch.Tensor], torch.Tensor], in_features: int,
               max_rows: int) -> bool:  # fmt: skip
    """Whether ``product`` gives every row bitwise the same result at every row count checked
    (up to ``max_rows``): each count's rows against the same rows inside the largest product."""
    counts = sorted({n for n in CHECKED_ROWS if n < max_rows} | {max_rows})
    x = torch.randn(counts[-1], in_features, generator=torch.Generator().manual_seed(0))
    whole = product(x)
    for n in counts[:-1]:
        for start in {0, counts[-1] - n}:  # the first rows, and a slice from the end
            part = product(x[start : start + n].contiguous())
            if not torch.equal(part, whole[start : start + n]):
                return False
    return True


class RowByRow(nn.Module):
    """A product run one row at a time: the same call shape for every row, so invariant
    whatever the product does inside (the fallback; slow for prefills)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.nbytes = getattr(inner, "nbytes", 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.inner(x)
        return torch.cat([self.inner(row) for row in x.split(1)])

    def dense_weight(self) -> torch.Tensor:
        return dense_weight(self.inner)


def _seconds(call: Callable[[], object], repeats: int = 5) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def _invariant_plan(layer: QuantizedLinear, max_rows: int) -> str | None:
    """The product that computes every row of ``layer`` the same way at every row count, the
    fastest such for one decode row plus one five-row verification; None if none does.

    Kept in the autotune cache: invariant products differ from one another in their rounding,
    so every engine on this machine must pick the same one (a second engine timing afresh could
    pick another and disagree with the first in the last bit)."""
    names = list(candidates(layer.stored.codes.device))
    key = "batch-invariant|" + measurement_key(f"{layer.tune_key}|{max_rows} rows", names)
    cache = load_measurements()
    if key in cache:
        return cache[key]
    agreeing = {}
    for name in names:
        product = product_by_name(name)
        if rows_agree(lambda x, p=product: p(x, layer.stored), layer.in_features, max_rows):
            agreeing[name] = product

    def cost(product) -> float:
        one, five = torch.randn(1, layer.in_features), torch.randn(5, layer.in_features)
        return _seconds(lambda: product(one, layer.stored)) + _seconds(
            lambda: product(five, layer.stored)
        )

    chosen = min(agreeing, key=lambda name: cost(agreeing[name])) if agreeing else None
    cache = load_measurements()  # another engine may have saved meanwhile: keep its entries
    cache.setdefault(key, chosen)
    save_measurements(cache)
    return cache[key]


def _int8_plan(layer: QuantizedLinear, max_rows: int) -> str | None:
    """The 8-bit-activation product for ``layer`` if its weight takes one and it is
    row-invariant here (it is by construction; checked like every other choice)."""
    isas = int8_isas()
    if not isas or int8_unsupported(layer.stored) is not None:
        return None
    name = f"kernel-int8-{isas[0]}"
    product = product_by_name(name)
    if not rows_agree(lambda x: product(x, layer.stored), layer.in_features, max_rows):
        return None
    return name


def make_batch_invariant(model: nn.Module, max_rows: int, int8: bool = False) -> dict[str, str]:
    """Give every product of ``model`` a batch-invariant form (see the module docstring), for
    steps of up to ``max_rows`` rows. Returns what each kind of weight runs, for the log.

    ``int8``: weights that take 8-bit activations (engine/models/int8_activations.py) run
    those products; the others the exact invariant ones."""
    chosen: dict[str, str] = {}
    plans: dict[str, str | None] = {}  # layers of one shape share the check
    if int8 and int8_isas() == ["portable"]:
        log.warning(
            "int8_activations: this CPU has neither AVX2 nor AVX-512 VNNI, so the 8-bit products "
            "run their portable reference path: the same numbers, several times slower than the "
            "exact products"
        )
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                key = child.tune_key
                if key not in plans:
                    plans[key] = (int8 and _int8_plan(child, max_rows)) or _invariant_plan(
                        child, max_rows
                    )
                if plans[key] is not None:
                    child.set_plan([(1 << 62, plans[key])])
                    chosen[key] = plans[key]
                    continue
            elif isinstance(child, Linear):
                key = f"dense-{child.out_features}x{child.in_features}"
                if key not in plans:
                    plans[key] = "dense" if rows_agree(child, child.in_features, max_rows) else None
                if plans[key] is not None:
                    chosen[key] = "dense"
                    continue
            else:
                continue
            setattr(parent, child_name, RowByRow(child))
            chosen[key] = "row by row"
    if model.stack is not None and any(isinstance(m, RowByRow) for m in model.layers.modules()):
        model.stack = None  # the C++ stack would run the wrapped products' own plans
    log.info("batch-invariant products: %s", chosen)
    model.batch_invariant = True
    model.int8_activations = int8
    return chosen
