"""The OpenAI-compatible HTTP API through the real `openai` client."""

import json
import math
import re
import subprocess
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from conftest import API_KEY, BROWSER_ORIGIN, QUESTION, ROOT, Server, client, refused_start, synth_model


def post_json(server, path: str, body: dict) -> tuple[int, dict]:
    """POSTs JSON outside the client's `/v1` (`/tokenize`, `/detokenize`):
    the status and the body, errors included."""
    req = urllib.request.Request(
        f"{server.http}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def model_id(server) -> str:
    return client(server).models.list().data[0].id


def test_models_and_health(server):
    models = client(server).models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct.Q4_1"
    assert models[0].max_model_len == 2048
    # Health needs no key.
    with urllib.request.urlopen(f"{server.http}/health", timeout=10) as r:
        assert r.status == 200
        assert json.load(r) == {"status": "ok"}


def test_chat_whole_and_streamed_agree_with_usage(server):
    c = client(server)
    whole = c.chat.completions.create(
        model=model_id(server), messages=QUESTION, max_tokens=24, temperature=0
    )
    text = whole.choices[0].message.content
    assert "Paris" in text, text
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    u = whole.usage
    assert u.prompt_tokens > 10
    assert 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(
        c.chat.completions.create(
            model=model_id(server),
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in chunks if ch.choices
    )
    assert streamed == text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == u.completion_tokens
    # The same prompt again: its prefix is served from the cache.
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    server.wait_idle()


def test_completions_whole_streamed_and_stop(server):
    c = client(server)
    prompt = "The first three planets from the sun are Mercury,"
    whole = c.completions.create(
        model=model_id(server), prompt=prompt, max_tokens=16, temperature=0
    )
    assert whole.object == "text_completion"
    text = whole.choices[0].text
    assert text.strip(), text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=model_id(server),
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        if ch.choices
    )
    assert streamed == text
    # A stop string cuts the text before it and ends with `stop`.
    word = text.split()[0]
    cut = c.completions.create(
        model=model_id(server), prompt=prompt, max_tokens=16, temperature=0, stop=[word]
    )
    assert word not in cut.choices[0].text
    assert cut.choices[0].finish_reason == "stop"
    # vLLM's `stop_reason` names the stop string (none when the length ran out).
    assert cut.choices[0].stop_reason == word
    assert whole.choices[0].stop_reason is None or whole.choices[0].finish_reason == "stop"
    last = list(c.completions.create(
        model=model_id(server), prompt=prompt, max_tokens=16, temperature=0, stop=["zzz", word], stream=True
    ))[-1]
    assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", word)


def test_n_choices_seeded_sampling(server):
    c = client(server)
    ask = dict(
        model=model_id(server),
        messages=[{"role": "user", "content": "Write a word."}],
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=3,
    )
    r = c.chat.completions.create(**ask)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.message.content is not None for ch in r.choices)
    # Usage sums the choices' tokens (8 at most each).
    assert 3 <= r.usage.completion_tokens <= 24
    texts = [ch.message.content for ch in r.choices]
    # Seeded: the same three texts again.
    again = c.chat.completions.create(**ask)
    assert [ch.message.content for ch in again.choices] == texts
    # Streamed, each choice's chunks carry its index.
    seen = {0: "", 1: "", 2: ""}
    for ch in c.chat.completions.create(**ask, stream=True):
        for choice in ch.choices:
            seen[choice.index] += choice.delta.content or ""
    assert [seen[i] for i in range(3)] == texts
    server.wait_idle()


def test_continuous_usage_in_every_chunk(server):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk of a
    choice carries its usage so far (the prompt's tokens, the tokens
    generated up to it); the last one's equals the final usage."""
    c = client(server)
    for n in (1, 2):
        chunks = list(c.completions.create(
            model="", prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=1, n=n,
            stream=True,
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ))
        final = chunks[-1].usage
        assert not chunks[-1].choices and final.completion_tokens > 0
        seen = {}
        for ch in chunks[:-1]:
            assert len(ch.choices) == 1 and ch.usage is not None, ch
            i, u = ch.choices[0].index, ch.usage
            assert u.prompt_tokens == final.prompt_tokens
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens
            assert u.completion_tokens >= seen.get(i, 0)
            seen[i] = u.completion_tokens
        assert sorted(seen) == list(range(n))
        assert sum(seen.values()) == final.completion_tokens
    server.wait_idle()


def test_best_of_returns_the_likeliest_choices(server):
    """Completions' `best_of`: `best_of` choices are generated per prompt
    (the ones `n=best_of` gives, seed for seed) and the `n` with the highest
    mean log-probability per token come back, likeliest first; all are
    counted in usage. It cannot be streamed, nor be below `n`."""
    c = client(server)
    prompts = ["Once upon a time", "The best thing about Paris is"]
    kw = dict(model="", prompt=prompts, max_tokens=12, temperature=1.0, seed=7)
    every = c.completions.create(**kw, n=4, logprobs=0)
    best = c.completions.create(**kw, n=2, best_of=4)
    assert [ch.index for ch in best.choices] == [0, 1, 2, 3]
    for p in range(2):
        group = every.choices[4 * p: 4 * p + 4]
        lps = [ch.logprobs.token_logprobs for ch in group]
        means = [sum(lp) / len(lp) if lp else -math.inf for lp in lps]
        order = sorted(range(4), key=lambda j: (-means[j], j))
        want = [group[j].text for j in order[:2]]
        assert [ch.text for ch in best.choices[2 * p: 2 * p + 2]] == want, (means, want)
        assert all(ch.logprobs is None for ch in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens
    assert best.usage.prompt_tokens == every.usage.prompt_tokens
    # With logprobs asked for, they stay.
    shown = c.completions.create(**kw, n=1, best_of=3, logprobs=2)
    assert shown.choices[0].logprobs.top_logprobs and len(shown.choices) == 2
    for body in [dict(n=3, best_of=2), dict(best_of=17), dict(best_of=2, stream=True)]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="", prompt="x", max_tokens=2, **body)
        assert e.value.body["param"] == "best_of", body
    server.wait_idle()


