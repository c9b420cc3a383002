"""Structured output through the real `openai` client (and grpcio): every
sampled output validates against its JSON schema, checked by `jsonschema`.

Numbers carry `multipleOf` (a precision, as a price has cents): a plain
`number` lets a sampled model write digits until `max_tokens`, which no
constraint can stop without changing what the schema means.

`SILICEO_SCHEMA_RUNS` sets the generations per schema on SmolLM2 (default
50); `SILICEO_SCHEMA_RUNS_QWEN` on Qwen2.5-Coder-1.5B (default 10 here, as a
1.5B model on CI's two cores costs about a second per output token batch;
`cargo xtask test-python` with SILICEO_SCHEMA_RUNS_QWEN=50 runs the full
count).
"""

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import grpc
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from conftest import Server, client, model_file

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    "palette": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow", "black"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 5,
            },
        },
        "required": ["colors", "scores"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "title": {"type": "string", "maxLength": 30},
            "in_stock": {"type": "boolean"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
        },
        "required": ["id", "title", "in_stock"],
        "additionalProperties": False,
    },
    "place": {
        "type": "object",
        "properties": {
            "latitude": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
            "longitude": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001},
            "elevation_m": {"type": "integer", "minimum": -500, "maximum": 9000},
        },
        "required": ["latitude", "longitude", "elevation_m"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "person": "Invent a person and give their name, age and address as JSON.",
    "sentiment": "Classify the sentiment of: 'The delivery was late but the food was great.'",
    "palette": "Pick a few colours for a logo and score them, as JSON.",
    "product": "Describe a product of a hardware shop as JSON.",
    "place": "Give the coordinates and elevation of a mountain village as JSON.",
}


