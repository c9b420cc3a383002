"""SMG in gRPC mode: the gateway tokenizes with the tokenizer our replicas
hand it (`GetTokenizer`: tokenizer.json made from the GGUF's vocabulary) and
calls their `vllm.grpc.engine.VllmEngine` service; under cache_aware it
routes on the blocks our prefix caches announce (`SubscribeKvEvents`)."""

import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

import grpc
import pytest
import tokenizers

from conftest import QUESTION, ROOT, Server, client, model_file, replica_set
from fleet import DOCUMENTS, MODEL, Gateway, kill_mid_run, served_by

REPLICAS = 2
# Texts whose tokens depend on every rule of a pre-tokenizer: digits,
# contractions, runs of spaces and newlines, punctuation, non-Latin scripts,
# and the chat template's special tokens.
TEXTS = [
    "The capital of France is Paris.",
    "It's 12,345.67 dollars -- isn't it?  Yes!!\n\n\tTabs\tand   spaces   ",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé: 東京タワー, Москва, καλημέρα 🌍🚀 ",
    "def f(x):\n    return x**2  # squares\n\n\n",
    "    leading spaces and trailing newlines\r\n\r\n",
    "a1b22c333d4444 0.5e-10 1e9 I'll we've they'd YOU'RE",
]


@pytest.fixture(scope="module")
def vllm_pb():
    """grpcio stubs compiled from our copy of SMG's engine protocol."""
    out = Path(tempfile.mkdtemp())
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
            f"--python_out={out}", f"--grpc_python_out={out}", "vllm/engine.proto",
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    from vllm import engine_pb2, engine_pb2_grpc

    return engine_pb2, engine_pb2_grpc


def fetch_tokenizer(server: Server, vllm_pb) -> dict[str, bytes]:
    """`GetTokenizer`'s zip, checked against its SHA-256, as {name: bytes}."""
    pb, pbg = vllm_pb
    with grpc.insecure_channel(server.grpc) as ch:
        chunks = list(pbg.VllmEngineStub(ch).GetTokenizer(pb.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert all(c.sha256 == "" for c in chunks[:-1])
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


@pytest.mark.parametrize(
    "model",
    [None, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"],
    ids=["smollm2", "qwen2.5"],
)
def test_the_exported_tokenizer_gives_llama_cpps_token_ids(model, vllm_pb, grpc_api):
    extra = ("--model", model_file(model, "")) if model else ()
    s = Server(*extra)
    try:
        files = fetch_tokenizer(s, vllm_pb)
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "config.json"} <= set(files)
        tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
        config = json.loads(files["tokenizer_config.json"])
        assert "chat_template" in config and config["eos_token"]
        eos = json.loads(files["generation_config.json"])["eos_token_id"]
        assert eos and all(isinstance(e, int) for e in eos)
        # llama.cpp's tokenizer, through our own gRPC API.
        pb, _, _ = grpc_api
        from siliceo.v1 import inference_pb2_grpc as pbg

        with grpc.insecure_channel(s.grpc) as ch:
            stub = pbg.InferenceStub(ch)
            for text in TEXTS:
                ours = list(stub.Tokenize(pb.TokenizeRequest(text=text, add_special=False)).ids)
                hf = tok.encode(text, add_special_tokens=False).ids
                assert hf == ours, (text, hf, ours)
                # And back: the gateway detokenizes what we generate.
                assert tok.decode(ours, skip_special_tokens=False) == text
    finally:
        s.stop()


@pytest.fixture(scope="module")
def grpc_replicas():
    with replica_set(REPLICAS, context=8192) as servers:
        yield servers


def grpc_gateway(replicas, policy: str) -> Gateway:
    # Prefill is slow on two cores: a worker busy with a 1,500-token prompt
    # is not wedged.
    return Gateway(
        [f"grpc://{s.grpc}" for s in replicas], policy,
        extra=["--worker-wedge-secs", "120", "--block-size", "64"],
    )


def gateway_metrics(gw: Gateway) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{gw.prometheus_port}/metrics",
                                  timeout=10).read().decode()


def index_blocks(gw: Gateway, server: Server) -> float:
    """The blocks SMG's KV index holds for `server`, from its metrics (a
    worker it never indexed a block for has no sample: 0)."""
    for line in gateway_metrics(gw).splitlines():
        if line.startswith("smg_kv_index_blocks{") and server.grpc in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def test_smg_in_grpc_mode_answers_as_our_http_api_does(grpc_replicas):
    gw = grpc_gateway(grpc_replicas, "round_robin")
    try:
        workers = json.loads(urllib.request.urlopen(f"{gw.url}/workers").read())
        kinds = {(w.get("runtime_type"), w.get("connection_mode"))
                 for w in workers.get("workers", workers)}
        assert kinds == {("vllm", "grpc")}, workers
        c = gw.client()
        direct = client(grpc_replicas[0], key="none")
        for stream in (False, True):
            kw = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
            want = direct.chat.completions.create(**kw)
            if stream:
                text = "".join(
                    ch.choices[0].delta.content or ""
                    for ch in c.chat.completions.create(**kw, stream=True)
                    if ch.choices
                )
            else:
                got = c.chat.completions.create(**kw)
                text = got.choices[0].message.content
                # The gateway's template and tokenizer made our prompt tokens.
                assert got.usage.prompt_tokens == want.usage.prompt_tokens
                assert got.usage.completion_tokens == want.usage.completion_tokens
            assert text == want.choices[0].message.content, (text, want)
            assert "Paris" in text
        # A stop string ends generation in the engine.
        r = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=40,
                                 temperature=0, stop=["7"])
        assert "7" not in r.choices[0].text and r.choices[0].finish_reason == "stop", r
        # n choices in one call, each its own stream on the replica.
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                 temperature=1.0, seed=3, n=3)
        assert sorted(ch.index for ch in r.choices) == [0, 1, 2], r
        assert all(ch.text for ch in r.choices), r
        assert 3 <= r.usage.completion_tokens <= 24, r.usage
    finally:
        gw.stop()
    for s in grpc_replicas:
        s.wait_idle()