def test_errors_are_the_clients_typed_exceptions(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model_id(server), messages=QUESTION, temperature=7
        )
    assert e.value.body["param"] == "temperature"
    # Checked by the runtime, named the same way.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model_id(server), messages=QUESTION, top_p=1.5
        )
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model_id(server), messages=[{"role": "robot", "content": "x"}]
        )
    assert e.value.body["param"] == "messages[0].role"
    for bias in [{"one": 5}, {"1": 101}, {"99999999": 5}]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=model_id(server), messages=QUESTION, logit_bias=bias
            )
        assert e.value.body["param"] == "logit_bias", bias
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model_id(server), messages=QUESTION, max_tokens="many"
        )
    assert e.value.body["param"] == "max_tokens"
    # What asks for something this server cannot do is named, not ignored.
    for kw, param in [
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model_id(server), messages=QUESTION, max_tokens=2, **kw)
        assert (e.value.body["param"], e.value.body["code"]) == (param, "unsupported_parameter")
    # A body over the limit: 413 in OpenAI's shape.
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=model_id(server), prompt="x" * (5 << 20))
    assert e.value.status_code == 413
    # An unknown path.
    with pytest.raises(openai.NotFoundError):
        c.get("/v1/nothing", cast_to=object)
    # Still serving.
    r = c.completions.create(model=model_id(server), prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    # `null` is every optional field's default, as on OpenAI's API (the
    # client sends None as null).
    r = c.chat.completions.create(
        model=model_id(server),
        messages=QUESTION,
        max_tokens=2,
        stream=None,
        temperature=None,
        top_p=None,
        n=None,
        stop=None,
        seed=None,
        logprobs=None,
        stream_options=None,
        extra_body={"ignore_eos": None, "top_k": None},
    )
    assert r.usage.completion_tokens >= 1
    server.wait_idle()


def test_a_closed_stream_frees_its_kv(server):
    c = client(server)
    stream = c.completions.create(
        model=model_id(server),
        prompt="Count from one to a thousand: one, two, three,",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for ch in stream:
        got += 1
        if got == 5:
            break
    m = server.metrics()
    assert m["siliceo_running_sequences"] == 1
    stream.close()
    m = server.wait_idle(timeout=30)
    assert m["siliceo_kv_blocks_used"] == 0


def test_a_full_queue_is_429():
    s = Server("--max-running", "1", "--max-waiting", "1")
    try:
        c = client(s, key="unused")
        streams = []
        for _ in range(2):
            streams.append(
                c.completions.create(
                    model=model_id(s),
                    prompt="Once upon a time",
                    max_tokens=500,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=model_id(s), prompt="x", max_tokens=1)
        assert e.value.response.headers["retry-after"] == "1"
        for st in streams:
            st.close()
        s.wait_idle(timeout=30)
    finally:
        s.stop()


def test_a_page_on_an_allowed_origin_may_call_the_api(server, embed_server):
    """`--allow-origin`: a browser's preflight is answered before the API key
    is asked for, every answer (errors too) names the origin, other origins
    get no grant, and a server without the flag grants none."""

    def call(srv, method, path, headers, body=None):
        req = urllib.request.Request(
            f"{srv.http}{path}", data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers

    asked = "authorization,content-type,x-stainless-os"
    preflight = {
        "Origin": BROWSER_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked,
    }
    status, h = call(server, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 200
    assert h["Access-Control-Allow-Origin"] == BROWSER_ORIGIN
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert h["Access-Control-Allow-Headers"] == asked
    body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
    page = {
        "Origin": BROWSER_ORIGIN,
        "Authorization": f"Bearer {API_KEY}",
        "Content-Type": "application/json",
    }
    status, h = call(server, "POST", "/v1/chat/completions", page, body)
    assert (status, h["Access-Control-Allow-Origin"]) == (200, BROWSER_ORIGIN)
    wrong_key = {**page, "Authorization": "Bearer wrong"}
    status, h = call(server, "POST", "/v1/chat/completions", wrong_key, body)
    assert (status, h["Access-Control-Allow-Origin"]) == (401, BROWSER_ORIGIN)
    other = {**page, "Origin": "http://elsewhere.example"}
    status, h = call(server, "POST", "/v1/chat/completions", other, body)
    assert status == 200 and "Access-Control-Allow-Origin" not in h
    status, h = call(embed_server, "OPTIONS", "/v1/embeddings", preflight)
    assert "Access-Control-Allow-Origin" not in h
    server.wait_idle()


def test_tokenize_and_detokenize(server, grpc_api):
    """`/tokenize` gives the tokens a request runs on (a chat's count is the
    usage a chat completion reports), `/detokenize` turns them back, and
    gRPC's Tokenize agrees."""
    pb, stub, meta = grpc_api

    def post(path, body):
        return post_json(server, path, body)

    text = "The capital of France is Paris."
    status, t = post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and t["count"] == len(t["tokens"]) > 3
    assert t["max_model_len"] == 2048
    assert "".join(t["token_strs"]) == text
    grpc_ids = stub.Tokenize(
        pb.TokenizeRequest(text=text, add_special=True), metadata=meta
    ).ids
    assert list(grpc_ids) == t["tokens"]
    status, d = post("/detokenize", {"tokens": t["tokens"]})
    assert status == 200 and d["prompt"] == text == d["content"]
    # llama-server's field name.
    assert post("/tokenize", {"content": text})[1]["tokens"] == t["tokens"]
    # A chat: as many tokens as a chat completion's usage counts.
    status, chat = post("/tokenize", {"messages": QUESTION})
    r = client(server).chat.completions.create(
        model=model_id(server), messages=QUESTION, max_tokens=1
    )
    assert status == 200 and chat["count"] == r.usage.prompt_tokens
    for path, body, param in [
        ("/detokenize", {"tokens": [1, 10**8]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ]:
        status, e = post(path, body)
        assert status in (400, 404) and e["error"]["param"] == param, (body, e)


def test_a_final_assistant_message_is_continued(server, grpc_api):
    """vLLM's `continue_final_message`: the model goes on from the final
    assistant message's text (a prefill) instead of answering it. Greedy,
    the continuation equals a completion of the tokens `/tokenize` renders
    for it, whole and streamed; gRPC's `continue_final_message` and
    Anthropic's prefill (a final assistant message) give the same text.
    `add_generation_prompt: false` renders the chat closed."""
    import anthropic

    pb, stub, meta = grpc_api
    c = client(server)
    prefill = "The capital of France is"
    msgs = [{"role": "user", "content": "Tell me about France."},
            {"role": "assistant", "content": prefill}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    status, t = post_json(server, "/tokenize", {"messages": msgs, **go_on, "return_token_strs": True})
    assert status == 200 and "".join(t["token_strs"]).endswith(prefill), t
    ask = dict(model="", messages=msgs, max_tokens=16, temperature=0)
    r = c.chat.completions.create(**ask, extra_body=go_on)
    cont = r.choices[0].message.content
    assert cont and r.usage.prompt_tokens == t["count"]
    want = c.completions.create(model="", prompt=t["tokens"], max_tokens=16, temperature=0)
    assert cont == want.choices[0].text
    chunks = c.chat.completions.create(**ask, stream=True, extra_body={"continue_final_message": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cont

    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in msgs])
    req = pb.GenerateRequest(chat=chat, max_tokens=16, continue_final_message=True)
    assert "".join(x.text for x in stub.Generate(req, metadata=meta)) == cont
    a = anthropic.Anthropic(base_url=server.http, api_key=API_KEY, max_retries=0)
    m = a.messages.create(model="", max_tokens=16, messages=msgs, extra_body={"temperature": 0})
    assert m.content[0].text == cont and m.usage.input_tokens == t["count"]

    # Answered (the default), the chat gets a new assistant turn; closed, none.
    answered = post_json(server, "/tokenize", {"messages": msgs})[1]["count"]
    closed = post_json(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]
    assert t["count"] < closed["count"] < answered

    for body, param in [
        (dict(messages=QUESTION, extra_body=go_on), "messages"),
        (dict(messages=msgs, extra_body={**go_on, "add_generation_prompt": True}),
         "continue_final_message"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="", max_tokens=4, **body)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="", max_tokens=4, messages=[msgs[0], {"role": "assistant", "content": "Paris "}])
    assert "whitespace" in e.value.body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x", continue_final_message=True), metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "continue_final_message" in e.value.details()
    server.wait_idle()


def test_vllms_guided_decoding_and_stop_token_ids(server, grpc_api):
    """vLLM's guided decoding in its older (`guided_*`) and newer
    (`structured_outputs`) shapes: sampled outputs are one of the choices
    (quotes and all), match the regex, or validate against the schema (an
    object or its text). `stop_token_ids` ends a request at the token, whose
    text is returned, as vLLM does. What vLLM serves and this server does
    not is a 400 naming it."""
    import jsonschema

    c = client(server)
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    choices = ["yes", "no", 'it depends "really"']
    for i in range(4):
        for body in [{"guided_choice": choices}, {"structured_outputs": {"choice": choices}}]:
            r = c.chat.completions.create(model="", messages=ask, max_tokens=20, temperature=1.0,
                                          seed=i, extra_body=body)
            assert r.choices[0].message.content in choices, (body, r.choices[0].message.content)
    # A choice's quotes, backslashes and newlines are its own.
    odd = 'say "hi" \\ then\nbye'
    r = c.chat.completions.create(model="", messages=ask, max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": [odd]})
    assert r.choices[0].message.content == odd
    rx = "[0-9]{3}-[a-z]{2}"
    for body in [{"guided_regex": rx}, {"structured_outputs": {"regex": rx}}]:
        r = c.completions.create(model="", prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                 extra_body=body)
        assert re.fullmatch(rx, r.choices[0].text), r.choices[0].text
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    for body in [{"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema}}]:
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "A person."}],
                                      max_tokens=60, temperature=0.8, seed=5, extra_body=body)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = c.chat.completions.create(model="", messages=ask, max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    # The token that ends it is returned.
    pb, stub, meta = grpc_api
    prompt = "The capital of France is"
    ids = [t for x in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=12), metadata=meta)
           for t in x.token_ids]
    k = 3
    k = ids.index(ids[k])  # its first place
    r = c.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0,
                             extra_body={"stop_token_ids": [ids[k]]})
    status, want = post_json(server, "/detokenize", {"tokens": ids[: k + 1]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want["prompt"], "stop")
    assert r.usage.completion_tokens == k + 1

    for body, param in [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"guided_regex": "a", "regex": "b"}, "regex"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_grammar": "start: nope_rule"}, "guided_grammar"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="", messages=ask, max_tokens=4, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)
    server.wait_idle()


def test_embeddings_and_rerank(embed_server):
    c = client(embed_server, key="unused")
    r = c.embeddings.create(
        model="all-MiniLM-L6-v2.f16", input=["a cat sits on the mat", "a kitten rests on a rug"]
    )
    assert [d.index for d in r.data] == [0, 1]
    assert len(r.data[0].embedding) == 384
    norm = sum(x * x for x in r.data[0].embedding)
    assert abs(norm - 1.0) < 1e-3
    assert r.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="all-MiniLM-L6-v2.f16", input=[])
    assert e.value.body["param"] == "input"
    # Token ids, as OpenAI's API takes them, used as they are: the ids of
    # `[CLS] a cat sits on the mat [SEP]` embed as that text does.
    text = c.embeddings.create(model="all-MiniLM-L6-v2.f16", input="a cat sits on the mat")
    ids = [101, 1037, 4937, 7719, 2006, 1996, 13523, 102]
    for given in [ids, [ids]]:
        r = c.embeddings.create(model="all-MiniLM-L6-v2.f16", input=given)
        assert r.data[0].embedding == text.data[0].embedding
        assert r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="all-MiniLM-L6-v2.f16", input=[[101, 30522]])
    assert e.value.body["param"] == "input"
    assert "vocabulary" in e.value.body["message"]
    ranked = c.post(
        "/rerank",
        body={
            "query": "what do cats do?",
            "documents": ["stock prices fell", "cats sleep most of the day"],
        },
        cast_to=object,
    )
    assert ranked["results"][0]["index"] == 1


def test_greedy_over_http_equals_grpc(server, grpc_api):
    """The same greedy request gives the same text on both protocols."""
    pb, stub, meta = grpc_api
    c = client(server)
    for prompt in ["The capital of Italy is", "def fibonacci(n):", "Roses are red,"]:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=20)
        grpc_text = "".join(r.text for r in stub.Generate(req, metadata=meta))
        http = c.completions.create(
            model=model_id(server), prompt=prompt, max_tokens=20, temperature=0
        )
        assert http.choices[0].text == grpc_text, prompt


def test_developer_messages_are_system_messages(server, grpc_api):
    """OpenAI's `developer` role (its newer name for `system`, which its docs
    now use in its place) reaches the template as `system`: the same
    greedy answer on both protocols. A message without content is refused,
    naming it, unless an assistant message calls tools."""
    pb, stub, meta = grpc_api
    c = client(server)

    def ask(role):
        msgs = [
            {"role": role, "content": "Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ]
        r = c.chat.completions.create(
            model=model_id(server), messages=msgs, max_tokens=12, temperature=0
        )
        return r.choices[0].message.content, r.usage.prompt_tokens

    # SmolLM2's template adds its own system turn when the first message is
    # not `system`: a `developer` turn passed through as it came would
    # change the prompt, not only its role's name.
    as_system, as_developer = ask("system"), ask("developer")
    assert as_developer == as_system
    req = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="developer", content="Answer in one word."),
                pb.ChatMessage(role="user", content="What colour is the sky?"),
            ]
        ),
        max_tokens=12,
    )
    assert "".join(r.text for r in stub.Generate(req, metadata=meta)) == as_system[0]
    for msgs, param in [
        ([{"role": "user", "content": None}], "messages[0].content"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}],
            "messages[1].content",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model_id(server), messages=msgs)
        assert e.value.body["param"] == param
    # An endpoint asked with the wrong method: 405 in OpenAI's shape, with
    # the methods it takes.
    req = urllib.request.Request(f"{server.http}/v1/chat/completions", method="GET")
    req.add_header("Authorization", f"Bearer {API_KEY}")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405
    assert e.value.headers["Allow"] == "POST"
    assert json.load(e.value)["error"]["type"] == "invalid_request_error"
    server.wait_idle()


def test_n_choices_compute_the_prompt_once(server, grpc_api):
    pb, stub, meta = grpc_api

    def kv():
        return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=meta).kv

    # A prompt no earlier test sent, longer than a block.
    prompt = "Fresh words: " + " ".join(f"w{i}x" for i in range(60))
    before = kv()
    r = client(server).completions.create(
        model=model_id(server), prompt=prompt, max_tokens=4, n=3, seed=1
    )
    after = kv()
    p = r.usage.prompt_tokens
    assert p > 64
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    misses = after.prefix_miss_tokens - before.prefix_miss_tokens
    # Choice 0 computes the prompt; choices 1 and 2 find all of it but the
    # last token (always recomputed) in the cache.
    assert hits == 2 * (p - 1), (hits, misses, p)
    assert misses == p + 2, (hits, misses, p)
    server.wait_idle()


def test_max_tokens_over_the_context_is_refused(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model_id(server), prompt="Hello", max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=model_id(server), messages=QUESTION, max_completion_tokens=5000
        )
    assert e.value.body["param"] == "max_completion_tokens"
    server.wait_idle()


