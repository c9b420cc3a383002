"""A Python client for siliceo-infer: streaming generation and cancellation.

Generate the stubs first (see README.md), then:

    python client.py "Tell me a story"                # stream a generation
    python client.py --cancel-after 5 "Count to 100"  # cancel mid-stream
"""

import argparse
import os
import sys

import grpc

from siliceo.v1 import inference_pb2 as pb
from siliceo.v1 import inference_pb2_grpc as rpc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--addr", default="127.0.0.1:50051")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--cancel-after", type=int, default=0,
                    help="cancel the request after this many messages (0: never)")
    args = ap.parse_args()

    metadata = []
    if key := os.environ.get("SILICEO_API_KEY"):
        metadata.append(("authorization", f"Bearer {key}"))

    with grpc.insecure_channel(args.addr) as channel:
        stub = rpc.InferenceStub(channel)
        sampling = pb.SamplingParams()
        if args.temperature is not None:
            sampling.temperature = args.temperature
        req = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=args.prompt)]),
            max_tokens=args.max_tokens,
            sampling=sampling,
        )
        call = stub.Generate(req, metadata=metadata)
        n = 0
        try:
            for msg in call:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                n += 1
                if msg.HasField("usage"):
                    u = msg.usage
                    reason = pb.FinishReason.Name(msg.finish_reason)
                    print(f"\n[{reason}] prompt {u.prompt_tokens} ({u.cached_prompt_tokens} cached), "
                          f"{u.completion_tokens} generated, ttft {u.ttft_ms} ms", file=sys.stderr)
                if args.cancel_after and n >= args.cancel_after:
                    call.cancel()  # the server cancels the request and frees its KV
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                print("\n[cancelled by the client]", file=sys.stderr)
                return 0
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
