#!/usr/bin/env python3
"""The real-engine matrix's table: one row per (seed, role), one column per label, each cell
req/s, KV hit (the engines' own counters) and TTFT p50 ms; then each label's medians, and each
run's timeline (hit and req/s per 10-s window from its first request; when the hit rate first came
within 2 pt of the run's last half, and how many later windows fell below it).
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
for (seed, role, l), r in sorted(cells.items()):
    t = r.get("timeline")
    if not t or t.get("converged_s") is None:
        continue
    hits = " ".join(f"{100 * w['kv_hit_rate']:.0f}" for w in t["windows"])
    rps = " ".join(f"{w['throughput_rps']:.0f}" for w in t["windows"])
    print(f"{role} s{seed} {l}: hit% {hits} | req/s {rps} | converged {t['converged_s']:.0f} s, "
          f"{t.get('dips', 0)} dips")