def readme_curls() -> list[str]:
    """The curl commands of the README's HTTP section (every `sh` block,
    indented ones in lists too), as written."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The OpenAI-compatible HTTP API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^ *```sh\n(.*?)^ *```", section, re.S | re.M)
    commands, current = [], ""
    for line in "".join(blocks).splitlines():
        current += line + "\n"
        if line.startswith("curl") or current.strip():
            # A command ends where its quotes balance.
            if current.count("'") % 2 == 0:
                commands.append(current.strip())
                current = ""
    return [c for c in commands if c.startswith("curl")]


def test_the_readme_curl_examples_work(embed_server):
    commands = readme_curls()
    assert len(commands) >= 6 and any("/v1/responses" in c for c in commands)
    for cmd in commands:
        cmd = cmd.replace("http://127.0.0.1:8080", embed_server.http)
        out = subprocess.run(
            ["bash", "-c", cmd + " --fail-with-body"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, (cmd, out.stdout, out.stderr)
        body = out.stdout.strip()
        if body.startswith("data:"):
            assert body.endswith("data: [DONE]"), body
        else:
            json.loads(body)


def test_logprobs_chat_completions_and_streamed(server):
    c = client(server)
    r = c.chat.completions.create(
        model="", messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-4
        # Greedy: the chosen token is the most likely one.
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob

    chunks = c.chat.completions.create(
        model="", messages=QUESTION, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3, stream=True,
    )
    streamed = [e for ch in chunks for cc in ch.choices if cc.logprobs for e in cc.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]

    t = c.completions.create(model="", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == t.usage.completion_tokens
    assert "".join(lp.tokens) == t.choices[0].text
    assert lp.text_offset[0] == 0 and all(
        b - a == len(tok) for a, b, tok in zip(lp.text_offset, lp.text_offset[1:], lp.tokens)
    )
    assert all(len(top) == 2 and max(top.values()) == x for top, x in zip(lp.top_logprobs, lp.token_logprobs))

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", messages=QUESTION, max_tokens=2, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    server.wait_idle()


def test_logit_bias_forces_and_bans_tokens(server, grpc_api):
    pb, stub, meta = grpc_api
    (yes,) = stub.Tokenize(pb.TokenizeRequest(text=" yes"), metadata=meta).ids
    c = client(server)
    forced = c.completions.create(
        model="", prompt="Is the sky green? Answer:", max_tokens=3, temperature=0,
        logit_bias={str(yes): 100},
    )
    assert forced.choices[0].text == " yes yes yes"
    # The greedy first token, banned: another one comes first.
    ask = dict(model="", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=0)
    first = c.completions.create(**ask).choices[0].logprobs.tokens[0]
    (first_id,) = stub.Tokenize(pb.TokenizeRequest(text=first), metadata=meta).ids
    banned = c.completions.create(**ask, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first, first


def test_grpc_logprobs_and_logit_bias_match_http(server, grpc_api):
    """The same greedy request reports the same log-probabilities on both
    protocols, and a logit bias acts the same."""
    pb, stub, meta = grpc_api
    prompt = "The capital of France is"
    req = pb.GenerateRequest(prompt=prompt, max_tokens=6, logprobs=True, top_logprobs=2)
    grpc_lps = [lp for r in stub.Generate(req, metadata=meta) for lp in r.logprobs]
    http = client(server).completions.create(
        model="", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    ).choices[0].logprobs
    assert [lp.bytes.decode() for lp in grpc_lps] == http.tokens
    assert [lp.logprob for lp in grpc_lps] == pytest.approx(http.token_logprobs, abs=1e-6)
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in grpc_lps)

    (yes,) = stub.Tokenize(pb.TokenizeRequest(text=" yes"), metadata=meta).ids
    forced = pb.GenerateRequest(
        prompt="Is the sky green? Answer:", max_tokens=3,
        sampling=pb.SamplingParams(logit_bias={yes: 100.0}),
    )
    assert "".join(r.text for r in stub.Generate(forced, metadata=meta)) == " yes yes yes"
    bad = pb.GenerateRequest(prompt="x", max_tokens=2, sampling=pb.SamplingParams(logit_bias={yes: 500.0}))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()


def test_echo_scores_prompts_as_lm_eval_asks(server, grpc_api):
    """`echo` with `logprobs`: lm-eval's loglikelihood request (token ids,
    `max_tokens` 1, `logprobs` 1, reading `token_logprobs[ctxlen:-1]`), a text
    prompt scored alone (`max_tokens` 0), and the same streamed."""
    pb, stub, meta = grpc_api
    c = client(server)
    prompt = "The capital of France is"
    ctx = list(stub.Tokenize(pb.TokenizeRequest(text=prompt, add_special=True), metadata=meta).ids)
    # The greedy continuation, generated with its log-probabilities.
    gen = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=6, logprobs=True), metadata=meta))
    cont_ids = [t for r in gen for t in r.token_ids]
    cont_text = "".join(r.text for r in gen)
    decoded = c.completions.create(model="", prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    assert decoded.choices[0].text == cont_text

    r = c.completions.create(
        model="", prompt=[ctx + cont_ids], echo=True, max_tokens=1, logprobs=1, temperature=0
    )
    choice, lp = r.choices[0], r.choices[0].logprobs
    n = len(ctx) + len(cont_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text.startswith(prompt + cont_text) and choice.text == "".join(lp.tokens)
    assert lp.text_offset[0] == 0 and all(
        b - a == len(tok) for a, b, tok in zip(lp.text_offset, lp.text_offset[1:], lp.tokens)
    )
    # Each continuation token scores as it did when it was generated: the
    # same logits, computed in a chunk instead of one per step.
    cont = lp.token_logprobs[len(ctx):-1]
    assert cont == decoded.choices[0].logprobs.token_logprobs
    # lm-eval's is_greedy: every continuation token is the most likely one.
    assert all(x == max(top.values()) for x, top in zip(cont, lp.top_logprobs[len(ctx):-1]))

    def loglikelihood(continuation: str) -> float:
        ids = list(stub.Tokenize(pb.TokenizeRequest(text=continuation), metadata=meta).ids)
        s = c.completions.create(model="", prompt=[ctx + ids], echo=True, max_tokens=1, logprobs=1, temperature=0)
        return sum(s.choices[0].logprobs.token_logprobs[len(ctx):-1])

    assert loglikelihood(" Paris") > loglikelihood(" a banana") + 2

    # A text prompt scored alone: its text, every token, nothing generated.
    s = c.completions.create(model="", prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    only = s.choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (len(ctx), 0)
    assert "".join(only.logprobs.tokens) == prompt
    assert only.logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(ctx)]
    assert all(len(top) == 2 for top in only.logprobs.top_logprobs[1:])

    # Streamed: the echo first, in a chunk of its own, then the tokens.
    ask = dict(model="", prompt=prompt, echo=True, max_tokens=4, temperature=0, logprobs=1)
    whole = c.completions.create(**ask).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(**ask, stream=True) if ch.choices]
    assert chunks[0].text == prompt and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [x for ch in chunks if ch.logprobs for x in ch.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    # An echo without logprobs is the prompt's text, and keeps the cache.
    plain = c.completions.create(model="", prompt=prompt, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text == whole.text and plain.choices[0].logprobs is None

    for bad, param in [
        (dict(prompt=prompt, max_tokens=0), "max_tokens"),
        (dict(prompt="def f(", suffix=")", echo=True, max_tokens=2), "echo"),
        (dict(prompt=prompt, echo=True, max_tokens=0, logprobs=21), "logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="", **bad)
        assert e.value.body["param"] == param, bad
    server.wait_idle()


def test_grpc_scores_prompts(server, grpc_api):
    """gRPC's `prompt_logprobs` and `score_only`: the prompt's tokens in a
    message of their own, the same numbers as an HTTP echo."""
    pb, stub, meta = grpc_api
    prompt = "The capital of France is"
    msgs = list(stub.Generate(
        pb.GenerateRequest(prompt=prompt, prompt_logprobs=2, score_only=True), metadata=meta
    ))
    assert len(msgs) == 2
    scored, done = msgs
    assert scored.request_id and not scored.token_ids and not scored.text
    assert done.finish_reason == pb.FINISH_REASON_LENGTH and done.usage.completion_tokens == 0
    lps = scored.prompt_logprobs
    assert len(lps) == done.usage.prompt_tokens
    assert lps[0].logprob == 0 and not lps[0].top and lps[0].rank == 0
    assert b"".join(l.bytes for l in lps).decode() == prompt
    assert all(len(l.top) == 2 and l.logprob < 0 for l in lps[1:])
    # Ranks: 1 exactly where the token is the most likely one.
    assert all((l.rank == 1) == (l.top[0].token_id == l.token_id) for l in lps[1:])
    http = client(server).completions.create(
        model="", prompt=prompt, echo=True, max_tokens=0, logprobs=2
    ).choices[0].logprobs
    assert [l.logprob for l in lps[1:]] == pytest.approx(http.token_logprobs[1:], abs=1e-6)
    # Scored on the way to generating: the prompt's message comes first.
    msgs = list(stub.Generate(pb.GenerateRequest(prompt=prompt, prompt_logprobs=0, max_tokens=3), metadata=meta))
    assert len(msgs[0].prompt_logprobs) == len(lps) and not msgs[0].token_ids
    assert sum(len(m.token_ids) for m in msgs) == 3
    for req, field in [
        (pb.GenerateRequest(prompt=prompt, score_only=True), "score_only"),
        (pb.GenerateRequest(prompt=prompt, prompt_logprobs=1, score_only=True, max_tokens=2), "max_tokens"),
        (pb.GenerateRequest(prompt=prompt, prompt_logprobs=21), "prompt_logprobs"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=meta))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    server.wait_idle()


def test_vllm_prompt_logprobs_on_both_endpoints(server, grpc_api):
    """vLLM's `prompt_logprobs` extension (what its clients send through
    `extra_body`): per choice on completions, at the top level on chat, in the
    first chunk when streamed; the same numbers as an echo."""
    pb, stub, meta = grpc_api
    c = client(server)
    prompt = "The capital of France is"
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=prompt, add_special=True), metadata=meta).ids)
    echo = c.completions.create(model="", prompt=prompt, echo=True, max_tokens=0, logprobs=1).choices[0].logprobs
    r = c.completions.create(
        model="", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids) == r.usage.prompt_tokens
    for pos, (entry, tid) in enumerate(zip(scored[1:], ids[1:]), start=1):
        own = entry[str(tid)]
        assert own["logprob"] == echo.token_logprobs[pos]
        assert own["decoded_token"] == echo.tokens[pos]
        # The token and the most likely one (itself when it ranks first).
        assert len(entry) == (1 if own["rank"] == 1 else 2), entry
        assert min(v["rank"] for v in entry.values()) == 1
        assert max(v["logprob"] for v in entry.values()) == max(echo.top_logprobs[pos].values())
    # Streamed: the first chunk's choice carries them.
    chunks = list(c.completions.create(
        model="", prompt=prompt, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 1}
    ))
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == scored
    assert not any("prompt_logprobs" in (ch.choices[0].model_extra or {}) for ch in chunks[1:] if ch.choices)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # Scored alone.
    only = c.completions.create(model="", prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert only.choices[0].text == "" and only.usage.completion_tokens == 0
    assert [e[str(t)]["logprob"] for e, t in zip(only.choices[0].model_extra["prompt_logprobs"][1:], ids[1:])] == echo.token_logprobs[1:]

    chat = c.chat.completions.create(
        model="", messages=QUESTION, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    cp = chat.model_extra["prompt_logprobs"]
    assert cp[0] is None and len(cp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in cp[1:])
    chunks = list(c.chat.completions.create(
        model="", messages=QUESTION, max_tokens=3, temperature=0, stream=True, extra_body={"prompt_logprobs": 0}
    ))
    assert chunks[0].model_extra["prompt_logprobs"] == cp
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not any("prompt_logprobs" in (ch.model_extra or {}) for ch in chunks[1:])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": -1})
    assert e.value.body["param"] == "prompt_logprobs"
    server.wait_idle()


def test_n_choices_share_one_scoring_of_the_prompt(server, grpc_api):
    """`n` choices with `echo` and `logprobs`: the prompt is scored once (by
    choice 0, without the cache) and every choice echoes those scores; the
    other choices find the prompt in the cache."""
    pb, stub, meta = grpc_api

    def kv():
        return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=meta).kv

    prompt = "Scored words: " + " ".join(f"s{i}y" for i in range(60))
    before = kv()
    r = client(server).completions.create(
        model="", prompt=prompt, max_tokens=3, n=3, seed=2, echo=True, logprobs=1
    )
    after = kv()
    p = r.usage.prompt_tokens
    assert p > 64
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    misses = after.prefix_miss_tokens - before.prefix_miss_tokens
    # Choice 0 looks nothing up; choices 1 and 2 find all but the last token.
    assert (hits, misses) == (2 * (p - 1), 2), (hits, misses, p)
    heads = [c.logprobs.token_logprobs[:p] for c in r.choices]
    assert heads[0][0] is None and all(h == heads[0] for h in heads)
    assert all(c.text.startswith(prompt) for c in r.choices)
    # Streamed, each choice's first chunk echoes the same scores.
    chunks = list(client(server).completions.create(
        model="", prompt=prompt, max_tokens=3, n=3, seed=2, echo=True, logprobs=1, stream=True
    ))
    firsts = {}
    for ch in chunks:
        for c in ch.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == [0, 1, 2]
    assert all(f.text == prompt and f.logprobs.token_logprobs == heads[0] for f in firsts.values())
    server.wait_idle()


def test_a_batch_of_prompts_is_answered_as_choices(server, grpc_api):
    """`prompt` as a list: each prompt's `n` choices in turn (index
    `p * n + j`), each as its request alone would answer it, whole and
    streamed; lm-eval's batched loglikelihood requests likewise."""
    pb, stub, meta = grpc_api
    c = client(server)
    prompts = ["The capital of France is", "One, two, three,", "def add(a, b):"]
    solo = [c.completions.create(model="", prompt=p, max_tokens=8, temperature=0) for p in prompts]
    batch = c.completions.create(model="", prompt=prompts, n=2, max_tokens=8, temperature=0)
    assert [ch.index for ch in batch.choices] == list(range(6))
    for i, ch in enumerate(batch.choices):
        alone = solo[i // 2].choices[0]
        assert (ch.text, ch.finish_reason) == (alone.text, alone.finish_reason), i
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in solo)

    texts, usage = {}, None
    for ch in c.completions.create(
        model="", prompt=prompts, n=2, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        for cc in ch.choices:
            texts[cc.index] = texts.get(cc.index, "") + cc.text
        usage = ch.usage or usage
    assert [texts[i] for i in range(6)] == [ch.text for ch in batch.choices]
    assert usage.prompt_tokens == batch.usage.prompt_tokens

    # lm-eval with batch_size > 1: token ids, echo, one token, logprobs 1.
    ids = [list(stub.Tokenize(pb.TokenizeRequest(text=p, add_special=True), metadata=meta).ids) for p in prompts]
    one = [
        c.completions.create(model="", prompt=[i], echo=True, max_tokens=1, logprobs=1, temperature=0)
        for i in ids
    ]
    many = c.completions.create(model="", prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0)
    assert len(many.choices) == 3
    for ch, alone in zip(many.choices, one):
        assert ch.text == alone.choices[0].text
        assert ch.logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
        assert ch.logprobs.tokens == alone.choices[0].logprobs.tokens
    # Too many prompts, or a middle to fill in a batch: 400 naming the field.
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt=["x"] * 65, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt=["x", "y"], suffix="z", max_tokens=1)
    assert e.value.body["param"] == "suffix"
    server.wait_idle()


