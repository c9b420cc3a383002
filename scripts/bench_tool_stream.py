"""When a streamed tool call reaches the client: the time to its name (the
first `tool_calls` delta), to its arguments' first piece, and to the end,
against a running `siliceo serve` on a model with a tool syntax (Qwen2.5).

    siliceo serve --model models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --http-listen 127.0.0.1:18080 &
    python scripts/bench_tool_stream.py --reps 5

Run with the test venv's Python (it has the `openai` package). Prints the
median of each time over the reps, in milliseconds from the request.
"""

import argparse
import statistics
import time

import openai

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", default="http://127.0.0.1:18080")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    c = openai.OpenAI(base_url=f"{a.http}/v1", api_key="unused", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
    rows = {"name": [], "first arguments": [], "end": [], "deltas": []}
    for _ in range(a.reps):
        t0 = time.perf_counter()
        named = args = None
        deltas = 0
        for chunk in c.chat.completions.create(model="", messages=ask, tools=TOOLS,
                                               temperature=0, max_tokens=80, stream=True):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                deltas += 1
                now = (time.perf_counter() - t0) * 1000
                if d.function.name and named is None:
                    named = now
                if d.function.arguments and args is None:
                    args = now
        rows["name"].append(named)
        rows["first arguments"].append(args)
        rows["end"].append((time.perf_counter() - t0) * 1000)
        rows["deltas"].append(deltas)
    for k, v in rows.items():
        print(f"{k:>16}: median {statistics.median(v):.0f}  ({', '.join(f'{x:.0f}' for x in v)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
