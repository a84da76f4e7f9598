"""End to end: a real `sapo-node` (silo, tiny random model) serves /healthz, /status and /metrics while training."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from conftest import REPO, free_port, node_env
from promtext import parse_prometheus, value_of

pytestmark = pytest.mark.timeout(240)


async def poll(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, done, timeout: float, what: str):
    """GET `url` until `done(status, body)` is true; fail early if the node exits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"node exited early ({proc.returncode}) while waiting for {what}"
        try:
            async with http.get(url) as resp:
                body = await resp.read()
                last = (resp.status, body[:300])
                if done(resp.status, body):
                    return resp.status, body
        except aiohttp.ClientConnectionError as e:  # not listening yet (model still loading)
            last = e
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.mark.slow
async def test_live_node_status_endpoints(tmp_path: Path, tiny_args: list[str]) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "node.cli", *tiny_args, "--rounds", "100000", "--run-dir", str(run_dir),
           "--status-port", str(port)]  # fmt: skip
    log = open(tmp_path / "node.out", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=node_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await poll(http, f"{url}/healthz", proc, lambda s, b: s == 200, 90, "/healthz 200")
            _, body = await poll(
                http, f"{url}/status", proc, lambda s, b: s == 200 and orjson.loads(b)["round"] >= 2, 120, "round >= 2"
            )
            snap = orjson.loads(body)
            assert snap["model"] == "tiny-random" and snap["swarm"] == "silo" and snap["peer_id"] == "silo"
            assert len(snap["history"]) >= 2 and all("reward_mean" in h for h in snap["history"])
            assert [h["round"] for h in snap["history"]][:2] == [0, 1]
            assert {"generate", "score", "train"} <= set(snap["phase_s"]), snap["phase_s"]
            assert snap["totals"]["rounds"] >= 2 and snap["last_round_at"] and snap["uptime_s"] > 0

            async with http.get(f"{url}/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                types, _, samples = parse_prometheus(await resp.text())
            assert types["sapo_round"] == "gauge" and types["sapo_rounds_total"] == "counter"
            assert value_of(samples, "sapo_round") >= 2
            assert value_of(samples, "sapo_build_info", kind="node", model="tiny-random", swarm="silo") == 1
            assert value_of(samples, "sapo_phase_duration_seconds", phase="generate") > 0
        proc.send_signal(signal.SIGTERM)  # finish the current round, checkpoint, exit 0
        rc = proc.wait(timeout=60)
        log.seek(0)
        out = log.read()
        assert rc == 0, out[-3000:]
        assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()
        assert "SIGTERM: stopping at a safe point" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
