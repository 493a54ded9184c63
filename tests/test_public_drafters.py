"""Medusa heads in the layouts users download (vLLM's, FasterDecoding's): loaded, written from
ours, round-tripped to identical drafts, and refused with a message that names the problem."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders.drafter_files import TrainedDrafter
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.medusa import MedusaHeads
from engine.decoders.public_drafters import export, find_layout
from engine.models.linear import dense_weight
from tests.tiny_models import save_heads_drafter

PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6 + [14]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ours(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("medusa") / "ours"
    return save_heads_drafter(tiny_model_dir, path, "medusa", num_heads=3, scale=0.05, seed=3)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), decoder={"load_shipped_drafters": False})


def _drafts(model_dir, drafter_dir) -> tuple:
    """The greedy outputs and what the drafts did (per-position acceptance counts): equal
    only when the drafts were the same."""
    decoder = {"method": "medusa", "draft_policy": "fixed", "num_speculative_tokens": 4,
               "medusa": {"drafter": str(drafter_dir), "quantization": "none"}}  # fmt: skip
    llm = LLM(model=str(model_dir), decoder=decoder)
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    stats = llm.engine.speculator.stats_by_decoder["medusa"]
    return outputs, stats.num_drafts, stats.num_draft_tokens, list(stats.accepted_per_position)


def test_ours_round_trips_through_vllms_layout_to_identical_drafts(tiny_model_dir, ours, llm,
                                                                    tmp_path):  # fmt: skip
    model = llm.engine.model
    mine = load_drafter(str(ours), "medusa", MedusaHeads, model)
    export(mine, model, "medusa-vllm", tmp_path / "vllm")
    assert find_layout(tmp_path / "vllm").name == "medusa-vllm"
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["num_heads"] == 3 and config["medusa_fc_bias"] is True
    back = load_drafter(str(tmp_path / "vllm"), "medusa", MedusaHeads, model)
    assert torch.equal(back.network.weight, mine.network.weight)
    assert torch.equal(back.draft_vocab, mine.draft_vocab) and back.accuracies == mine.accuracies
    assert _drafts(tiny_model_dir, tmp_path / "vllm") == _drafts(tiny_model_dir, ours)


def test_medusa_2s_layout_keeps_the_heads(ours, llm, tmp_path):
    model = llm.engine.model
    mine = load_drafter(str(ours), "medusa", MedusaHeads, model)
    export(mine, model, "medusa-v2", tmp_path / "v2")
    assert sorted(p.name for p in (tmp_path / "v2").iterdir()) == [
        "config.json", "medusa_lm_head.safetensors"]  # fmt: skip
    back = load_drafter(str(tmp_path / "v2"), "medusa", MedusaHeads, model)
    assert torch.equal(back.network.bias, mine.network.bias)
    assert torch.equal(back.draft_vocab, torch.arange(model.arch.vocab_size))


def _write_v1(directory, heads: MedusaHeads, lm_head: torch.Tensor, blocks: int = 1):
    """FasterDecoding's medusa_lm_head.pt: {i}.{j}.linear.* and a per-head {i}.{L}.weight."""
    directory.mkdir(parents=True)
    state = {}
    for i in range(heads.num_heads):
        for j in range(blocks):
            state[f"{i}.{j}.linear.weight"] = heads.weight[i].detach().clone()
            state[f"{i}.{j}.linear.bias"] = heads.bias[i].detach().clone()
        state[f"{i}.{blocks}.weight"] = lm_head.clone()
    torch.save(state, directory / "medusa_lm_head.pt")
    config = {"medusa_num_heads": 2, "medusa_num_layers": blocks, "base_model_name_or_path": "x"}
    (directory / "config.json").write_text(json.dumps(config))  # 2 heads: understated
    return directory


def test_faster_decodings_first_layout_loads_when_its_heads_read_the_targets_rows(llm, tmp_path):
    model = llm.engine.model
    heads = MedusaHeads(3, model.arch.hidden_size)
    torch.nn.init.normal_(heads.weight, std=0.02)
    path = _write_v1(tmp_path / "v1", heads, dense_weight(model.lm_head).float())
    back = load_drafter(str(path), "medusa", MedusaHeads, model)
    assert back.network.num_heads == 3  # counted from the tensors, not the config
    assert torch.equal(back.network.weight, heads.weight.detach())