# A ChatML template of our own for SmolLM2 (its vocabulary has the markers),
# with Qwen3's switch: `enable_thinking: false` closes an empty think block.
CHATML_THINK = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- if open_thinking is defined and open_thinking -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    """SmolLM2 behind CHATML_THINK: a template that knows `<think>`, as a
    reasoning model's does."""
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(CHATML_THINK)
    s = Server("--chat-template-file", str(path), "--reasoning-budgets", "low=8")
    yield s
    s.stop()


def test_a_chat_template_file_and_template_arguments(grpc_api, think_server, tmp_path):
    """`serve --chat-template-file` replaces the GGUF's template, and
    `chat_template_kwargs` (HTTP) or `chat_template_kwargs` JSON (gRPC) reach
    it: the tokens /tokenize shows are the ones a request runs on."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    s = think_server

    def post(body):
        return post_json(s, "/tokenize", body)

    hi = [{"role": "user", "content": "Hi"}]
    off = {"enable_thinking": False}
    _, plain = post({"messages": hi, "return_token_strs": True})
    _, think = post({"messages": hi, "chat_template_kwargs": off, "return_token_strs": True})
    # Ours, not the GGUF's (which adds its own system prompt); the
    # markers are special tokens, whose text is not shown.
    assert "".join(plain["token_strs"]) == "user\nHi\nassistant\n"
    assert "".join(think["token_strs"]) == "".join(plain["token_strs"]) + "<think>\n\n</think>\n\n"
    c = client(s)
    r = c.chat.completions.create(
        model="", messages=hi, max_tokens=2, temperature=0, extra_body={"chat_template_kwargs": off}
    )
    assert r.usage.prompt_tokens == think["count"]
    r = c.chat.completions.create(model="", messages=hi, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == plain["count"]
    # The Responses API passes them on too.
    r = c.responses.create(
        model="", input="Hi", max_output_tokens=2, extra_body={"chat_template_kwargs": off}
    )
    assert r.usage.input_tokens == think["count"]
    # gRPC: the same arguments as JSON text.
    with grpc.insecure_channel(s.grpc) as ch:
        stub = pbg.InferenceStub(ch)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
        done = list(stub.Generate(pb.GenerateRequest(
            chat=chat, max_tokens=1, chat_template_kwargs=json.dumps(off)
        )))[-1]
        assert done.usage.prompt_tokens == think["count"]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(chat=chat, max_tokens=1, chat_template_kwargs="[1]")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat_template_kwargs" in e.value.details()
    # What they cannot do is named.
    for call in [
        lambda: c.chat.completions.create(
            model="", messages=hi, max_tokens=1, extra_body={"chat_template_kwargs": {"messages": []}}),
        lambda: c.completions.create(
            model="", prompt="Hi", max_tokens=1, extra_body={"chat_template_kwargs": off}),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "chat_template_kwargs"
    assert post({"prompt": "Hi", "chat_template_kwargs": off})[1]["error"]["param"] == "chat_template_kwargs"
    s.wait_idle()
    # A template that does not compile stops start-up, saying so.
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    assert "chat template" in refused_start("--chat-template-file", str(bad))


# A thought, then an answer, as a reasoning model writes them (forced here by
# a grammar: SmolLM2 does not think on its own).
THINK_THEN_ANSWER = r"""
start: "<think>" THOUGHT "</think>\n\n" ANSWER
THOUGHT: /[a-z][a-z ]{8,40}/
ANSWER: /[A-Z][a-z ]{3,30}\./
"""


def forced_call_streams_alike(c, ask):
    """`ask` forces one tool call: whole, its finish reason is `tool_calls`;
    streamed through the `openai` client's own accumulator it is the same
    call, its arguments in more than one delta. Returns the whole answer's
    message and call."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    whole = c.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    call = whole.message.tool_calls[0]
    state = ChatCompletionStreamState()
    kinds = []
    for chunk in c.chat.completions.create(**ask, stream=True):
        kinds.extend(e.type for e in state.handle_chunk(chunk))
    got = state.get_final_completion().choices[0]
    assert got.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == [
        (call.function.name, call.function.arguments)]
    assert kinds.count("tool_calls.function.arguments.delta") > 1, kinds
    return whole.message, call


# A weather tool whose one argument is bounded, so a forced call ends.
CITY_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
CITY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": CITY_PARAMS}}]
CITY_ASK = [{"role": "user", "content": "Weather in Paris?"}]


def forced_city_call(c, **kw):
    """Forces a call to CITY_TOOLS' tool on CITY_ASK (greedy; `kw` adds to
    or replaces the request), checked by `forced_call_streams_alike`: a call
    to `get_weather` and no text. Returns the message, the call and the
    request."""
    ask = dict(dict(model="", messages=CITY_ASK, tools=CITY_TOOLS, tool_choice="required",
                    temperature=0), **kw)
    message, call = forced_call_streams_alike(c, ask)
    assert call.function.name == "get_weather" and message.content is None
    return message, call, ask


def two_cities_under_auto(c, ask, regex: str, max_tokens: int):
    """Under `tool_choice: auto`, the model writes (by `regex`) two calls to
    CITY_TOOLS' tool, for Rome then Oslo, in its template's syntax: both are
    read, in order, and the answer ends on `tool_calls`."""
    r = c.chat.completions.create(**dict(ask, tool_choice="auto", parallel_tool_calls=True,
                                         max_tokens=max_tokens), extra_body={"regex": regex})
    got = [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls]
    assert got == ["Rome", "Oslo"] and r.choices[0].finish_reason == "tool_calls", r


def call_rendered_back(s, call, result: str | None = "18 C", **body) -> str:
    """The prompt text `s`'s template renders for CITY_ASK, then an assistant
    message making `call`, then (unless `result` is None) the tool's
    `result`: the call as the template writes it back."""
    loop = CITY_ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function",
        "function": {"name": "get_weather", "arguments": call.function.arguments}}]}]
    if result is not None:
        loop.append({"role": "tool", "tool_call_id": call.id, "content": result})
    status, t = post_json(s, "/tokenize", dict(body, messages=loop))
    assert status == 200, t
    return post_json(s, "/detokenize", {"tokens": t["tokens"]})[1]["prompt"]


def template_server(name: str) -> Server:
    """A server on one of the chat crate's test-data templates."""
    return Server("--chat-template-file", str(ROOT / "crates" / "chat" / "src" / name))


