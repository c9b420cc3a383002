"""A fleet: three real `siliceo serve` replicas on 127.0.0.1 behind SMG (the
Shepherd Model Gateway, from PyPI), spoken to by the `openai` client
through the gateway."""

import json
import time
import urllib.request

import pytest

from conftest import QUESTION, replica_set
from fleet import DOCUMENTS, MODEL, Gateway, kill_mid_run, served_by

REPLICAS = 3


@pytest.fixture(scope="module")
def replicas():
    # Requests go one at a time in most tests: each replica may use both
    # cores. KV for 8,192 tokens: three ~1,500-token prefixes fit at once.
    with replica_set(REPLICAS, context=8192) as servers:
        yield servers


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


def test_a_replica_added_at_run_time_starts_receiving_traffic(replicas):
    first, added = replicas[:2], replicas[2]
    gw = Gateway([s.http for s in first], "round_robin")
    try:
        c = gw.client()

        def ask_and_see():
            before = [s.metrics()["siliceo_prompt_tokens_total"] for s in replicas]
            r = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                          temperature=0)
            assert "Paris" in r.choices[0].message.content, r
            return served_by(replicas, before)

        assert {ask_and_see() for _ in range(4)} == {0, 1}
        # SMG's control plane: only the URL; it probes the worker itself.
        req = urllib.request.Request(
            f"{gw.url}/workers", data=json.dumps({"url": added.http}).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 202, r.status
            assert json.loads(r.read())["url"] == added.http
        deadline = time.time() + 30
        while True:
            workers = json.loads(urllib.request.urlopen(f"{gw.url}/workers", timeout=5).read())
            ready = [w["url"] for w in workers["workers"] if w.get("is_healthy")]
            if added.http in ready or time.time() > deadline:
                break
            time.sleep(0.2)
        assert sorted(ready) == sorted(s.http for s in replicas), workers
        # Round robin over three: the new replica gets its share at once.
        seen = [ask_and_see() for _ in range(6)]
        assert seen.count(2) >= 1 and set(seen) == {0, 1, 2}, seen
    finally:
        gw.stop()
    for s in replicas:
        s.wait_idle()


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started(replicas):
    gw = Gateway([s.http for s in replicas], "round_robin")
    try:
        during, after = kill_mid_run(gw, replicas[1], after=12)
    finally:
        gw.stop()
    # Whole (not streamed) answers: the gateway retries a request whose
    # replica died before answering on another one.
    assert during == [24] * 8, during
    assert after == [24] * 12, after
    for s in replicas:
        if s.proc.poll() is None:
            s.wait_idle()