def test_refusals_name_what_is_wrong(llm, ours, tmp_path):
    model = llm.engine.model
    d, vocab = model.arch.hidden_size, model.arch.vocab_size
    heads = MedusaHeads(2, d)
    with pytest.raises(ValueError, match="0.1.weight is a trained LM head of its own"):
        load_drafter(str(_write_v1(tmp_path / "own", heads, torch.randn(vocab, d))),
                     "medusa", MedusaHeads, model)  # fmt: skip
    with pytest.raises(ValueError, match="2 residual blocks per head"):
        load_drafter(str(_write_v1(tmp_path / "deep", heads, torch.zeros(vocab, d), blocks=2)),
                     "medusa", MedusaHeads, model)  # fmt: skip
    wide = MedusaHeads(2, d * 2)
    with pytest.raises(ValueError, match=rf"tensor 0.0.linear.weight has shape \[{2 * d}, {2 * d}"
                                         rf"\], this model needs \[{d}, {d}\]"):  # fmt: skip
        load_drafter(str(_write_v1(tmp_path / "wide", wide, torch.zeros(vocab, 2 * d))),
                     "medusa", MedusaHeads, model)  # fmt: skip
    mine = load_drafter(str(ours), "medusa", MedusaHeads, model)
    export(mine, model, "medusa-vllm", tmp_path / "vllm")
    with pytest.raises(ValueError, match="holds a medusa drafter \\(medusa-vllm\\), not hydra"):
        load_drafter(str(tmp_path / "vllm"), "hydra", MedusaHeads, model)
    with pytest.raises(ValueError, match="a medusa drafter can be written as: medusa-vllm, "):
        export(mine, model, "eagle3", tmp_path / "nope")


def test_a_drafter_trained_for_another_model_is_refused(llm, tmp_path):
    model = llm.engine.model
    heads = MedusaHeads(2, model.arch.hidden_size)
    other = {"hidden_size": model.arch.hidden_size, "vocab_size": 7, "num_layers": 1}
    TrainedDrafter("medusa", heads, torch.arange(5), [[0.5]] * 2, other, {}).save(tmp_path / "x")
    with pytest.raises(ValueError, match="was trained for .*'vocab_size': 7.*not this model"):
        load_drafter(str(tmp_path / "x"), "medusa", MedusaHeads, model)


