"""Drafters in the layouts users download, one table entry per layout: how to recognise a
directory in it, how to read it into our ``TrainedDrafter``, and how to write ours out in it.

EAGLE-1/2 (``eagle1``, SafeAILab's layout, which vLLM and SGLang load): ``fc`` [H, 2H] over
[token embedding; the target's final-normed feature] and one Llama layer ``layers.0.*`` whose
attention has no input norm; the target's embedding and whole LM head read in and out. Ours
is the same network (``EagleNetwork(input_norm=False)``; by default ours has an input norm,
which this layout has no place for) read out through the draft vocabulary's rows, which rides
along in an extra config key so a round trip drafts identically.

Medusa heads (FasterDecoding/Medusa and vLLM's layout):

- ``medusa-vllm``: vLLM's ``model.safetensors`` with ``blocks.{i}.layers.{j}.weight/bias``,
  ``lm_heads.{i}.weight`` and an optional ``token_map`` (the draft vocabulary), and a config
  with ``num_heads``/``num_hidden_layers`` (or ``medusa_num_*``), ``truncated_vocab_size``,
  ``medusa_fc_bias``. Ours writes here losslessly: its readout is the target's LM head rows of
  the draft vocabulary, which is what ``lm_heads`` + ``token_map`` say.
- ``medusa-v1``: FasterDecoding's ``medusa_lm_head.pt`` (keys ``{i}.{j}.linear.weight/bias``
  and a per-head ``{i}.{L}.weight`` [V, H]).
- ``medusa-v2``: FasterDecoding's ``medusa_lm_head.safetensors`` with ``"version": "2"``: no
  per-head LM head, every head reads out through the target's.

Our heads have one residual block each and read out through the target's LM head, so a
checkpoint with more blocks per head, or with per-head LM heads that are not the target's own
rows, is refused with what it has; so is one whose tensors do not fit the target (the message
names the tensor and both shapes). Public checkpoints carry no held-out accuracies, which our
tree ranking reads; ``PRIOR_ACCURACIES`` stands in (head h's i-th candidate right
0.6 * 0.6^h * 0.5^i of the time, Medusa's reported shape), so trees are ranked sensibly from
the start.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.decoders.drafter_files import CONFIG_FILE, TrainedDrafter, target_signature
from engine.decoders.eagle3_layout import EAGLE3_LAYOUT
from engine.decoders.layout_files import (
    ACCURACIES_KEY,
    Layout,
    config_of,
    expect_shape,
    has_key,
    prior_accuracies,
    tensors_of,
)
from engine.models.linear import dense_weight
from engine.models.rope import deinterleave_rope_rows, interleave_rope_rows


def _target_rows(model, rows: torch.Tensor) -> torch.Tensor:

    return dense_weight(model.lm_head).float()[rows]


def _heads_from_blocks(heads_class, weights: list, biases: list, source: Path, model, names):
    """Our Medusa heads (``heads_class``) from one residual block per head, checked against
    the target."""
    d = model.arch.hidden_size
    heads = heads_class(len(weights), d)
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        expect_shape(names[i][0], w, (d, d), source)
        expect_shape(names[i][1], b, (d,), source)
        heads.weight.data[i] = w.float()
        heads.bias.data[i] = b.float()
    return heads


def _one_block_per_head(config: dict, keys, pattern: str, source: Path) -> int:
    """The head count (from the tensors: published configs understate it); refuses more than
    one residual block per head."""
    found = [re.fullmatch(pattern, k) for k in keys]
    heads = {int(m.group(1)) for m in found if m}
    blocks = {int(m.group(2)) for m in found if m}
    layers = config.get("medusa_num_layers", config.get("num_hidden_layers", 1))
    if not heads:
        raise ValueError(f"{source}: no Medusa head blocks found")
    if blocks != {0} or layers != 1:
        raise ValueError(
            f"{source}: {max(layers, len(blocks))} residual blocks per head; specserve's "
            "Medusa heads have one"
        )
    if heads != set(range(len(heads))):
        raise ValueError(f"{source}: Medusa heads {sorted(heads)} are not numbered 0..n-1")
    return len(heads)


def _check_readout(lm_heads: dict, vocab: torch.Tensor, model, source: Path) -> None:
    """Per-head LM heads must be the target's own rows of the vocabulary (ours read out
    through the target's head)."""
    d = model.arch.hidden_size
    target = _target_rows(model, vocab)
    for name, weight in lm_heads.items():
        expect_shape(name, weight, (len(vocab), d), source)
        if not torch.allclose(weight.float(), target, rtol=1e-2, atol=1e-3):
            raise ValueError(
                f"{source}: {name} is a trained LM head of its own; specserve's Medusa heads "
                "read out through the target's LM head (Medusa-2), so this checkpoint is "
                "not supported"
            )


