"""wildtrain's model in Transformers' format: the config mapping, what is refused, the
multipliers folded into the weights, and an exported model that Transformers loads and that
computes wildtrain's logits and greedy continuations, for every architecture option of the
presets (tiny dims)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.models import random_model
from wildtrain.config import ModelConfig
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.export import write_hf
from wildtrain.model import Transformer
from wildtrain.model.hf import NotExpressible, hf_architecture, hf_state_dict, rotate_halves
from wildtrain.sample import generate

EOS = ByteTokenizer.eos_id

# Each option the presets use (explicit or derived SwiGLU width, grouped-query attention as
# in 21b), and each the config offers: multi-query attention, muP's multipliers (against a
# base of half the width, head_dim and depth: logits, residual branches and attention's
# 1/head_dim scale), another rotary base and norm epsilon, per-document attention, a sliding window.
ARCHITECTURES = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64),
    "gqa_ffn_dim": ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=64),
    "mqa": ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=1, max_seq_len=64),
    "mup_rope_eps": ModelConfig(
        dim=64,
        n_layers=3,
        n_heads=4,
        max_seq_len=64,
        output_mult=0.25,
        residual_mult=0.6,
        rope_theta=500000.0,
        norm_eps=1e-6,
        base_dim=32,
        base_ffn_dim=96,
        base_head_dim=8,
        base_n_layers=1,
    ),
    "document": ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64, attention="document"),
    "window": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, attention_window=7),
    "document_window": ModelConfig(
        dim=64, n_layers=2, n_heads=4, max_seq_len=64, attention="document", attention_window=5
    ),
}


def export_model(folder, cfg: ModelConfig, model: Transformer, **kwargs):
    from transformers import AutoModelForCausalLM

    folder.mkdir()
    write_hf(folder, cfg, model.state_dict(), ByteTokenizer(), {"run": "test"}, **kwargs)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def wildtrain_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    one_document = torch.zeros_like(tokens) if model.cfg.attention != "causal" else None
    with torch.no_grad():
        return model(tokens, doc_ids=one_document)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_exported_model_computes_wildtrains_logits(tmp_path, name):
    cfg = ARCHITECTURES[name]
    model = random_model(cfg)
    hf = export_model(tmp_path / "hf", cfg, model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = wildtrain_logits(model, tokens)
    with torch.no_grad():
        got = hf(tokens).logits
    assert expected.abs().max() > 0.1, "logits too small for the tolerance to mean anything"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["tiny", "gqa_ffn_dim", "mup_rope_eps", "window"])
def test_greedy_sample_equals_the_exports_generate(tmp_path, name):
    cfg = ARCHITECTURES[name]
    model = random_model(cfg, seed=2)
    hf = export_model(tmp_path / "hf", cfg, model)
    prompt = list(b"The quick brown fox")
    ours = generate(model, prompt, 30, eos_id=EOS)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=EOS)
    assert ours == theirs[0, len(prompt) :].tolist()
    assert len(ours) == 30 or ours[-1] == EOS


def test_sampling_is_reproducible_by_seed_and_not_greedy():
    model = random_model(ARCHITECTURES["tiny"])
    prompt = list(b"abc")

    def draw(seed: int) -> list[int]:
        return generate(model, prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(seed))

    assert draw(0) == draw(0)
    assert len({tuple(draw(seed)) for seed in range(3)} | {tuple(generate(model, prompt, 20))}) > 1


def test_prefix_lm_samples_with_the_prompt_as_its_prefix():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64, attention="prefix_lm")
    model = random_model(cfg)
    prompt = list(b"prefix")
    ids = generate(model, prompt, 10)
    # The first token is predicted from the last prompt position, which attends to the whole
    # prompt bidirectionally: the model's own forward with that prefix.
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(tokens, doc_ids=torch.zeros_like(tokens), prefix=torch.ones_like(tokens))
    assert ids[0] == int(logits[0, -1].argmax())


def test_large_exports_are_sharded_and_load(tmp_path):
    cfg = ARCHITECTURES["gqa_ffn_dim"]
    model = random_model(cfg)
    hf = export_model(tmp_path / "hf", cfg, model, max_shard_size="100KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, wildtrain_logits(model, tokens), rtol=1e-4, atol=2e-5)


def test_config_maps_each_field():
    cfg = ModelConfig(
        vocab_size=500,
        dim=96,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=None,
        multiple_of=64,
        max_seq_len=128,
        rope_theta=1e6,
        norm_eps=1e-6,
    )
    arch = hf_architecture(cfg, eos_id=7)
    assert arch.model_type == "llama" and arch.name == "LlamaForCausalLM"
    assert {
        k: arch.config[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
            "tie_word_embeddings",
            "eos_token_id",
            "bos_token_id",
        )
    } == {
        "vocab_size": 500,
        "hidden_size": 96,
        "intermediate_size": 256,  # 8/3 * 96 = 256, a multiple of 64
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
        "eos_token_id": 7,
        "bos_token_id": None,
    }
    windowed = hf_architecture(ModelConfig(attention_window=32), eos_id=7)
    assert windowed.name == "MistralForCausalLM" and windowed.config["sliding_window"] == 32
    assert hf_architecture(ModelConfig(n_kv_heads=None, n_heads=4), 0).config["num_key_value_heads"] == 4


def test_prefix_lm_is_refused_in_one_line_naming_the_key():
    with pytest.raises(NotExpressible) as refused:
        hf_architecture(ModelConfig(attention="prefix_lm"), eos_id=256)
    message = str(refused.value)
    assert message.startswith("model.attention=prefix_lm: ") and "\n" not in message


def test_multipliers_fold_into_the_last_projections_and_the_head():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, output_mult=0.5, residual_mult=0.25, max_seq_len=16)
    weights = random_model(cfg).state_dict()
    hf = hf_state_dict(cfg, weights)
    assert torch.equal(hf["lm_head.weight"], weights["output.weight"] * 0.5)
    for i in range(2):
        assert torch.equal(
            hf[f"model.layers.{i}.self_attn.o_proj.weight"], weights[f"layers.{i}.attention.wo.weight"] * 0.25
        )
        assert torch.equal(
            hf[f"model.layers.{i}.mlp.down_proj.weight"], weights[f"layers.{i}.feed_forward.w2.weight"] * 0.25
        )
        # What a residual branch reads, and the norms, are left as they are.
        assert torch.equal(hf[f"model.layers.{i}.mlp.up_proj.weight"], weights[f"layers.{i}.feed_forward.w3.weight"])
        assert torch.equal(hf[f"model.layers.{i}.input_layernorm.weight"], weights[f"layers.{i}.attention_norm.weight"])
    assert torch.equal(hf["model.embed_tokens.weight"], weights["tok_embeddings.weight"])


def test_rotary_pairs_become_halves_per_head():
    # Rows named by (head, dimension): pairs (0, 1), (2, 3) of each head become halves.
    weight = torch.arange(2 * 4, dtype=torch.float32)[:, None]
    assert rotate_halves(weight, heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_weights_of_another_model_are_refused_naming_what_is_missing():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    weights = random_model(cfg).state_dict()
    weights.pop("layers.1.attention.wq.weight")
    with pytest.raises(ValueError, match=r"missing \['layers.1.attention.wq.weight'\]"):
        hf_state_dict(cfg, weights)
