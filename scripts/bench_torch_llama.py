#!/usr/bin/env python3
"""transformers + torch on the model and batch of `cargo bench --bench train`'s llama_d256
case, for the comparison quoted next to pipefill's figures.

The model: LlamaForCausalLM with vocab 50, hidden 256, 8 layers, 4 heads over 2 key/value
heads, SwiGLU intermediate 704, RoPE (theta 10000), RMSNorm eps 1e-5, tied embeddings, f32.
One step: 4 micro-batches of 4 × 64 tokens with gradient accumulation (the loss of each
scaled by 1/4), global-norm clipping at 1.0, one torch.optim.AdamW update; what
pipefill's reference trainer and pipeline do per step. The median of the timed steps (after
two warm-up steps) is printed as tokens/s.

Run (a venv with torch and transformers, e.g. the one scripts/hf_fixtures.py uses):
    python scripts/bench_torch_llama.py [--threads N] [--steps 20]
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    micro_batches, batch, seq = 4, 4, 64
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        for _ in range(micro_batches)
    ]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for ids in data:
            out = model(input_ids=ids, labels=ids)
            (out.loss / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tokens = micro_batches * batch * seq
    median = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"torch {torch.__version__} + transformers, llama_d256: {params} params on "
        f"{torch.get_num_threads()} thread(s): median step {median * 1e3:.1f} ms, "
        f"median {tokens / median:.0f} tokens/s over {len(times)} steps of {tokens} tokens"
    )


if __name__ == "__main__":
    main()