def validate(text: str, schema: dict):
    """`jsonschema` on decimals: with floats, 19.99 is not a multiple of 0.01."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    jsonschema.validate(json.loads(text, parse_float=Decimal), exact)


def read_stream(chunks, part) -> tuple[list, str | None]:
    """`part(delta)` of every streamed choice delta, and the finish reason."""
    parts, finish = [], None
    for ch in chunks:
        for cc in ch.choices:
            parts.extend(part(cc.delta))
            finish = cc.finish_reason or finish
    return parts, finish


def response_format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def generate_all(server, runs: int, max_tokens: int) -> list[str]:
    """`runs` sampled generations per schema, 8 at a time; returns failures."""
    c = client(server, timeout=600)
    model = c.models.list().data[0].id
    jobs = [(name, i) for name in SCHEMAS for i in range(runs)]

    def one(job):
        name, i = job
        r = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[name]}],
            response_format=response_format(name),
            temperature=0.8,
            seed=1000 + i,
            max_tokens=max_tokens,
        )
        choice = r.choices[0]
        text = choice.message.content
        try:
            validate(text, SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{name}#{i} ({choice.finish_reason}): {text!r}: {e}"
        if choice.finish_reason != "stop":
            return f"{name}#{i} finished with {choice.finish_reason}: {text!r}"
        return None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    failures = [r for r in results if r]
    print(f"{len(jobs) - len(failures)} of {len(jobs)} outputs validate")
    return failures


def test_sampled_outputs_validate_on_smollm2(server):
    runs = int(os.environ.get("SILICEO_SCHEMA_RUNS", "50"))
    assert generate_all(server, runs, 300) == []
    server.wait_idle()


@pytest.fixture(scope="module")
def qwen_server():
    s = Server("--model", model_file("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "--spec"))
    yield s
    s.stop()


def test_sampled_outputs_validate_on_qwen(qwen_server):
    runs = int(os.environ.get("SILICEO_SCHEMA_RUNS_QWEN", "10"))
    assert generate_all(qwen_server, runs, 300) == []
    qwen_server.wait_idle()


def test_json_object_streamed_regex_and_grammar(server):
    c = client(server)
    model = c.models.list().data[0].id
    # json_object bounds nothing: sampled, this small model can write one
    # long string until max_tokens. Greedy, it closes its object.
    chunks = c.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Give a JSON object with a cat's name and age."},
        ],
        response_format={"type": "json_object"},
        stream=True,
        max_tokens=300,
        temperature=0,
    )
    parts, finish = read_stream(chunks, lambda d: [d.content or ""])
    text = "".join(parts)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict), text

    date = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "When did Apollo 11 land on the Moon?"}],
        extra_body={"regex": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
        temperature=1.0,
        seed=1,
        max_tokens=20,
    ).choices[0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.message.content), date
    assert date.finish_reason == "stop"

    lark = 'start: ("yes" | "no") ", because " /[a-z ]{1,30}/ "."'
    answer = c.completions.create(
        model=model,
        prompt="Q: Is the sea salty?\nA:",
        extra_body={"grammar": lark},
        temperature=0.8,
        seed=2,
        max_tokens=40,
    ).choices[0]
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", answer.text), answer
    assert answer.finish_reason == "stop"
    server.wait_idle()


def test_bad_constraints_are_400_naming_the_field(server):
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}, "strict": True},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"regex": "([a-z"}}, "regex"),
        ({"extra_body": {"grammar": "root ::= \"a\""}}, "grammar"),
        ({"extra_body": {"regex": "a", "grammar": 'start: "a"'}}, "grammar"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="", messages=msgs, max_tokens=5, **kw)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, (kw, e.value.body)
    # An unsupported keyword without strict is ignored, and the server serves on.
    r = c.chat.completions.create(
        model="",
        messages=msgs,
        max_tokens=30,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "uniqueItems": True}},
        },
    )
    assert isinstance(json.loads(r.choices[0].message.content), list)
    server.wait_idle()


def test_grpc_constraints(server, grpc_api):
    pb, stub, meta = grpc_api
    schema = json.dumps(SCHEMAS["sentiment"])
    req = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPTS["sentiment"])]),
        max_tokens=100,
        constraint=pb.Constraint(json_schema=pb.JsonSchema(schema=schema, strict=True)),
    )
    text = "".join(r.text for r in stub.Generate(req, metadata=meta))
    validate(text, SCHEMAS["sentiment"])
    bad = pb.GenerateRequest(prompt="hi", constraint=pb.Constraint(regex="(unclosed"))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "constraint.regex" in e.value.details()
    server.wait_idle()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "multipleOf": 0.01},
                    "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                },
                "required": ["amount", "from", "to"],
            },
        },
    },
]


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


PARIS = "What is the weather like in Paris right now?"


def chat_call(c, ask: str):
    """A greedy chat completion of `ask` with TOOLS, and its first call."""
    chat = c.chat.completions.create(
        model="", messages=[{"role": "user", "content": ask}], tools=TOOLS,
        temperature=0, max_tokens=80,
    )
    return chat, chat.choices[0].message.tool_calls[0]


def test_tool_calls_on_qwen(qwen_server):
    c = client(qwen_server, timeout=600)
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = c.chat.completions.create(model="", messages=ask, tools=TOOLS, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    validate(call.function.arguments, schema_of("get_weather"))
    assert "paris" in args["city"].lower()

    # `required` forces a call even where none is needed, with valid arguments.
    hello = [{"role": "user", "content": "Say hello to me."}]
    for i in range(3):
        r = c.chat.completions.create(
            model="", messages=hello, tools=TOOLS, tool_choice="required",
            temperature=0.7, seed=i, max_tokens=120,
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r
        for tc in calls:
            validate(tc.function.arguments, schema_of(tc.function.name))

    # Streamed, a call arrives as it is written: its name first, then its
    # arguments in many deltas, which the client's own accumulator joins
    # into exactly the call of the whole answer. Forced (a named function)
    # and unforced alike.
    named = {"type": "function", "function": {"name": "convert_currency"}}
    euros = [{"role": "user", "content": "I have 20 euros. How many dollars is that?"}]
    for messages, choice in [(euros, named), (ask, "auto")]:
        req = dict(
            model="", messages=messages, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, temperature=0, max_tokens=80,
        )
        whole = c.chat.completions.create(**req).choices[0]
        state = ChatCompletionStreamState()
        kinds = []
        for chunk in c.chat.completions.create(stream=True, **req):
            kinds.extend(e.type for e in state.handle_chunk(chunk))
        got = state.get_final_completion().choices[0]
        assert got.finish_reason == whole.finish_reason == "tool_calls", got
        assert len(got.message.tool_calls) == len(whole.message.tool_calls) == 1
        g, w = got.message.tool_calls[0].function, whole.message.tool_calls[0].function
        assert (g.name, g.arguments) == (w.name, w.arguments)
        assert kinds.count("tool_calls.function.arguments.delta") > 3, kinds
        validate(g.arguments, schema_of(g.name))

    # The answer goes back through the template as a tool message (tools
    # not offered again: this small coder model would call it once more).
    follow = ask + [
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
    ]
    r = c.chat.completions.create(
        model="", messages=follow, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40
    )
    assert r.choices[0].finish_reason == "stop"
    assert "18" in r.choices[0].message.content, r.choices[0].message.content
    qwen_server.wait_idle()


def test_grpc_tool_calls_on_qwen(qwen_server, grpc_protos):
    """Tools over gRPC: the call a chat completion makes comes in
    `tool_calls` deltas (the first with its id and name, then its arguments
    as written) with FINISH_REASON_TOOL_CALLS, and the tool's answer,
    sent back as an assistant message with the call and a tool message,
    gives the chat completion's answer exactly."""
    import grpc

    from conftest import API_KEY

    pb, pbg = grpc_protos
    meta = [("authorization", f"Bearer {API_KEY}")]
    c = client(qwen_server, timeout=600)
    ask = PARIS
    chat, want = chat_call(c, ask)
    tools = [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                     parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    with grpc.insecure_channel(qwen_server.grpc) as ch:
        stub = pbg.InferenceStub(ch)
        msgs = [pb.ChatMessage(role="user", content=ask)]
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=msgs), tools=tools, max_tokens=80)
        out = list(stub.Generate(req, metadata=meta))
        deltas = [d for r in out for d in r.tool_calls]
        assert out[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
        assert "".join(r.text for r in out) == (chat.choices[0].message.content or "")
        assert {d.index for d in deltas} == {0} and deltas[0].name == want.function.name
        assert deltas[0].id and all(not d.name for d in deltas[1:])
        assert len(deltas) > 3, deltas
        args = "".join(d.arguments for d in deltas)
        assert args == want.function.arguments

        answer = "18 degrees celsius and sunny"
        follow = msgs + [
            pb.ChatMessage(role="assistant", tool_calls=[
                pb.ToolCall(id=deltas[0].id, name=deltas[0].name, arguments=args)]),
            pb.ChatMessage(role="tool", tool_call_id=deltas[0].id, content=answer),
        ]
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=follow), tools=tools,
                                 tool_choice="none", max_tokens=40)
        text = "".join(r.text for r in stub.Generate(req, metadata=meta))
        turns = [
            {"role": "user", "content": ask},
            {"role": "assistant", "tool_calls": [{"id": deltas[0].id, "type": "function",
             "function": {"name": deltas[0].name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": deltas[0].id, "content": answer},
        ]
        r = c.chat.completions.create(model="", messages=turns, tools=TOOLS, tool_choice="none",
                                      temperature=0, max_tokens=40)
        assert text == r.choices[0].message.content and "18" in text

        # A named function is forced, as on HTTP.
        req = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Say hello.")]),
            tools=tools, tool_choice="convert_currency", parallel_tool_calls=False, max_tokens=80)
        out = list(stub.Generate(req, metadata=meta))
        deltas = [d for r in out for d in r.tool_calls]
        assert [d.name for d in deltas if d.name] == ["convert_currency"]
        validate("".join(d.arguments for d in deltas), schema_of("convert_currency"))
    qwen_server.wait_idle()


# The same tools as the Responses API takes them (flat).
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_call_functions_on_qwen(qwen_server):
    """The Responses API's function calls: the call a chat completion makes,
    as a `function_call` item; its output continues the kept conversation
    as the chat with a tool message does."""
    c = client(qwen_server, timeout=600)
    ask = PARIS
    chat, want = chat_call(c, ask)
    r = c.responses.create(
        model="", input=ask, tools=RESPONSE_TOOLS, temperature=0, max_output_tokens=80
    )
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert (call.name, call.arguments) == (want.function.name, want.function.arguments)
    assert call.call_id.startswith("call_") and call.status == "completed"

    # The tool's answer, after the kept call.
    answer = "18 degrees celsius and sunny"
    follow = c.responses.create(
        model="", previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": answer}],
        tools=RESPONSE_TOOLS, tool_choice="none", temperature=0, max_output_tokens=40,
    )
    assert "18" in follow.output_text, follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens > 0
    turns = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": r.output_text or None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": answer},
    ]
    chat = c.chat.completions.create(
        model="", messages=turns, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40
    )
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens

    # A named function, streamed through the client's helper.
    with c.responses.stream(
        model="", input="I have 20 euros. How many dollars is that?", tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "convert_currency"},
        parallel_tool_calls=False, temperature=0, max_output_tokens=80,
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["convert_currency"], final.output
    validate(calls[0].arguments, schema_of("convert_currency"))
    assert kinds.count("response.function_call_arguments.done") == 1
    # The arguments streamed as written, and equal to a whole response's.
    assert kinds.count("response.function_call_arguments.delta") > 3, kinds
    assert kinds[-1] == "response.completed"
    whole = c.responses.create(
        model="", input="I have 20 euros. How many dollars is that?", tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "convert_currency"},
        parallel_tool_calls=False, temperature=0, max_output_tokens=80,
    )
    want = [o for o in whole.output if o.type == "function_call"]
    assert [(w.name, w.arguments) for w in want] == [(c.name, c.arguments) for c in calls]
    qwen_server.wait_idle()


