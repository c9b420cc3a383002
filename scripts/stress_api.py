#!/usr/bin/env python3
"""Hammers a running `siliceo serve` with a mix of requests on all three HTTP
APIs (chat and text completions, the Responses API with background responses
and `previous_response_id` chains, `truncation: auto` over the context,
Anthropic's Messages API, schemas after a reasoning model's thinking), many
cut short
on purpose (streams closed early, client timeouts, cancellations, refused
input, a full queue), then checks that the server went idle with no KV block
in use and still answers `/health`. Exit status 1 when it did not.

Run it with the test venv's Python (it has the `openai` and `anthropic`
clients), against a server started with a metrics port and a short queue:

    siliceo serve --http-listen 127.0.0.1:18080 --metrics-listen 127.0.0.1:19090 --max-waiting 8 &
    $CARGO_TARGET_DIR/pyenv/bin/python scripts/stress_api.py \
        --http http://127.0.0.1:18080 --metrics http://127.0.0.1:19090 --requests 150

Against a reasoning template (`--chat-template-file
crates/chat/src/testdata_gpt_oss.jinja`, say) the chats go through its
output reader, and schemas follow its thinking.
"""

import argparse
import random
import sys
import threading
import time
import urllib.request

import anthropic
import openai


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if line and not line.startswith("#") and len(parts) == 2:
            out[parts[0]] = float(parts[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http", default="http://127.0.0.1:18080")
    ap.add_argument("--metrics", default="http://127.0.0.1:19090")
    ap.add_argument("--key", default="unused")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    oa = openai.OpenAI(base_url=f"{a.http}/v1", api_key=a.key, max_retries=0, timeout=60)
    cl = anthropic.Anthropic(base_url=a.http, api_key=a.key, max_retries=0, timeout=60)
    errors: dict[str, int] = {}
    kept: list[str] = []
    background: list[str] = []
    lock = threading.Lock()
    count = "Count from one to a thousand: one, two, three,"

    def one(i: int):
        r = random.Random(a.seed * 100_003 + i)
        try:
            kind = r.randrange(11)
            if kind == 0:  # a Responses stream closed early
                s = oa.responses.create(model="", input=count, max_output_tokens=200, stream=True,
                                        extra_body={"ignore_eos": True})
                for k, _ in enumerate(s):
                    if k > r.randrange(3, 30):
                        break
                s.close()
            elif kind == 1:  # kept, then continued
                x = oa.responses.create(model="", input="Tell me a story.", max_output_tokens=30)
                with lock:
                    kept.append(x.id)
                oa.responses.create(model="", input="And then?", previous_response_id=x.id,
                                    max_output_tokens=20)
            elif kind == 2:  # background, most cancelled; half streamed, left and resumed
                streamed = r.random() < 0.5
                b = oa.responses.create(model="", input=count, max_output_tokens=300, background=True,
                                        stream=streamed, extra_body={"ignore_eos": True})
                if streamed:  # the id comes with the first event (response.created)
                    rid = None
                    for k, e in enumerate(b):
                        rid = rid or e.response.id
                        if k > r.randrange(2, 20):
                            break
                    b.close()
                    b = oa.responses.retrieve(rid)
                with lock:
                    background.append(b.id)
                time.sleep(r.random())
                if streamed and r.random() < 0.5:
                    follow = oa.responses.retrieve(b.id, stream=True, starting_after=3)
                    for k, _ in enumerate(follow):
                        if k > r.randrange(2, 20):
                            break
                    follow.close()
                if r.random() < 0.7:
                    oa.responses.cancel(b.id)
            elif kind == 3:  # a batch of prompts, whole or streamed; best_of; vLLM's extras
                pick = r.randrange(3)
                if pick == 0:
                    oa.completions.create(model="", prompt=["a", "b c", "d e f"], n=2, max_tokens=20,
                                          stream=r.random() < 0.5)
                elif pick == 1:
                    oa.completions.create(model="", prompt=["a", "b c"], n=2, best_of=3,
                                          max_tokens=20)
                else:
                    oa.chat.completions.create(
                        model="", max_tokens=30, stream=r.random() < 0.5,
                        messages=[{"role": "user", "content": "Pick one."},
                                  {"role": "assistant", "content": "I pick"}],
                        extra_body={"continue_final_message": True, "min_tokens": 5,
                                    "guided_choice": [" red", " blue", " green"],
                                    "include_stop_str_in_output": True})
            elif kind == 4:  # a client that gives up
                oa.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=20, timeout=0.3)
            elif kind == 5:  # over the context: refused, or its oldest turns dropped
                if r.random() < 0.5:
                    oa.responses.create(model="", input="x", max_output_tokens=10**6)
                else:
                    turns = [{"role": ("user", "assistant")[j % 2], "content": count * 8}
                             for j in range(r.randrange(20, 60))] + [{"role": "user", "content": "Go on."}]
                    x = oa.responses.create(model="", input=turns, truncation="auto",
                                            max_output_tokens=20, stream=r.random() < 0.5)
                    if isinstance(x, openai.Stream):
                        for _ in x:
                            pass
            elif kind == 6:  # an Anthropic stream closed early
                with cl.messages.stream(model="", max_tokens=200,
                                        messages=[{"role": "user", "content": count}],
                                        extra_body={"ignore_eos": True}) as st:
                    for k, _ in enumerate(st.text_stream):
                        if k > r.randrange(2, 20):
                            break
            elif kind == 7:
                cl.messages.create(model="", max_tokens=30, stop_sequences=["."],
                                   messages=[{"role": "user", "content": "Tell me a story."}])
            elif kind == 9:  # a schema after the thinking (a budget: a 400 for a model that
                # does not think), whole or streamed and dropped early
                fmt = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
                    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False}}}
                extra = {"thinking_token_budget": r.randrange(0, 8)} if r.random() < 0.5 else {}
                x = oa.chat.completions.create(
                    model="", max_tokens=120, response_format=fmt, stream=r.random() < 0.5,
                    messages=[{"role": "user", "content": "Where is it sunny?"}], extra_body=extra)
                if isinstance(x, openai.Stream):
                    for k, _ in enumerate(x):
                        if k > r.randrange(5, 60):
                            break
                    x.close()
            elif kind == 8:  # refused input
                cl.messages.create(model="", max_tokens=10, messages=[
                    {"role": "user", "content": [{"type": "image", "source": {}}]}])
            else:
                cl.messages.count_tokens(model="", messages=[{"role": "user", "content": "hi"}])
        except Exception as e:  # the point is what the server does
            with lock:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(a.requests)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    print("client errors by kind (expected: refusals, timeouts, 429s):", errors)

    deadline = time.time() + 180
    while True:
        m = metrics(a.metrics)
        idle = all(m.get(k) == 0 for k in
                   ("siliceo_kv_blocks_used", "siliceo_running_sequences", "siliceo_queue_length"))
        if idle or time.time() > deadline:
            break
        time.sleep(0.2)
    shown = {k: m.get(k) for k in
             ("siliceo_kv_blocks_used", "siliceo_running_sequences", "siliceo_queue_length")}
    print("after:", shown)
    statuses: dict[str, int] = {}
    for b in background:
        s = oa.responses.retrieve(b).status
        statuses[s] = statuses.get(s, 0) + 1
    print("background responses:", statuses)
    health = urllib.request.urlopen(f"{a.http}/health", timeout=10).status
    print("health:", health)
    ok = idle and health == 200 and not ({"queued", "in_progress"} & statuses.keys())
    print("OK" if ok else "FAILED: the server did not go idle, or a response is stuck")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
