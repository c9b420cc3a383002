"""Anthropic's Messages API (`/v1/messages`) through the real `anthropic`
client: its answers equal the chat completion of the same conversation
(greedy), whole and streamed through the client's helper; count_tokens
counts what runs; stop sequences, errors and keys as the client expects
them. Tool use runs on Qwen in test_structured.py; thinking blocks beside
the other reasoning tests in test_openai_api.py."""

import anthropic
import pytest

from conftest import API_KEY, QUESTION, client

SYSTEM, USER = QUESTION[0]["content"], QUESTION[1]["content"]


def claude(server, key=API_KEY, **kw) -> anthropic.Anthropic:
    """The `anthropic` client on `server` (the key goes in `x-api-key`)."""
    return anthropic.Anthropic(base_url=server.http, api_key=key, max_retries=0, **kw)


def test_a_message_is_the_chat_completion_of_its_conversation(server):
    a, c = claude(server), client(server)
    # (This SDK has no sampling parameters: greedy goes in the body.)
    ask = dict(model="", max_tokens=24, system=SYSTEM,
               messages=[{"role": "user", "content": USER}], extra_body={"temperature": 0})
    m = a.messages.create(**ask)
    chat = c.chat.completions.create(model="", messages=QUESTION, max_tokens=24, temperature=0)
    want = chat.choices[0]
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == want.message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert m.model == "SmolLM2-135M-Instruct.Q4_1"
    # The same through the client's stream helper, which checks the events.
    with a.messages.stream(**ask) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == final.content[0].text == m.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    assert final.usage.input_tokens == m.usage.input_tokens
    # count_tokens counts what a request runs on.
    n = a.messages.count_tokens(model="", system=SYSTEM, messages=ask["messages"])
    assert n.input_tokens == m.usage.input_tokens
    # A stop sequence ends it, named.
    word = m.content[0].text.split()[1]
    s = a.messages.create(**ask, stop_sequences=["qqq", word])
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", word)
    assert word not in s.content[0].text
    server.wait_idle()


def test_models_as_the_client_lists_them(server):
    import datetime

    a = claude(server)
    page = a.models.list()
    assert [m.id for m in page.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    m = page.data[0]
    assert (m.type, m.display_name, m.max_input_tokens) == ("model", m.id, 2048)
    assert m.created_at.tzinfo is not None
    assert abs(m.created_at.timestamp() - datetime.datetime.now(datetime.UTC).timestamp()) < 3600
    assert (page.has_more, page.first_id, page.last_id) == (False, m.id, m.id)
    assert a.models.retrieve(m.id).created_at == m.created_at


def test_errors_and_keys_as_the_client_expects_them(server):
    a = claude(server)
    ok = [{"role": "user", "content": "hi"}]
    bad = [
        (dict(extra_body={"temperature": 1.5}), "temperature"),
        (dict(output_config={"effort": "high"}), "output_config.effort"),
        (dict(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]),
         "messages[0].content[0].type"),
        (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (dict(max_tokens=5000), "max_tokens"),  # over the 2,048-token context
        # SmolLM2 does not think.
        (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    ]
    for kw, field in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(**{"model": "", "max_tokens": 4, "messages": ok, **kw})
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(field), e.value.body
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="claude-opus-4", max_tokens=4, messages=ok)
    with pytest.raises(anthropic.AuthenticationError):
        claude(server, key="wrong").messages.create(model="", max_tokens=4, messages=ok)
    # Bearer works too (`auth_token`), as for the OpenAI endpoints.
    b = anthropic.Anthropic(base_url=server.http, auth_token=API_KEY, max_retries=0)
    assert b.messages.create(model="", max_tokens=2, messages=ok).usage.output_tokens >= 1
    server.wait_idle()


def test_a_closed_message_stream_frees_its_kv(server):
    a = claude(server)
    with a.messages.stream(
        model="", max_tokens=1000,
        messages=[{"role": "user", "content": "Count from one to a thousand: one, two, three,"}],
        extra_body={"temperature": 0, "ignore_eos": True},
    ) as st:
        got = 0
        for _ in st.text_stream:
            got += 1
            if got == 5:
                break
        assert server.metrics()["siliceo_running_sequences"] == 1
    m = server.wait_idle(timeout=30)
    assert m["siliceo_kv_blocks_used"] == 0
