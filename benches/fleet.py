"""The fleet benchmark: a shared-prefix workload through SMG over N real
`siliceo serve` replicas, under several routing policies, in HTTP and gRPC
mode. Run by `cargo xtask bench fleet [ARGS]` (which builds the release
binary and the venv with `smg` and `openai`); ARGS:

  --modes http,grpc   --policies cache_aware,round_robin,consistent_hashing
  --docs 16 --questions 8 --doc-tokens 1000 --replicas 3 --context 16384
  --threads T (per replica; default 2) --json

Workload: `--docs` documents of about `--doc-tokens` tokens, each asked
`--questions` questions, interleaved (question q of every document, then
question q+1), one request at a time, each a streamed completion of 2
tokens. Every policy starts from fresh replicas (empty caches). Figures:

- warm hits: of the requests after a document's first, those served with
  at least 90 % of the document from a prefix cache;
- prompt tokens computed: prompt tokens minus cached ones, summed over the
  replicas (their Prometheus counters), against the least any policy can
  compute (each document once, plus every question's own tokens);
- TTFT p50 / p95 over all requests, as the client sees it through the
  gateway.

Under consistent_hashing each request carries its document's id as the
routing key (`X-SMG-Routing-Key`): that is how a client asks that
policy to keep a conversation on one replica.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from conftest import replica_set  # noqa: E402
from fleet import DOCUMENTS, MODEL, Gateway  # noqa: E402

ROUTING_KEY = "X-SMG-Routing-Key"


def documents(n: int, tokens: int) -> list[str]:
    """`n` distinct documents of about `tokens` tokens (SmolLM2's tokenizer
    gives about 4.8 characters per token on DOCUMENTS' sentences); each starts with its
    own id, so no two share a first block."""
    out = []
    for d in range(n):
        body = []
        i = d
        while sum(len(s) for s in body) < tokens * 4.8:
            body.append(DOCUMENTS[i % len(DOCUMENTS)])
            i += d + 1
        out.append(f"[Document {d} of the fleet benchmark] " + "".join(body))
    return out


def counters(replicas) -> list[tuple[float, float]]:
    out = []
    for s in replicas:
        m = s.metrics()
        out.append((m["siliceo_prompt_tokens_total"], m["siliceo_cached_prompt_tokens_total"]))
    return out


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def run_policy(mode: str, policy: str, docs: list[str], questions: int, args) -> dict:
    with replica_set(args.replicas, context=args.context, threads=args.threads) as replicas:
        if mode == "grpc":
            urls = [f"grpc://{s.grpc}" for s in replicas]
            extra = ["--worker-wedge-secs", "120", "--block-size", "64"]
        else:
            urls = [s.http for s in replicas]
            extra = []
        gw = Gateway(urls, policy, extra=extra)
        try:
            c = gw.client()
            ttft, served, warm, warm_hits = [], [0] * len(replicas), 0, 0
            start = counters(replicas)
            t_run = time.time()
            for q in range(questions):
                for d, doc in enumerate(docs):
                    before = counters(replicas)
                    headers = {ROUTING_KEY: f"doc-{d}"} if policy == "consistent_hashing" else {}
                    t0 = time.perf_counter()
                    first = None
                    for ch in c.completions.create(
                        model=MODEL, prompt=doc + f" Question {q}: what happened next?",
                        max_tokens=2, temperature=0, stream=True, extra_headers=headers,
                    ):
                        if first is None and ch.choices and ch.choices[0].text:
                            first = time.perf_counter()
                    ttft.append(((first or time.perf_counter()) - t0) * 1000)
                    after = counters(replicas)
                    moved = [i for i in range(len(replicas)) if after[i][0] > before[i][0]]
                    if len(moved) != 1:
                        raise RuntimeError(f"request {q}/{d}: prompt counters moved on {moved}")
                    where = moved[0]
                    served[where] += 1
                    prompt = after[where][0] - before[where][0]
                    cached = after[where][1] - before[where][1]
                    if q > 0:
                        warm += 1
                        warm_hits += cached >= 0.9 * (prompt - 16)
                    print(
                        f"  {mode} {policy}: q{q} doc {d:2} -> replica {where}, "
                        f"{int(prompt)} prompt tokens, {int(cached)} cached, {ttft[-1]:.0f} ms",
                        file=sys.stderr,
                    )
            end = counters(replicas)
            prompt_total = sum(e[0] - s[0] for s, e in zip(start, end))
            cached_total = sum(e[1] - s[1] for s, e in zip(start, end))
            return {
                "mode": mode,
                "policy": policy,
                "requests": len(ttft),
                "warm": warm,
                "warm_hits": warm_hits,
                "prompt_tokens": int(prompt_total),
                "computed": int(prompt_total - cached_total),
                "token_hit_rate": cached_total / prompt_total,
                "ttft_p50_ms": statistics.median(ttft),
                "ttft_p95_ms": percentile(ttft, 95),
                "served": served,
                "seconds": time.time() - t_run,
            }
        finally:
            gw.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="http,grpc")
    ap.add_argument("--policies", default="cache_aware,round_robin,consistent_hashing")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.environ.get("SILICEO_BIN"):
        sys.exit("fleet bench: set SILICEO_BIN (cargo xtask bench fleet does)")
    docs = documents(args.docs, args.doc_tokens)
    rows = []
    for mode in args.modes.split(","):
        for policy in args.policies.split(","):
            print(f"fleet bench: {mode} mode, {policy}", file=sys.stderr)
            rows.append(run_policy(mode, policy, docs, args.questions, args))
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{args.replicas} replicas × `siliceo serve --threads {args.threads} --context {args.context}` "
        f"(SmolLM2-135M) behind smg launch; {args.docs} documents × {args.questions} questions, "
        f"interleaved, one request at a time; prompts of {rows[0]['prompt_tokens'] / rows[0]['requests']:.0f} tokens on average"
    )
    print()
    print("| mode | policy | warm hits | prompt tokens computed | token hit rate | TTFT p50 ms | TTFT p95 ms | requests per replica |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['policy']} | {r['warm_hits']}/{r['warm']} | "
            f"{r['computed']:,} of {r['prompt_tokens']:,} | {r['token_hit_rate']:.1%} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | {' / '.join(map(str, r['served']))} |"
        )


if __name__ == "__main__":
    main()
