"""A fleet's parts for the tests and the fleet benchmark: SMG (the Shepherd
Model Gateway, installed from PyPI into the test venv) in front of real
`siliceo serve` replicas, and which replica served a request."""

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from conftest import free_port

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def smg_binary() -> str:
    smg = Path(sys.executable).with_name("smg")
    if not smg.is_file():
        raise RuntimeError(f"{smg} is missing: `cargo xtask test-python` installs smg into its venv")
    return str(smg)


class Gateway:
    """`smg launch` in front of `urls`, with fast health checks."""

    def __init__(self, urls: list[str], policy: str, extra: list[str] = ()):
        self.port = free_port()
        self.prometheus_port = free_port()
        # HTTP workers tokenize for themselves; gRPC ones need the gateway to
        # load their tokenizer (it asks them for it).
        autoload = [] if any(u.startswith("grpc") for u in urls) else ["--disable-tokenizer-autoload"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/siliceo-smg-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [
                smg_binary(), "launch", "--worker-urls", *urls,
                "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(self.prometheus_port), "--prometheus-host", "127.0.0.1",
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
                "--load-monitor-interval", "1", *autoload,
                "--shutdown-grace-period-secs", "1", "--log-level", "warn", *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),  # smg writes smg.pid where it runs
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                r = json.loads(urllib.request.urlopen(f"{self.url}/readiness", timeout=2).read())
                if r.get("healthy_workers") == len(urls):
                    return
            except Exception:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"smg did not get {len(urls)} healthy workers: {open(self.log.name).read()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def served_by(replicas, before):
    """Which replica a finished request ran on: the one whose prompt-token
    counter moved."""
    moved = [
        i for i, s in enumerate(replicas)
        if s.metrics()["siliceo_prompt_tokens_total"] > before[i]
    ]
    assert len(moved) == 1, moved
    return moved[0]


DOCUMENTS = [
    "The harbour committee reviewed the accounts, the pier repairs, the ferry timetable "
    "and the letters about the market square. ",
    "In the orchard the apple trees were pruned, the hives were moved to the east wall "
    "and the cider press was oiled for autumn. ",
    "The observatory logged the comet's path, recalibrated the mirror, and wrote to the "
    "university about the new spectrograph. ",
]


def kill_mid_run(gw: Gateway, victim, after: int):
    """Eight whole greedy completions of 24 tokens, four at a time, through
    `gw`; `victim` (a replica) gets SIGKILL while they run. Then `after`
    more, one at a time. Returns each one's completion tokens, or the
    error it got: (during, after)."""
    c = gw.client()

    def ask(i: int):
        try:
            r = c.completions.create(
                model=MODEL, prompt=f"Request {i}: the capital of France is",
                max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(ask, i) for i in range(8)]
        time.sleep(0.3)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        during = [f.result(timeout=120) for f in running]
    return during, [ask(100 + i) for i in range(after)]
