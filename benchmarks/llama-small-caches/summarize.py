#!/usr/bin/env python3
"""The real-engine matrix's table: one row per (seed, role), one column per label, each cell
req/s, KV hit (the engines' own counters) and TTFT p50 ms, each the median over the cell's
repeats (matrix.sh's REPEAT; with more than one, the req/s range follows in brackets); then each
label's medians; then, for PA and PA4, each cell's ratio to the best peer (SMG, SGL) in req/s and
TTFT p50; then each run's timeline (hit and req/s per 10-s window from its first request; when
the hit rate first came within 2 pt of the run's last half, and how many later windows fell
below it).
    python3 benchmarks/llama-small-caches/summarize.py DIR"""
import json
import pathlib
import re
import statistics
import sys

runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    m = re.fullmatch(r"(user|system)-s(\d+)-([A-Z0-9]+)(?:-r(\w+))?", path.stem)
    if not m:
        continue
    role, seed, label, tag = m.group(1), int(m.group(2)), m.group(3), m.group(4) or "0"
    # a numeric tag is a repeat; any other names a build (run.sh's REPEAT_TAG with another
    # PREFIXCTL), a column of its own: PA4-old, PA4-new
    rep = int(tag) if tag.isdigit() else 0
    if not tag.isdigit():
        label = f"{label}-{tag}"
    r = json.loads(path.read_text())["results"][0]
    runs.setdefault((seed, role, label), []).append((rep, r))


def median(rs, field):
    return statistics.median(r[field] for r in rs)


cells = {k: [r for _, r in sorted(v, key=lambda x: x[0])] for k, v in runs.items()}
order = ["PA", "PA4", "SMG", "SGL", "RANDOM", "ENVOY", "DP"]
labels = sorted({k[2] for k in cells}, key=lambda l: (order.index(l.split("-")[0]) if l.split("-")[0] in order else len(order), l))
keys = sorted({(k[0], k[1]) for k in cells})
print("| seed, role | " + " | ".join(labels) + " |")
print("|---|" + "---|" * len(labels))
for seed, role in keys:
    row = []
    for l in labels:
        rs = cells.get((seed, role, l))
        if rs is None:
            row.append("-")
            continue
        rps = [r["throughput_rps"] for r in rs]
        spread = f" [{min(rps):.1f}-{max(rps):.1f}]" if len(rs) > 1 else ""
        row.append(f"{median(rs, 'throughput_rps'):.2f}{spread}, {100 * median(rs, 'kv_hit_rate'):.1f}%, "
                   f"{median(rs, 'ttft_p50_ms'):.0f}")
    print(f"| {seed}, {role} | " + " | ".join(row) + " |")
for l in labels:
    rs = [(median(v, "throughput_rps"), median(v, "kv_hit_rate"), median(v, "ttft_p50_ms"))
          for k, v in cells.items() if k[2] == l]
    med = lambda i: statistics.median(x[i] for x in rs)
    n = sum(len(v) for k, v in cells.items() if k[2] == l)
    print(f"{l}: median {med(0):.1f} req/s, {100 * med(1):.1f}%, {med(2):.0f} ms ({len(rs)} cells, {n} runs)")
peers = [l for l in labels if l.split("-")[0] in ("SMG", "SGL")]
for l in (x for x in labels if x.split("-")[0] in ("PA", "PA4") and peers):
    won, ratios = 0, []
    for seed, role in keys:
        ours = cells.get((seed, role, l))
        theirs = [cells[(seed, role, p)] for p in peers if (seed, role, p) in cells]
        if not ours or not theirs:
            continue
        best = max(theirs, key=lambda rs: median(rs, "throughput_rps"))
        ratio = median(ours, "throughput_rps") / median(best, "throughput_rps")
        ttft = median(ours, "ttft_p50_ms") / median(best, "ttft_p50_ms")
        ratios.append(f"{seed} {role} {ratio:.2f}/{ttft:.2f}")
        won += ratio >= 1.0
    print(f"{l} vs best peer (req/s ratio / TTFT p50 ratio): {', '.join(ratios)}; "
          f"at least the best peer's req/s in {won} of {len(ratios)} cells")
for (seed, role, l), v in sorted(runs.items()):
    for rep, r in sorted(v, key=lambda x: x[0]):
        t = r.get("timeline")
        if not t or t.get("converged_s") is None:
            continue
        hits = " ".join(f"{100 * w['kv_hit_rate']:.0f}" for w in t["windows"])
        rps = " ".join(f"{w['throughput_rps']:.0f}" for w in t["windows"])
        tag = f" r{rep}" if rep else ""
        print(f"{role} s{seed} {l}{tag}: hit% {hits} | req/s {rps} | converged {t['converged_s']:.0f} s, "
              f"{t.get('dips', 0)} dips")