def test_claude_tool_use_on_qwen(qwen_server):
    """Anthropic's tool use: the call a chat completion makes, as a
    `tool_use` block; its `tool_result` continues the conversation as the
    chat with a tool message does."""
    import anthropic

    a = anthropic.Anthropic(base_url=qwen_server.http, api_key="k", max_retries=0, timeout=600)
    c = client(qwen_server, timeout=600)
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]
    ask = PARIS
    chat, want = chat_call(c, ask)
    greedy = {"temperature": 0}
    m = a.messages.create(
        model="", max_tokens=80, extra_body=greedy, tools=tools,
        messages=[{"role": "user", "content": ask}],
    )
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == want.function.name
    assert uses[0].input == json.loads(want.function.arguments)
    validate(json.dumps(uses[0].input), schema_of("get_weather"))

    answer = "18 degrees celsius and sunny"
    turns = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": answer}]},
    ]
    follow = a.messages.create(
        model="", max_tokens=40, extra_body=greedy, tools=tools, tool_choice={"type": "none"}, messages=turns
    )
    text = "".join(b.text for b in follow.content if b.type == "text")
    assert "18" in text, text
    prose = "".join(b.text for b in m.content if b.type == "text")
    chat = c.chat.completions.create(
        model="", tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40, messages=[
            {"role": "user", "content": ask},
            {"role": "assistant", "content": prose or None, "tool_calls": [
                {"id": uses[0].id, "type": "function",
                 "function": {"name": uses[0].name, "arguments": json.dumps(uses[0].input)}}]},
            {"role": "tool", "tool_call_id": uses[0].id, "content": answer},
        ],
    )
    assert text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens

    # A named tool, streamed through the client's helper.
    with a.messages.stream(
        model="", max_tokens=80, extra_body=greedy, tools=tools,
        tool_choice={"type": "tool", "name": "convert_currency", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "I have 20 euros. How many dollars is that?"}],
    ) as st:
        pieces = [e.partial_json for e in st if e.type == "input_json"]
        final = st.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["convert_currency"] and final.stop_reason == "tool_use"
    validate(json.dumps(uses[0].input), schema_of("convert_currency"))
    # The input streamed as written; it adds up to the input.
    assert len(pieces) > 3, pieces
    assert json.loads("".join(pieces)) == uses[0].input
    qwen_server.wait_idle()


