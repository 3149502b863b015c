#!/usr/bin/env python3
"""Writes a tiny random-weight Llama that vLLM can serve, with no model hub: DIR gets config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
chat_template.jinja (the files the router's chat-tokens crate loads: DIR/tokenizer.json and the
template and special tokens beside it).

- The model: transformers' LlamaConfig (2 layers, hidden 128, 4 heads, 2 KV heads, head dim 32),
  weights drawn from torch's RNG under a fixed seed.
- The tokenizer: a ByteLevel BPE (as GPT-2, Llama 3 and Qwen use) trained with `tokenizers` on a
  fixed corpus (a few English paragraphs and every 2-letter lowercase piece, so the benches'
  pseudo-word text takes a few bytes per token), with ChatML's special tokens and a ChatML chat
  template. No BOS is added: the template writes every special token, as Qwen's does.

Deterministic: the same DIR contents on every run with the same package versions.

Usage: tiny_model.py DIR [--seed N] [--layers N] [--hidden N] [--vocab N]
Run it with the vLLM venv's python (scripts/vllm-cpu/install.sh prints it): it needs torch,
transformers and tokenizers.
"""

import argparse
import itertools
import os
import string
import sys

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PARAGRAPHS = """
You are a helpful assistant. Answer the question using the documents below.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
A router sends each request to the engine that already holds its prompt's prefix in its KV cache,
so the prefill computes only the tokens it has not seen. Tokens, blocks, hashes and events.
Question: what does the document say about the weather in Paris on Monday? Answer briefly.
def main():\n    print("hello, world")\n    return 0\n
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Numbers 0123456789 and 3.14159, dates 2026-12-07, punctuation !?.,;:'"()[]{}<>/\\|@#$%^&*-_=+~`
"""


def corpus():
    lines = PARAGRAPHS.strip().split("\n") * 8
    pairs = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    # each 2-letter piece alone and after a space, several times, so the BPE learns them all
    for _ in range(4):
        lines.append(" ".join(pairs))
        lines.append("".join(pairs))
    return lines


def tokenizer(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        sys.exit(f"tiny_model.py: {e} (run it with the python scripts/vllm-cpu/install.sh prints)")

    os.makedirs(args.dir, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer(args.vocab),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=32768,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(args.dir)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.dir)
    print(args.dir)


if __name__ == "__main__":
    main()
