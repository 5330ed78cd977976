import re
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from wildtrain.config import PACKAGE_CONF_DIR, ModelConfig
from wildtrain.model import Transformer, flops_per_token, param_count

TINY = ModelConfig()
GQA = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=32)
PRESETS = sorted((PACKAGE_CONF_DIR / "model").glob("*.yaml"))


def make(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def tokens(cfg: ModelConfig, batch: int = 2, seq_len: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [TINY, GQA], ids=["tiny", "gqa"])
def test_forward_shapes_and_loss(cfg):
    model = make(cfg)
    x = tokens(cfg)
    assert model(x).shape == (2, 16, cfg.vocab_size)
    loss = model(x, targets=tokens(cfg, seed=2))
    assert loss.ndim == 0 and torch.isfinite(loss)
    # At init the predictions are near uniform.
    assert abs(loss.item() - torch.log(torch.tensor(cfg.vocab_size)).item()) < 0.5


def test_backward_reaches_every_parameter():
    model = make(TINY)
    model(tokens(TINY), targets=tokens(TINY, seed=2)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cfg", [TINY, GQA], ids=["tiny", "gqa"])
def test_causal(cfg):
    model = make(cfg).eval()
    x = tokens(cfg, seq_len=12)
    t = 5
    y = x.clone()
    y[:, t + 1 :] = (y[:, t + 1 :] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_position_matters():
    # Without rotary embeddings, attention is permutation-invariant over the prefix, so the
    # last position's logits would not depend on the order of the earlier tokens.
    model = make(TINY).eval()
    x = tokens(TINY, batch=1, seq_len=8)
    swapped = x.clone()
    swapped[0, [0, 1]] = x[0, [1, 0]]
    with torch.no_grad():
        assert not torch.allclose(model(x)[0, -1], model(swapped)[0, -1])


def test_gqa_has_smaller_kv_projections():
    model = make(GQA)
    head_dim = GQA.dim // GQA.n_heads
    attn = model.layers[0].attention
    assert attn.wq.weight.shape == (GQA.n_heads * head_dim, GQA.dim)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (GQA.n_kv_heads * head_dim, GQA.dim)


def test_rope_buffers_not_in_state_dict():
    model = make(TINY)
    buffers = dict(model.named_buffers())
    half_head = TINY.dim // TINY.n_heads // 2
    assert buffers["rope_cos"].shape == buffers["rope_sin"].shape == (TINY.max_seq_len, half_head)
    state = model.state_dict()
    assert not any("rope" in key for key in state)
    assert set(state) == {name for name, _ in model.named_parameters()}
    make(TINY, seed=3).load_state_dict(state)  # strict: no missing or unexpected keys


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        make(TINY)(tokens(TINY, seq_len=TINY.max_seq_len + 1))


def test_residual_projections_are_scaled():
    model = make(replace(TINY, n_layers=8, dim=256))
    block = model.layers[0]
    # std 0.02 / sqrt(2 * 8) = 0.005, against 0.02 for the other weights.
    assert block.attention.wo.weight.std().item() == pytest.approx(0.005, rel=0.1)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.005, rel=0.1)
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("cfg", [TINY, GQA, replace(TINY, ffn_dim=200)], ids=["tiny", "gqa", "ffn_dim"])
def test_param_count_matches_module(cfg):
    model = make(cfg)
    assert param_count(cfg) == model.num_params() == sum(p.numel() for p in model.parameters())


def test_flops_per_token_tiny_by_hand():
    d, layers, vocab, seq_len = 128, 2, 320, 256
    ffn = 352  # 8/3 * 128 = 341.3, rounded up to a multiple of 32
    attention = 4 * d * d  # wq, wk, wv, wo; no GQA, so all dim x dim
    mlp = 3 * d * ffn  # w1, w3, w2
    head = d * vocab
    n_matmul = layers * (attention + mlp) + head  # embedding and norms excluded
    expected = 6 * n_matmul + 12 * layers * d * seq_len
    assert expected == 6 * 442_368 + 786_432 == 3_440_640
    assert flops_per_token(TINY, seq_len) == expected


def test_flops_grow_with_seq_len_by_attention_term():
    delta = flops_per_token(TINY, 200) - flops_per_token(TINY, 100)
    assert delta == 12 * TINY.n_layers * TINY.dim * 100


def stated_size(name: str):
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([mb])", name)
    return float(match[1]) * {"m": 1e6, "b": 1e9}[match[2]] if match else None


def test_presets_exist():
    assert {p.stem for p in PRESETS} >= {"tiny", "125m", "1.3b", "7b", "21b"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_matches_its_size(path):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    assert cfg.name == path.stem
    assert cfg.dim % cfg.n_heads == 0
    assert cfg.n_heads % (cfg.n_kv_heads or cfg.n_heads) == 0
    size = stated_size(cfg.name)
    if size is not None:
        assert 0.9 * size <= param_count(cfg) <= 1.1 * size


def test_loss_goes_down_on_a_fixed_batch():
    model = make(TINY)
    batch = tokens(TINY, batch=4, seq_len=65, seed=4)
    x, y = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_mup_multipliers_scale_the_logits_the_branches_the_hidden_init_and_lr():
    from wildtrain.config import OptimConfig
    from wildtrain.engine import param_groups

    plain_cfg = ModelConfig(n_layers=2)
    torch.manual_seed(0)
    plain = Transformer(plain_cfg)
    torch.manual_seed(0)
    mup = Transformer(replace(plain_cfg, output_mult=0.25, hidden_init_std=0.005, base_n_layers=1))
    assert mup.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert mup.layers[0].attention.wq.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert mup.layers[0].attention.wo.weight.std().item() == pytest.approx(0.005 / 2 ** 0.5, rel=0.05)
    mup.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, plain_cfg.vocab_size, (2, 8))
    torch.testing.assert_close(mup(tokens), plain(tokens) * 0.25)

    deeper = Transformer(replace(plain_cfg, residual_mult=0.0))
    deeper.load_state_dict(plain.state_dict())
    # With no residual branches, the blocks pass the embeddings through unchanged.
    expected = deeper.output(deeper.norm(deeper.tok_embeddings(tokens)))
    torch.testing.assert_close(deeper(tokens), expected)

    assert len(param_groups(plain, OptimConfig())) == 2  # what earlier checkpoints' optimizers hold
    groups = param_groups(plain, OptimConfig(lr=1e-2, hidden_lr_mult=0.25))
    hidden = {id(p) for p in plain.hidden_matrices()}
    assert {id(p) for p in groups[2]["params"]} == hidden and groups[2]["lr"] == pytest.approx(2.5e-3)
    assert id(plain.output.weight) in {id(p) for p in groups[0]["params"]}
    assert sum(len(g["params"]) for g in groups) == len(list(plain.parameters()))