def _drafter(heads, vocab, model, layout: str, source: Path) -> TrainedDrafter:
    # Ours, written out, keeps its held-out accuracies in an extra config key, so a round
    # trip ranks its tree the same.
    accuracies = config_of(source).get(ACCURACIES_KEY)
    info = {"loaded_from": str(source), "layout": layout,
            "accuracies": "held-out, as written" if accuracies else "prior: none in the files"}
    accuracies = accuracies or prior_accuracies(heads.num_heads)
    return TrainedDrafter("medusa", heads, vocab.long(), accuracies, target_signature(model),
                          info)  # fmt: skip


# ---- vLLM ------------------------------------------------------------------------------------
VLLM_FILE = "model.safetensors"
VLLM_BLOCK = r"blocks\.(\d+)\.layers\.(\d+)\.weight"


def _is_vllm_medusa(directory: Path) -> bool:
    config = config_of(directory)
    return (directory / VLLM_FILE).is_file() and (
        config.get("model_type") == "medusa" or "MedusaModel" in config.get("architectures", [])
    )


def _load_vllm_medusa(directory: Path, model, heads_class) -> TrainedDrafter:
    source = directory / VLLM_FILE
    config = config_of(directory)
    tensors = {k.removeprefix("medusa_heads."): v for k, v in tensors_of(source).items()}
    count = _one_block_per_head(config, tensors, VLLM_BLOCK, source)
    names = [(f"blocks.{i}.layers.0.weight", f"blocks.{i}.layers.0.bias") for i in range(count)]
    if not config.get("medusa_fc_bias", False):  # vLLM's default: blocks without a bias
        for _, bias in names:
            tensors.setdefault(bias, torch.zeros(model.arch.hidden_size))
    missing = [n for pair in names for n in pair if n not in tensors]
    if missing:
        raise ValueError(f"{source}: missing tensors {', '.join(missing)}")
    heads = _heads_from_blocks(heads_class, [tensors[w] for w, _ in names],
                               [tensors[b] for _, b in names], source, model, names)  # fmt: skip
    vocab = tensors.get("token_map", torch.arange(model.arch.vocab_size)).long()
    if len(vocab) and int(vocab.max()) >= model.arch.vocab_size:
        raise ValueError(f"{source}: token_map names token {int(vocab.max())}, past this "
                         f"model's vocabulary of {model.arch.vocab_size}")  # fmt: skip
    if config.get("original_lm_head"):
        lm_heads = {"lm_head.weight": tensors.get("lm_head.weight", tensors["lm_heads.0.weight"])}
    else:
        lm_heads = {f"lm_heads.{i}.weight": tensors[f"lm_heads.{i}.weight"] for i in range(count)}
    _check_readout(lm_heads, vocab, model, source)
    return _drafter(heads, vocab, model, "medusa-vllm", directory)


def _save_vllm_medusa(drafter: TrainedDrafter, model, directory: Path) -> None:

    heads, vocab = drafter.network, drafter.draft_vocab.long()
    rows = _target_rows(model, vocab).contiguous()
    tensors = {"token_map": vocab.contiguous()}
    for i in range(heads.num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = heads.weight[i].detach().float().contiguous()
        tensors[f"blocks.{i}.layers.0.bias"] = heads.bias[i].detach().float().contiguous()
        tensors[f"lm_heads.{i}.weight"] = rows.clone()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / VLLM_FILE))
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size, "vocab_size": model.arch.vocab_size,
        "num_heads": heads.num_heads, "num_hidden_layers": 1,
        "truncated_vocab_size": len(vocab), "medusa_fc_bias": True, "original_lm_head": False,
        ACCURACIES_KEY: drafter.accuracies,
    }  # fmt: skip
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


# ---- FasterDecoding --------------------------------------------------------------------------
V1_FILE, V2_FILE = "medusa_lm_head.pt", "medusa_lm_head.safetensors"
FD_BLOCK = r"(\d+)\.(\d+)\.linear\.weight"


def _load_faster_decoding(directory: Path, model, heads_class) -> TrainedDrafter:
    v2 = (directory / V2_FILE).is_file()
    source = directory / (V2_FILE if v2 else V1_FILE)
    config, tensors = config_of(directory), tensors_of(source)
    count = _one_block_per_head(config, tensors, FD_BLOCK, source)
    names = [(f"{i}.0.linear.weight", f"{i}.0.linear.bias") for i in range(count)]
    heads = _heads_from_blocks(heads_class, [tensors[w] for w, _ in names],
                               [tensors[b] for _, b in names], source, model, names)  # fmt: skip
    vocab = torch.arange(model.arch.vocab_size)
    lm_heads = {f"{i}.1.weight": tensors[f"{i}.1.weight"] for i in range(count)
                if f"{i}.1.weight" in tensors}  # fmt: skip
    if lm_heads:
        _check_readout(lm_heads, vocab, model, source)
    return _drafter(heads, vocab, model, "medusa-v1" if not v2 else "medusa-v2", directory)


