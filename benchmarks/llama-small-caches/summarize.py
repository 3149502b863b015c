#!/usr/bin/env python3
"""The real-engine matrix's table: one row per (seed, role), one column per label, each cell
req/s, KV hit (the engines' own counters) and TTFT p50 ms; then each label's medians.
    python3 benchmarks/llama-small-caches/summarize.py DIR"""
import json
import pathlib
import re
import statistics
import sys

cells = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    m = re.fullmatch(r"(user|system)-s(\d+)-([A-Z0-9]+)", path.stem)
    if not m:
        continue
    role, seed, label = m.group(1), int(m.group(2)), m.group(3)
    r = json.loads(path.read_text())["results"][0]
    cells[(seed, role, label)] = r
labels = [l for l in ["PA", "PA4", "SMG", "SGL", "RANDOM"] if any(k[2] == l for k in cells)]
print("| seed, role | " + " | ".join(labels) + " |")
print("|---|" + "---|" * len(labels))
for seed, role in sorted({(k[0], k[1]) for k in cells}):
    row = []
    for l in labels:
        r = cells.get((seed, role, l))
        row.append("-" if r is None else
                   f"{r['throughput_rps']:.2f}, {100 * r['kv_hit_rate']:.1f}%, {r['ttft_p50_ms']:.0f}")
    print(f"| {seed}, {role} | " + " | ".join(row) + " |")
for l in labels:
    rs = [r for k, r in cells.items() if k[2] == l]
    med = lambda f: statistics.median(f(r) for r in rs)
    print(f"{l}: median {med(lambda r: r['throughput_rps']):.1f} req/s, "
          f"{100 * med(lambda r: r['kv_hit_rate']):.1f}%, {med(lambda r: r['ttft_p50_ms']):.0f} ms ({len(rs)} cells)")