# Llama 3's tool-call format (a call is the answer's JSON, `parameters` for
# the arguments, no marker) in ChatML's turns, which SmolLM2 knows.
LLAMA_JSON_TOOLS = (
    "{%- if tools -%}<|im_start|>system\nTo call a function, respond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor -%}<|im_end|>\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + ('ipython' if m.role == 'tool' else m.role) + '\n' }}"
    "{%- if m.tool_calls -%}{%- set c = m.tool_calls[0].function -%}"
    "{{ '{\"name\": \"' + c.name + '\", \"parameters\": ' + c.arguments | tojson + '}' }}"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_llama3_json_tool_calls(tmp_path):
    """A template that writes calls as Llama 3's does (the answer's JSON,
    `parameters`, no marker) is known by how it renders a call: a required
    call is forced with the tool's schema and read back as `tool_calls`,
    streamed as written and equal to the whole answer; the call and its
    result render back through the template."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    path = tmp_path / "llama_json.jinja"
    path.write_text(LLAMA_JSON_TOOLS)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
        ask = dict(model="", messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=tools, tool_choice="required", temperature=0, max_tokens=60)
        message, call = forced_call_streams_alike(c, ask)
        assert call.function.name == "get_weather" and message.content is None
        assert set(json.loads(call.function.arguments)) == {"city"}
        # Two calls written (forced here by a regex, the model deciding on
        # its own under `auto`): both read, or with `parallel_tool_calls:
        # false` only the first, whole and streamed.
        two = ('\\{"name": "get_weather", "parameters": \\{"city": "Paris"\\}\\}; '
               '\\{"name": "get_weather", "parameters": \\{"city": "Rome"\\}\\}')
        auto = dict(ask, tool_choice="auto", extra_body={"regex": two})
        r = c.chat.completions.create(**auto)
        cities = [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls]
        assert cities == ["Paris", "Rome"], r
        r = c.chat.completions.create(**auto, parallel_tool_calls=False)
        assert [t.function.arguments for t in r.choices[0].message.tool_calls] == [
            '{"city": "Paris"}']
        state = ChatCompletionStreamState()
        for chunk in c.chat.completions.create(**auto, parallel_tool_calls=False, stream=True):
            state.handle_chunk(chunk)
        calls = state.get_final_completion().choices[0].message.tool_calls
        assert [t.function.arguments for t in calls] == ['{"city": "Paris"}']

        # The call and its result go back through the template.
        follow = ask["messages"] + [
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]
        status, t = post_json(s, "/tokenize", {"messages": follow, "return_token_strs": True})
        text = "".join(t["token_strs"])
        assert status == 200 and '{"name": "get_weather", "parameters": {"city": ' in text, text
        assert "ipython\n18 C" in text
        r = c.chat.completions.create(model="", messages=follow, max_tokens=5)
        assert r.usage.prompt_tokens == t["count"]
        s.wait_idle()
    finally:
        s.stop()


# Mistral's newer tool-call format (`[TOOL_CALLS]NAME[ARGS]{…}` per call)
# in ChatML's turns, which SmolLM2 knows.
MISTRAL_ARGS_TOOLS = (
    "{%- if tools -%}<|im_start|>system\n[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "<|im_end|>\n{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{{ '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}"
    "{%- endfor -%}{%- elif m.role == 'tool' -%}{{ '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_mistral_name_args_tool_calls(tmp_path):
    """A template that writes calls as Mistral's newer models do
    (`[TOOL_CALLS]NAME[ARGS]{…}` per call): a required call is forced in
    that shape and read back, streamed as written and equal to the whole
    answer; two calls written under `auto` are both read (one with
    `parallel_tool_calls: false`); the call and its result render back."""
    path = tmp_path / "mistral_args.jinja"
    path.write_text(MISTRAL_ARGS_TOOLS)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, max_tokens=60, parallel_tool_calls=False)
        assert set(json.loads(call.function.arguments)) == {"city"}
        two = ('\\[TOOL_CALLS\\]get_weather\\[ARGS\\]\\{"city": "Paris"\\}'
               '\\[TOOL_CALLS\\]get_weather\\[ARGS\\]\\{"city": "Rome"\\}')
        auto = dict(ask, tool_choice="auto", parallel_tool_calls=True, extra_body={"regex": two})
        r = c.chat.completions.create(**auto)
        cities = [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls]
        assert cities == ["Paris", "Rome"], r
        r = c.chat.completions.create(**dict(auto, parallel_tool_calls=False))
        assert [t.function.arguments for t in r.choices[0].message.tool_calls] == ['{"city": "Paris"}']
        follow = ask["messages"] + [
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]
        status, t = post_json(s, "/tokenize", {"messages": follow, "return_token_strs": True})
        text = "".join(t["token_strs"])
        assert status == 200 and "[TOOL_CALLS]get_weather[ARGS]{" in text, text
        assert "[TOOL_RESULTS]18 C[/TOOL_RESULTS]" in text
        s.wait_idle()
    finally:
        s.stop()


def test_qwen3_coder_xml_tool_calls(grpc_api):
    """Qwen3-Coder's own template (its calls in XML: one tag per argument)
    on SmolLM2: a required call is forced in that shape and read back with
    its values typed by the tool's schema, streamed as written and equal to
    the whole answer, and the same over gRPC; a call the model writes under
    `auto` is read too; the call and its result render back."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    s = template_server("testdata_qwen3_coder.jinja")
    try:
        c = client(s)
        params = {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
            "required": ["city", "days"]}
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city", "parameters": params}}]
        msgs = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
        ask = dict(model="", messages=msgs, tools=tools, tool_choice="required",
                   parallel_tool_calls=False, temperature=0, max_tokens=80)
        _, call = forced_call_streams_alike(c, ask)
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "days"}
        assert isinstance(args["city"], str) and isinstance(args["days"], int), args
        with grpc.insecure_channel(s.grpc) as ch:
            stub = pbg.InferenceStub(ch)
            out = list(stub.Generate(pb.GenerateRequest(
                chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=msgs[0]["content"])]),
                max_tokens=80, tools=[pb.Tool(name="get_weather", parameters=json.dumps(params))],
                tool_choice="required", parallel_tool_calls=False)))
        deltas = [d for m in out for d in m.tool_calls]
        assert deltas[0].name == "get_weather"
        assert "".join(d.arguments for d in deltas) == call.function.arguments
        # Written by the model under `auto` (a regex here): read, typed.
        written = ("<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nRome\\n</parameter>\\n"
                   "<parameter=days>\\n3\\n</parameter>\\n</function>\\n</tool_call>")
        r = c.chat.completions.create(**dict(ask, tool_choice="auto"), extra_body={"regex": written})
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {
            "city": "Rome", "days": 3}
        # The call and its result go back through the template, in XML.
        follow = msgs + [
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]
        status, t = post_json(s, "/tokenize", {"messages": follow, "return_token_strs": True})
        text = "".join(t["token_strs"])
        assert status == 200, t
        assert f"<parameter=days>\n{args['days']}\n</parameter>" in text, text
        assert "<tool_response>\n18 C\n</tool_response>" in text, text
        r = c.chat.completions.create(model="", messages=follow, max_tokens=5)
        assert r.usage.prompt_tokens == t["count"]
        s.wait_idle()
    finally:
        s.stop()


def test_qwen3_template_tool_loop():
    """Qwen3's own template on SmolLM2: a required call is forced (after
    the thinking, which a budget of 0 closes at once) and read back; the
    next turn sends the call back as OpenAI clients do (`content: null`,
    which this template reads as text: given as empty text) with its
    `reasoning_content`, which the template shows again, and the model
    answers it."""
    s = template_server("testdata_qwen3.jinja")
    try:
        c = client(s)
        message, call, _ = forced_city_call(c, parallel_tool_calls=False, max_tokens=80,
                                            extra_body={"thinking_token_budget": 0})
        assert message.reasoning_content is None, message
        follow = CITY_ASK + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
             "reasoning_content": "Need the weather."},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]
        status, t = post_json(s, "/tokenize", {"messages": follow, "return_token_strs": True})
        text = "".join(t["token_strs"])
        assert status == 200, t
        assert "<think>\nNeed the weather.\n</think>\n\n<tool_call>" in text, text
        assert "<tool_response>\n18 C\n</tool_response>" in text, text
        r = c.chat.completions.create(model="", messages=follow, max_tokens=5,
                                      extra_body={"thinking_token_budget": 0})
        assert r.usage.prompt_tokens == t["count"]
        s.wait_idle()
    finally:
        s.stop()


def test_real_templates_take_what_openai_clients_send():
    """Templates as their models ship them that fail on what OpenAI's
    clients send are adapted at start-up, so a tool loop (the call with
    `content: null` and the server's long call id, then its result) and a
    system message render: Mistral-Nemo's 9-character ids, DeepSeek-V3.1's
    arguments as text, Gemma 2's system role folded into the user turn."""
    loop = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_18eedc3dd3393c090001", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_18eedc3dd3393c090001", "content": "18 C"},
    ]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    cases = [
        ("testdata_mistral_nemo.jinja", loop, ['"call_id": "', "18 C"]),
        ("testdata_deepseek_v31.jinja", loop, ['get_weather<｜tool▁sep｜>{"city": "Paris"}']),
        ("testdata_gemma2.jinja", system, ["user\nBe brief.\n\nHi<end_of_turn>"]),
    ]
    for name, msgs, wanted in cases:
        s = template_server(name)
        try:
            status, t = post_json(s, "/tokenize", {"messages": msgs})
            assert status == 200, (name, t)
            text = post_json(s, "/detokenize", {"tokens": t["tokens"]})[1]["prompt"]
            for w in wanted:
                assert w in text, (name, text)
            r = client(s).chat.completions.create(model="", messages=msgs, max_tokens=3)
            assert r.usage.prompt_tokens == t["count"], name
            s.wait_idle()
        finally:
            s.stop()


# DeepSeek-R1's tool-call format (each call's type, its name, and its
# arguments in a JSON fence) in a minimal template of DeepSeek's turns.
DEEPSEEK_R1_TOOLS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}"
    "{%- for t in m.tool_calls -%}"
    "{{ '<｜tool▁call▁begin｜>' + t.type + '<｜tool▁sep｜>' + t.function.name"
    " + '\\n```json\\n' + t.function.arguments + '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor -%}{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'tool' -%}{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜><think>\\n' }}{%- endif -%}"
)


def test_deepseek_tool_calls(tmp_path):
    """DeepSeek's tool calls on SmolLM2: V3.1's own template
    (`NAME<｜tool▁sep｜>{…}` in the list's tags) and an R1-style one (the
    call's type, then its name and a JSON fence). A required call is forced
    in each shape and read back, streamed as written; two calls the model
    writes under `auto` are both read. R1's template opens a thinking
    block, as DeepSeek-R1's does: a budget of 0 closes it at once and the
    call follows; the template renders the call back. (SmolLM2's vocabulary
    spells DeepSeek's tags in many byte tokens.)"""
    two = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
           '\\{"city": "Rome"\\}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather'
           '<｜tool▁sep｜>\\{"city": "Oslo"\\}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    s = template_server("testdata_deepseek_v31.jinja")
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=200)
        assert set(json.loads(call.function.arguments)) == {"city"}
        two_cities_under_auto(c, ask, two, max_tokens=400)
        s.wait_idle()
    finally:
        s.stop()
    path = tmp_path / "deepseek_r1.jinja"
    path.write_text(DEEPSEEK_R1_TOOLS)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=200,
                                              extra_body={"thinking_token_budget": 0})
        # The forced close is "\n</think>\n\n": its newline is all the thinking.
        assert message.reasoning_content == "\n", message
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"}
        text = call_rendered_back(s, call)
        fence = f"function<｜tool▁sep｜>get_weather\n```json\n{call.function.arguments}\n```"
        assert fence in text, text
        s.wait_idle()
    finally:
        s.stop()


# Command R's tool-call format (a JSON list of numbered calls in its action
# tags) in a minimal template of Cohere's turns.
COMMAND_R_TOOLS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_ACTION|>["
    "{%- for t in m.tool_calls -%}{{ ', ' if not loop.first }}"
    '{"tool_call_id": "{{ loop.index0 }}", "tool_name": "{{ t.function.name }}", '
    '"parameters": {{ t.function.arguments | tojson }}}'
    "{%- endfor -%}]<|END_ACTION|><|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'assistant' -%}"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{{ m.content }}"
    "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    "{%- elif m.role == 'tool' -%}"
    "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>{{ m.content }}"
    "<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{%- endif -%}"
)