def _save_faster_decoding_v2(drafter: TrainedDrafter, model, directory: Path) -> None:
    """Medusa-2's layout: the blocks only (every head reads out through the target's whole
    LM head there, so drafts can differ from ours, which read the draft vocabulary's rows)."""

    heads = drafter.network
    tensors = {}
    for i in range(heads.num_heads):
        tensors[f"{i}.0.linear.weight"] = heads.weight[i].detach().float().contiguous()
        tensors[f"{i}.0.linear.bias"] = heads.bias[i].detach().float().contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / V2_FILE))
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": 1, "version": "2",
              "base_model_name_or_path": drafter.target.get("model", ""),
              ACCURACIES_KEY: drafter.accuracies}  # fmt: skip
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


# ---- EAGLE-1 / EAGLE-2 (SafeAILab's layout; vLLM and SGLang load it too) ---------------------
EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")
EAGLE_VOCAB_KEY = "specserve_draft_vocab"  # an extra config key: ours' draft vocabulary
EAGLE_PROJECTIONS = {
    "q": "layers.0.self_attn.q_proj.weight", "k": "layers.0.self_attn.k_proj.weight",
    "v": "layers.0.self_attn.v_proj.weight", "o": "layers.0.self_attn.o_proj.weight",
    "gate": "layers.0.mlp.gate_proj.weight", "up": "layers.0.mlp.up_proj.weight",
    "down": "layers.0.mlp.down_proj.weight",
}  # fmt: skip


def _eagle_file(directory: Path) -> Path | None:
    return next((directory / f for f in EAGLE_FILES if (directory / f).is_file()), None)


def _is_eagle1(directory: Path) -> bool:
    config = config_of(directory)
    path = _eagle_file(directory)
    if path is None or config.get("num_hidden_layers") != 1 or "draft_vocab_size" in config:
        return False
    return "fc.weight" in tensors_of(path) if path.suffix == ".bin" else has_key(path, "fc.weight")


def _load_eagle1(directory: Path, model, network_class) -> TrainedDrafter:
    source = _eagle_file(directory)
    config, tensors = config_of(directory), tensors_of(source)
    arch = model.arch
    d = arch.hidden_size
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = config.get("intermediate_size", arch.intermediate_size)
    if config.get("num_attention_heads", arch.num_heads) != arch.num_heads or config.get(
        "num_key_value_heads", config.get("num_attention_heads", arch.num_heads)
    ) != arch.num_kv_heads:
        raise ValueError(
            f"{source}: {config.get('num_attention_heads')} heads / "
            f"{config.get('num_key_value_heads')} KV heads; the drafter shares the target's "
            f"rope and cache, which has {arch.num_heads} / {arch.num_kv_heads}"
        )
    wanted = {"fc.weight": (d, 2 * d), EAGLE_PROJECTIONS["q"]: (q_rows, d),
              EAGLE_PROJECTIONS["k"]: (kv_rows, d), EAGLE_PROJECTIONS["v"]: (kv_rows, d),
              EAGLE_PROJECTIONS["o"]: (d, q_rows), EAGLE_PROJECTIONS["gate"]: (inter, d),
              EAGLE_PROJECTIONS["up"]: (inter, d), EAGLE_PROJECTIONS["down"]: (d, inter),
              "layers.0.post_attention_layernorm.weight": (d,)}  # fmt: skip
    for name, shape in wanted.items():
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name}")
        expect_shape(name, tensors[name], shape, source)
    has_norm = "layers.0.input_layernorm.weight" in tensors
    network = network_class(d, arch.num_heads, arch.num_kv_heads, arch.head_dim, inter,
                            arch.rms_norm_eps, input_norm=has_norm)  # fmt: skip
    with torch.no_grad():
        network.fc.weight.copy_(tensors["fc.weight"].float())
        bias = tensors.get("fc.bias")
        network.fc.bias.copy_(torch.zeros(d) if bias is None else bias.float())
        # Checkpoints keep q/k rows in the rotate-half layout, the engine in adjacent pairs.
        q = interleave_rope_rows(tensors[EAGLE_PROJECTIONS["q"]].float(), arch.num_heads)
        k = interleave_rope_rows(tensors[EAGLE_PROJECTIONS["k"]].float(), arch.num_kv_heads)
        network.qkv.weight.copy_(torch.cat([q, k, tensors[EAGLE_PROJECTIONS["v"]].float()]))
        network.o.weight.copy_(tensors[EAGLE_PROJECTIONS["o"]].float())
        gate_up = [tensors[EAGLE_PROJECTIONS[x]] for x in ("gate", "up")]
        network.gate_up.weight.copy_(torch.cat(gate_up).float())
        network.down.weight.copy_(tensors[EAGLE_PROJECTIONS["down"]].float())
        network.post_attention_norm.copy_(tensors["layers.0.post_attention_layernorm.weight"])
        if has_norm:
            norm = tensors["layers.0.input_layernorm.weight"]
            expect_shape("layers.0.input_layernorm.weight", norm, (d,), source)
            network.input_norm.copy_(norm)
    vocab = torch.tensor(config.get(EAGLE_VOCAB_KEY) or range(arch.vocab_size))
    accuracies = config.get(ACCURACIES_KEY) or [[0.6 * 0.8**s] for s in range(4)]
    info = {"loaded_from": str(directory), "layout": "eagle1"}
    return TrainedDrafter("eagle", network.eval(), vocab.long(), accuracies,
                          target_signature(model), info)  # fmt: skip


