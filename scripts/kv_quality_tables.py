"""Markdown tables from `siliceo eval-kv --json` outputs (docs/KV_QUALITY.md).

    python3 scripts/kv_quality_tables.py out/*.json
"""
import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    base = d["configs"][0]["perplexity"]
    chunk = d.get("shadow_chunk")
    how = ""
    if chunk is not None and any(c.get("ours") for c in d["configs"]):
        how = " · ours as " + ("decoding sees them" if chunk == 1 else "a chunked prefill sees them")
    print(f"**{d['model']}** · `{d['text'].rsplit('/', 1)[-1]}` ({d['text_tokens']} tokens) · "
          f"windows of {d['window']} ({d['windows']} windows, {d['scored_positions']} positions scored){how}\n")
    print("| K/V | bits/elem | KV bytes/token | perplexity | Δ ppl | mean KL | p99 KL | top-1 agree | attn err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in d["configs"]:
        name = c.get("name", f"{c['k']}/{c['v']}")
        err = c.get("attn_rel_err_mean")
        err = f"{err:.1e}" if err is not None else ""
        print(f"| {name} | {c['bits_per_element']:.2f} | {c['kv_bytes_per_token']} | "
              f"{c['perplexity']:.4f} | {100 * (c['perplexity'] / base - 1):+.2f} % | {c['kl_mean']:.5f} | "
              f"{c['kl_p99']:.4f} | {100 * c['top1_agreement']:.2f} % | {err} |")
    print()