def test_command_r_tool_calls(tmp_path):
    """Command R's tool calls on SmolLM2 (a template of Cohere's turns): a
    required call is forced as a numbered item of its action list and read
    back, its arguments streamed as written; two calls the model writes
    under `auto` are both read."""
    path = tmp_path / "command_r.jinja"
    path.write_text(COMMAND_R_TOOLS)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=100)
        assert set(json.loads(call.function.arguments)) == {"city"}
        two = ('<\\|START_ACTION\\|>\\[\\{"tool_call_id": "0", "tool_name": "get_weather", '
               '"parameters": \\{"city": "Rome"\\}\\}, \\{"tool_call_id": "1", "tool_name": '
               '"get_weather", "parameters": \\{"city": "Oslo"\\}\\}\\]<\\|END_ACTION\\|>')
        two_cities_under_auto(c, ask, two, max_tokens=150)
        s.wait_idle()
    finally:
        s.stop()


# LFM2's tool-call format (a Python list of calls in its tags; the tools
# listed in its system turn) in ChatML's turns, which LFM2 and SmolLM2 share.
LFM2_TOOLS = (
    "{%- if tools -%}<|im_start|>system\nList of tools: <|tool_list_start|>["
    "{%- for t in tools -%}{{ t | tojson }}{{ ', ' if not loop.last }}{%- endfor -%}"
    "]<|tool_list_end|><|im_end|>\n{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.tool_calls -%}<|tool_call_start|>["
    "{%- for tc in m.tool_calls -%}{{ ', ' if not loop.first }}{{ tc.function.name }}("
    "{%- for k, v in tc.function.arguments.items() -%}{{ ', ' if not loop.first }}"
    "{{ k }}={{ v | tojson }}{%- endfor -%}){%- endfor -%}]<|tool_call_end|>"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_lfm2_tool_calls(tmp_path):
    """LFM2's tool calls on SmolLM2 (a template of its turns): a required
    call is forced as a Python call in its tags and read back as JSON, its
    arguments streamed as written; two calls the model writes in one list
    under `auto` (one string single-quoted) are both read; the call renders
    back through the template."""
    path = tmp_path / "lfm2.jinja"
    path.write_text(LFM2_TOOLS)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=100)
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"}
        two = (r"<\|tool_call_start\|>\[get_weather\(city='Rome'\), "
               r'get_weather\(city="Oslo"\)\]<\|tool_call_end\|>')
        two_cities_under_auto(c, ask, two, max_tokens=150)
        text = call_rendered_back(s, call, result=None)
        written = f"<|tool_call_start|>[get_weather(city={json.dumps(args['city'])})]<|tool_call_end|>"
        assert written in text, text
        s.wait_idle()
    finally:
        s.stop()


# GLM's tool-call format (the name after `<tool_call>`, each argument's key
# and value in their own tags) in a minimal template of GLM's turns, in
# GLM-4.5's layout (`NL` a newline) or GLM-4.7's (none).
GLM_TOOLS = (
    "{%- if tools -%}<|system|>\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] -%}{{ '<tool_call>' + tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() -%}NL<arg_key>{{ k }}</arg_key>NL"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>"
    "{%- endfor -%}NL</tool_call>{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{%- endif -%}"
)


def test_glm_tool_calls(tmp_path):
    """GLM's tool calls on SmolLM2, in GLM-4.5's layout and GLM-4.7's (told
    apart by the template): a required call is forced in that layout and
    read back as JSON typed by the tool's schema, its string value streamed
    as written; two calls the model writes under `auto` are both read; the
    call renders back through the template."""
    for nl in ["\n", ""]:
        path = tmp_path / f"glm{len(nl)}.jinja"
        path.write_text(GLM_TOOLS.replace("NL", "{{ '\\n' }}" if nl else ""))
        s = Server("--chat-template-file", str(path))
        try:
            c = client(s)
            message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=100)
            args = json.loads(call.function.arguments)
            assert set(args) == {"city"}
            n = "\\n" if nl else ""  # the regex's newline
            one = (f"<tool_call>get_weather{n}<arg_key>city</arg_key>{n}<arg_value>CITY"
                   f"</arg_value>{n}</tool_call>")
            two_cities_under_auto(c, ask, one.replace("CITY", "Rome") + n
                                  + one.replace("CITY", "Oslo"), max_tokens=150)
            text = call_rendered_back(s, call, result=None)
            assert f"<arg_key>city</arg_key>{nl}<arg_value>{args['city']}</arg_value>" in text, text
            s.wait_idle()
        finally:
            s.stop()


# A thought in Gemma 4's channel, then an answer (forced: neither SmolLM2 nor
# a synthetic model thinks on its own).
GEMMA4_THOUGHT_THEN_ANSWER = (
    'start: "<|channel>thought\\n" THOUGHT "<channel|>" ANSWER\n'
    "THOUGHT: /[a-z][a-z ]{8,40}/\nANSWER: /[A-Z][a-z ]{3,30}\\./\n"
)


def test_gemma4_tool_calls_and_thinking():
    """Gemma 4's own template on SmolLM2 (calls as `<|tool_call>call:NAME{…}
    <tool_call|>`, arguments in Gemma's notation: bare keys, strings between
    `<|"|>` tokens): a required call is forced in that notation and read back
    as JSON, streamed as it is written; two calls the model writes under
    `auto` are both read; the call and its result render back in the
    notation. Its thinking is off by default (the prompt closes an empty
    thought); switched on, a thought in its channel is split off as
    `reasoning_content`. (SmolLM2 spells Gemma's tokens in byte tokens.)"""
    s = template_server("testdata_gemma4.jinja")
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=120)
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"} and message.reasoning_content is None, message
        two = (r'<\|tool_call>call:get_weather\{city:<\|"\|>Rome<\|"\|>\}<tool_call\|>'
               r'<\|tool_call>call:get_weather\{city:<\|"\|>Oslo<\|"\|>\}<tool_call\|>')
        two_cities_under_auto(c, ask, two, max_tokens=150)
        text = call_rendered_back(s, call, tools=CITY_TOOLS)
        q = '<|"|>'
        written = (f"<|tool_call>call:get_weather{{city:{q}{args['city']}{q}}}<tool_call|>"
                   f"<|tool_response>response:get_weather{{value:{q}18 C{q}}}<tool_response|>")
        assert written in text, text
        # Thinking: off unless switched on; on, its channel is split off.
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        on = {"chat_template_kwargs": {"enable_thinking": True},
              "grammar": GEMMA4_THOUGHT_THEN_ANSWER}
        r = c.chat.completions.create(model="", messages=ask, max_tokens=80, temperature=0,
                                      extra_body=on)
        m = r.choices[0].message
        assert m.reasoning_content and m.reasoning_content.startswith("\n"), m
        assert m.content and "channel" not in m.reasoning_content + m.content, m
        plain = c.chat.completions.create(model="", messages=ask, max_tokens=8, temperature=0)
        assert plain.choices[0].message.reasoning_content is None, plain
        s.wait_idle()
    finally:
        s.stop()


def test_gemma4_architecture_with_its_template(tmp_path):
    """Gemma 4's architecture at test size (`synth-model --like gemma4-mini`:
    heads of two sizes, the last two layers reading earlier layers' KV;
    random weights, SmolLM2's tokenizer) served through our store with
    Gemma 4's own template: a forced call in Gemma's notation, the same
    whole and streamed, and a thought split off."""
    model = synth_model("gemma4-mini", str(tmp_path / "gemma4-mini.gguf"))
    template = str(ROOT / "crates" / "chat" / "src" / "testdata_gemma4.jinja")
    s = Server("--model", model, "--chat-template-file", template)
    try:
        assert "KV ours kv8:kv8" in s.ready_line, s.ready_line
        c = client(s)
        message, call, _ = forced_city_call(c, parallel_tool_calls=False, max_tokens=80)
        assert set(json.loads(call.function.arguments)) == {"city"}, call
        on = {"chat_template_kwargs": {"enable_thinking": True},
              "grammar": GEMMA4_THOUGHT_THEN_ANSWER}
        r = c.chat.completions.create(model="", messages=QUESTION, max_tokens=60, temperature=0,
                                      extra_body=on)
        m = r.choices[0].message
        assert m.reasoning_content and m.content and "channel" not in m.content, m
        s.wait_idle()
    finally:
        s.stop()


def test_granite_tool_calls():
    """Granite 3.3's own template on SmolLM2 (calls as a JSON list after
    `<|tool_call|>`): a required call is forced in that shape and read back,
    streamed as written; two calls the model writes under `auto`, one in
    Granite's own key order (arguments first), are both read."""
    s = template_server("testdata_granite33.jinja")
    try:
        c = client(s)
        message, call, ask = forced_city_call(c, parallel_tool_calls=False, max_tokens=60)
        assert set(json.loads(call.function.arguments)) == {"city"}
        two = ('<\\|tool_call\\|>\\[\\{"arguments": \\{"city": "Rome"\\}, "name": "get_weather"\\}, '
               '\\{"name": "get_weather", "arguments": \\{"city": "Oslo"\\}\\}\\]')
        two_cities_under_auto(c, ask, two, max_tokens=150)
        s.wait_idle()
    finally:
        s.stop()


def test_nemotron_tool_calls():
    """Nemotron Nano 2's own template on SmolLM2 (calls as a JSON list in
    `<TOOLCALL>` tags; its prompt opens a thinking block): a required call
    is forced after the thinking, which a budget of 0 closes at once, and
    read back, streamed as written; no thought but the close's newline."""
    s = template_server("testdata_nemotron_nano2.jinja")
    try:
        c = client(s)
        message, call, _ = forced_city_call(c, parallel_tool_calls=False, max_tokens=80,
                                            extra_body={"thinking_token_budget": 0})
        assert set(json.loads(call.function.arguments)) == {"city"}
        # The forced close is "\n</think>\n\n": its newline is all the thinking.
        assert message.reasoning_content == "\n", message
        s.wait_idle()
    finally:
        s.stop()