def test_the_export_command_writes_a_layout_that_loads(tiny_model_dir, ours, llm, tmp_path):
    from tooling.cli import main

    out = tmp_path / "exported"
    args = ["export", "medusa", "--model", str(tiny_model_dir), "--drafter", str(ours),
            "--layout", "medusa-vllm", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    back = load_drafter(str(out), "medusa", MedusaHeads, llm.engine.model)
    assert back.network.num_heads == 3
    assert main([*args[:-4], "--layout", "eagle3", "--output", str(out)]) == 2  # a clear error


# ---- EAGLE-1 / EAGLE-2 ------------------------------------------------------------------------
def _eagle(model_dir, path, input_norm: bool, vocab=None):
    """A random EAGLE drafter for the tiny model (scaled so its drafts vary)."""
    from engine.decoders.eagle import EagleNetwork

    config = json.loads((model_dir / "config.json").read_text())
    d, heads = config["hidden_size"], config["num_attention_heads"]
    torch.manual_seed(5)
    network = EagleNetwork(d, heads, config["num_key_value_heads"], d // heads,
                           config["intermediate_size"], config["rms_norm_eps"],
                           input_norm=input_norm)  # fmt: skip
    target = {"hidden_size": d, "vocab_size": config["vocab_size"],
              "num_layers": config["num_hidden_layers"]}  # fmt: skip
    vocab = torch.arange(config["vocab_size"]) if vocab is None else vocab
    TrainedDrafter("eagle", network, vocab, [[0.5, 0.2]] * 3, target, {}).save(path)
    return path


def _eagle_drafts(model_dir, drafter_dir, method: str = "eagle") -> tuple:
    """Greedy outputs and the drafting statistics of an EAGLE-family drafter (unquantized)."""
    decoder = {"method": method, "draft_policy": "fixed", "num_speculative_tokens": 3,
               method: {"drafter": str(drafter_dir), "quantization": "none"}}  # fmt: skip
    llm = LLM(model=str(model_dir), decoder=decoder)
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    stats = llm.engine.speculator.stats_by_decoder[method]
    return outputs, stats.num_draft_tokens, list(stats.accepted_per_position)


def test_an_eagle1_drafter_round_trips_to_identical_drafts(tiny_model_dir, llm, tmp_path):
    from engine.decoders.eagle import EagleNetwork

    model = llm.engine.model
    vocab = torch.arange(0, model.arch.vocab_size, 2)  # a draft vocabulary: every other token
    ours = _eagle(tiny_model_dir, tmp_path / "ours", input_norm=False, vocab=vocab)
    mine = load_drafter(str(ours), "eagle", EagleNetwork, model)
    export(mine, model, "eagle1", tmp_path / "eagle1")
    assert find_layout(tmp_path / "eagle1").name == "eagle1"
    back = load_drafter(str(tmp_path / "eagle1"), "eagle", EagleNetwork, model)
    assert back.network.input_norm is None and torch.equal(back.draft_vocab, vocab)
    for name, value in mine.network.state_dict().items():
        assert torch.equal(back.network.state_dict()[name], value), name
    assert _eagle_drafts(tiny_model_dir, tmp_path / "eagle1") == _eagle_drafts(tiny_model_dir, ours)


def test_a_safeailab_checkpoint_loads(tiny_model_dir, llm, tmp_path):
    """As SafeAILab saves one: pytorch_model.bin with the frozen embedding, no fc bias
    ("bias": false), separate q/k/v and gate/up, the whole vocabulary."""
    from engine.decoders.eagle import EagleNetwork

    model = llm.engine.model
    ours = _eagle(tiny_model_dir, tmp_path / "ours", input_norm=False)
    mine = load_drafter(str(ours), "eagle", EagleNetwork, model)
    export(mine, model, "eagle1", tmp_path / "x")
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "x" / "model.safetensors"))
    del state["fc.bias"]
    state["embed_tokens.weight"] = torch.zeros(model.arch.vocab_size, model.arch.hidden_size)
    (tmp_path / "bin").mkdir()
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("specserve")} | {"bias": False}
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    back = load_drafter(str(tmp_path / "bin"), "eagle", EagleNetwork, model)
    assert torch.equal(back.network.fc.bias, torch.zeros(model.arch.hidden_size))
    assert len(back.draft_vocab) == model.arch.vocab_size
    outputs, drafted, _ = _eagle_drafts(tiny_model_dir, tmp_path / "bin")
    assert drafted > 0
    assert outputs == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_eagle1_refusals(tiny_model_dir, llm, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.decoders.eagle import EagleNetwork

    model = llm.engine.model
    normed = load_drafter(str(_eagle(tiny_model_dir, tmp_path / "n", input_norm=True)), "eagle",
                          EagleNetwork, model)  # fmt: skip
    with pytest.raises(ValueError, match="no place for; train it with .*--no-input-norm"):
        export(normed, model, "eagle1", tmp_path / "out")
    plain = load_drafter(str(_eagle(tiny_model_dir, tmp_path / "p", input_norm=False)), "eagle",
                         EagleNetwork, model)  # fmt: skip
    export(plain, model, "eagle1", tmp_path / "bad")
    state = load_file(str(tmp_path / "bad" / "model.safetensors"))
    d = model.arch.hidden_size
    state["fc.weight"] = torch.zeros(d, 3 * d)
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor fc.weight has shape \[{d}, {3 * d}\], this "
                                         rf"model needs \[{d}, {2 * d}\]"):  # fmt: skip
        load_drafter(str(tmp_path / "bad"), "eagle", EagleNetwork, model)


# ---- EAGLE-3 ---------------------------------------------------------------------------------
@pytest.fixture
def eagle3_ours(tiny_model_dir, tmp_path):
    from tests.tiny_models import save_eagle3_drafter

    # A draft vocabulary out of token order (ours is by frequency; the layout's by token id).
    vocab = torch.tensor([40, 3, 17, 5, 6, 7, 8, 9, 23, 11, 12, 13, 14, 41, 42, 43, 44, 45])
    return save_eagle3_drafter(tiny_model_dir, tmp_path / "ours", draft_vocab=vocab, seed=3)


