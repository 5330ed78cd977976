"""`wildtrain sample` on the GPU: greedy continuations on CUDA are the CPU's, with plain causal
attention (SDPA) and with the masks FlexAttention runs there (a sliding window, a prefix-LM's
prompt), which sampling compiles once, at its one fixed length."""

from __future__ import annotations

import pytest

from tests.helpers.models import random_model
from wildtrain.config import ModelConfig
from wildtrain.sample import generate

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("options", [{}, {"attention_window": 7}, {"attention": "prefix_lm"}], ids=str)
def test_greedy_continuation_on_cuda_is_the_cpus(options):
    model = random_model(ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64, **options))
    prompt = list(b"The quick brown fox")
    on_cpu = generate(model, prompt, 24)
    assert generate(model.cuda(), prompt, 24) == on_cpu