def test_gpt_oss_harmony(grpc_api):
    """gpt-oss's own template (OpenAI's harmony format) on SmolLM2: a
    required call is forced as a message to `functions.NAME` and read back,
    streamed as written and over gRPC; thinking in the `analysis` channel
    and the `final` answer are split alike whole, streamed and in the
    Responses API; a thinking budget closes the analysis into the final
    message; an effort level reaches the template as `reasoning_effort`; and
    the thinking before a call goes back to the template with the call."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    s = template_server("testdata_gpt_oss.jinja")
    try:
        c = client(s)
        params, msgs = CITY_PARAMS, CITY_ASK
        message, call, _ = forced_city_call(c, max_tokens=80)
        assert set(json.loads(call.function.arguments)) == {"city"}
        with grpc.insecure_channel(s.grpc) as ch:
            out = list(pbg.InferenceStub(ch).Generate(pb.GenerateRequest(
                chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=msgs[0]["content"])]),
                max_tokens=80, tools=[pb.Tool(name="get_weather", parameters=json.dumps(params))],
                tool_choice="required")))
        deltas = [d for m in out for d in m.tool_calls]
        assert deltas[0].name == "get_weather"
        assert "".join(d.arguments for d in deltas) == call.function.arguments

        # Thinking, then the answer, written in harmony (a regex holds the
        # model to the format, which SmolLM2 does not know).
        head = r"<\|channel\|>analysis<\|message\|>"
        final = r"<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>[a-z ]{1,40}"
        count = [{"role": "user", "content": "Count from one to fifty in words."}]
        free = dict(model="", messages=count, temperature=0, max_tokens=100,
                    extra_body={"regex": head + "[a-z ]*" + final})
        whole = c.chat.completions.create(**free).choices[0].message
        thought, answer = whole.reasoning_content, whole.content
        assert thought and answer and "<|" not in thought + answer, whole
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in c.chat.completions.create(**free, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for k in streamed:
                streamed[k] += (getattr(delta, k, None) or "") if delta else ""
        assert streamed == {"reasoning_content": thought, "content": answer}
        r = c.responses.create(model="", input=count[0]["content"], temperature=0,
                               max_output_tokens=100, extra_body={"regex": free["extra_body"]["regex"]})
        assert [o.type for o in r.output] == ["reasoning", "message"], r
        assert r.output[0].content[0].text == thought and r.output_text == answer

        # A budget of 2 thinking tokens (the header's last, one more): the
        # free thought's first token, then the final message.
        budgeted = c.chat.completions.create(**dict(free, extra_body=dict(
            free["extra_body"], thinking_token_budget=2))).choices[0].message
        assert budgeted.reasoning_content and budgeted.content, budgeted
        assert thought.startswith(budgeted.reasoning_content)
        assert len(budgeted.reasoning_content) < len(thought)
        # A schema holds the final message only: thinking first is free.
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": params}}
        held = c.chat.completions.create(model="", messages=count, temperature=0, max_tokens=150,
                                         response_format=fmt,
                                         extra_body={"thinking_token_budget": 2}).choices[0].message
        assert set(json.loads(held.content)) == {"city"}, held
        assert "<|" not in (held.reasoning_content or "") + held.content, held
        # `minimal` effort: a budget of 0 and the template told `low`.
        minimal = c.chat.completions.create(**free, reasoning_effort="minimal").choices[0].message
        by_hand = c.chat.completions.create(**dict(free, extra_body=dict(
            free["extra_body"], thinking_token_budget=0,
            chat_template_kwargs={"reasoning_effort": "low"}))).choices[0].message
        assert minimal.reasoning_content is None and minimal.content == by_hand.content
        prompts = [post_json(s, "/tokenize", {"messages": count, "return_token_strs": True,
                                              "chat_template_kwargs": kw})[1]["token_strs"]
                   for kw in ({"reasoning_effort": "low"}, {})]
        assert "Reasoning: low" in "".join(prompts[0]) and "Reasoning: medium" in "".join(prompts[1])

        # The thinking before a call goes back with it; the result follows.
        follow = msgs + [
            {"role": "assistant", "tool_calls": [call.model_dump()],
             "reasoning_content": "Need the weather."},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]
        status, t = post_json(s, "/tokenize", {"messages": follow, "return_token_strs": True})
        text = "".join(t["token_strs"])
        assert status == 200, t
        turn = ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                + json.dumps(json.loads(call.function.arguments)) + "<|call|>")
        assert turn in text, text
        assert text.endswith('<|channel|>commentary<|message|>"18 C"<|end|><|start|>assistant'), text
        # A preamble and thinking on one call (the template refuses both):
        # the preamble joins the thinking.
        said = [dict(m, content="Let me look.") if m["role"] == "assistant" else m for m in follow]
        status, t2 = post_json(s, "/tokenize", {"messages": said, "return_token_strs": True})
        assert status == 200, t2
        assert "analysis<|message|>Need the weather.\n\nLet me look.<|end|>" in "".join(t2["token_strs"])
        # gRPC's `ChatMessage.reasoning` reaches the template alike.
        args = call.function.arguments
        grpc_follow = [
            pb.ChatMessage(role="user", content=msgs[0]["content"]),
            pb.ChatMessage(role="assistant", reasoning="Need the weather.", tool_calls=[
                pb.ToolCall(id=call.id, name="get_weather", arguments=args)]),
            pb.ChatMessage(role="tool", tool_call_id=call.id, content="18 C"),
        ]
        with grpc.insecure_channel(s.grpc) as ch:
            done = list(pbg.InferenceStub(ch).Generate(pb.GenerateRequest(
                chat=pb.ChatMessages(messages=grpc_follow), max_tokens=1)))[-1]
        assert done.usage.prompt_tokens == t["count"]
        _, bare = post_json(s, "/tokenize", {"messages": [
            dict(m, reasoning_content=None) if m["role"] == "assistant" else m for m in follow]})
        assert bare["count"] < t["count"]
        s.wait_idle()
    finally:
        s.stop()


def test_each_api_switches_thinking_off(think_server):
    """Asking for no thinking (chat's `reasoning_effort: "none"`, the
    Responses API's `reasoning.effort: "none"`, Anthropic's `thinking:
    {"type": "disabled"}`) sets the template's own switch
    (`enable_thinking: false`): each prompt, and each count of it, is the
    one `chat_template_kwargs` gives; explicit template arguments win."""
    import anthropic

    s = think_server
    c = client(s)
    hi = [{"role": "user", "content": "Hi"}]
    off = post_json(s, "/tokenize", {"messages": hi,
                                     "chat_template_kwargs": {"enable_thinking": False}})[1]["count"]
    on = post_json(s, "/tokenize", {"messages": hi})[1]["count"]
    assert off > on
    r = c.chat.completions.create(model="", messages=hi, max_tokens=1, reasoning_effort="none")
    assert r.usage.prompt_tokens == off
    r = c.chat.completions.create(model="", messages=hi, max_tokens=1, reasoning_effort="none",
                                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.usage.prompt_tokens == on
    none = {"effort": "none"}
    resp = c.responses.create(model="", input="Hi", max_output_tokens=1, reasoning=none)
    assert resp.usage.input_tokens == off
    assert c.responses.input_tokens.count(model="", input="Hi", reasoning=none).input_tokens == off
    a = anthropic.Anthropic(base_url=s.http, api_key="k", max_retries=0)
    m = a.messages.create(model="", max_tokens=1, messages=hi, thinking={"type": "disabled"})
    assert m.usage.input_tokens == off
    counted = a.messages.count_tokens(model="", messages=hi, thinking={"type": "disabled"})
    assert counted.input_tokens == off
    assert a.messages.count_tokens(model="", messages=hi).input_tokens == on
    s.wait_idle()


def test_a_reasoning_models_thinking_is_split_from_its_answer(grpc_api, think_server):
    """With a template that knows `<think>`, a chat's leading thinking block
    goes to `reasoning_content` (chat completions, whole and streamed) or a
    `reasoning` item (the Responses API), the answer to `content`; gRPC
    gives the raw text they were split from, or, with `split_reasoning`,
    the same split."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    c = client(think_server)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model="", messages=ask, max_tokens=80, temperature=0)
    g = {"grammar": THINK_THEN_ANSWER}
    r = c.chat.completions.create(**kw, extra_body=g)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    thought, answer = msg.reasoning_content, msg.content
    assert thought and answer and "<think>" not in thought + answer
    with grpc.insecure_channel(think_server.grpc) as ch:
        stub = pbg.InferenceStub(ch)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ask[0]["content"])])
        raw = "".join(m.text for m in stub.Generate(pb.GenerateRequest(
            chat=chat, max_tokens=80, constraint=pb.Constraint(lark=THINK_THEN_ANSWER)
        )))
        # Asked to, gRPC splits it too.
        split = list(stub.Generate(pb.GenerateRequest(
            chat=chat, max_tokens=80, constraint=pb.Constraint(lark=THINK_THEN_ANSWER),
            split_reasoning=True,
        )))
    assert raw == f"<think>{thought}</think>\n\n{answer}"
    assert "".join(m.reasoning for m in split) == thought
    assert "".join(m.text for m in split) == answer
    assert sum(bool(m.reasoning) for m in split) > 1

    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body=g))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer

    # The Responses API: a reasoning item, then the message.
    rk = dict(model="", input=ask[0]["content"], max_output_tokens=80, temperature=0, extra_body=g)
    resp = c.responses.create(**rk)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == thought
    assert resp.output_text == answer
    with c.responses.stream(**rk) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == answer

    # No thinking block: all answer, no reasoning.
    r = c.chat.completions.create(**kw, extra_body={"regex": "Paris is [a-z ]{3,20}\\."})
    assert r.choices[0].message.content.startswith("Paris is ")
    assert r.choices[0].message.reasoning_content is None
    think_server.wait_idle()


