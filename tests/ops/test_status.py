"""Status server: /status, /metrics, /healthz, dashboard routes, failure handling, bootstrap kind."""

from __future__ import annotations

import time

import aiohttp
import pytest

from node.ops.prometheus import METRICS_CONTENT_TYPE, render_metrics
from node.ops.status import health_check, start_status_server, start_status_server_in_thread
from promtext import parse_prometheus, value_of

pytestmark = pytest.mark.timeout(60)

EVIL_NAME = 'al"ice\\\nbob'  # quote, backslash and newline: must be escaped in labels


def fake_snapshot(**over) -> dict:
    now = time.time()
    snap = {
        "peer_id": "12D3KooWFake",
        "public_key": "ab" * 32,
        "maddrs": ["/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWFake"],
        "swarm": "test-swarm",
        "model": "SmolLM2-135M-Instruct",
        "version": "0.1.0",
        "round": 7,
        "phase": "train",
        "uptime_s": 123.5,
        "started_at": now - 123.5,
        "last_round_at": now - 2.0,
        "last_reward": 0.25,
        "reward_ma": 0.2,
        "phase_s": {"generate": 3.5, "score": 0.25, "publish": 0.1, "fetch": 1.0, "train": 4.0},
        "history": [
            {
                "round": r,
                "reward_mean": r / 10,
                "num_local": 4,
                "num_external": r % 3,
                "phase_s": {"generate": 3.0, "train": 4.0},
                "signal_frac": 0.5,
                "entropy_mean": 1.5,
            }
            | ({"eval_accuracy": r / 20, "eval_unseen_accuracy": r / 40} if r % 5 == 1 else {})
            for r in range(1, 7)
        ],
        "eval": {
            "round": 6,
            "eval_accuracy": 0.3,
            "eval_accuracy/count_bits": 0.25,
            "eval_s": 4.5,
            "eval_size": 64,
            "eval_baseline": 0.125,
            "eval_unseen_accuracy": 0.2,
            "eval_unseen_accuracy/chain_sum": 0.15,
            "eval_unseen_baseline": 0.175,
            "eval_unseen_size": 64,
        },
        "entropy": 1.5,
        "signal_frac": 0.5,
        "peers": {
            "cd" * 32: {"name": EVIL_NAME, "last_round": 6, "last_seen": now - 1},
            "ef" * 32: {"name": "carol", "last_round": 5, "last_seen": now - 30},
        },
        "groups": {
            "accepted": {"cd" * 32: 12},
            "rejected": {"ef" * 32: {"bad_signature": 2, 'weird"reason': 1}},
        },
        "totals": {
            "rounds": 6,
            "tokens_generated": 98765,
            "groups_local": 24,
            "groups_external": 6,
            "dropped_zero_adv": 3,
        },
        "reputation": {
            "tracked": 40,
            "banned": 1,
            "ban_threshold": -10.0,
            "max_score": 5.0,
            "peers": {
                "ef" * 32: {"score": -10.0, "banned_until": now + 3600, "strikes": 1, "last_seen": now - 30},
                "cd" * 32: {"score": 1.5, "banned_until": None, "strikes": 0, "last_seen": now - 1},
            },
        },
        "verify": {"last_round_s": 0.75, "last_round_bytes": 123456, "last_round_batches": 9},
        "network": {"pipeline": True, "median_age_s": 2.5, "median_age_rounds": 1, "groups_waiting": 3},
    }
    snap.update(over)
    return snap


# ---------------------------------------------------------------- fixtures


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


class Box:
    def __init__(self, snap):
        self.snap = snap
        self.fail = False
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("node state is being rebuilt")
        return self.snap


# ---------------------------------------------------------------- tests


async def test_status_json_and_routes(client):
    box = Box(fake_snapshot())
    server = await start_status_server(box)
    try:
        assert server.port > 0
        base = f"http://127.0.0.1:{server.port}"
        async with client.get(base + "/status") as r:
            assert r.status == 200
            assert r.content_type == "application/json"
            body = await r.json()
        assert body["round"] == 7
        assert body["peers"]["cd" * 32]["name"] == EVIL_NAME
        assert len(body["history"]) == 6

        async with client.get(base + "/") as r:
            assert r.status == 200
            html = await r.text()
            assert 'id="reward-chart"' in html
            assert "Content-Security-Policy" in r.headers
        for asset in ("app.js", "style.css"):
            async with client.get(base + "/static/" + asset) as r:
                assert r.status == 200, asset
                assert "http://" not in await r.text() and "https://" not in await r.text()
        async with client.get(base + "/static/../status.py") as r:
            assert r.status in (403, 404)
        async with client.get(base + "/nope") as r:
            assert r.status == 404
    finally:
        await server.stop()


