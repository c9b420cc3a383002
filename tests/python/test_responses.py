"""OpenAI's Responses API (`/v1/responses`) through the real `openai`
client: its answers equal the chat completion of the same conversation,
token for token (greedy), whole and streamed; `previous_response_id`
continues a kept conversation from the prefix cache; kept responses are
retrieved, listed and deleted; structured output parses into pydantic
models; errors name the field. Function calls run on Qwen in
test_structured.py."""

import json

import jsonschema
import openai
import pydantic
import pytest

from conftest import QUESTION, client

SYSTEM, USER = QUESTION[0]["content"], QUESTION[1]["content"]


def chat_text(c, messages, max_tokens):
    r = c.chat.completions.create(
        model="", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0], r.usage


def test_a_response_is_the_chat_completion_of_its_conversation(server):
    c = client(server)
    r = c.responses.create(
        model="", instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0
    )
    choice, usage = chat_text(c, QUESTION, 24)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == choice.message.content
    assert "Paris" in r.output_text
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    want = "completed" if choice.finish_reason == "stop" else "incomplete"
    assert r.status == want
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].status == want
    assert r.instructions == SYSTEM and r.max_output_tokens == 24

    # Items instead of instructions: the same conversation, the same answer.
    items = c.responses.create(
        model="",
        input=[
            {"role": "developer", "content": SYSTEM},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]},
        ],
        max_output_tokens=24,
        temperature=0,
    )
    assert items.output_text == r.output_text

    # Cut short: incomplete, with the reason.
    short = c.responses.create(
        model="", instructions=SYSTEM, input=USER, max_output_tokens=3, temperature=0
    )
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3
    assert r.output_text.startswith(short.output_text)
    server.wait_idle()


def test_streamed_events_build_the_same_response(server):
    c = client(server)
    whole = c.responses.create(
        model="", instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0
    )
    # Raw events: typed, numbered, in the order the API gives them.
    events = list(
        c.responses.create(
            model="", instructions=SYSTEM, input=USER, max_output_tokens=24,
            temperature=0, stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text
    assert last.usage.output_tokens == whole.usage.output_tokens
    assert last.id == events[0].response.id != whole.id

    # The client's stream helper, which checks the events' consistency
    # itself as it accumulates them.
    with c.responses.stream(
        model="", instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0
    ) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert text == final.output_text == whole.output_text
    server.wait_idle()


def test_previous_response_id_continues_from_the_cache(server):
    c = client(server)
    first = c.responses.create(
        model="", instructions=SYSTEM, input="My name is Ada. Say hello to me.",
        max_output_tokens=16, temperature=0,
    )
    second = c.responses.create(
        model="", instructions=SYSTEM, input="What is my name?",
        previous_response_id=first.id, max_output_tokens=16, temperature=0,
    )
    assert second.previous_response_id == first.id
    # The chat of both turns gives the same answer from the same prompt.
    turns = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    choice, usage = chat_text(c, turns, 16)
    assert second.output_text == choice.message.content
    assert second.usage.input_tokens == usage.prompt_tokens
    # The first turn's prompt came from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1

    # Counted beforehand: the prompt tokens each turn ran on.
    count = c.responses.input_tokens.count(
        model="", instructions=SYSTEM, input="What is my name?", previous_response_id=first.id)
    assert (count.object, count.input_tokens) == ("response.input_tokens", second.usage.input_tokens)
    assert c.responses.input_tokens.count(
        model="", instructions=SYSTEM, input="My name is Ada. Say hello to me.",
    ).input_tokens == first.usage.input_tokens

    # Kept: retrieved as it was answered, its input listed.
    got = c.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    items = c.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "What is my name?"
    assert items.has_more is False

    # Deleted: gone, and nothing continues from it.
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    for call in (c.responses.create, c.responses.input_tokens.count):
        with pytest.raises(openai.NotFoundError) as e:
            call(model="", input="Hi", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"
    # The second turn keeps the whole conversation on its own.
    third = c.responses.create(
        model="", input="Thanks.", previous_response_id=second.id,
        max_output_tokens=4, temperature=0,
    )
    assert third.usage.input_tokens > second.usage.input_tokens

    # store: false keeps nothing.
    gone = c.responses.create(model="", input="Hi", store=False, max_output_tokens=2)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)
    server.wait_idle()


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(server):
    """`truncation: auto`: a conversation over the 2,048-token context loses
    its oldest turns, whole (cut before a user message; the instructions
    stay), the fewest that make it fit beside `max_output_tokens`; without
    it the request is a 400. The count endpoint agrees, and a response that
    continues it sees the whole conversation again, truncated anew."""
    c = client(server)
    line = "The quick brown fox jumps over the lazy dog near the river bank. "
    turns = []
    for i in range(14):
        turns.append({"role": "user", "content": f"Note {i}: " + line * 12})
        turns.append({"role": "assistant", "content": f"Noted {i}."})
    turns.append({"role": "user", "content": "Which note came last?"})
    kw = dict(model="", instructions=SYSTEM, max_output_tokens=16)

    def count(items):
        return c.responses.input_tokens.count(model="", instructions=SYSTEM, input=items).input_tokens

    assert count(turns) + 16 > 2048
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**kw, input=turns)
    assert e.value.body["param"] == ("input" if count(turns) >= 2048 else "max_output_tokens")
    # The fewest whole turns dropped: cut before user message `k`.
    cuts = [i for i, t in enumerate(turns) if t["role"] == "user"]
    k = next(i for i in cuts if count(turns[i:]) + 16 <= 2048)
    assert k > 0 and count(turns[cuts[cuts.index(k) - 1]:]) + 16 > 2048
    r = c.responses.create(**kw, input=turns, truncation="auto", temperature=0)
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == count(turns[k:])
    counted = c.responses.input_tokens.count(
        model="", instructions=SYSTEM, input=turns, truncation="auto")
    assert counted.input_tokens == r.usage.input_tokens
    # What fits is not cut.
    short = c.responses.create(**kw, input=turns[-3:], truncation="auto", temperature=0)
    assert short.usage.input_tokens == count(turns[-3:])
    # Continued: the kept conversation is whole, and is cut again.
    more = c.responses.create(**kw, input="And the first?", previous_response_id=r.id,
                              truncation="auto", temperature=0)
    assert more.status in ("completed", "incomplete") and more.usage.input_tokens + 16 <= 2048
    server.wait_idle()


def test_input_items_page_in_either_order(server):
    c = client(server)
    texts = [f"Note {i}." for i in range(5)]
    r = c.responses.create(
        model="", input=[{"role": "user", "content": t} for t in texts], max_output_tokens=1
    )
    newest = c.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in newest.data] == texts[:-3:-1]
    assert newest.has_more is True
    rest = c.responses.input_items.list(r.id, limit=10, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == texts[2::-1]
    assert rest.has_more is False
    asc = c.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in asc.data] == texts
    # The client pages on its own.
    assert [i.content[0].text for i in c.responses.input_items.list(r.id, limit=2)] == texts[::-1]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.input_items.list(r.id, limit=0)
    assert e.value.body["param"] == "limit"


