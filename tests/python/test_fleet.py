"""A fleet: three real `siliceo serve` replicas on 127.0.0.1 behind SMG (the
Shepherd Model Gateway, from PyPI), spoken to by the `openai` client
through the gateway."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conftest import QUESTION, free_port, replica_set

REPLICAS = 3
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def smg_binary() -> str:
    smg = Path(sys.executable).with_name("smg")
    if not smg.is_file():
        pytest.fail(f"{smg} is missing: `cargo xtask test-python` installs smg into its venv")
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
                "--prometheus-port", str(self.prometheus_port),
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


@pytest.fixture(scope="module")
def replicas():
    # Requests go one at a time in most tests: each replica may use both
    # cores. KV for 8,192 tokens: three ~1,500-token prefixes fit at once.
    with replica_set(REPLICAS, context=8192) as servers:
        yield servers


def served_by(replicas, before):
    """Which replica a finished request ran on: the one whose prompt-token
    counter moved."""
    moved = [
        i for i, s in enumerate(replicas)
        if s.metrics()["siliceo_prompt_tokens_total"] > before[i]
    ]
    assert len(moved) == 1, moved
    return moved[0]


def test_the_openai_client_through_smg_gets_answers_from_every_replica(replicas):
    gw = Gateway([s.http for s in replicas], "round_robin")
    try:
        c = gw.client()
        assert MODEL in [m.id for m in c.models.list().data]
        seen = set()
        for _ in range(REPLICAS):
            before = [s.metrics()["siliceo_prompt_tokens_total"] for s in replicas]
            r = c.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=16, temperature=0
            )
            assert "Paris" in r.choices[0].message.content, r
            assert r.usage.completion_tokens > 0
            seen.add(served_by(replicas, before))
        assert seen == set(range(REPLICAS))
        # Streamed, through the gateway.
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True
            )
            if ch.choices
        )
        assert "Paris" in text
        # The replicas' load reports, as SMG polls them.
        loads = json.loads(urllib.request.urlopen(f"{replicas[0].http}/v1/loads").read())
        load = loads["loads"][0]
        assert load["num_running_reqs"] == 0 and 0 <= load["token_usage"] <= 1
        assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] > 0
    finally:
        gw.stop()
    for s in replicas:
        s.wait_idle()


DOCUMENTS = [
    "The harbour committee reviewed the accounts, the pier repairs, the ferry timetable "
    "and the letters about the market square. ",
    "In the orchard the apple trees were pruned, the hives were moved to the east wall "
    "and the cider press was oiled for autumn. ",
    "The observatory logged the comet's path, recalibrated the mirror, and wrote to the "
    "university about the new spectrograph. ",
]


def shared_prefix_run(replicas, policy: str, tag: str, rounds: int = 8):
    """Per document: one cold request, then `rounds - 1` warm ones with the same
    ~1,500-token prefix and another question. Returns, over the warm ones,
    how many landed on the replica that computed the prefix first, and how
    many were served from a prefix cache."""
    gw = Gateway([s.http for s in replicas], policy)
    try:
        c = gw.client()
        prefixes = [f"[{tag} {d}] " + doc * 68 for d, doc in enumerate(DOCUMENTS)]
        home, landed, hits, warm = {}, 0, 0, 0
        for rnd in range(rounds):
            # Each round starts at another document, so that round robin
            # does not send a document to the same replica every time.
            for j in range(len(prefixes)):
                d = (j + rnd) % len(prefixes)
                prefix = prefixes[d]
                before = [s.metrics()["siliceo_prompt_tokens_total"] for s in replicas]
                r = c.completions.create(
                    model=MODEL, prompt=prefix + f"Question {rnd}: what happened?",
                    max_tokens=2, temperature=0,
                )
                where = served_by(replicas, before)
                prompt = r.usage.prompt_tokens
                cached = r.usage.prompt_tokens_details.cached_tokens
                assert 1450 < prompt < 1900, prompt
                if rnd == 0:
                    home[d] = where
                    continue
                warm += 1
                landed += where == home[d]
                hits += cached >= 1400
        return landed, hits, warm
    finally:
        gw.stop()


def test_cache_aware_routing_keeps_a_shared_prefix_on_its_replica(replicas):
    landed, hits, warm = shared_prefix_run(replicas, "cache_aware", "A")
    print(f"cache_aware: {landed}/{warm} on the prefix's replica, {hits}/{warm} cache hits")
    assert warm == 21
    assert landed >= 0.9 * warm and hits >= 0.9 * warm, (landed, hits)
    # Round robin, for comparison (4 rounds: every replica gets each prefix).
    landed_rr, hits_rr, warm_rr = shared_prefix_run(replicas, "round_robin", "B", rounds=4)
    print(f"round_robin: {landed_rr}/{warm_rr} on the prefix's replica, {hits_rr}/{warm_rr} cache hits")
    # It spreads each prefix over all three replicas: a third land where it
    # was computed first, and only those find it in their cache (each
    # replica computes each prefix once).
    assert landed_rr <= warm_rr // 2, landed_rr
    assert hits_rr <= warm_rr // 2, hits_rr
    for s in replicas:
        s.wait_idle()


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started(replicas):
    gw = Gateway([s.http for s in replicas], "round_robin")
    try:
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
            victim = replicas[1]
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            during = [f.result(timeout=120) for f in running]
        # Whole (not streamed) answers: the gateway retries a request whose
        # replica died before answering on another one.
        lost = [r for r in during if not isinstance(r, int)]
        assert not lost, lost
        assert all(r == 24 for r in during)
        after = [ask(100 + i) for i in range(12)]
        assert after == [24] * 12, after
    finally:
        gw.stop()
    for s in replicas:
        if s.proc.poll() is None:
            s.wait_idle()
