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
    mup = Transformer(replace(plain_cfg, output_mult=0.25, hidden_init_std=0.005))
    assert mup.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert mup.layers[0].attention.wq.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert mup.layers[0].attention.wo.weight.std().item() == pytest.approx(0.005 / 2, rel=0.05)  # / sqrt(2 layers x 2)
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
    hidden = {id(p) for _, p in plain.hidden_matrices()}
    assert {id(p) for p in groups[2]["params"]} == hidden and groups[2]["lr"] == pytest.approx(2.5e-3)
    assert id(plain.output.weight) in {id(p) for p in groups[0]["params"]}
    assert sum(len(g["params"]) for g in groups) == len(list(plain.parameters()))


# muP against a base model (Tensor Programs V, Table 3/8 for Adam), measured on the modules:
# a base of width 64 (head_dim 16, ffn_dim 96, 2 layers) and a target 4x as wide whose MLP is
# 8x as wide, with heads twice as wide, 4 layers.
BASE = ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=32)
WIDE = ModelConfig(dim=256, n_layers=4, n_heads=8, ffn_dim=768, max_seq_len=32)


def promoted(base: ModelConfig, target: ModelConfig) -> ModelConfig:
    from wildtrain.sweeps.transfer import transfer

    overrides = transfer(base, 1.0, target).overrides()
    return replace(target, **{k.removeprefix("model."): v for k, v in overrides.items() if k.startswith("model.")})


def test_init_variance_of_each_hidden_matrix_is_inverse_to_its_own_fan_in():
    base, wide = make(BASE), make(promoted(BASE, WIDE))
    base_layer, wide_layer = dict(base.layers[0].named_parameters()), dict(wide.layers[0].named_parameters())
    for name, weight in wide_layer.items():
        if weight.ndim != 2:
            continue
        # Init var ~ 1 / fan_in: w2 (fan-in ffn_dim, 8x) at 1/8 of the base's, the rest at 1/4.
        fan_in_ratio = base_layer[name].shape[1] / weight.shape[1]
        assert fan_in_ratio == (1 / 8 if name == "feed_forward.w2.weight" else 1 / 4)
        variance_ratio = weight.var().item() / base_layer[name].var().item()
        assert variance_ratio == pytest.approx(fan_in_ratio, rel=0.1), name
    # The embedding's and output head's fan-in or fan-out is the vocabulary: their init is kept.
    for kept in ("tok_embeddings.weight", "output.weight"):
        assert wide.get_parameter(kept).std().item() == pytest.approx(0.02, rel=0.05)


def test_logits_scale_with_one_over_the_width_and_attention_with_one_over_head_dim():
    x = tokens(BASE)
    plain = make(replace(WIDE, n_layers=2))

    def with_base(**base) -> Transformer:
        own = dict(base_dim=256, base_ffn_dim=768, base_head_dim=32, base_n_layers=2)
        model = Transformer(replace(WIDE, n_layers=2, **(own | base)))
        model.load_state_dict(plain.state_dict())
        return model

    with torch.no_grad():
        # Output multiplier 1 / width multiplier: a base 4x narrower, logits x 1/4.
        torch.testing.assert_close(with_base(base_dim=64)(x), plain(x) / 4)
        # Attention logits q.k / head_dim, equal to q.k / sqrt(head_dim) at the base's head_dim:
        # a base head_dim of 8 (head_dim 32 here) gives q.k / sqrt(32) x sqrt(8 / 32), the logits
        # of the standard model whose queries are halved.
        halved = make(replace(WIDE, n_layers=2))
        halved.load_state_dict(plain.state_dict())
        for block in halved.layers:
            block.attention.wq.weight.mul_(0.5)
        torch.testing.assert_close(with_base(base_head_dim=8)(x), halved(x))


def test_a_model_at_its_own_base_shape_is_the_standard_one():
    plain = make(BASE)
    at_base = make(promoted(BASE, BASE))
    for (name, weight), other in zip(plain.state_dict().items(), at_base.state_dict().values()):
        assert torch.equal(weight, other), name
    x = tokens(BASE)
    with torch.no_grad():
        torch.testing.assert_close(at_base(x), plain(x), rtol=1e-6, atol=1e-6)
    from wildtrain.config import OptimConfig
    from wildtrain.engine import param_groups

    assert [len(g["params"]) for g in param_groups(at_base, OptimConfig())] == [
        len(g["params"]) for g in param_groups(plain, OptimConfig())
    ]