def test_logprobs_equal_the_chat_completions(server):
    c = client(server)
    r = c.responses.create(
        model="", instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=3,
    )
    chat = c.chat.completions.create(
        model="", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(l.token, l.logprob) for l in got] == [(l.token, l.logprob) for l in want]
    assert [[(t.token, t.logprob) for t in l.top_logprobs] for l in got] == [
        [(t.token, t.logprob) for t in l.top_logprobs] for l in want
    ]
    # Streamed: each delta carries its tokens'.
    events = list(
        c.responses.create(
            model="", instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0,
            include=["message.output_text.logprobs"], top_logprobs=3, stream=True,
        )
    )
    streamed = [l.logprob for e in events if e.type == "response.output_text.delta" for l in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [l.logprob for l in done.logprobs] == [l.logprob for l in want]
    # A token whose text never showed (end of sequence) has no delta.
    assert streamed == [l.logprob for l in want][: len(streamed)] and len(streamed) >= len(want) - 1
    # Without asking, none.
    plain = c.responses.create(model="", input=USER, max_output_tokens=2, temperature=0)
    assert plain.output[0].content[0].logprobs == []


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=100)


def test_structured_output_parses_into_a_model(server):
    c = client(server)
    r = c.responses.parse(
        model="", input="Describe Paris as JSON.", text_format=City,
        max_output_tokens=200, temperature=0,
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)
    # The schema the client sent (its strict form) holds, sampled too.
    schema = City.model_json_schema()
    for seed in range(3):
        s = c.responses.create(
            model="", input="Describe a city as JSON.", max_output_tokens=200,
            temperature=1.0, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        )
        jsonschema.validate(json.loads(s.output_text), schema)
    # Streamed through the helper, parsed by the pydantic model.
    with c.responses.stream(
        model="", input="Describe Rome as JSON.", text_format=City,
        max_output_tokens=200, temperature=0,
    ) as st:
        final = st.get_final_response()
    assert isinstance(final.output_parsed, City)
    server.wait_idle()


