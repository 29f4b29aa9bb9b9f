#!/usr/bin/env python3
"""Builds tests/fixtures/data/: a tiny byte-level BPE tokenizer and the expected outputs
the Rust tests compare with (tests/data_jsonl.rs, src/data/ unit tests).

Run by hand (no network): needs the `tokenizers` and `jinja2` Python packages.

    /work/hfenv/bin/python scripts/data_fixtures.py          # or any python with both

Writes, under tests/fixtures/data/:
- tokenizer/tokenizer.json         a Qwen2-style tokenizer (Split regex + ByteLevel, BPE)
                                   trained on generated text, vocab 300, three specials
- tokenizer/tokenizer_config.json  eos/pad tokens and a Qwen2-like chat template
- expected.json                    the Python tokenizer's ids (and decodes) of fixed texts,
                                   the chat template rendered by jinja2 as transformers
                                   renders it (trim_blocks, lstrip_blocks, raise_exception,
                                   tojson), and those renderings' ids
- llama3-tokenizer/                 a Llama 3-style one (its digit-run regex, a BOS added by
                                   a TemplateProcessing post-processor), ids in expected.json
- sft.jsonl, pretrain.jsonl, chat.jsonl, rl.jsonl  small datasets of each record form

Everything is deterministic (fixed seed), so rerunning it rewrites the same files.
"""

import json
import os
import random

import jinja2
import jinja2.sandbox
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "data")
TOK_DIR = os.path.join(ROOT, "tokenizer")

# Qwen2's pre-tokenizer pattern (its tokenizer.json: Split, then ByteLevel without regex).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3's pre-tokenizer pattern (digits in runs of up to three).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]

# A Qwen2-like template: a default system prompt, strip() through Python string methods,
# raise_exception on an unknown role, tojson, add_generation_prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}"
    "{% if message.get('meta') %}{{ '<|im_start|>meta\\n' + (message['meta'] | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = (
    "the a pipeline stage actor bubble fills with useful work drafter model trains on hidden "
    "states while schedule runs forward backward weight gradient add sort count parity "
    "answer question what is sum of and numbers list token"
).split()


def corpus(rng, n):
    lines = []
    for _ in range(n):
        k = rng.randint(3, 12)
        words = [rng.choice(WORDS) for _ in range(k)]
        if rng.random() < 0.5:
            words.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ""]))
    return lines


def build_tokenizer(rng, pattern=QWEN2_PATTERN, specials=SPECIALS):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng, 2000), trainer=trainer)
    return tok


def render(template, messages, add_generation_prompt, config):
    # As transformers' apply_chat_template renders: a sandbox with trim/lstrip blocks.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=config.get("bos_token") or "",
        eos_token=config.get("eos_token") or "",
    )


def main():
    rng = random.Random(21)
    os.makedirs(TOK_DIR, exist_ok=True)
    tok = build_tokenizer(rng)
    tok.save(os.path.join(TOK_DIR, "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(TOK_DIR, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    texts = [
        "the pipeline stage fills a bubble.",
        "What is the sum of 1234 and 56?",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Unicode: café, naïve, 東京, emoji 🚀!",
        "it's they're we've I'm you'll he'd",
        "<|im_start|>user\nhello<|im_end|>",
        "",
    ]
    encoded = [tok.encode(t, add_special_tokens=True) for t in texts]
    conversations = [
        [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "  2 + 3 = 5. #### 5 "},
        ],
        [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "add 12 and 30", "meta": {"id": 7, "tag": "café"}},
            {"role": "assistant", "content": "42"},
            {"role": "user", "content": "and 1 more?"},
            {"role": "assistant", "content": "43"},
        ],
    ]
    chats = []
    for messages in conversations:
        for gen in (False, True):
            text = render(CHAT_TEMPLATE, messages, gen, config)
            chats.append({
                "messages": messages,
                "add_generation_prompt": gen,
                "text": text,
                "ids": tok.encode(text, add_special_tokens=False).ids,
            })
    expected = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "specials": {s: tok.token_to_id(s) for s in SPECIALS},
        "encode": [
            {"text": t, "ids": e.ids, "decoded": tok.decode(e.ids, skip_special_tokens=False),
             "decoded_skip_special": tok.decode(e.ids, skip_special_tokens=True)}
            for t, e in zip(texts, encoded)
        ],
        "chat": chats,
    }
    # A Llama 3-style tokenizer: its regex, a BOS added by the post-processor.
    llama_dir = os.path.join(ROOT, "llama3-tokenizer")
    os.makedirs(llama_dir, exist_ok=True)
    llama = build_tokenizer(random.Random(3), LLAMA3_PATTERN, LLAMA3_SPECIALS)
    bos = llama.token_to_id("<|begin_of_text|>")
    llama.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    llama.save(os.path.join(llama_dir, "tokenizer.json"))
    with open(os.path.join(llama_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
        f.write("\n")
    expected["llama3"] = {
        "bos": bos,
        "eos": llama.token_to_id("<|end_of_text|>"),
        "encode": [{"text": t, "ids": llama.encode(t, add_special_tokens=True).ids} for t in texts],
    }
    with open(os.path.join(ROOT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")

    def write_jsonl(name, records):
        with open(os.path.join(ROOT, name), "w") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    write_jsonl("pretrain.jsonl", [{"text": t} for t in corpus(rng, 40)])
    sft = []
    for _ in range(40):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sft.append({"prompt": f"what is the sum of {a} and {b}? ", "completion": f"answer {a + b}."})
    write_jsonl("sft.jsonl", sft)
    chat = []
    for _ in range(20):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        chat.append({"messages": [
            {"role": "user", "content": f"add {a} and {b}"},
            {"role": "assistant", "content": f"{a + b}"},
        ]})
    write_jsonl("chat.jsonl", chat)
    rl = []
    for _ in range(10):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rl.append({"prompt": f"what is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    write_jsonl("rl.jsonl", rl)
    print(f"wrote {ROOT}: vocab {expected['vocab_size']}")


if __name__ == "__main__":
    main()