def test_a_thinking_budget_closes_the_block(grpc_api, server, think_server):
    """A thinking budget (gRPC's `thinking_budget`, vLLM's
    `thinking_token_budget`, Anthropic's `budget_tokens`, an effort level):
    once the model has thought that many tokens, `\\n</think>\\n\\n` is
    forced and it answers. Greedy, the output is exactly the unbudgeted
    thought's first tokens, the close's tokens, then what the model writes
    after those tokens (a generation from them); every API gives the same
    split. A budget a grammar's thinking cannot take changes nothing."""
    import anthropic

    pb, plain_stub, meta = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    ask = "Why is the sky blue?"
    opened = {"open_thinking": True}  # the prompt opens the block, as DeepSeek-R1's
    n, budget = 40, 8
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ask)])
    with grpc.insecure_channel(think_server.grpc) as ch:
        stub = pbg.InferenceStub(ch)

        def gen(**kw):
            kw.setdefault("chat", chat)
            kw.setdefault("chat_template_kwargs", json.dumps(opened))
            kw.setdefault("max_tokens", n)
            out = list(stub.Generate(pb.GenerateRequest(**kw)))
            return [t for m in out for t in m.token_ids], out

        free, _ = gen()
        capped, out = gen(thinking_budget=budget)
        _, split = gen(thinking_budget=budget, split_reasoning=True)
        close = list(stub.Tokenize(pb.TokenizeRequest(text="\n</think>\n\n")).ids)
        status, p = post_json(think_server, "/tokenize", {
            "messages": [{"role": "user", "content": ask}], "chat_template_kwargs": opened})
        assert status == 200
        head = capped[: budget + len(close)]
        after, _ = gen(chat=None, chat_template_kwargs="",
                       tokens=pb.TokenIds(ids=p["tokens"] + head), max_tokens=n - len(head))
        # Without a budget SmolLM2 never closes the block by itself.
        status, d = post_json(think_server, "/detokenize", {"tokens": free})
        assert "</think>" not in d["prompt"]
        at0, _ = gen(thinking_budget=0)
    assert capped[:budget] == free[:budget]
    assert capped[budget: budget + len(close)] == close
    assert capped[budget + len(close):] == after and after
    assert at0[: len(close)] == close
    raw = "".join(m.text for m in out)
    thought = "".join(m.reasoning for m in split)
    answer = "".join(m.text for m in split)
    assert raw.startswith(thought + "</think>") and thought.endswith("\n")
    assert answer and raw.endswith(answer)

    # The same split on each API: chat (whole and streamed), an effort
    # level (`--reasoning-budgets low=8`), the Responses API, Anthropic's.
    c = client(think_server)
    msgs = [{"role": "user", "content": ask}]
    kw = dict(model="", messages=msgs, max_tokens=n, temperature=0)
    tk = {"chat_template_kwargs": opened}
    for body in ({"thinking_token_budget": budget}, {}):
        extra = dict(tk, **body)
        r = c.chat.completions.create(**kw, extra_body=extra,
                                      **({} if body else {"reasoning_effort": "low"}))
        m = r.choices[0].message
        assert (m.reasoning_content, m.content) == (thought, answer), body
    deltas = [ch.choices[0].delta for ch in c.chat.completions.create(
        **kw, stream=True, extra_body=dict(tk, thinking_token_budget=budget)) if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    resp = c.responses.create(model="", input=ask, max_output_tokens=n, temperature=0,
                              reasoning={"effort": "low"}, extra_body=tk)
    assert resp.reasoning.effort == "low"
    assert resp.output[0].content[0].text == thought and resp.output_text == answer
    a = anthropic.Anthropic(base_url=think_server.http, api_key="k", max_retries=0)
    am = a.messages.create(model="", max_tokens=n, messages=msgs,
                           thinking={"type": "enabled", "budget_tokens": budget},
                           extra_body=dict(tk, temperature=0))
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in am.content] == [
        ("thinking", thought), ("text", answer)]

    # A grammar that writes the thinking and cannot take the close keeps
    # its course: the budget changes nothing.
    g = {"grammar": THINK_THEN_ANSWER}
    gk = dict(model="", messages=msgs, max_tokens=80, temperature=0)
    want = c.chat.completions.create(**gk, extra_body=g).choices[0].message
    for b in (3, 1000):
        got = c.chat.completions.create(**gk, extra_body=dict(g, thinking_token_budget=b))
        assert got.choices[0].message == want

    # An unknown level, or a budget for a model that does not think: 400s.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"
    assert "minimal, low" in e.value.body["message"]
    plain = client(server)
    for extra in ({"reasoning_effort": "low"}, {"thinking_token_budget": 4}):
        with pytest.raises(openai.BadRequestError) as e:
            plain.chat.completions.create(model="", messages=msgs, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra)), extra
    with pytest.raises(grpc.RpcError) as e:
        list(plain_stub.Generate(pb.GenerateRequest(chat=chat, max_tokens=4, thinking_budget=4),
                                 metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "thinking_budget" in e.value.details()
    think_server.wait_idle()
    server.wait_idle()


def test_structured_output_follows_the_thinking(grpc_api, think_server):
    """A reasoning model thinks freely, then its answer is held to the
    request's schema: with the block opened by the prompt (as DeepSeek-R1's)
    and a budget of 8 tokens, the thought is exactly the unconstrained
    budgeted thought, and the answer after it is JSON of the schema, on
    chat completions (whole and streamed) and gRPC."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    c = client(think_server)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    opened = {"open_thinking": True}
    schema = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 40}},
              "required": ["reason"], "additionalProperties": False}
    kw = dict(model="", messages=ask, max_tokens=60, temperature=0)
    free = c.chat.completions.create(**kw, extra_body={
        "chat_template_kwargs": opened, "thinking_token_budget": 8}).choices[0].message
    fmt = {"type": "json_schema", "json_schema": {"name": "why", "schema": schema, "strict": True}}
    extra = {"chat_template_kwargs": opened, "thinking_token_budget": 8}
    r = c.chat.completions.create(**kw, response_format=fmt, extra_body=extra)
    m = r.choices[0].message
    assert m.reasoning_content == free.reasoning_content and m.reasoning_content, (m, free)
    assert set(json.loads(m.content)) == {"reason"}, m.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in c.chat.completions.create(**kw, response_format=fmt, extra_body=extra, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for k in streamed:
            streamed[k] += (getattr(delta, k, None) or "") if delta else ""
    assert streamed == {"reasoning_content": m.reasoning_content, "content": m.content}
    with grpc.insecure_channel(think_server.grpc) as ch:
        out = list(pbg.InferenceStub(ch).Generate(pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ask[0]["content"])]),
            chat_template_kwargs=json.dumps(opened), max_tokens=60, thinking_budget=8,
            split_reasoning=True,
            constraint=pb.Constraint(json_schema=pb.JsonSchema(schema=json.dumps(schema), strict=True)))))
    assert "".join(o.reasoning for o in out) == m.reasoning_content
    assert "".join(o.text for o in out) == m.content
    think_server.wait_idle()


# ChatML for SmolLM2 whose thinking is in Mistral's `[THINK]` tags (as
# Magistral's); `open_thinking` opens the block in the prompt.
CHATML_SQUARE_THINK = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if open_thinking is defined and open_thinking -%}{{ '[THINK]\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def test_square_thinking_tags_split_and_budget(grpc_api, tmp_path):
    """A template whose model thinks in `[THINK]…[/THINK]` (Mistral's
    reasoning models): the block is split off as `reasoning_content`, and a
    thinking budget closes it with `\\n[/THINK]\\n\\n`."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    path = tmp_path / "square.jinja"
    path.write_text(CHATML_SQUARE_THINK)
    s = Server("--chat-template-file", str(path))
    try:
        c = client(s)
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        grammar = THINK_THEN_ANSWER.replace('"<think>"', '"[THINK]"').replace(
            '"</think>', '"[/THINK]')
        r = c.chat.completions.create(model="", messages=ask, max_tokens=80, temperature=0,
                                      extra_body={"grammar": grammar})
        m = r.choices[0].message
        assert m.reasoning_content and m.content and "[THINK]" not in m.reasoning_content + m.content
        with grpc.insecure_channel(s.grpc) as ch:
            stub = pbg.InferenceStub(ch)
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ask[0]["content"])])
            raw = "".join(x.text for x in stub.Generate(pb.GenerateRequest(
                chat=chat, max_tokens=80, constraint=pb.Constraint(lark=grammar))))
            assert raw == f"[THINK]{m.reasoning_content}[/THINK]\n\n{m.content}"
            close = list(stub.Tokenize(pb.TokenizeRequest(text="\n[/THINK]\n\n")).ids)
            opened = json.dumps({"open_thinking": True})
            out = list(stub.Generate(pb.GenerateRequest(
                chat=chat, max_tokens=30, chat_template_kwargs=opened, thinking_budget=6,
                split_reasoning=True)))
            ids = [t for x in out for t in x.token_ids]
            assert ids[6: 6 + len(close)] == close, ids
            thought = "".join(x.reasoning for x in out)
            assert thought.endswith("\n") and "[/THINK]" not in thought
        s.wait_idle()
    finally:
        s.stop()


def test_min_tokens_holds_off_the_end(server, grpc_api):
    """vLLM's `min_tokens`: until that many tokens, what would end the
    output (its end-of-generation token, a stop string) does not. Greedy,
    the output goes on past where it ended, from the same text; gRPC's
    `min_tokens` gives the same; above max_tokens it is a 400."""
    pb, stub, meta = grpc_api
    c = client(server)
    kw = dict(model="", messages=QUESTION, max_tokens=80, temperature=0)
    short = c.chat.completions.create(**kw)
    k = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and k < 60, short
    text = short.choices[0].message.content
    at_least = {"min_tokens": k + 10}
    longer = c.chat.completions.create(**kw, extra_body=at_least)
    assert longer.usage.completion_tokens >= k + 10
    assert longer.choices[0].message.content.startswith(text)
    assert len(longer.choices[0].message.content) > len(text)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(**kw, stream=True, extra_body=at_least) if ch.choices)
    assert streamed == longer.choices[0].message.content
    # A stop string met early does not stop it.
    word = text.split()[1]
    r = c.chat.completions.create(**kw, stop=[word], extra_body=at_least)
    assert r.choices[0].message.content.startswith(text), r.choices[0].message.content
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION])
    msgs = list(stub.Generate(pb.GenerateRequest(chat=chat, max_tokens=80, min_tokens=k + 10),
                              metadata=meta))
    assert "".join(m.text for m in msgs) == longer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", messages=QUESTION, max_tokens=5, extra_body={"min_tokens": 6})
    assert e.value.body["param"] == "min_tokens"
    server.wait_idle()


def test_the_stop_string_that_ended_a_request_is_named(server, grpc_api):
    """gRPC's `stop_sequence` and vLLM's `stop_reason` (chat, whole and
    streamed) name the stop string that ended the output."""
    pb, stub, meta = grpc_api
    c = client(server)
    text = c.chat.completions.create(model="", messages=QUESTION, max_tokens=12, temperature=0).choices[0].message.content
    word = text.split()[1]
    r = c.chat.completions.create(model="", messages=QUESTION, max_tokens=12, temperature=0, stop=["qqq", word])
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", word)
    msgs = list(stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION]),
        max_tokens=12, stop=["qqq", word],
    ), metadata=meta))
    assert msgs[-1].stop_sequence == word and msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(m.text for m in msgs) == r.choices[0].message.content
    msgs = list(stub.Generate(pb.GenerateRequest(prompt="One, two,", max_tokens=2), metadata=meta))
    assert msgs[-1].stop_sequence == ""
    # vLLM's `include_stop_str_in_output`: the stop string ends the text,
    # whole and streamed, and on the Responses API.
    keep = {"include_stop_str_in_output": True}
    kw = dict(model="", messages=QUESTION, max_tokens=12, temperature=0, stop=["qqq", word])
    r2 = c.chat.completions.create(**kw, extra_body=keep)
    assert r2.choices[0].message.content == r.choices[0].message.content + word
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(**kw, stream=True, extra_body=keep) if ch.choices)
    assert streamed == r2.choices[0].message.content
    resp = c.responses.create(model="", instructions=QUESTION[0]["content"],
                              input=QUESTION[1]["content"], max_output_tokens=12, temperature=0,
                              extra_body={"stop": ["qqq", word], **keep})
    assert resp.output_text == r2.choices[0].message.content
    msgs = list(stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION]),
        max_tokens=12, stop=["qqq", word], include_stop_str_in_output=True,
    ), metadata=meta))
    assert "".join(m.text for m in msgs) == r2.choices[0].message.content


def test_claude_gets_thinking_blocks(think_server):
    """Anthropic's Messages API: a reasoning model's thinking is a
    `thinking` block before the text, whole and streamed, the same split
    as the chat completion's."""
    import anthropic

    a = anthropic.Anthropic(base_url=think_server.http, api_key="k", max_retries=0)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    g = {"grammar": THINK_THEN_ANSWER, "temperature": 0}
    chat = client(think_server).chat.completions.create(
        model="", messages=ask, max_tokens=80, extra_body=g
    ).choices[0].message
    m = a.messages.create(model="", max_tokens=80, messages=ask, extra_body=g)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (chat.reasoning_content, chat.content)
    assert m.stop_reason == "end_turn"
    with a.messages.stream(model="", max_tokens=80, messages=ask, extra_body=g) as st:
        final = st.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", chat.reasoning_content), ("text", chat.content)
    ]
    think_server.wait_idle()
