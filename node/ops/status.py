"""HTTP status server for a SAPO node (and the bootstrap): JSON, Prometheus metrics, health, dashboard.

The server runs inside the caller's asyncio event loop (aiohttp ``AppRunner`` + ``TCPSite``; no threads).
It knows nothing about the node itself: it is handed a zero-argument callable ``snapshot()`` that returns a
JSON-safe dict (see ``docs/OPERATING.md`` for the keys) and renders it on every request.

Routes::

    GET /          dashboard (node) or a minimal page (bootstrap)
    GET /static/*  dashboard assets (packaged as ``node/ops/static/*``)
    GET /status    the snapshot as JSON
    GET /metrics   Prometheus text exposition format 0.0.4
    GET /healthz   "ok" (200) or a reason (503); 500 when the snapshot callable fails

A snapshot callable that raises (or returns something that is not a dict / not serialisable) yields an
HTTP 500 with a short message; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from node.ops.prometheus import (
    METRICS_CONTENT_TYPE,
    as_dict,
    num,
    render_metrics,
)

__all__ = [
    "StatusServer",
    "start_status_server",
    "ThreadedStatusServer",
    "start_status_server_in_thread",
    "health_check",
    "DEFAULT_STALE_AFTER_S",
]

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: /healthz reports 503 when no round finished for this long (first round: since start).
DEFAULT_STALE_AFTER_S = 1800.0

_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Everything the dashboard needs is same-origin; peer names are untrusted text and are never
    # inserted as HTML, but a strict CSP makes that a second line of defence.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
}


def health_check(
    snap: Mapping[str, Any],
    kind: str = "node",
    stale_after_s: float | None = DEFAULT_STALE_AFTER_S,
    now: float | None = None,
) -> tuple[bool, str]:
    """Return (healthy, reason).

    Unhealthy when the snapshot says ``"healthy": False`` (reason from ``"unhealthy_reason"`` if given), or,
    for kind="node" with a staleness bound, when the last round finished more than ``stale_after_s`` ago
    (``"last_round_at"``, Unix time) or, before the first round, when the node started more than
    ``stale_after_s`` ago (``"started_at"``). Without those keys staleness is not judged.
    """
    if snap.get("healthy") is False:
        reason = snap.get("unhealthy_reason")
        return False, str(reason) if reason else "node reports unhealthy"
    if kind != "node" or not stale_after_s:
        return True, "ok"
    now = time.time() if now is None else now
    last = num(snap.get("last_round_at"))
    rounds = num(as_dict(snap.get("totals")).get("rounds"))
    if last is not None:
        age = now - last
        if age > stale_after_s:
            return False, f"stale: last round finished {age:.0f}s ago (bound {stale_after_s:.0f}s)"
    elif rounds == 0 and not snap.get("history"):
        started = num(snap.get("started_at"))
        if started is not None and now - started > stale_after_s:
            return False, f"stale: no round finished in {now - started:.0f}s since start (bound {stale_after_s:.0f}s)"
    return True, "ok"


# --------------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------------


class SnapshotError(Exception):
    pass


class StatusServer:
    """A running status server; created by :func:`start_status_server`."""

    def __init__(self, runner: web.AppRunner, site: web.TCPSite, host: str, port: int) -> None:
        self._runner = runner
        self._site = site
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "", None):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> StatusServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _make_app(
    snapshot: Callable[[], Any],
    kind: str,
    stale_after_s: float | None,
) -> web.Application:
    async def take() -> dict:
        try:
            result = snapshot()
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # noqa: BLE001 - any failure of the callable becomes a 500
            logger.warning("status snapshot failed: %r", e, exc_info=logger.isEnabledFor(logging.DEBUG))
            raise SnapshotError(f"{type(e).__name__}: {e}") from e
        if not isinstance(result, dict):
            raise SnapshotError(f"snapshot returned {type(result).__name__}, expected dict")
        return result

    def error_response(msg: str, as_json: bool) -> web.Response:
        if as_json:
            return web.Response(status=500, body=orjson.dumps({"error": msg}), content_type="application/json")
        return web.Response(status=500, text=f"error: {msg}\n")

    async def status(request: web.Request) -> web.Response:
        try:
            snap = await take()
            body = orjson.dumps(snap, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
        except SnapshotError as e:
            return error_response(f"snapshot failed: {e}", True)
        except (TypeError, orjson.JSONEncodeError) as e:
            return error_response(f"snapshot is not JSON-serialisable: {e}", True)
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        try:
            text = render_metrics(await take(), kind=kind)
        except SnapshotError as e:
            return error_response(f"snapshot failed: {e}", False)
        except Exception as e:  # noqa: BLE001 - never let a bad snapshot kill the endpoint
            logger.warning("metrics rendering failed: %r", e)
            return error_response(f"metrics rendering failed: {type(e).__name__}: {e}", False)
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        try:
            snap = await take()
            ok, reason = health_check(snap, kind=kind, stale_after_s=stale_after_s)
        except SnapshotError as e:
            return error_response(f"snapshot failed: {e}", False)
        except Exception as e:  # noqa: BLE001
            return error_response(f"health check failed: {type(e).__name__}: {e}", False)
        return web.Response(
            status=200 if ok else 503,
            text=("ok" if ok else f"unhealthy: {reason}") + "\n",
            headers={"Cache-Control": "no-store"},
        )

    page = "bootstrap.html" if kind == "bootstrap" else "index.html"

    async def index(request: web.Request) -> web.StreamResponse:
        path = STATIC_DIR / page
        if not path.is_file():
            return web.Response(status=404, text=f"dashboard asset {page} is not installed\n")
        return web.FileResponse(path, headers={"Cache-Control": "no-cache"})

    @web.middleware
    async def headers_mw(request: web.Request, handler: Callable) -> web.StreamResponse:
        resp = await handler(request)
        for k, v in _SECURITY_HEADERS.items():
            resp.headers.setdefault(k, v)
        return resp

    app = web.Application(middlewares=[headers_mw])
    app.router.add_get("/", index)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    if STATIC_DIR.is_dir():
        app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False)
    return app


async def start_status_server(
    snapshot: Callable[[], dict],
    host: str = "127.0.0.1",
    port: int = 0,
    kind: str = "node",
    *,
    stale_after_s: float | None = DEFAULT_STALE_AFTER_S,
) -> StatusServer:
    """Start the status server in the running event loop and return once it is listening.

    ``port=0`` picks a free port; the bound port is ``server.port``. ``kind`` is ``"node"`` or
    ``"bootstrap"``. ``stale_after_s`` bounds the age of the last finished round for /healthz (None: off).
    Stop it with ``await server.stop()``.
    """
    if kind not in ("node", "bootstrap"):
        raise ValueError(f"kind must be 'node' or 'bootstrap', not {kind!r}")
    app = _make_app(snapshot, kind, stale_after_s)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = _bound_port(runner.addresses) or port
    logger.info("status server (%s) listening on %s:%s", kind, host, bound)
    return StatusServer(runner, site, host, bound)


def _bound_port(addresses: Iterable[Any]) -> int | None:
    for addr in addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return None


class ThreadedStatusServer:
    """The same server on its own event loop in a daemon thread, for synchronous programs (the bootstrap).

    The snapshot callable is then called from that thread: it must be thread-safe (e.g. read a few ints).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, server: StatusServer) -> None:
        self._loop = loop
        self._thread = thread
        self.server = server
        self.port = server.port
        self.host = server.host
        self.url = server.url

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop)
        try:
            fut.result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)


def start_status_server_in_thread(
    snapshot: Callable[[], dict],
    host: str = "127.0.0.1",
    port: int = 0,
    kind: str = "node",
    *,
    stale_after_s: float | None = DEFAULT_STALE_AFTER_S,
    timeout: float = 10.0,
) -> ThreadedStatusServer:
    """Start the status server in a background thread; returns once it listens (raises if it cannot bind)."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started["server"] = loop.run_until_complete(
                start_status_server(snapshot, host, port, kind, stale_after_s=stale_after_s)
            )
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            started["error"] = e
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=f"sapo-status-{kind}", daemon=True)
    thread.start()
    if not ready.wait(timeout):
        raise TimeoutError("status server did not start")
    if "error" in started:
        raise started["error"]
    return ThreadedStatusServer(loop, thread, started["server"])
