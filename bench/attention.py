"""Attention masks and objectives: kernel time per mask, then training tokens/s per objective.

Usage: python bench/attention.py                 # on the GPU machine: B=8, 16 heads, 4096 tokens, d=128, bf16; 1.3b
       python bench/attention.py --device cpu    # a tiny shape (tests/integration/test_bench_scripts.py runs it)

Table 1, forward + backward of one attention call, per mask: causal SDPA (the flash path
plain causal runs on), FlexAttention with the document and the prefix-LM block masks (the
mask's build timed apart and included in the total, as a step pays it once per batch),
and the prefix-LM mask as a dense boolean mask through SDPA (what the fast kernels
offered before); causal SDPA is the reference. Goal: document and prefix-LM masks <= 1.4x
causal. Figures on an H200: docs/benchmarks.md, models and GPUs.

Table 2, the model preset (1.3b on CUDA, tiny on CPU) trained in plain PyTorch (AdamW,
bf16 autocast and compile on CUDA) on packed rows of random documents, per objective and
mask; examples are built on the host each step as the training loop does. Goal: every
objective's step within 10% of causal.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from progress import say  # first: its clock starts with the script


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--steps", type=int, default=20, help="measured repetitions (attention) and steps (model)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first (default: 5 cuda, 1 cpu)")
    parser.add_argument(
        "--shape", default=None, help="B,H,T,D of table 1 (default: 8,16,4096,128 cuda; 2,2,128,16 cpu)"
    )
    parser.add_argument("--preset", default=None, help="model of table 2 (default: 1.3b cuda, tiny cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="of table 2 (default: 2048 cuda, 64 cpu)")
    parser.add_argument("--batch", type=int, default=None, help="of table 2 (default: 8 cuda, 2 cpu)")
    return parser.parse_args()


ARGS = _args()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from wildtrain.config import load_config  # noqa: E402
from wildtrain.data.objectives import Objective  # noqa: E402
from wildtrain.data.tokenizer import ByteTokenizer  # noqa: E402
from wildtrain.model import Transformer, masks  # noqa: E402
from wildtrain.train.step import model_inputs  # noqa: E402

ON_CUDA = (ARGS.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
WARMUP = ARGS.warmup if ARGS.warmup is not None else (5 if ON_CUDA else 1)
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
# Uncompiled, FlexAttention runs a dense reference implementation; CPU runs that (correct, slow),
# forward only: FlexAttention has no backward on CPU, so table 1 there times forwards.
FLEX = torch.compile(flex_attention, dynamic=False) if ON_CUDA else flex_attention
BACKWARD = ON_CUDA


class Clock:
    """Milliseconds of what runs between start() and stop(), on the device's own clock."""

    def start(self) -> None:
        if ON_CUDA:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if ON_CUDA:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (time.perf_counter() - self._t) * 1e3


