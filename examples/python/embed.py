"""Embeddings and reranking from Python against a siliceo server started with
an embedding model (see README.md):

    python embed.py "A man is playing a guitar." "Someone is strumming a guitar." "Stocks fell."
    python embed.py --rerank "how do I bake bread" "Mix flour and water, then bake." "Stocks fell."
"""

import argparse
import math
import os

import grpc

from siliceo.v1 import inference_pb2 as pb
from siliceo.v1 import inference_pb2_grpc as rpc


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / (
        math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("texts", nargs="+")
    ap.add_argument("--addr", default="127.0.0.1:50051")
    ap.add_argument("--rerank", action="store_true",
                    help="score texts[1:] against the query texts[0], best first")
    args = ap.parse_args()
    metadata = []
    if key := os.environ.get("SILICEO_API_KEY"):
        metadata.append(("authorization", f"Bearer {key}"))
    with grpc.insecure_channel(args.addr) as channel:
        stub = rpc.InferenceStub(channel)
        try:
            if args.rerank:
                r = stub.Rerank(pb.RerankRequest(query=args.texts[0], documents=args.texts[1:]),
                                metadata=metadata)
                print(f"method: {r.method}")
                for res in r.results:
                    print(f"{res.score:+.4f}  {args.texts[1 + res.index]}")
            else:
                r = stub.Embed(pb.EmbedRequest(inputs=args.texts, normalize=True), metadata=metadata)
                vecs = [list(e.values) for e in r.embeddings]
                print(f"{len(vecs)} vectors of {len(vecs[0])} dims, {r.prompt_tokens} tokens")
                for i in range(len(vecs)):
                    for j in range(i + 1, len(vecs)):
                        print(f"cosine {i}-{j}: {cosine(vecs[i], vecs[j]):.4f}")
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