async def test_metrics_exposition(client):
    server = await start_status_server(Box(fake_snapshot()))
    try:
        async with client.get(f"http://127.0.0.1:{server.port}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == METRICS_CONTENT_TYPE
            text = await r.text()
    finally:
        await server.stop()
    types, helps, samples = parse_prometheus(text)
    for name, mtype in {
        "sapo_round": "gauge",
        "sapo_reward_last": "gauge",
        "sapo_reward_moving_average": "gauge",
        "sapo_phase_duration_seconds": "gauge",
        "sapo_tokens_generated_total": "counter",
        "sapo_groups_accepted_total": "counter",
        "sapo_groups_rejected_total": "counter",
        "sapo_known_peers": "gauge",
        "sapo_uptime_seconds": "gauge",
        "sapo_build_info": "gauge",
        "sapo_rounds_total": "counter",
    }.items():
        assert types.get(name) == mtype, name
        assert helps.get(name), name
    assert all(n.startswith("sapo_") for n in types)
    assert all(not n.endswith("_total") or t == "counter" for n, t in types.items())
    assert value_of(samples, "sapo_round") == 7
    assert value_of(samples, "sapo_reward_last") == 0.25
    assert value_of(samples, "sapo_tokens_generated_total") == 98765
    assert value_of(samples, "sapo_phase_duration_seconds", phase="generate") == 3.5
    assert value_of(samples, "sapo_phase", phase="train") == 1
    assert value_of(samples, "sapo_phase", phase="generate") == 0
    assert value_of(samples, "sapo_known_peers") == 2
    assert value_of(samples, "sapo_groups_accepted_total", peer="cd" * 32) == 12
    assert value_of(samples, "sapo_groups_rejected_total", peer="ef" * 32, reason="bad_signature") == 2
    assert value_of(samples, "sapo_groups_rejected_total", peer="ef" * 32, reason='weird"reason') == 1
    assert value_of(samples, "sapo_peer_info", peer="cd" * 32, name=EVIL_NAME) == 1
    assert value_of(samples, "sapo_build_info", version="0.1.0", model="SmolLM2-135M-Instruct") == 1
    assert "sapo_bootstrap_peers_seen" not in types
    # reputation: aggregates, and per-peer rows only for the bounded table of the snapshot
    assert types["sapo_publishers_banned"] == "gauge" and value_of(samples, "sapo_publishers_banned") == 1
    assert value_of(samples, "sapo_publishers_tracked") == 40
    assert value_of(samples, "sapo_publisher_score", peer="ef" * 32) == -10
    assert value_of(samples, "sapo_publisher_score", peer="cd" * 32) == 1.5
    assert value_of(samples, "sapo_publisher_banned_until_timestamp_seconds", peer="ef" * 32) > time.time()
    assert not [
        s for s in samples if s[0] == "sapo_publisher_banned_until_timestamp_seconds" and s[1].get("peer") == "cd" * 32
    ], "no ban, no sample"
    assert value_of(samples, "sapo_verify_seconds_last_round") == 0.75
    assert value_of(samples, "sapo_verify_bytes_last_round") == 123456
    assert value_of(samples, "sapo_network_lag_seconds") == 2.5 and value_of(samples, "sapo_network_lag_rounds") == 1
    assert value_of(samples, "sapo_network_groups_waiting") == 3
    assert value_of(samples, "sapo_eval_accuracy") == 0.3
    assert value_of(samples, "sapo_eval_accuracy_by_dataset", dataset="count_bits") == 0.25
    assert value_of(samples, "sapo_eval_round") == 6 and value_of(samples, "sapo_eval_duration_seconds") == 4.5
    assert value_of(samples, "sapo_eval_constant_baseline") == 0.125
    assert value_of(samples, "sapo_eval_unseen_accuracy") == 0.2
    assert value_of(samples, "sapo_eval_unseen_accuracy_by_dataset", dataset="chain_sum") == 0.15
    assert value_of(samples, "sapo_eval_unseen_constant_baseline") == 0.175
    # a mix without an unseen set exports none of its metrics (not zeros)
    plain = fake_snapshot(eval={"round": 6, "eval_accuracy": 0.3, "eval_baseline": 0.125})
    assert not [name for name in parse_prometheus(render_metrics(plain))[0] if "unseen" in name]
    assert value_of(samples, "sapo_token_entropy") == 1.5 and value_of(samples, "sapo_signal_fraction") == 0.5


def test_render_metrics_tolerates_junk():
    junk = {
        "round": "seven",
        "last_reward": None,
        "reward_ma": float("nan"),
        "phase_s": [1, 2],
        "peers": {"x": None},
        "groups": {"accepted": {"x": "many"}, "rejected": {"y": 3}},
        "totals": None,
        "uptime_s": float("inf"),
    }
    types, _, samples = parse_prometheus(render_metrics(junk))
    assert "sapo_round" not in types and "sapo_reward_last" not in types
    assert value_of(samples, "sapo_uptime_seconds") == float("inf")
    assert "NaN" in render_metrics(junk)
    parse_prometheus(render_metrics({}))  # only build info, still valid


async def test_healthz(client):
    box = Box(fake_snapshot())
    server = await start_status_server(box, stale_after_s=60)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with client.get(base + "/healthz") as r:
            assert r.status == 200
            assert (await r.text()).strip() == "ok"
        box.snap = fake_snapshot(healthy=False, unhealthy_reason="DHT lost all peers")
        async with client.get(base + "/healthz") as r:
            assert r.status == 503
            assert "DHT lost all peers" in await r.text()
        box.snap = fake_snapshot(last_round_at=time.time() - 3600)
        async with client.get(base + "/healthz") as r:
            assert r.status == 503
            assert "stale" in await r.text()
    finally:
        await server.stop()


def test_health_check_first_round_grace():
    now = 1_000_000.0
    fresh = {"started_at": now - 10, "totals": {"rounds": 0}, "history": []}
    old = {"started_at": now - 5000, "totals": {"rounds": 0}, "history": []}
    assert health_check(fresh, stale_after_s=600, now=now)[0]
    assert not health_check(old, stale_after_s=600, now=now)[0]
    assert health_check(old, stale_after_s=None, now=now)[0]
    assert health_check(old, kind="bootstrap", stale_after_s=600, now=now)[0]
    # no last_round_at but rounds done: staleness cannot be judged -> healthy
    assert health_check({"started_at": now - 5000, "totals": {"rounds": 3}}, stale_after_s=600, now=now)[0]


async def test_failing_snapshot_gives_500_and_server_survives(client):
    box = Box(fake_snapshot())
    server = await start_status_server(box)
    base = f"http://127.0.0.1:{server.port}"
    try:
        box.fail = True
        for path in ("/status", "/metrics", "/healthz"):
            async with client.get(base + path) as r:
                assert r.status == 500, path
                assert "node state is being rebuilt" in await r.text()
        box.fail = False
        box.snap = {"not": object()}  # not JSON-serialisable
        async with client.get(base + "/status") as r:
            assert r.status == 500
            assert "serialis" in (await r.json())["error"]
        box.snap = ["not", "a", "dict"]
        async with client.get(base + "/status") as r:
            assert r.status == 500
        box.snap = fake_snapshot()
        async with client.get(base + "/status") as r:
            assert r.status == 200
            assert (await r.json())["round"] == 7
        async with client.get(base + "/") as r:
            assert r.status == 200
    finally:
        await server.stop()


async def test_async_snapshot_and_stop_releases_port(client):
    async def snap():
        return fake_snapshot(round=42)

    server = await start_status_server(snap)
    port = server.port
    async with client.get(f"http://127.0.0.1:{port}/status") as r:
        assert (await r.json())["round"] == 42
    await server.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with client.get(f"http://127.0.0.1:{port}/status") as r:
            pass


async def test_bootstrap_kind(client):
    snap = {
        "peer_id": "12D3KooWBoot",
        "maddrs": ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWBoot"],
        "swarm": "test-swarm",
        "uptime_s": 9.0,
        "peers_seen": 5,
        "version": "0.1.0",
    }
    server = await start_status_server(lambda: snap, kind="bootstrap")
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with client.get(base + "/status") as r:
            assert (await r.json())["peers_seen"] == 5
        async with client.get(base + "/metrics") as r:
            assert r.status == 200
            types, _, samples = parse_prometheus(await r.text())
        assert value_of(samples, "sapo_bootstrap_peers_seen") == 5
        assert value_of(samples, "sapo_uptime_seconds") == 9
        assert value_of(samples, "sapo_build_info", kind="bootstrap") == 1
        assert "sapo_round" not in types
        async with client.get(base + "/healthz") as r:
            assert r.status == 200
        async with client.get(base + "/") as r:
            assert r.status == 200
            assert 'data-kind="bootstrap"' in await r.text()
    finally:
        await server.stop()


async def test_bad_kind_rejected():
    with pytest.raises(ValueError):
        await start_status_server(dict, kind="relay")


def test_threaded_server_for_sync_programs():
    import json
    import urllib.error
    import urllib.request

    seen = {"n": 0}

    def snap():
        seen["n"] += 1
        return {"peer_id": "boot", "peers_seen": seen["n"], "uptime_s": 1.0, "version": "0.1.0"}

    srv = start_status_server_in_thread(snap, kind="bootstrap")
    try:
        with urllib.request.urlopen(f"{srv.url}/status", timeout=5) as r:
            assert json.loads(r.read())["peers_seen"] == 1
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=5) as r:
            assert b"sapo_bootstrap_peers_seen 2" in r.read()
    finally:
        srv.stop()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{srv.url}/status", timeout=2)
    # a port that is taken is reported to the caller, not swallowed by the thread
    holder = start_status_server_in_thread(snap)
    try:
        with pytest.raises(OSError):
            start_status_server_in_thread(snap, port=holder.port)
    finally:
        holder.stop()
