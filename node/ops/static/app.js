/* SAPO node dashboard: polls ./status every 2 s and draws small hand-written canvas charts.
 * No libraries, no external resources. Untrusted strings (peer names, reasons) are only ever set via
 * textContent, never as HTML. */
(function () {
  "use strict";

  var POLL_MS = 2000;
  var MA_WINDOW = 10;
  var BAR_ROUNDS = 120; // bar charts show at most this many recent rounds
  var PHASE_ORDER = ["generate", "score", "publish", "fetch", "verify", "train", "checkpoint", "idle"];
  var PHASE_COLORS = {
    generate: "#2563eb", score: "#10b981", publish: "#f59e0b", fetch: "#8b5cf6", verify: "#a855f7",
    train: "#ef4444", checkpoint: "#64748b", idle: "#cbd5e1"
  };
  var EXTRA_COLORS = ["#0ea5e9", "#d946ef", "#84cc16", "#f97316", "#14b8a6"];

  var kind = document.body.dataset.kind || "node";
  var last = null;

  function $(id) { return document.getElementById(id); }
  function setText(id, v) { var el = $(id); if (el) el.textContent = v; }
  function cssVar(name, fallback) {
    var v = getComputedStyle(document.documentElement).getPropertyValue(name);
    return (v && v.trim()) || fallback;
  }
  function isNum(x) { return typeof x === "number" && isFinite(x); }
  function fmt(x, digits) { return isNum(x) ? x.toFixed(digits === undefined ? 3 : digits) : "–"; }
  function fmtInt(x) { return isNum(x) ? Math.round(x).toLocaleString("en-US") : "–"; }
  function fmtDuration(s) {
    if (!isNum(s)) return "–";
    s = Math.max(0, Math.floor(s));
    var d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    if (m) return m + "m " + sec + "s";
    return sec + "s";
  }
  function fmtAgo(ts) {
    if (!isNum(ts)) return "–";
    return fmtDuration(Date.now() / 1000 - ts) + " ago";
  }
  function short(key) {
    key = String(key || "");
    return key.length > 16 ? key.slice(0, 8) + "…" + key.slice(-6) : key;
  }
  function phaseColor(p, i) { return PHASE_COLORS[p] || EXTRA_COLORS[i % EXTRA_COLORS.length]; }

  /* ---------------------------------------------------------------- canvas helpers */

  function setupCanvas(canvas) {
    var dpr = window.devicePixelRatio || 1;
    var w = Math.max(50, canvas.clientWidth), h = Math.max(50, canvas.clientHeight);
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx: ctx, w: w, h: h, pad: { l: 46, r: 10, t: 10, b: 22 } };
  }

  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / n)));
    var err = span / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var ticks = [], t = Math.ceil(lo / step) * step;
    for (; t <= hi + step * 1e-9; t += step) ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    return ticks;
  }

  function tickLabel(t) {
    var a = Math.abs(t);
    if (a >= 1000) return (t / 1000).toFixed(a >= 10000 ? 0 : 1) + "k";
    if (a >= 10 || t === Math.round(t)) return String(Math.round(t * 10) / 10);
    return t.toFixed(a >= 1 ? 1 : 2);
  }

  function drawAxes(g, lo, hi, xFirst, xLast) {
    var ctx = g.ctx, p = g.pad, muted = cssVar("--muted", "#6b7385"), grid = cssVar("--border", "#dde1e8");
    var ticks = niceTicks(lo, hi, 4);
    ctx.strokeStyle = grid; ctx.fillStyle = muted; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    ticks.forEach(function (t) {
      var y = yPos(g, t, lo, hi);
      ctx.beginPath(); ctx.moveTo(p.l, Math.round(y) + 0.5); ctx.lineTo(g.w - p.r, Math.round(y) + 0.5); ctx.stroke();
      ctx.fillText(tickLabel(t), p.l - 6, y);
    });
    ctx.textBaseline = "top";
    if (xFirst !== undefined) { ctx.textAlign = "left"; ctx.fillText("round " + xFirst, p.l, g.h - p.b + 6); }
    if (xLast !== undefined && xLast !== xFirst) { ctx.textAlign = "right"; ctx.fillText("round " + xLast, g.w - p.r, g.h - p.b + 6); }
  }

  function yPos(g, v, lo, hi) {
    var p = g.pad;
    return g.h - p.b - (v - lo) / (hi - lo || 1) * (g.h - p.t - p.b);
  }

  function emptyMessage(g, msg) {
    g.ctx.fillStyle = cssVar("--muted", "#6b7385");
    g.ctx.textAlign = "center"; g.ctx.textBaseline = "middle";
    g.ctx.fillText(msg, g.w / 2, g.h / 2);
  }

  /* series: [{values: [number|null], color}], xs: round numbers */
  function drawLineChart(canvas, xs, series) {
    var g = setupCanvas(canvas), ctx = g.ctx, p = g.pad;
    var all = [];
    series.forEach(function (s) { s.values.forEach(function (v) { if (isNum(v)) all.push(v); }); });
    canvas.dataset.points = String(xs.length);
    if (!xs.length || !all.length) { emptyMessage(g, "waiting for the first round…"); return; }
    var lo = Math.min.apply(null, all), hi = Math.max.apply(null, all);
    if (lo === hi) { lo -= 0.5; hi += 0.5; }
    var ticks = niceTicks(lo, hi, 4); lo = Math.min(lo, ticks[0]); hi = Math.max(hi, ticks[ticks.length - 1]);
    drawAxes(g, lo, hi, xs[0], xs[xs.length - 1]);
    var x0 = xs[0], x1 = xs[xs.length - 1], plotW = g.w - p.l - p.r;
    function xPos(x) { return x1 === x0 ? p.l + plotW / 2 : p.l + (x - x0) / (x1 - x0) * plotW; }
    series.forEach(function (s) {
      ctx.strokeStyle = s.color; ctx.lineWidth = s.width || 1.5; ctx.beginPath();
      var pen = false, n = 0;
      for (var i = 0; i < xs.length; i++) {
        var v = s.values[i];
        if (!isNum(v)) { if (!s.connect) pen = false; continue; }  // connect: sparse series (eval rounds)
        var x = xPos(xs[i]), y = yPos(g, v, lo, hi);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        pen = true; n++;
      }
      ctx.stroke();
      if (n === 1 || xs.length < 40) { // mark points when there are few of them
        ctx.fillStyle = s.color;
        for (var j = 0; j < xs.length; j++) {
          if (!isNum(s.values[j])) continue;
          ctx.beginPath(); ctx.arc(xPos(xs[j]), yPos(g, s.values[j], lo, hi), 2, 0, 2 * Math.PI); ctx.fill();
        }
      }
    });
  }

  /* stacks: [{values: [number], color}] drawn bottom-up, one bar per x */
  function drawStackedBars(canvas, xs, stacks) {
    var g = setupCanvas(canvas), ctx = g.ctx, p = g.pad;
    canvas.dataset.points = String(xs.length);
    if (!xs.length) { emptyMessage(g, "waiting for the first round…"); return; }
    var totals = xs.map(function (_, i) {
      return stacks.reduce(function (a, s) { return a + (isNum(s.values[i]) ? Math.max(0, s.values[i]) : 0); }, 0);
    });
    var hi = Math.max.apply(null, totals.concat([1e-9]));
    var ticks = niceTicks(0, hi, 4); hi = Math.max(hi, ticks[ticks.length - 1]);
    drawAxes(g, 0, hi, xs[0], xs[xs.length - 1]);
    var plotW = g.w - p.l - p.r, slot = plotW / xs.length, bw = Math.max(1, slot * 0.8);
    for (var i = 0; i < xs.length; i++) {
      var base = 0, x = p.l + i * slot + (slot - bw) / 2;
      for (var k = 0; k < stacks.length; k++) {
        var v = stacks[k].values[i];
        if (!isNum(v) || v <= 0) continue;
        var yTop = yPos(g, base + v, 0, hi), yBot = yPos(g, base, 0, hi);
        ctx.fillStyle = stacks[k].color;
        ctx.fillRect(x, yTop, bw, Math.max(0.5, yBot - yTop));
        base += v;
      }
    }
  }

  /* ---------------------------------------------------------------- rendering */

  function movingAverage(vals, w) {
    var out = [], sum = 0, q = [];
    vals.forEach(function (v) {
      if (isNum(v)) { q.push(v); sum += v; if (q.length > w) sum -= q.shift(); }
      out.push(q.length ? sum / q.length : null);
    });
    return out;
  }

  function renderCharts(s) {
    var hist = Array.isArray(s.history) ? s.history.filter(function (r) { return r && isNum(r.round); }) : [];
    var xs = hist.map(function (r) { return r.round; });
    var rewards = hist.map(function (r) { return isNum(r.reward_mean) ? r.reward_mean : null; });
    drawLineChart($("reward-chart"), xs, [
      { values: rewards, color: cssVar("--reward", "#2563eb") },
      { values: movingAverage(rewards, MA_WINDOW), color: cssVar("--ma", "#f59e0b"), width: 2 }
    ]);

    renderHealthChart(hist, xs);

    var recent = hist.slice(-BAR_ROUNDS), rx = recent.map(function (r) { return r.round; });
    drawStackedBars($("mix-chart"), rx, [
      { values: recent.map(function (r) { return r.num_local; }), color: cssVar("--local", "#10b981") },
      { values: recent.map(function (r) { return r.num_external; }), color: cssVar("--external", "#8b5cf6") }
    ]);

    var phases = PHASE_ORDER.slice();
    recent.forEach(function (r) {
      Object.keys(r.phase_s || {}).forEach(function (ph) { if (phases.indexOf(ph) < 0) phases.push(ph); });
    });
    var used = phases.filter(function (ph) {
      return recent.some(function (r) { return r.phase_s && isNum(r.phase_s[ph]) && r.phase_s[ph] > 0; });
    });
    drawStackedBars($("phase-chart"), rx, used.map(function (ph, i) {
      return { values: recent.map(function (r) { return (r.phase_s || {})[ph]; }), color: phaseColor(ph, i) };
    }));
    var legend = $("phase-legend");
    legend.textContent = "";
    used.forEach(function (ph, i) {
      var sw = document.createElement("span"); sw.className = "sw"; sw.style.background = phaseColor(ph, i);
      legend.appendChild(sw); legend.appendChild(document.createTextNode(ph));
    });
    renderPhaseTable(s.phase_s || (hist.length ? hist[hist.length - 1].phase_s : null) || {});
  }

  // Held-out accuracy (evaluated rounds only, joined; the unseen set's where the mix has one) and the share
  // of groups with signal, all in [0, 1].
  function renderHealthChart(hist, xs) {
    var pick = function (k) { return hist.map(function (r) { return isNum(r[k]) ? r[k] : null; }); };
    drawLineChart($("health-chart"), xs, [
      { values: pick("eval_accuracy"), color: cssVar("--eval", "#dc2626"), width: 2, connect: true },
      { values: pick("eval_unseen_accuracy"), color: cssVar("--unseen", "#9333ea"), width: 2, connect: true },
      { values: pick("signal_frac"), color: cssVar("--signal", "#0891b2") }
    ]);
  }

  function renderHealth(s) {
    var ev = s.eval || {};
    setText("v-eval", isNum(ev.eval_accuracy) ? fmt(ev.eval_accuracy) + " @" + ev.round : "–");
    setText("v-unseen", isNum(ev.eval_unseen_accuracy) ? fmt(ev.eval_unseen_accuracy) + " @" + ev.round : "–");
    var unseenBase = isNum(ev.eval_unseen_baseline) ? " / " + fmt(ev.eval_unseen_baseline) : "";
    setText("v-baseline", fmt(ev.eval_baseline) + unseenBase);
    var guard = s.guard || {};
    setText("v-guard", (isNum(guard.restores) ? guard.restores : "–") + " / " +
      (isNum(guard.lr) ? guard.lr.toExponential(2) : "–"));
    var lastGuard = guard.last || null;
    var guardCard = $("v-guard");
    if (guardCard) guardCard.title = lastGuard ? "round " + lastGuard.round + ": " + lastGuard.reason +
      " (restored " + (lastGuard.restored_to === -1 ? "the starting weights" : "round " + lastGuard.restored_to) +
      ")" : "no restore yet";
    setText("v-health", fmt(s.entropy, 2) + " / " + (isNum(s.signal_frac) ? (100 * s.signal_frac).toFixed(0) + "%" : "–"));
  }

  function renderPhaseTable(ps) {
    var tbody = $("phase-table").tBodies[0];
    tbody.textContent = "";
    var keys = Object.keys(ps).filter(function (k) { return isNum(ps[k]); });
    keys.sort(function (a, b) {
      var ia = PHASE_ORDER.indexOf(a), ib = PHASE_ORDER.indexOf(b);
      return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || (a < b ? -1 : 1);
    });
    var total = keys.reduce(function (a, k) { return a + ps[k]; }, 0);
    keys.forEach(function (k) {
      var tr = tbody.insertRow();
      tr.insertCell().textContent = k;
      var c1 = tr.insertCell(); c1.className = "num"; c1.textContent = fmt(ps[k], 2);
      var c2 = tr.insertCell(); c2.className = "num"; c2.textContent = total > 0 ? (100 * ps[k] / total).toFixed(0) + "%" : "–";
    });
  }

  function renderPeers(s) {
    var peers = (s.peers && typeof s.peers === "object") ? s.peers : {};
    var groups = s.groups || {}, acc = groups.accepted || {}, rej = groups.rejected || {};
    var rep = (s.reputation && typeof s.reputation === "object" && s.reputation.peers) || {};
    var keys = Object.keys(peers);
    Object.keys(acc).concat(Object.keys(rej), Object.keys(rep)).forEach(function (k) {
      if (keys.indexOf(k) < 0) keys.push(k);
    });
    keys.sort(function (a, b) { return ((peers[b] || {}).last_seen || 0) - ((peers[a] || {}).last_seen || 0); });
    var tbody = $("peer-table").tBodies[0];
    tbody.textContent = "";
    keys.forEach(function (k) {
      var p = peers[k] || {}, tr = tbody.insertRow();
      tr.insertCell().textContent = p.name ? String(p.name) : "?";
      var kc = tr.insertCell(); kc.className = "mono"; kc.textContent = short(k); kc.title = k;
      var c;
      c = tr.insertCell(); c.className = "num"; c.textContent = isNum(p.last_round) ? String(p.last_round) : "–";
      c = tr.insertCell(); c.className = "num"; c.textContent = fmtAgo(p.last_seen);
      c = tr.insertCell(); c.className = "num"; c.textContent = fmtInt(acc[k] || 0);
      var r = rep[k] || {};
      c = tr.insertCell(); c.className = "num"; c.textContent = isNum(r.score) ? r.score.toFixed(2) : "–";
      c = tr.insertCell();
      c.textContent = isNum(r.banned_until) ? new Date(r.banned_until * 1000).toLocaleString() : "–";
      if (isNum(r.banned_until)) tr.className = "banned";
      c = tr.insertCell();
      var reasons = rej[k] || {};
      Object.keys(reasons).sort().forEach(function (r) {
        var tag = document.createElement("span"); tag.className = "tag";
        tag.textContent = r + ": " + reasons[r];
        c.appendChild(tag);
      });
      if (!c.childNodes.length) c.textContent = "–";
    });
    $("peer-empty").style.display = keys.length ? "none" : "";
  }

  // joined, silo, or "solo: waiting for peers since <local time>" while no peer answers (p2p/membership.py)
  function renderMembership(m) {
    var el = $("v-swarm");
    if (!el) return;
    m = (m && typeof m === "object") ? m : {};
    var text = typeof m.state === "string" ? m.state : "–";
    if (m.state === "solo") {
      text = "solo: waiting for peers" + (isNum(m.since) ? " since " + new Date(m.since * 1000).toLocaleString() : "");
    }
    el.textContent = text;
    el.title = m.state === "solo" && m.last_error ? "last try: " + String(m.last_error) : "";
    el.dataset.state = typeof m.state === "string" ? m.state : "";
  }

  function renderIdentity(s) {
    setText("i-peer-id", s.peer_id || "–");
    setText("i-pubkey", s.public_key || "–");
    setText("i-swarm", s.swarm || "–");
    setText("i-model", s.model || "–");
    setText("i-version", s.version || "–");
    var m = $("i-maddrs");
    if (m) {
      m.textContent = "";
      (Array.isArray(s.maddrs) ? s.maddrs : []).forEach(function (a) {
        var d = document.createElement("div"); d.textContent = String(a); m.appendChild(d);
      });
      if (!m.childNodes.length) m.textContent = "–";
    }
  }

  function renderNode(s) {
    var totals = s.totals || {};
    setText("peer-name", s.name ? "· " + s.name : (s.peer_id ? "· " + short(s.peer_id) : ""));
    setText("v-round", isNum(s.round) ? String(s.round) : "–");
    setText("v-phase", s.phase || "–");
    setText("v-reward", fmt(s.last_reward));
    setText("v-ma", fmt(s.reward_ma));
    setText("v-peers", s.peers ? String(Object.keys(s.peers).length) : "–");
    renderMembership(s.membership);
    setText("v-banned", s.reputation && isNum(s.reputation.banned) ? String(s.reputation.banned) : "–");
    setText("v-tokens", fmtInt(totals.tokens_generated));
    setText("v-groups", fmtInt(totals.groups_local) + " / " + fmtInt(totals.groups_external));
    setText("v-uptime", fmtDuration(s.uptime_s));
    renderHealth(s);
    renderIdentity(s);
    renderCharts(s);
    renderPeers(s);
  }

  function renderBootstrap(s) {
    setText("v-peers-seen", fmtInt(s.peers_seen));
    setText("v-uptime", fmtDuration(s.uptime_s));
    renderIdentity(s);
  }

  function render(s) {
    if (kind === "bootstrap") renderBootstrap(s); else renderNode(s);
  }

  function setConn(state, msg) {
    var el = $("conn");
    if (!el) return;
    el.dataset.state = state;
    el.textContent = msg;
  }

  function poll() {
    fetch("status", { cache: "no-store", headers: { "Accept": "application/json" } })
      .then(function (resp) {
        return resp.json().catch(function () { return {}; }).then(function (body) {
          if (!resp.ok) throw new Error((body && body.error) || ("HTTP " + resp.status));
          return body;
        });
      })
      .then(function (s) {
        last = s;
        render(s);
        setConn("ok", "live · updated " + new Date().toLocaleTimeString());
      })
      .catch(function (e) {
        setConn("error", "status unavailable: " + (e && e.message ? e.message : e));
      })
      .then(function () { setTimeout(poll, POLL_MS); });
  }

  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () { if (last && kind !== "bootstrap") renderCharts(last); }, 100);
  });

  poll();
})();