def _save_eagle1(drafter: TrainedDrafter, model, directory: Path) -> None:
    """SafeAILab's EAGLE-1 layout (one layer, ``fc`` over [embedding; feature], the target's
    embedding and LM head shared); the draft vocabulary and accuracies ride in extra config
    keys. A layer with an input norm is written with ``layers.0.input_layernorm.weight``, which
    SafeAILab's own first layer and vLLM's have no place for: they would drop it and draft
    differently, so this refuses such a drafter (train with --no-input-norm to export)."""

    network, arch = drafter.network, model.arch
    if network.input_norm is not None:
        raise ValueError(
            "this EAGLE drafter has a norm before its attention, which EAGLE-1's first layer "
            "has no place for; train it with `specserve train eagle --no-input-norm` to export"
        )
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    q, k, v = network.qkv.weight.detach().float().split([q_rows, kv_rows, kv_rows])
    gate, up = network.gate_up.weight.detach().float().chunk(2)
    tensors = {
        "fc.weight": network.fc.weight.detach().float(),
        "fc.bias": network.fc.bias.detach().float(),
        EAGLE_PROJECTIONS["q"]: deinterleave_rope_rows(q, arch.num_heads),
        EAGLE_PROJECTIONS["k"]: deinterleave_rope_rows(k, arch.num_kv_heads),
        EAGLE_PROJECTIONS["v"]: v,
        EAGLE_PROJECTIONS["o"]: network.o.weight.detach().float(),
        EAGLE_PROJECTIONS["gate"]: gate, EAGLE_PROJECTIONS["up"]: up,
        EAGLE_PROJECTIONS["down"]: network.down.weight.detach().float(),
        "layers.0.post_attention_layernorm.weight": network.post_attention_norm.detach().float(),
    }  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / EAGLE_FILES[0]))
    s = network.shape
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"], "rms_norm_eps": s["rms_norm_eps"],
        "vocab_size": arch.vocab_size, "bias": True, "hidden_act": "silu",
        "tie_word_embeddings": False,
        EAGLE_VOCAB_KEY: drafter.draft_vocab.tolist(), ACCURACIES_KEY: drafter.accuracies,
    }  # fmt: skip
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("medusa-vllm", "medusa", _is_vllm_medusa, _load_vllm_medusa, _save_vllm_medusa),
        Layout(
            "medusa-v2", "medusa", lambda d: (d / V2_FILE).is_file(), _load_faster_decoding,
            _save_faster_decoding_v2,
        ),
        Layout("medusa-v1", "medusa", lambda d: (d / V1_FILE).is_file(), _load_faster_decoding,
               None),
        Layout("eagle1", "eagle", _is_eagle1, _load_eagle1, _save_eagle1),
        EAGLE3_LAYOUT,
    )
}  # fmt: skip


def find_layout(directory: Path) -> Layout | None:
    """The public layout ``directory`` is in (None: ours, or none we know)."""
    config = config_of(directory)
    if "type" in config and "shape" in config:
        return None  # a specserve drafter directory
    return next((layout for layout in LAYOUTS.values() if layout.matches(directory)), None)


def export(drafter: TrainedDrafter, model, layout: str, directory: Path) -> None:
    """Write ``drafter`` (for ``model``) to ``directory`` in the public ``layout``."""
    found = LAYOUTS.get(layout)
    writable = [n for n, entry in LAYOUTS.items() if entry.save and entry.kind == drafter.kind]
    if found is None or found.save is None or found.kind != drafter.kind:
        raise ValueError(
            f"a {drafter.kind} drafter can be written as: {', '.join(writable) or 'none'}"
        )
    found.save(drafter, model, Path(directory))
