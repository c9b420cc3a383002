"""One front door for both protocols: one TLS certificate, one set of
limits, one set of metrics, with the clients users have (`openai`, grpcio)
against the real server."""

import ssl
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import grpc
import httpx2 as httpx  # what openai 3.x builds on
import openai
import pytest

from conftest import API_KEY, QUESTION, Server, client, parse_metrics, refused_start


def make_certificates(dir: Path) -> tuple[Path, Path, Path]:
    """A test CA and a certificate for 127.0.0.1 it signs (rustls refuses a
    self-signed CA as an end entity), by the openssl command line."""

    def openssl(*args: str):
        subprocess.run(["openssl", *args], cwd=dir, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=siliceo test CA",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", *ec, "-subj", "/CN=localhost", "-keyout", "key.pem", "-out", "leaf.csr")
    (dir / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", "cert.pem", "-extfile", "ext.cnf")
    return dir / "ca.pem", dir / "cert.pem", dir / "key.pem"


def test_one_certificate_serves_https_and_grpc_over_tls(grpc_api):
    pb, _, md = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    ca, cert, key = make_certificates(Path(tempfile.mkdtemp()))
    srv = Server("--api-key", API_KEY, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert srv.http.startswith("https://127.0.0.1:"), srv.ready_line
        assert "TLS" in srv.ready_line
        # The openai client trusts the test CA.
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca))) as http:
            c = client(srv, http_client=http)
            r = c.chat.completions.create(
                model=c.models.list().data[0].id,
                messages=QUESTION,
                max_tokens=8,
                temperature=0,
            )
            assert r.choices[0].message.content
            assert r.usage.completion_tokens > 0
        # A client that does not trust it is refused by its own TLS check.
        with httpx.Client() as http:
            with pytest.raises(openai.APIConnectionError):
                client(srv, http_client=http).models.list()
        # Plain HTTP to the HTTPS port gets no answer.
        port = srv.http.rsplit(":", 1)[1]
        with pytest.raises(Exception):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
        # gRPC on the same certificate.
        creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        host = srv.grpc.replace("127.0.0.1", "localhost")
        with grpc.secure_channel(host, creds) as ch:
            stub = pbg.InferenceStub(ch)
            req = pb.GenerateRequest(prompt="The sky is", max_tokens=4, ignore_eos=True)
            tokens = [t for r in stub.Generate(req, metadata=md) for t in r.token_ids]
            assert len(tokens) == 4
        srv.wait_idle()
    finally:
        srv.stop()


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(url, timeout=10).read().decode())


def test_http_serves_metrics_that_count_both_protocols(server, grpc_api):
    pb, stub, md = grpc_api
    # /metrics on the HTTP port, open like /health, is the same exposition
    # as the metrics port.
    url = f"{server.http}/metrics"
    before = scrape(url)
    c = client(server)
    c.chat.completions.create(
        model=c.models.list().data[0].id, messages=QUESTION, max_tokens=3, temperature=0
    )
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=c.models.list().data[0].id, prompt="Hi", max_tokens=0)
    list(stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True), metadata=md))
    server.wait_idle()
    after = scrape(url)
    chat_ok = 'siliceo_api_requests_total{protocol="http",endpoint="/v1/chat/completions",status="200"}'
    bad = 'siliceo_api_requests_total{protocol="http",endpoint="/v1/completions",status="400"}'
    grpc_ok = 'siliceo_api_requests_total{protocol="grpc",endpoint="Generate",status="OK"}'
    assert after.get(chat_ok, 0) == before.get(chat_ok, 0) + 1, after
    assert after.get(bad, 0) == before.get(bad, 0) + 1, after
    assert after.get(grpc_ok, 0) == before.get(grpc_ok, 0) + 1, after
    # Tokens are counted by the runtime, whichever protocol asked: 3 + 2.
    gen = "siliceo_generated_tokens_total"
    assert after.get(gen, 0) - before.get(gen, 0) >= 5
    # The metrics port shows the same counters.
    assert server.metrics()[chat_ok] == after.get(chat_ok, 0)


def test_grpc_refuses_max_tokens_over_the_context_like_http(server, grpc_api):
    pb, stub, md = grpc_api
    req = pb.GenerateRequest(prompt="Once upon a time", max_tokens=100_000)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=md))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("max_tokens: the prompt's"), e.value.details()
    c = client(server)
    with pytest.raises(openai.BadRequestError) as h:
        c.completions.create(
            model=c.models.list().data[0].id, prompt="Once upon a time", max_tokens=100_000
        )
    assert h.value.body["param"] == "max_tokens"
    assert h.value.body["code"] == "context_length_exceeded"
    server.wait_idle()


def test_several_api_keys_open_both_protocols(grpc_api, tmp_path):
    """`--api-key` (repeated) and `--api-key-file`: any one key opens HTTP
    and gRPC alike; any other is refused by both."""
    pb, _, _ = grpc_api
    from siliceo.v1 import inference_pb2_grpc as pbg

    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nbob-key\n\n  carol-key  \n")
    srv = Server("--api-key", "alice-key", "--api-key-file", str(keys))
    try:
        assert "one of 3 API keys required" in srv.ready_line, srv.ready_line
        with grpc.insecure_channel(srv.grpc) as ch:
            stub = pbg.InferenceStub(ch)
            for k in ["alice-key", "bob-key", "carol-key"]:
                assert client(srv, key=k).models.list().data
                ids = stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=[("authorization", f"Bearer {k}")]).ids
                assert len(ids) > 0
            for bad in ["# the team's keys", "", "bob"]:
                with pytest.raises(openai.AuthenticationError):
                    client(srv, key=bad or "x").models.list()
                with pytest.raises(grpc.RpcError) as e:
                    stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=[("authorization", f"Bearer {bad}")])
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop()
    # A key file with no key in it would leave the server open: refused.
    empty = tmp_path / "empty"
    empty.write_text("# nobody yet\n")
    assert "no key in it" in refused_start("--api-key-file", str(empty))