def packed_doc_ids(batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of documents of 1/16 to 1/2 of the row, as `prepare` packs them."""
    rows = []
    for _ in range(batch):
        lengths = rng.integers(length // 16, length // 2, length)
        rows.append(np.repeat(np.arange(length), lengths)[:length])
    return np.stack(rows).astype(np.int32)


def attention_table() -> None:
    B, H, T, D = map(int, (ARGS.shape or ("8,16,4096,128" if ON_CUDA else "2,2,128,16")).split(","))
    rng = np.random.default_rng(0)
    doc_ids = packed_doc_ids(B, T, rng)
    # Each document's first three quarters are its inputs: prefix_lm's mean target share.
    prefix = np.concatenate(
        [np.arange(n) < n * 3 // 4 for row in doc_ids for n in np.unique(row, return_counts=True)[1]]
    )
    doc_ids, prefix = (torch.from_numpy(a).to(DEVICE) for a in (doc_ids, prefix.reshape(B, T)))
    q, k, v = (torch.randn(B, H, T, D, device=DEVICE, dtype=DTYPE, requires_grad=BACKWARD) for _ in range(3))
    grad = torch.randn(B, H, T, D, device=DEVICE, dtype=DTYPE)

    def run(attend, build=None) -> tuple[float, float]:
        clock, mask_ms, total_ms = Clock(), [], []
        for i in range(WARMUP + ARGS.steps):
            clock.start()
            mask = build() if build else None
            built = clock.stop() if build else 0.0
            clock.start()
            out = attend(mask)
            if BACKWARD:
                out.backward(grad)
            ms = clock.stop()
            if i >= WARMUP:
                mask_ms.append(built)
                total_ms.append(built + ms)
        return float(np.median(mask_ms)), float(np.median(total_ms))

    def block(kind: str):
        return lambda: create_block_mask(masks.mask_mod(kind, doc_ids, prefix), B, None, T, T, device=DEVICE)

    rows = []
    say(f"table 1: B={B} H={H} T={T} D={D} {str(DTYPE).removeprefix('torch.')}, {'fwd+bwd' if BACKWARD else 'fwd'}")
    for name, attend, build in (
        ("causal SDPA", lambda m: F.scaled_dot_product_attention(q, k, v, is_causal=True), None),
        ("document Flex", lambda m: FLEX(q, k, v, block_mask=m), block("document")),
        ("prefix-LM Flex", lambda m: FLEX(q, k, v, block_mask=m), block("prefix_lm")),
        (
            "prefix-LM dense SDPA",
            lambda m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            lambda: masks.dense(masks.mask_mod("prefix_lm", doc_ids, prefix), B, T, DEVICE),
        ),
    ):
        mask_ms, total_ms = run(attend, build)
        rows.append((name, mask_ms, total_ms))
        say(f"  {name}: {total_ms:.2f} ms")
    causal_ms = rows[0][2]
    print(f"\n{'mask':<22}{'mask ms':>9}{'total ms':>10}{'x causal':>10}")
    print("-" * 51)
    for name, mask_ms, total_ms in rows:
        print(f"{name.replace(' ', '_'):<22}{mask_ms:>9.2f}{total_ms:>10.2f}{total_ms / causal_ms:>10.2f}")
    print()


def model_table() -> None:
    preset = ARGS.preset or ("1.3b" if ON_CUDA else "tiny")
    seq_len = ARGS.seq_len or (2048 if ON_CUDA else 64)
    batch = ARGS.batch or (8 if ON_CUDA else 2)
    say(f"table 2: {preset}, {batch} x {seq_len} tokens per step")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
    doc_ids = packed_doc_ids(batch, seq_len + 1, rng)
    rows = []
    for objective, attention in (
        ("causal", "causal"),
        ("causal", "document"),
        ("prefix_lm", "prefix_lm"),
        ("ul2", "document"),
        ("ul2", "prefix_lm"),
    ):
        cfg = load_config(
            [
                f"model={preset}",
                f"data.seq_len={seq_len}",
                f"train.objective={objective}",
                f"model.attention={attention}",
            ]
        )
        built = Objective.of(cfg.objective, cfg.train, cfg.model, ByteTokenizer().describe())
        torch.manual_seed(0)
        model = Transformer(replace(cfg.model, max_seq_len=max(seq_len, cfg.model.max_seq_len))).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ON_CUDA)
        forward = torch.compile(model) if ON_CUDA else model
        clock, step_ms = Clock(), []
        for step in range(WARMUP + ARGS.steps):
            clock.start()
            rows_np = built.rows(step, np.arange(batch), tokens, doc_ids)
            inputs = model_inputs(torch.from_numpy(rows_np).to(DEVICE, non_blocking=True).long())
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=ON_CUDA):
                loss = forward(**inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ms = clock.stop()
            if step >= WARMUP:
                step_ms.append(ms)
        ms = float(np.median(step_ms))
        rows.append((objective, attention, batch * seq_len / ms * 1e3, ms))
        say(f"  {objective}/{attention}: {ms:.1f} ms/step, loss {loss.item():.3f}")
        del model, optimizer, forward
        if ON_CUDA:
            torch.cuda.empty_cache()
    causal_ms = rows[0][3]
    print(f"\n{'objective':<11}{'attention':<11}{'tokens/s':>11}{'step ms':>10}{'x causal':>10}")
    print("-" * 53)
    for objective, attention, tokens_per_s, ms in rows:
        print(f"{objective:<11}{attention:<11}{tokens_per_s:>11.0f}{ms:>10.1f}{ms / causal_ms:>10.2f}")
    print()


if __name__ == "__main__":
    attention_table()
    model_table()
