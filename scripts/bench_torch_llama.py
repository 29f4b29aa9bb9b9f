#!/usr/bin/env python3
"""transformers + torch on the models and batch of `cargo bench --bench train`, for the
comparison quoted next to pipefill's figures.

Shapes (--shape), random weights, f32:
- llama_d256 (default): LlamaForCausalLM with vocab 50, hidden 256, 8 layers, 4 heads over
  2 key/value heads, SwiGLU intermediate 704, RoPE (theta 10000), RMSNorm eps 1e-5, tied
  embeddings;
- llama_135m: the bench's real/llama_135m, SmolLM-135M's shape: vocab 49152, hidden 576,
  30 layers, 9 heads over 3, intermediate 1536, tied;
- qwen2.5_0.5b: the bench's real/qwen2.5_0.5b, Qwen2ForCausalLM with Qwen2.5-0.5B's shape:
  vocab 151936, hidden 896, 24 layers, 14 heads over 2, q/k/v biases, intermediate 4864,
  RoPE theta 1e6, RMSNorm eps 1e-6, tied.

One step: 4 micro-batches of 4 × 64 tokens with gradient accumulation (the loss of each
scaled by 1/4), global-norm clipping at 1.0, one torch.optim.AdamW update; what
pipefill's reference trainer and pipeline do per step. The median of the timed steps (after
two warm-up steps) is printed as tokens/s, and the peak RSS of the process.

Run (a venv with torch and transformers, e.g. the one scripts/hf_fixtures.py uses):
    python scripts/bench_torch_llama.py [--shape llama_135m] [--threads N] [--steps 20]
"""

import argparse
import resource
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SEQ = 64


def model_of(shape: str) -> torch.nn.Module:
    common = dict(max_position_embeddings=SEQ, tie_word_embeddings=True, attn_implementation="sdpa")
    if shape == "llama_d256":
        config = LlamaConfig(
            vocab_size=50,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            **common,
        )
        return LlamaForCausalLM(config)
    if shape == "llama_135m":
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            **common,
        )
        return LlamaForCausalLM(config)
    if shape == "qwen2.5_0.5b":
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            **common,
        )
        return Qwen2ForCausalLM(config)
    raise SystemExit(f"unknown --shape {shape!r}: llama_d256, llama_135m or qwen2.5_0.5b")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama_d256")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = model_of(args.shape).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    micro_batches, batch, seq = 4, 4, SEQ
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"torch {torch.__version__} + transformers, {args.shape}: {params} params on "
        f"{torch.get_num_threads()} thread(s): median step {median * 1e3:.1f} ms, "
        f"median {tokens / median:.0f} tokens/s over {len(times)} steps of {tokens} tokens, "
        f"peak RSS {peak / 1024:.0f} MB"
    )


if __name__ == "__main__":
    main()
