#!/usr/bin/env python3
"""Builds the Hugging Face interop fixtures under tests/fixtures/hf/ (issue 21).

Run by hand, from the repository root, with a Python that has torch, transformers (5.x),
safetensors and tokenizers installed (no network is needed; everything is random):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers safetensors
    /tmp/hfenv/bin/python scripts/hf_fixtures.py            # writes tests/fixtures/hf/*
    /tmp/hfenv/bin/python scripts/hf_fixtures.py --only qwen2_rl   # one fixture
    /tmp/hfenv/bin/python scripts/hf_fixtures.py --greedy   # only greedy.json of each fixture
    /tmp/hfenv/bin/python scripts/hf_fixtures.py --check FIXTURE EXPORT
        # loads both with from_pretrained: an export of FIXTURE must give its logits
        # (tests/hf_interop.rs writes exports there when PIPEFILL_HF_EXPORT=DIR is set)

Each fixture is a tiny randomly initialised model (fixed seeds, f32 unless said) saved with
save_pretrained, plus `expected.safetensors` and `expected.json`:

- `input_ids`, `targets` ([2, 8], int64): the fixed batch;
- `logits` ([2, 8, vocab], f32): the eager f32 forward of transformers;
- `grad.<hf name>`: every parameter's gradient of the mean cross-entropy of logits vs targets
  (no shift: target t is the label of position t), after one loss.backward();
- `adamw.<hf name>` (when `adamw` is in expected.json): every parameter after one
  torch.optim.AdamW step with the hyper-parameters in expected.json, weight decay on the
  matrices and embeddings only (pipefill never decays norm gains and biases);
- expected.json: the loss, the AdamW hyper-parameters, the dtype of the saved weights;
- greedy.json: transformers' greedy continuation (`generate`, do_sample=False, stopping at
  generation_config.json's eos_token_id) of fixed prompts, from the saved directory as
  `from_pretrained` loads it (f32), for the token-for-token test of `pipefill generate`.

Parameters are drawn from N(0, 1/fan_in) (embeddings N(0, 1), norm gains 1 + N(0, 0.1²),
biases N(0, 0.1²)) rather than transformers' std 0.02, so activations, attention patterns
and logits are O(1) and a wrong convention (RoPE layout, norm eps, GQA head order) shows.

Fixtures: qwen2_rl (tied, vocabulary 300 with the tokenizer of tests/fixtures/data/tokenizer
copied in: the model `pipefill rl --model` and `pipefill train --model` run on the JSONL
fixtures, its tokenizer defaulting to the directory's), llama (GQA 4/2 heads, untied, one
model.safetensors), qwen2 (qkv biases, saved in
shards with model.safetensors.index.json), qwen2_tied (tie_word_embeddings: no
lm_head.weight in the file; its gradient is the embedding's, both uses summed), mistral (weights saved in bf16; the expected
outputs are those of the bf16-rounded weights computed in f32), llama3 (llama3 rope_scaling).
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
BATCH, SEQ = 2, 8
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # nn.Linear weight [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def build_fixture(name, cls, config, seed, adamw=True, dtype="float32", shard=None, tokenizer=None):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    randomize(model, seed)
    if dtype == "bfloat16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)

    out_dir = os.path.join(OUT, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    if dtype == "bfloat16":
        # A copy: .to() would also round the rotary inv_freq buffer of the model computing
        # the expected outputs.
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out_dir, **kwargs)
    else:
        model.save_pretrained(out_dir, **kwargs)

    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), targets.reshape(-1)
    )
    loss.backward()
    tensors = {
        "input_ids": ids.contiguous(),
        "targets": targets.contiguous(),
        "logits": logits.detach().contiguous(),
    }
    named = dict(model.named_parameters())
    for n, p in named.items():
        tensors[f"grad.{n}"] = p.grad.detach().clone().contiguous()
    meta = {"loss": loss.item(), "dtype": dtype, "batch": BATCH, "seq": SEQ}
    if adamw:
        decay = [p for n, p in named.items() if p.dim() >= 2]
        no_decay = [p for n, p in named.items() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": ADAMW["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=ADAMW["lr"],
            betas=ADAMW["betas"],
            eps=ADAMW["eps"],
            foreach=False,
        )
        opt.step()
        for n, p in named.items():
            tensors[f"adamw.{n}"] = p.detach().clone().contiguous()
        meta["adamw"] = {
            "lr": ADAMW["lr"],
            "beta1": ADAMW["betas"][0],
            "beta2": ADAMW["betas"][1],
            "eps": ADAMW["eps"],
            "weight_decay": ADAMW["weight_decay"],
        }
    if tokenizer:
        shutil.copy(os.path.join(tokenizer, "tokenizer.json"), out_dir)
        # Special tokens as strings: transformers 5 refuses the dict form the data fixture's
        # tokenizer_config.json has (an AddedToken without its "__type").
        with open(os.path.join(tokenizer, "tokenizer_config.json")) as f:
            tok_config = json.load(f)
        for key, value in tok_config.items():
            if key.endswith("_token") and isinstance(value, dict):
                tok_config[key] = value["content"]
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(tok_config, f, indent=2)
            f.write("\n")
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in named.values())} params")
    write_greedy(name)


GREEDY_PROMPTS = [[1, 5, 9, 3], [7, 2], [11, 4, 6, 8, 10, 12]]
GREEDY_NEW = 8


def write_greedy(name):
    out_dir = os.path.join(OUT, name)
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager")
    model = model.float().eval()
    tokens = []
    with torch.no_grad():
        for prompt in GREEDY_PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=GREEDY_NEW,
                do_sample=False,
                pad_token_id=0,
            )
            tokens.append(out[0, len(prompt) :].tolist())
    with open(os.path.join(out_dir, "greedy.json"), "w") as f:
        json.dump(
            {"prompts": GREEDY_PROMPTS, "max_new_tokens": GREEDY_NEW, "tokens": tokens}, f
        )
        f.write("\n")
    print(f"{name}: greedy {tokens}")


def small(**kw):
    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--check",
        nargs=2,
        metavar=("FIXTURE", "EXPORT"),
        help="load both directories with from_pretrained and print their logits' max difference",
    )
    ap.add_argument("--only", metavar="NAME", help="build only this fixture")
    ap.add_argument(
        "--greedy",
        action="store_true",
        help="only (re)write greedy.json of the fixtures already built",
    )
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.check:
        logits = []
        for d in args.check:
            model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
            model = model.float().eval()
            ids = torch.arange(3 * SEQ).reshape(3, SEQ) % model.config.vocab_size
            with torch.no_grad():
                logits.append(model(input_ids=ids).logits)
        diff = (logits[0] - logits[1]).abs().max().item()
        print(f"{args.check[1]}: {type(model).__name__}, logits max abs diff {diff:.3e}")
        return 0 if diff <= 1e-5 else 1
    os.makedirs(OUT, exist_ok=True)
    only = args.only
    if args.greedy:
        for name in sorted(os.listdir(OUT)):
            if only is None or only == name:
                write_greedy(name)
        return 0

    def build(name, *a, **kw):
        if only is None or only == name:
            build_fixture(name, *a, **kw)

    build(
        "qwen2_rl",
        Qwen2ForCausalLM,
        Qwen2Config(
            **small(vocab_size=300, tie_word_embeddings=True, use_sliding_window=False)
        ),
        seed=6,
        adamw=False,
        tokenizer=os.path.join(os.path.dirname(OUT), "data", "tokenizer"),
    )
    build(
        "llama",
        LlamaForCausalLM,
        LlamaConfig(
            **small(
                hidden_size=64,
                intermediate_size=128,
                vocab_size=256,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
            )
        ),
        seed=1,
    )
    build(
        "qwen2",
        Qwen2ForCausalLM,
        Qwen2Config(**small(rope_theta=1000000.0, use_sliding_window=False)),
        seed=2,
        shard="40KB",
    )
    build(
        "qwen2_tied",
        Qwen2ForCausalLM,
        Qwen2Config(**small(tie_word_embeddings=True, use_sliding_window=False)),
        seed=5,
        adamw=False,
    )
    build(
        "mistral",
        MistralForCausalLM,
        MistralConfig(**small(sliding_window=None, head_dim=8)),
        seed=3,
        adamw=False,
        dtype="bfloat16",
    )
    build(
        "llama3",
        LlamaForCausalLM,
        LlamaConfig(
            **small(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        ),
        seed=4,
        adamw=False,
    )


if __name__ == "__main__":
    sys.exit(main())
