"""Build (once per machine) and load the C++ product kernels as ``torch.ops.specserve``.

The kernels are C++ files registered with ``torch.library``: the weight products
(``dequant_matmul.cpp``, ``amx_matmul.cpp``), the fused small operations of a layer
(``layer_ops.cpp``), attention of short query runs over the paged cache
(``paged_attention.cpp``) and its plan for chains (``attention_plan.cpp``), the decoder
layers run in one call (``decoder_stack.cpp``), and one-pass reductions over logits rows: a
greedy step's argmax, a draft step's softmax with its top and entropy (``row_reductions.cpp``).
They are compiled with the system's C++ compiler against the installed torch's headers
into one library in the specserve cache
(keyed by the source, torch version and machine architecture), so the first load on a
machine compiles for about 20 s and every later one loads at once. The instruction set is
chosen at run time inside the library, so one build serves any CPU of that architecture.

Where there is no compiler (or the build fails) ``load_kernels`` returns False and the
weights use the pure-PyTorch products in ``engine.models.weight_formats``: same results,
slower. ``SPECSERVE_NO_KERNELS=1`` forces that fallback.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from engine.models.pull import cache_dir

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "dequant_matmul.cpp",
        "amx_matmul.cpp",
        "int8_matmul.cpp",
        "layer_ops.cpp",
        "paged_attention.cpp",
        "decoder_stack.cpp",
        "draft_chain.cpp",
        "attention_plan.cpp",
        "row_reductions.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name) for name in ("weight_rows.h", "vector_exp.h", "decoder_stack.h")
]
# -fno-trapping-math: no kernel reads floating-point exception flags, and without it GCC will not
# if-convert the compares in vector_exp.h, so the loops calling it stay scalar.
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:

    return cache_dir() / "kernels"


def library_path() -> Path:
    """Where the compiled library for this source, torch and architecture lives."""
    key = hashlib.sha256(
        b"".join(s.read_bytes() for s in SOURCES + HEADERS)
        + " ".join(FLAGS).encode()
        + torch.__version__.encode()
        + platform.machine().encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"specserve_kernels-{key}.so"


def _compile(out: Path) -> None:
    # cpp_extension loads setuptools: only when a kernel must be built
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [
            compiler, *FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(partial),
            f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"kernel build failed:\n{result.stderr[-4000:]}")
        os.replace(partial, out)  # atomic: a concurrent loader sees all of it or nothing


def load_kernels(progress=None) -> bool:
    """Compile if needed and load the kernels; True when ``torch.ops.specserve`` is usable."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        _state["loaded"] = False
        if os.environ.get("SPECSERVE_NO_KERNELS") == "1":
            _state["error"] = "disabled by SPECSERVE_NO_KERNELS=1"
            return False
        path = library_path()
        try:
            if not path.exists():
                if progress:
                    progress(f"Compiling the CPU kernels into {path} (once per machine)...")
                _compile(path)
            torch.ops.load_library(str(path))
            _state["loaded"] = True
        except Exception as e:  # no compiler, failed build, unloadable library: fall back
            _state["error"] = f"{type(e).__name__}: {e}"
            print(f"specserve: C++ kernels unavailable, using PyTorch ({e})", file=sys.stderr)
        return bool(_state["loaded"])


def kernel_error() -> str | None:
    """Why the kernels did not load (None when they did or were not tried)."""
    return _state.get("error")  # type: ignore[return-value]


def available_isas() -> list[str]:
    """Instruction sets the loaded kernels can use on this CPU, fastest first."""
    if not load_kernels():
        return []
    # Asked on hot paths (every embedding lookup dequantizes): the answer never changes.
    if "isas" not in _state:
        _state["isas"] = torch.ops.specserve.cpu_isas().split(",")
    return list(_state["isas"])  # type: ignore[arg-type]


def main() -> int:
    """``python -m engine.kernels.build``: compile now (``make install`` does this)."""
    ok = load_kernels(progress=lambda m: print(m, file=sys.stderr))
    print(library_path() if ok else f"kernels not built: {kernel_error()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