def test_cache_aware_routes_on_the_blocks_our_events_announce(grpc_replicas):
    gw = grpc_gateway(grpc_replicas, "cache_aware")
    try:
        c = gw.client()
        docs = DOCUMENTS[:REPLICAS]
        prefixes = [f"[G {d}] " + doc * 68 for d, doc in enumerate(docs)]
        home, landed, hits, warm = {}, 0, 0, 0
        for rnd in range(4):
            for j in range(len(prefixes)):
                d = (j + rnd) % len(prefixes)
                before = [s.metrics()["siliceo_prompt_tokens_total"] for s in grpc_replicas]
                r = c.completions.create(model=MODEL, prompt=prefixes[d] + f"Question {rnd}:",
                                         max_tokens=2, temperature=0)
                where = served_by(grpc_replicas, before)
                if rnd == 0:
                    home[d] = where
                    continue
                warm += 1
                landed += where == home[d]
                hits += r.usage.prompt_tokens_details.cached_tokens >= 1400
        print(f"gRPC cache_aware: {landed}/{warm} on the prefix's replica, {hits}/{warm} hits")
        assert warm == 3 * len(prefixes)
        assert landed >= 0.9 * warm and hits >= 0.9 * warm, (landed, hits, warm)
        # The gateway's index holds, per replica, exactly the blocks that
        # replica's cache holds (what was stored and not removed).
        for s in grpc_replicas:
            s.wait_idle()
        deadline = time.time() + 10
        while True:
            held = [s.metrics()["siliceo_kv_cached_contents"] for s in grpc_replicas]
            seen = [index_blocks(gw, s) for s in grpc_replicas]
            if seen == held or time.time() > deadline:
                break
            time.sleep(0.5)
        assert seen == held, (seen, held)
        # cache_aware may keep both prefixes on one replica.
        assert sum(held) >= 40, held
        events = re.findall(r'smg_kv_event_blocks_total\{[^}]*op="stored"[^}]*\} (\S+)',
                            gateway_metrics(gw))
        assert events and sum(map(float, events)) >= sum(held), events
    finally:
        gw.stop()


def test_a_replica_killed_in_grpc_mode_loses_no_request_that_had_not_started(grpc_replicas):
    # Last in this module: it kills one of the module's replicas.
    gw = grpc_gateway(grpc_replicas, "round_robin")
    try:
        during, after = kill_mid_run(gw, grpc_replicas[1], after=8)
    finally:
        gw.stop()
    # Whole answers: the gateway retries on the other replica a request
    # whose replica died before it answered.
    assert during == [24] * 8, during
    assert after == [24] * 8, after
    grpc_replicas[0].wait_idle()


def test_prompt_logprobs_on_the_gateways_protocol(server, vllm_pb, grpc_api):
    """SMG's engine protocol carries `prompt_logprobs` back as
    `input_logprobs`, once per choice: with its first streamed tokens, or in
    its `Complete`; the first prompt token has no value. The numbers are
    those our own protocol gives."""
    pb, pbg = vllm_pb
    spb, stub, meta = grpc_api
    ids = list(stub.Tokenize(
        spb.TokenizeRequest(text="The capital of France is", add_special=True), metadata=meta
    ).ids)
    scored = list(stub.Generate(
        spb.GenerateRequest(tokens=spb.TokenIds(ids=ids), prompt_logprobs=2, score_only=True),
        metadata=meta,
    ))[0].prompt_logprobs
    with grpc.insecure_channel(server.grpc) as ch:
        engine = pbg.VllmEngineStub(ch)
        for stream in (False, True):
            req = pb.GenerateRequest(
                request_id=f"prompt-logprobs-{stream}",
                tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                stream=stream,
            )
            out = [getattr(r, r.WhichOneof("response")) for r in engine.Generate(req, metadata=meta, timeout=60)]
            carried = [m.input_logprobs for m in out if m.HasField("input_logprobs")]
            assert len(carried) == 1, out
            assert out[0].HasField("input_logprobs"), "not with the first message"
            p = carried[0]
            assert list(p.token_ids) == ids
            assert not p.token_logprobs[0].HasField("value")
            assert [x.value for x in p.token_logprobs[1:]] == [l.logprob for l in scored[1:]]
            assert [list(t.token_ids) for t in p.top_logprobs[1:]] == [
                [t.token_id for t in l.top] for l in scored[1:]
            ]
    server.wait_idle()