def test_an_eagle3_drafter_round_trips_to_identical_drafts(tiny_model_dir, llm, eagle3_ours,
                                                          tmp_path):  # fmt: skip
    from safetensors.torch import load_file

    from engine.decoders.eagle3 import Eagle3Network

    model = llm.engine.model
    mine = load_drafter(str(eagle3_ours), "eagle3", Eagle3Network, model)
    export(mine, model, "eagle3", tmp_path / "eagle3")
    assert find_layout(tmp_path / "eagle3").name == "eagle3"
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 18
    # Ours fuses the outputs of layers 0, 1, 2: the inputs of layers 1, 2, 3 in its terms.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    state = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    ordered = mine.draft_vocab.sort().values
    assert torch.equal(torch.arange(18) + state["d2t"], ordered)  # draft id i -> i + d2t[i]
    assert torch.equal(state["t2d"].nonzero().flatten(), ordered)
    assert state["t2d"].dtype == torch.bool and len(state["t2d"]) == model.arch.vocab_size
    back = load_drafter(str(tmp_path / "eagle3"), "eagle3", Eagle3Network, model)
    assert torch.equal(back.draft_vocab, ordered)
    assert back.network.shape == mine.network.shape
    exported = _eagle_drafts(tiny_model_dir, tmp_path / "eagle3", "eagle3")
    assert exported == _eagle_drafts(tiny_model_dir, eagle3_ours, "eagle3")


def test_eagle3_q_and_k_are_written_in_the_rotate_half_layout(llm, eagle3_ours, tmp_path):
    """Checkpoints keep Llama's rotate-half rows; the engine, adjacent pairs. The attention
    scores of the written rows under transformers' rotate-half rope must be ours."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from engine.decoders.eagle3 import Eagle3Network

    model = llm.engine.model
    arch = model.arch
    mine = load_drafter(str(eagle3_ours), "eagle3", Eagle3Network, model)
    export(mine, model, "eagle3", tmp_path / "out")
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    torch.manual_seed(0)
    x = torch.randn(6, 2 * arch.hidden_size)
    factors = model.rope.lookup(torch.arange(6))  # complex [T, 1, D/2]
    with torch.no_grad():
        q, k, _ = mine.network.attention_inputs(x, factors)
        groups = arch.num_heads // arch.num_kv_heads
        ours = torch.einsum("thd,shd->hts", q, k.repeat_interleave(groups, 1))
        cos = torch.cat([factors.real, factors.real], -1)[:, 0][None]  # [1, T, D]
        sin = torch.cat([factors.imag, factors.imag], -1)[:, 0][None]
        hq = (x @ state["midlayer.self_attn.q_proj.weight"].T).view(1, 6, arch.num_heads, -1)
        hk = (x @ state["midlayer.self_attn.k_proj.weight"].T).view(1, 6, arch.num_kv_heads, -1)
        hq, hk = apply_rotary_pos_emb(hq.transpose(1, 2), hk.transpose(1, 2), cos, sin)
        hk = hk.repeat_interleave(groups, 1)
        theirs = torch.einsum("htd,hsd->hts", hq[0], hk[0])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_eagle3_refusals(tiny_model_dir, llm, eagle3_ours, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.decoders.eagle3 import Eagle3Network

    model = llm.engine.model
    d = model.arch.hidden_size
    mine = load_drafter(str(eagle3_ours), "eagle3", Eagle3Network, model)

    def broken(name: str, change) -> str:
        directory = tmp_path / name
        export(mine, model, "eagle3", directory)
        state = load_file(str(directory / "model.safetensors"))
        config = json.loads((directory / "config.json").read_text())
        change(state, config)
        save_file(state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config))
        return str(directory)

    def wide_q(state, _):
        state["midlayer.self_attn.q_proj.weight"] = torch.zeros(d, d)

    wanted = rf"q_proj.weight has shape \[{d}, {d}\], this model needs \[{d}, {2 * d}\]"
    with pytest.raises(ValueError, match=wanted):
        load_drafter(broken("q", wide_q), "eagle3", Eagle3Network, model)

    def deep(_, config):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]

    with pytest.raises(ValueError, match=r"inputs of layers \[2, 16, 29\]; this model has 3"):
        load_drafter(broken("deep", deep), "eagle3", Eagle3Network, model)

    def clashing(state, _):
        state["t2d"] = torch.zeros_like(state["t2d"])
        state["t2d"][:18] = True

    with pytest.raises(ValueError, match="t2d and d2t name different draft vocabularies"):
        load_drafter(broken("maps", clashing), "eagle3", Eagle3Network, model)

    def no_map(state, _):
        del state["d2t"]

    with pytest.raises(ValueError, match="a head over 18 tokens needs d2t"):
        load_drafter(broken("nomap", no_map), "eagle3", Eagle3Network, model)
    with pytest.raises(ValueError, match="holds a eagle3 drafter"):
        from engine.decoders.eagle import EagleNetwork

        load_drafter(broken("kind", lambda s, c: None), "eagle", EagleNetwork, model)