def test_what_cannot_be_served_is_a_400_naming_the_field(server):
    c = client(server)
    bad = [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "input[0].content[0].type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "extra_body": {"n": 2}}, "n"),
        ({"input": "x", "extra_body": {"max_tokens": 5}}, "max_tokens"),
        ({"input": "x", "temperature": 5}, "temperature"),
        # Checked by the runtime, in this API's terms.
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="", **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="gpt-5", input="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_nothing")
    with pytest.raises(openai.NotFoundError):
        c.responses.delete("resp_nothing")
    # Still serving.
    assert c.responses.create(model="", input="Hi", max_output_tokens=2).usage.output_tokens >= 1
    server.wait_idle()


def test_a_closed_response_stream_frees_its_kv(server):
    c = client(server)
    stream = c.responses.create(
        model="", input="Count from one to a thousand: one, two, three,",
        max_output_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    got = 0
    for e in stream:
        got += e.type == "response.output_text.delta"
        if got == 5:
            break
    assert server.metrics()["siliceo_running_sequences"] == 1
    stream.close()
    m = server.wait_idle(timeout=30)
    assert m["siliceo_kv_blocks_used"] == 0


def test_background_responses_are_polled_and_cancelled(server):
    """`background: true` answers at once (in progress) and runs on; GET
    polls it to the same answer a foreground request gives. Cancelling one
    in progress stops it and frees its KV."""
    import time

    c = client(server)
    ask = dict(model="", instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0)
    fg = c.responses.create(**ask)
    bg = c.responses.create(**ask, background=True)
    assert bg.background is True and bg.status in ("queued", "in_progress")
    deadline = time.time() + 60
    r = bg
    while r.status in ("queued", "in_progress"):
        assert time.time() < deadline, r
        time.sleep(0.05)
        r = c.responses.retrieve(bg.id)
    assert (r.status, r.output_text) == (fg.status, fg.output_text)
    assert r.usage.output_tokens == fg.usage.output_tokens
    # Cancelling a finished one returns it as it is.
    assert c.responses.cancel(bg.id).status == fg.status

    long = c.responses.create(
        model="", input="Count from one to a thousand: one, two, three,", max_output_tokens=1000,
        temperature=0, background=True, extra_body={"ignore_eos": True},
    )
    deadline = time.time() + 60
    while server.metrics()["siliceo_running_sequences"] == 0:
        assert time.time() < deadline
        time.sleep(0.02)
    # Not continued while it runs.
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="", input="Go on.", previous_response_id=long.id)
    assert e.value.body["param"] == "previous_response_id"
    assert c.responses.cancel(long.id).status == "cancelled"
    m = server.wait_idle(timeout=30)
    assert m["siliceo_kv_blocks_used"] == 0
    assert c.responses.retrieve(long.id).status == "cancelled"

    # What background cannot do is named; a foreground response cannot be cancelled.
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="", input="x", background=True, store=False)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(fg.id)
    # Only a background response created with `stream` streams again.
    with pytest.raises(openai.BadRequestError) as e:
        list(c.responses.retrieve(bg.id, stream=True))
    assert e.value.body["param"] == "stream"
    server.wait_idle()


def test_a_streamed_background_response_is_resumed(server):
    """`background` with `stream`: the creator reads the events as they
    come, leaves, and the response runs on; `GET ?stream=true` resumes after
    the last event seen (`starting_after`), or replays all from the first.
    The events add up to the response a foreground request gives."""
    c = client(server)
    ask = dict(model="", instructions=SYSTEM, input=USER, max_output_tokens=40, temperature=0)
    fg = c.responses.create(**ask)
    stream = c.responses.create(**ask, background=True, stream=True)
    seen = []
    for e in stream:
        seen.append(e)
        if sum(x.type == "response.output_text.delta" for x in seen) == 3:
            break
    stream.close()
    rid = seen[0].response.id
    assert seen[0].type == "response.created" and seen[0].response.background is True
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == fg.output_text
    assert final.usage.output_tokens == fg.usage.output_tokens
    assert c.responses.retrieve(rid).output_text == fg.output_text
    # Replayed from the first event: the same events.
    again = list(c.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.with_raw_response.retrieve(rid, stream=True, starting_after=-1)
    assert e.value.body["param"] == "starting_after"

    # Cancelled while a client follows it: its stream ends, its KV is freed.
    long = c.responses.create(
        model="", input="Count from one to a thousand: one, two, three,", max_output_tokens=1000,
        temperature=0, background=True, stream=True, extra_body={"ignore_eos": True},
    )
    first = next(iter(long))
    follower = c.responses.retrieve(first.response.id, stream=True)
    got = 0
    for e in follower:
        got += e.type == "response.output_text.delta"
        if got == 5:
            break
    long.close()
    assert c.responses.cancel(first.response.id).status == "cancelled"
    list(follower)  # ends
    m = server.wait_idle(timeout=30)
    assert m["siliceo_kv_blocks_used"] == 0
    assert c.responses.retrieve(first.response.id).status == "cancelled"
