#!/usr/bin/env python3
"""Writes a tiny random-weight Llama model as GGUF, for running llama-server in tests and benches.

No weights are downloaded: every tensor is drawn from a seeded RNG (numpy), the tokenizer is a
SentencePiece-style ("llama") vocabulary made here: the 256 byte tokens (<0x00>..<0xFF>, so any
text tokenizes), printable ASCII characters, "▁" (SentencePiece's space), and every 2- and
3-letter lowercase piece with and without a leading "▁", so the bench's pseudo-word text takes
about 2.5 bytes per token. A ChatML chat template is embedded.

The weights are random but shaped so that generation emits lowercase text, never an early end of
stream: every token embedding carries a large constant in dimension 0, which survives the
(small) layers and the final norm, and the output matrix's column 0 favours lowercase pieces and
disfavours byte, control and end-of-generation tokens.

Usage: tiny_model.py OUT.gguf [--layers N] [--embd N] [--ff N] [--heads N] [--ctx N] [--seed N]
Needs the `gguf` and `numpy` packages (pip install gguf numpy).
"""

import argparse
import itertools
import string
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("tiny_model.py: the gguf package is missing (pip install gguf numpy)")

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# gguf token types
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def vocabulary():
    tokens, scores, types = [], [], []

    def add(text, score, ty):
        tokens.append(text)
        scores.append(score)
        types.append(ty)

    add("<unk>", 0.0, UNKNOWN)
    add("<s>", 0.0, CONTROL)
    add("</s>", 0.0, CONTROL)
    add("<|im_start|>", 0.0, CONTROL)
    add("<|im_end|>", 0.0, CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, BYTE)
    space = "\u2581"
    add(space, -1.0, NORMAL)
    for c in string.printable:
        if c.isprintable() and c != " ":
            add(c, -1.0, NORMAL)
    lower = string.ascii_lowercase
    # Longer pieces score higher, so SentencePiece's greedy merges prefer them.
    for a, b in itertools.product(space + lower, lower):
        add(a + b, -0.5, NORMAL)
    for a, b, c in itertools.product(space + lower, lower, lower):
        add(a + b + c, -0.25, NORMAL)
    return tokens, scores, types


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.embd % a.heads:
        sys.exit(f"tiny_model.py: --embd {a.embd} is not a multiple of --heads {a.heads}")

    rng = np.random.default_rng(a.seed)
    tokens, scores, types = vocabulary()
    n_vocab, d = len(tokens), a.embd

    def rand(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("prefix-router tiny random llama")
    w.add_context_length(a.ctx)
    w.add_embedding_length(d)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(d // a.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|>: ChatML's end of turn
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    embd = rand(n_vocab, d)
    embd[:, 0] = 1.0
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    out = rand(n_vocab, d)
    lowercase_piece = np.array(
        [types[i] == NORMAL and (t.strip("\u2581").isalpha() and t.strip("\u2581").islower()) for i, t in enumerate(tokens)]
    )
    out[:, 0] = np.where(lowercase_piece, 0.05, -0.5)
    w.add_tensor("output.weight", out)
    for i in range(a.layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(d, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"{b}.{name}.weight", rand(d, d))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate.weight", rand(a.ff, d))
        w.add_tensor(f"{b}.ffn_up.weight", rand(a.ff, d))
        w.add_tensor(f"{b}.ffn_down.weight", rand(d, a.ff))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.out)


if __name__ == "__main__":
    main()
