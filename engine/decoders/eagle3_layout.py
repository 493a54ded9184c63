"""EAGLE-3's public layout (``LlamaForCausalLMEagle3``: SafeAILab's and SpecForge's
checkpoints, which vLLM and SGLang load), read into our ``Eagle3Network`` and written from it.

The checkpoint: ``fc.weight`` [d, 3d] over the target's three layers; ``midlayer.*``, one Llama
layer whose q/k/v read [input_layernorm(embedding); hidden_norm(h)] [2d]; ``norm.weight`` and
``lm_head.weight`` [draft vocabulary, d]; ``d2t`` [draft vocabulary] (draft id i is target token
i + d2t[i]) and ``t2d`` [vocabulary] (whether a target token is drafted). The config names the
draft vocabulary's size and, where it says, ``eagle_config.eagle_aux_hidden_state_layer_ids``:
the layers whose *inputs* are fused (ours names the layers whose outputs are: one less); without
it, vLLM's default (2, L/2, L - 3). The target's embedding is shared, as in vLLM.

Two conversions: checkpoints keep q/k rows in Llama's rotate-half layout and the engine in
adjacent pairs (``engine.models.rope``), so those rows are permuted on the way in and out; and
a draft vocabulary in the layout is in token order, so ours is sorted on the way out (the
head's rows with it: the same drafts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.decoders.drafter_files import CONFIG_FILE, TrainedDrafter, target_signature
from engine.decoders.layout_files import (
    ACCURACIES_KEY,
    Layout,
    config_of,
    expect_shape,
    has_key,
    tensors_of,
)
from engine.models.rope import deinterleave_rope_rows, interleave_rope_rows

FILES = ("model.safetensors", "pytorch_model.bin")
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER = {
    "q": "midlayer.self_attn.q_proj.weight", "k": "midlayer.self_attn.k_proj.weight",
    "v": "midlayer.self_attn.v_proj.weight", "o": "midlayer.self_attn.o_proj.weight",
    "gate": "midlayer.mlp.gate_proj.weight", "up": "midlayer.mlp.up_proj.weight",
    "down": "midlayer.mlp.down_proj.weight",
    "embed_norm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
    "post_attention_norm": "midlayer.post_attention_layernorm.weight",
}  # fmt: skip


def _file(directory: Path) -> Path | None:
    return next((directory / f for f in FILES if (directory / f).is_file()), None)


def _matches(directory: Path) -> bool:
    path = _file(directory)
    if path is None:
        return False
    if ARCHITECTURE in config_of(directory).get("architectures", []):
        return True
    return path.suffix == ".safetensors" and has_key(path, LAYER["q"])


def _public_layer_ids(ours: list[int]) -> list[int]:
    return [i + 1 for i in ours]


def _feature_layers(config: dict, num_layers: int) -> list[int]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    return [int(i) - 1 for i in ids]


def _load(directory: Path, model, network_class) -> TrainedDrafter:
    source = _file(directory)
    config, tensors = config_of(directory), tensors_of(source)
    arch = model.arch
    d, vocab_size = arch.hidden_size, arch.vocab_size
    if config.get("hidden_size", d) != d or config.get("target_hidden_size", d) != d:
        raise ValueError(
            f"{source}: hidden size {config.get('hidden_size')} (target hidden size "
            f"{config.get('target_hidden_size', config.get('hidden_size'))}); this model has {d}"
        )
    heads = config.get("num_attention_heads", arch.num_heads)
    kv_heads = config.get("num_key_value_heads", heads)
    if (heads, kv_heads) != (arch.num_heads, arch.num_kv_heads):
        raise ValueError(
            f"{source}: {heads} heads / {kv_heads} KV heads; the drafter shares the target's "
            f"rope and cache, which has {arch.num_heads} / {arch.num_kv_heads}"
        )
    if config.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(
            f"{source}: vocabulary of {config['vocab_size']} tokens; this model has {vocab_size}"
        )
    layers = _feature_layers(config, arch.num_layers)
    if min(layers) < 0 or max(layers) >= arch.num_layers:
        raise ValueError(
            f"{source}: fuses the inputs of layers {_public_layer_ids(layers)}; this model has "
            f"{arch.num_layers}"
        )
    if "lm_head.weight" not in tensors:
        raise ValueError(f"{source}: missing tensor lm_head.weight")
    draft_size = tensors["lm_head.weight"].shape[0]
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = config.get("intermediate_size", arch.intermediate_size)
    wanted = {
        "fc.weight": (d, len(layers) * d), LAYER["q"]: (q_rows, 2 * d),
        LAYER["k"]: (kv_rows, 2 * d), LAYER["v"]: (kv_rows, 2 * d), LAYER["o"]: (d, q_rows),
        LAYER["gate"]: (inter, d), LAYER["up"]: (inter, d), LAYER["down"]: (d, inter),
        LAYER["embed_norm"]: (d,), LAYER["hidden_norm"]: (d,),
        LAYER["post_attention_norm"]: (d,), "norm.weight": (d,), "lm_head.weight": (draft_size, d),
        "d2t": (draft_size,), "t2d": (vocab_size,), "embed_tokens.weight": (vocab_size, d),
    }  # fmt: skip
    optional = {"d2t", "t2d", "embed_tokens.weight"}
    for name, shape in wanted.items():
        if name in tensors:
            expect_shape(name, tensors[name], shape, source)
        elif name not in optional:
            raise ValueError(f"{source}: missing tensor {name}")
    biased = sorted(n for n in tensors if n.startswith("midlayer.") and n.endswith(".bias"))
    if biased:
        raise ValueError(f"{source}: {biased[0]}: biases in the layer are not supported")
    vocab = _draft_vocabulary(tensors, draft_size, vocab_size, source)
    network = network_class(d, arch.num_heads, arch.num_kv_heads, arch.head_dim, inter,
                            arch.rms_norm_eps, draft_size, layers)  # fmt: skip
    with torch.no_grad():
        q = interleave_rope_rows(tensors[LAYER["q"]].float(), arch.num_heads)
        k = interleave_rope_rows(tensors[LAYER["k"]].float(), arch.num_kv_heads)
        network.qkv.weight.copy_(torch.cat([q, k, tensors[LAYER["v"]].float()]))
        network.o.weight.copy_(tensors[LAYER["o"]].float())
        network.gate_up.weight.copy_(torch.cat([tensors[LAYER[x]] for x in ("gate", "up")]))
        network.down.weight.copy_(tensors[LAYER["down"]].float())
        network.fc.weight.copy_(tensors["fc.weight"].float())
        network.lm_head.weight.copy_(tensors["lm_head.weight"].float())
        network.norm.copy_(tensors["norm.weight"].float())
        for ours in ("embed_norm", "hidden_norm", "post_attention_norm"):
            getattr(network, ours).copy_(tensors[LAYER[ours]].float())
    accuracies = config.get(ACCURACIES_KEY) or [[0.6 * 0.8**s] for s in range(4)]
    info = {"loaded_from": str(directory), "layout": "eagle3"}
    return TrainedDrafter("eagle3", network.eval(), vocab, accuracies, target_signature(model),
                          info)  # fmt: skip


def _draft_vocabulary(tensors: dict, draft_size: int, vocab_size: int, source) -> torch.Tensor:
    """The target token of each draft id, from ``d2t`` (offsets), checked against ``t2d``;
    without ``d2t`` the head must cover the whole vocabulary."""
    if "d2t" not in tensors:
        if draft_size != vocab_size:
            raise ValueError(
                f"{source}: a head over {draft_size} tokens needs d2t to say which; this "
                f"model's vocabulary has {vocab_size}"
            )
        return torch.arange(vocab_size)
    vocab = torch.arange(draft_size) + tensors["d2t"].long()
    if vocab.min() < 0 or vocab.max() >= vocab_size or len(vocab.unique()) != draft_size:
        raise ValueError(f"{source}: d2t maps draft ids outside or onto each other in the "
                         f"vocabulary of {vocab_size}")  # fmt: skip
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool().nonzero().flatten(),
                                            vocab.sort().values):  # fmt: skip
        raise ValueError(f"{source}: t2d and d2t name different draft vocabularies")
    return vocab


def _save(drafter: TrainedDrafter, model, directory: Path) -> None:

    network, arch = drafter.network, model.arch
    order = drafter.draft_vocab.argsort()  # the layout's draft ids run in token order
    vocab = drafter.draft_vocab[order]
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    q, k, v = network.qkv.weight.detach().float().split([q_rows, kv_rows, kv_rows])
    gate, up = network.gate_up.weight.detach().float().chunk(2)
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    tensors = {
        "fc.weight": network.fc.weight, LAYER["q"]: deinterleave_rope_rows(q, arch.num_heads),
        LAYER["k"]: deinterleave_rope_rows(k, arch.num_kv_heads), LAYER["v"]: v,
        LAYER["o"]: network.o.weight, LAYER["gate"]: gate, LAYER["up"]: up,
        LAYER["down"]: network.down.weight, LAYER["embed_norm"]: network.embed_norm,
        LAYER["hidden_norm"]: network.hidden_norm,
        LAYER["post_attention_norm"]: network.post_attention_norm, "norm.weight": network.norm,
        "lm_head.weight": network.lm_head.weight[order],
    }  # fmt: skip
    tensors = {name: t.detach().float().contiguous() for name, t in tensors.items()}
    tensors["d2t"] = (vocab - torch.arange(len(vocab))).contiguous()
    tensors["t2d"] = t2d
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / FILES[0]))
    s = network.shape
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"], "rms_norm_eps": s["rms_norm_eps"], "hidden_act": "silu",
        "vocab_size": arch.vocab_size, "draft_vocab_size": len(vocab),
        "target_hidden_size": s["hidden_size"], "tie_word_embeddings": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": _public_layer_ids(s["feature_layers"]),
            "use_aux_hidden_state": True,
        },
        ACCURACIES_KEY: drafter.accuracies,
    }  # fmt: skip
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


EAGLE3_LAYOUT = Layout("eagle3", "eagle3", _matches, _load, _save)
