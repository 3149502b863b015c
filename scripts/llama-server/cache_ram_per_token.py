#!/usr/bin/env python3
"""How much of llama-server's --cache-ram one prompt token of `prefixctl bench` takes (4 characters
of its pseudo-words), for LLAMA_CPP_MIB_PER_TOKEN in cli/src/bench/shapes.rs.

    FLEET_DIR=/tmp/calib LLAMA_SERVER_ARGS="-lv 4" CACHE_RAM_MIB=256 scripts/llama-server/fleet.sh start 1 8201
    python3 scripts/llama-server/cache_ram_per_token.py http://127.0.0.1:8201 /tmp/calib/llama-8201.log
    FLEET_DIR=/tmp/calib scripts/llama-server/fleet.sh stop

Sends chat prompts of 400 to 4,000 bench tokens, each followed by another so that the slot saves it
to the prompt cache, then reads the server's log lines `prompt_save: - saving prompt with length N,
total state size = X MiB` (logged at -lv 4) and prints MiB per bench token and per tokenizer token.
"""
import json
import random
import re
import sys
import urllib.request

url, log = sys.argv[1], sys.argv[2]
rng = random.Random(7)
# like the bench's vocabulary: 4,096 words of 2 to 9 letters
vocab = ["".join(chr(97 + rng.randrange(26)) for _ in range(rng.randrange(2, 10))) for _ in range(4096)]


def text(chars, seed):
    r, s = random.Random(seed), ""
    while len(s) < chars:
        s += vocab[r.randrange(len(vocab))] + " "
    return s[:chars]


sizes = [400, 800, 1200, 1600, 2400, 3200, 4000]  # bench tokens
prompt_tokens = {}
for i, t in enumerate(sizes + [10]):  # the last one only moves the slot off the one before
    body = json.dumps({"messages": [{"role": "user", "content": text(4 * t, i)}], "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    prompt_tokens[json.load(urllib.request.urlopen(req, timeout=600))["usage"]["prompt_tokens"]] = t
saved = [(int(n), float(mib)) for n, mib in re.findall(
    r"saving prompt with length (\d+), total state size = ([\d.]+) MiB", open(log).read())]
rows = [(prompt_tokens[n], n, mib) for n, mib in saved if n in prompt_tokens]
if len(rows) < 2:
    sys.exit(f"found {len(rows)} saved prompts in {log}: was the server started with -lv 4?")
for bench, n, mib in rows:
    print(f"{bench:5d} bench tokens = {n:5d} tokenizer tokens: {mib:.3f} MiB, {mib / bench:.6f} MiB per bench token")
(b0, n0, m0), (b1, n1, m1) = rows[0], rows[-1]
print(f"slope: {(m1 - m0) / (b1 - b0):.6f} MiB per bench token, {(m1 - m0) / (n1 - n0):.6f} per tokenizer token, "
      f"{(n1 - n0) / (b1 - b0):.3f} tokenizer tokens per bench token")