def test_tools_on_a_model_without_a_tool_syntax_are_400(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=5
        )
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=5,
        )
    assert e.value.body["param"] == "tool_choice"
    # tool_choice none: no tools offered, a plain answer.
    r = c.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
        tool_choice="none", max_tokens=5,
    )
    assert r.choices[0].message.tool_calls is None


def test_fill_in_the_middle_on_qwen(qwen_server, server, grpc_api):
    """`/v1/completions` with `suffix`: the model writes what goes between the
    prompt and the suffix, from the prompt its FIM tokens make (the same
    prompt written out by hand gives the same answer). A model without FIM
    tokens refuses, naming `suffix`, on both protocols."""
    c = client(qwen_server, timeout=600)
    prefix, suffix = "def add(a, b):\n    ", "\n\n\nprint(add(2, 3))\n"
    r = c.completions.create(
        model="", prompt=prefix, suffix=suffix, max_tokens=4, temperature=0
    )
    assert r.choices[0].text == "return a + b", r
    by_hand = "<|fim_prefix|>" + prefix + "<|fim_suffix|>" + suffix + "<|fim_middle|>"
    r2 = c.completions.create(model="", prompt=by_hand, max_tokens=4, temperature=0)
    assert (r2.choices[0].text, r2.usage.prompt_tokens) == (
        r.choices[0].text,
        r.usage.prompt_tokens,
    )
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt=[1, 2], suffix=suffix, max_tokens=2)
    assert e.value.body["param"] == "suffix"
    qwen_server.wait_idle()
    # SmolLM2 has no FIM tokens.
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model="", prompt="a", suffix="b", max_tokens=2)
    assert e.value.body["param"] == "suffix"
    pb, stub, meta = grpc_api
    req = pb.GenerateRequest(infill=pb.Infill(prefix="a", suffix="b"), max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("suffix:"), e.value.details()
