"""`wildtrain sample`: a continuation of a prompt from a checkpoint, by wildtrain's own model
(on the GPU where there is one, else the CPU), to look at what a run has learnt.

The prompt is one document: under `model.attention=prefix_lm` it is the prefix, whose
positions attend to each other, as a prefix-LM's inputs did in training. Greedy decoding
(temperature 0) gives the tokens that the exported model's `generate` gives (`export`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from wildtrain.export import RunInfo, read_checkpoint, run_tokenizer
from wildtrain.model import Transformer


class SampleError(ValueError):
    """A prompt or length the model cannot continue; one line."""


def check_length(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    if not prompt_tokens:
        raise SampleError("--prompt: empty; the model needs at least one token to continue")
    if prompt_tokens + max_tokens > max_seq_len:
        raise SampleError(
            f"--max-tokens: {prompt_tokens} prompt tokens + {max_tokens} exceed model.max_seq_len ({max_seq_len})"
        )


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> list[int]:
    """Up to `max_tokens` ids after `prompt`, the most likely each time (temperature 0) or
    drawn from the softmax of the logits / temperature with `generator` (a CPU one); ends
    after `eos_id`."""
    cfg = model.cfg
    check_length(len(prompt), max_tokens, cfg.max_seq_len)
    length = len(prompt) + max_tokens
    device = next(model.parameters()).device
    # Every pass runs the full length, the positions not generated yet holding padding that
    # no earlier position attends to: on CUDA a mask other than plain causal is compiled
    # once per shape (FlexAttention), so one shape compiles once.
    tokens = torch.zeros(1, length, dtype=torch.long, device=device)
    tokens[0, : len(prompt)] = torch.tensor(prompt, device=device)
    one_document = torch.zeros_like(tokens) if cfg.attention != "causal" else None
    prefix = (torch.arange(length, device=device) < len(prompt))[None] if cfg.attention == "prefix_lm" else None
    generated = []
    for n in range(len(prompt), length):
        logits = model(tokens, doc_ids=one_document, prefix=prefix)[0, n - 1].float().cpu()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
        generated.append(token)
        if token == eos_id:
            break
        tokens[0, n] = token
    return generated


@dataclass(frozen=True)
class Sampled:
    text: str
    ids: list[int]
    step: int
    checkpoint: str


def sample(
    run: RunInfo,
    prompt: str,
    *,
    step: Optional[int] = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> Sampled:
    """A continuation of `prompt` by the run's checkpoint (the newest committed, or `step`'s)."""
    tokenizer = run_tokenizer(run)
    ids = tokenizer.encode(prompt)
    check_length(len(ids), max_tokens, run.model.max_seq_len)  # before the checkpoint's download
    checkpoint = read_checkpoint(run, step)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:  # parameters made where they run: no second copy of the model on the host
        model = Transformer(run.model)
    model.load_state_dict(checkpoint.weights)
    model.eval()
    generated = generate(
        model,
        ids,
        max_tokens,
        temperature=temperature,
        eos_id=tokenizer.eos_id,
        generator=torch.Generator().manual_seed(seed),
    )
    return Sampled(tokenizer.decode(generated), generated, checkpoint.step, checkpoint.where)
