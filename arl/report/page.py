"""The run report: run_dir/report.html, one self-contained page (inline CSS, JS and SVG; nothing fetched from the
network), plus run_dir/curves.png when matplotlib is installed.

The page shows curves of held-out accuracy, reward, staleness (and the admitted eta), throughput, inference-server
busy, learner idle, the train-inference mismatch, the objective's clipped and masked fractions and each role's
resident memory (from metrics.jsonl) and a trajectory browser over traces.jsonl (filter by reward,
termination and outcome; generated tokens told apart from context by colour). Its data is one JSON object embedded in the page
(`<script id="arl-data" type="application/json">`), which `report_data` builds and the tests read back.

The controller rebuilds the page at each evaluation (in a thread, `ReportBuilder.request`) and the page and
curves.png at the end of the run;
`python scripts/report.py RUN_DIR` rebuilds it for any run directory.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Optional

from arl.report.traces import read_jsonl, tail_jsonl

logger = logging.getLogger("arl.report")

MAX_TRACES = 400  # traces embedded in the page (the newest); traces.jsonl keeps them all


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        return None
    return float(x)


def _get(rec: dict, path: str) -> Optional[float]:
    cur: Any = rec
    for part in path.split("/"):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return _num(cur)


def _server_busy(rec: dict) -> Optional[float]:
    idle = _get(rec, "inference_idle_frac")
    return None if idle is None else 1.0 - idle


def _learner_idle(rec: dict) -> Optional[float]:
    wait, step = _get(rec, "learner_wait_seconds"), _get(rec, "learner_step_seconds")
    if wait is None or step is None or wait + step <= 0:
        return None
    return wait / (wait + step)


def _field(path: str) -> Callable[[dict], Optional[float]]:
    return lambda rec: _get(rec, path)


# chart id -> (title, y label, record type, [(series label, value of a record)])
CHARTS: list[tuple[str, str, str, str, list[tuple[str, Callable[[dict], Optional[float]]]]]] = [
    ("accuracy", "Held-out accuracy", "accuracy", "eval",
     [("first answer", _field("first_acc")), ("solved within all turns", _field("solved_acc"))]),
    ("reward", "Reward", "mean reward", "train",
     [("trained batch", _field("reward_mean")), ("all rollouts (before filters)", _field("rollout/reward"))]),
    ("staleness", "Staleness", "policy versions behind", "train",
     [("head (newest batch)", _field("head_offpolicyness")), ("tail (oldest)", _field("tail_offpolicyness")),
      ("admitted eta (auto)", _field("admitted_eta"))]),
    ("throughput", "Learner throughput", "per second", "train",
     [("tokens/s", _field("tokens_per_s")), ("samples/s", _field("samples_per_s"))]),
    ("busy", "Inference servers busy", "fraction of time", "train", [("busy", _server_busy)]),
    ("learner_idle", "Learner idle", "fraction of step time", "train", [("waiting for data", _learner_idle)]),
    ("mismatch", "Train-inference mismatch (same-version tokens)", "per token", "train",
     [("KL engine || learner (k3)", _field("mismatch_kl")), ("past the threshold", _field("mismatch_frac"))]),
    ("health", "Objective health", "fraction of tokens", "train",
     [("clipped", _field("clip_frac")), ("masked by cap / corrections", _field("capped_frac"))]),
]


def memory_chart(trains: list[dict]) -> dict[str, Any]:
    """Resident memory per role process over the steps (train records' `rss_mib`): a curve that climbs with the work
    done is a leak, one that flattens after warm-up is not."""
    roles = sorted({k for r in trains if isinstance(r.get("rss_mib"), dict) for k in r["rss_mib"]})
    series = []
    for role in roles:
        pts = [[int(r["step"]), v] for r in trains if (v := _get(r, f"rss_mib/{role}")) is not None]
        if pts:
            series.append({"label": role, "points": sorted(pts, key=lambda p: p[0])})
    return {"id": "memory", "title": "Memory per role (RSS)", "ylabel": "MiB", "series": series}


def pick_traces(traces: list[dict], limit: int) -> list[dict]:
    """The newest `limit` traces, half of the room kept for sampled ones (filtered groups can outnumber them many
    times over), in file order."""
    if limit <= 0 or len(traces) <= limit:
        return list(traces)
    sampled = [i for i, t in enumerate(traces) if t.get("why") == "sampled"]
    other = [i for i, t in enumerate(traces) if t.get("why") != "sampled"]
    n_sampled = min(len(sampled), max(limit // 2, limit - len(other)))
    n_other = limit - n_sampled  # <= len(other), as there are more traces than `limit`
    chosen = sampled[len(sampled) - n_sampled:] + other[len(other) - n_other:]
    return [traces[i] for i in sorted(chosen)]


def report_data(run_dir: str, max_traces: int = MAX_TRACES) -> dict[str, Any]:
    """Everything the page shows, as one JSON-able object: charts (series of [step, value]), evaluations, the
    run's summary, and the newest `max_traces` trajectory traces."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    charts = []
    for cid, title, ylabel, rtype, series in CHARTS:
        recs = [r for r in records if r.get("type") == rtype and _num(r.get("step")) is not None]
        out_series = []
        for label, value in series:
            pts = sorted(([int(r["step"]), round(v, 6)] for r in recs if (v := value(r)) is not None),
                         key=lambda p: p[0])
            if pts:
                out_series.append({"label": label, "points": pts})
        charts.append({"id": cid, "title": title, "ylabel": ylabel, "series": out_series})
    charts.append(memory_chart([r for r in records if r.get("type") == "train" and _num(r.get("step")) is not None]))
    evals = [{"step": int(r["step"]), "first_acc": _num(r.get("first_acc")), "solved_acc": _num(r.get("solved_acc")),
              "n": r.get("n"), "seconds": _num(r.get("seconds"))}
             for r in records if r.get("type") == "eval" and _num(r.get("step")) is not None]
    summary = next((r for r in reversed(records) if r.get("type") == "summary"), None)
    trains = [r for r in records if r.get("type") == "train"]
    # the newest traces only (a day's traces.jsonl is not parsed at every evaluation): enough to pick from
    recent, n_traces = tail_jsonl(os.path.join(run_dir, "traces.jsonl"), 8 * max_traces)
    traces = pick_traces(recent, max_traces)
    return {
        "run": os.path.basename(os.path.normpath(run_dir)),
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": max((int(r["step"]) for r in trains if _num(r.get("step")) is not None), default=0),
        "elapsed": _num(trains[-1].get("elapsed")) if trains else None,
        "charts": charts,
        "evals": evals,
        "summary": {k: summary.get(k) for k in ("finished", "failure", "steps", "groups", "accepted_groups",
                                                "accepted_trajectories", "rollout_restarts", "inference_restarts")}
        if summary else None,
        "faults": sum(1 for r in records if r.get("type") == "fault"),
        "traces_total": n_traces,
        "traces": traces,
    }


def _json_for_script(data: Any) -> str:
    # inside <script>, "</" would end the element and "<!--" open a comment: escape both; \u2028/9 are fine in
    # JSON but not in older JS parsers
    text = json.dumps(data, default=float, allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _clean(data: Any) -> Any:
    """NaN/inf become null (JSON has neither)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {str(k): _clean(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_clean(v) for v in data]
    return data


def render_html(data: dict) -> str:
    title = f"ARL run report: {data.get('run', '')}"
    head, tail = _TEMPLATE.split("__DATA__")
    return head.replace("__TITLE__", html.escape(title)) + _json_for_script(_clean(data)) + tail


def write_curves_png(data: dict, path: str) -> bool:
    """The same charts as a PNG grid; False (with a log line) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no curves.png (pip install matplotlib)")
        return False
    charts = data["charts"]
    cols = 3
    rows = -(-len(charts) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, chart in zip(axes.flat, charts):
        for s in chart["series"]:
            xs, ys = zip(*s["points"])
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=s["label"])
        ax.set_title(chart["title"])
        ax.set_xlabel("step (policy version)")
        ax.set_ylabel(chart["ylabel"])
        ax.grid(alpha=0.3)
        if chart["series"]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(charts):]:
        ax.axis("off")
    fig.suptitle(data.get("run", ""))
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def write_report(run_dir: str, max_traces: int = MAX_TRACES, png: bool = True) -> str:
    """Build run_dir/report.html (atomically replaced) and, when `png`, run_dir/curves.png. Returns the page's
    path."""
    data = report_data(run_dir, max_traces)
    path = os.path.join(run_dir, "report.html")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_html(data))
    os.replace(tmp, path)
    if png:
        write_curves_png(data, os.path.join(run_dir, "curves.png"))
    return path


class ReportBuilder:
    """Rebuilds a run's report for the controller: `request()` starts a build of the page in a thread (at most one
    at a time; a request during a build runs one more build after it), `build()` builds the page and curves.png
    now (end of run; the PNG only then, as matplotlib costs seconds of CPU the running roles need). A failed build
    is logged, never raised: the report must not stop a run."""

    def __init__(self, run_dir: str, max_traces: int = MAX_TRACES) -> None:
        self.run_dir, self.max_traces = run_dir, max_traces
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._again = False
        self.builds = 0

    def _build_once(self, png: bool = False) -> None:
        try:
            write_report(self.run_dir, self.max_traces, png=png)
            self.builds += 1
        except Exception as e:  # noqa: BLE001
            logger.warning("could not build the run report: %s: %s", type(e).__name__, e)

    def _loop(self) -> None:
        while True:
            self._build_once()
            with self._lock:
                if not self._again:
                    self._thread = None
                    return
                self._again = False

    def request(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._again = True
                return
            self._thread = threading.Thread(target=self._loop, name="arl-report", daemon=True)
            self._thread.start()

    def build(self) -> None:
        with self._lock:
            t = self._thread
        if t is not None:
            t.join(timeout=60)
        self._build_once(png=True)


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:20px}
header .meta{opacity:.8;font-size:13px;margin-top:4px}
main{padding:16px 24px}
h2{font-size:16px;margin:20px 0 8px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:14px}
.card{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px 12px}
.card h3{margin:0 0 4px;font-size:14px}
svg text{font-size:10px;fill:#555}
.legend{font-size:11px;color:#444}
.legend span{display:inline-block;margin-right:10px}
.legend i{display:inline-block;width:10px;height:3px;vertical-align:middle;margin-right:4px}
table{border-collapse:collapse;font-size:12px}
td,th{border-bottom:1px solid #e4e7eb;padding:3px 8px;text-align:left}
.filters{display:flex;gap:12px;flex-wrap:wrap;align-items:center;font-size:13px;margin-bottom:8px}
.browser{display:grid;grid-template-columns:minmax(280px,30%) 1fr;gap:12px}
#tlist{max-height:640px;overflow:auto;background:#fff;border:1px solid #dde1e7;border-radius:6px}
#tlist div{padding:5px 8px;border-bottom:1px solid #eef0f3;cursor:pointer;font-size:12px}
#tlist div.sel{background:#e6eefc}
#tlist div:hover{background:#f0f4fb}
#tview{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px;min-height:200px}
.seg{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;padding:1px 2px;
border-radius:3px}
.gen{background:#c9f2d0;color:#0b4d1a}
.ctx{background:#eceef2;color:#333}
.role{font-size:10px;font-weight:600;color:#fff;background:#7a8394;border-radius:3px;padding:0 4px;margin:0 3px}
.role.assistant{background:#2f8f46}.role.tool{background:#b5761b}.role.user{background:#4a6fd1}
.tag{display:inline-block;font-size:11px;border-radius:3px;padding:0 5px;margin-right:4px;background:#eceef2}
.tag.bad{background:#fbd9d9}.tag.good{background:#c9f2d0}
.key span{margin-right:12px;font-size:12px}
#arl-errors{color:#b00020;font-family:monospace;white-space:pre-wrap}
</style></head>
<body>
<header><h1 id="title">ARL run report</h1><div class="meta" id="meta"></div></header>
<main>
<div id="arl-errors"></div>
<h2>Evaluations</h2><div id="evals" class="card"></div>
<h2>Curves</h2><div id="charts" class="grid"></div>
<h2>Trajectories</h2>
<div class="filters">
 <label>reward <select id="f-reward"><option value="">any</option><option value="pos">&gt; 0</option>
  <option value="zero">= 0</option><option value="none">unknown (no trajectory)</option></select></label>
 <label>termination <select id="f-term"><option value="">any</option></select></label>
 <label>outcome <select id="f-outcome"><option value="">any</option></select></label>
 <span id="f-count"></span>
</div>
<div class="key"><span><span class="seg gen">generated by the policy</span></span>
 <span><span class="seg ctx">context (prompt, feedback, tool output)</span></span></div>
<div class="browser"><div id="tlist"></div><div id="tview">Select a trajectory.</div></div>
</main>
<script id="arl-data" type="application/json">__DATA__</script>
<script>
"use strict";
window.addEventListener("error", function (e) {
  document.body.setAttribute("data-js-error", String(e.message));
  document.getElementById("arl-errors").textContent += "script error: " + e.message + "\n";
});
var COLORS = ["#2f6fd1", "#d1562f", "#2f8f46", "#8a3fb8", "#b5761b"];
var D = JSON.parse(document.getElementById("arl-data").textContent);
function el(tag, attrs, text) {
  var e = document.createElement(tag);
  for (var k in (attrs || {})) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function svgEl(tag, attrs) {
  var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  return e;
}
function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  var a = Math.abs(v);
  return a >= 1000 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : a >= 0.01 || a === 0 ? v.toFixed(3) : v.toExponential(1);
}
function chart(c) {
  var W = 380, H = 210, L = 46, R = 10, T = 8, B = 30;
  var card = el("div", {"class": "card", "id": "chart-" + c.id});
  card.appendChild(el("h3", {}, c.title));
  var svg = svgEl("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H});
  var xs = [], ys = [];
  c.series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
  if (!xs.length) {
    var t = svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}); t.textContent = "no data yet";
    svg.appendChild(t); card.appendChild(svg); return card;
  }
  var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
  var y0 = Math.min(0, Math.min.apply(null, ys)), y1 = Math.max.apply(null, ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  function sx(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
  function sy(y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); }
  for (var i = 0; i <= 4; i++) {
    var yv = y0 + (y1 - y0) * i / 4, yy = sy(yv);
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: yy, y2: yy, stroke: "#e6e8ec"}));
    var lt = svgEl("text", {x: L - 4, y: yy + 3, "text-anchor": "end"}); lt.textContent = fmt(yv); svg.appendChild(lt);
  }
  var xstep = Math.max(1, Math.ceil((x1 - x0) / 6));  // steps are integers: integer ticks
  for (var xv = Math.ceil(x0); xv <= x1; xv += xstep) {
    var xt = svgEl("text", {x: sx(xv), y: H - B + 13, "text-anchor": "middle"});
    xt.textContent = xv; svg.appendChild(xt);
  }
  var xl = svgEl("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"});
  xl.textContent = "step (policy version) - " + c.ylabel; svg.appendChild(xl);
  c.series.forEach(function (s, k) {
    var col = COLORS[k % COLORS.length];
    var d = s.points.map(function (p, j) { return (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); });
    svg.appendChild(svgEl("path", {d: d.join(" "), fill: "none", stroke: col, "stroke-width": 2}));
    if (s.points.length < 40) s.points.forEach(function (p) {
      var dot = svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: col});
      var tt = svgEl("title", {}); tt.textContent = s.label + " @" + p[0] + ": " + fmt(p[1]);
      dot.appendChild(tt); svg.appendChild(dot);
    });
  });
  card.appendChild(svg);
  var lg = el("div", {"class": "legend"});
  c.series.forEach(function (s, k) {
    var sp = el("span"); var sw = el("i"); sw.style.background = COLORS[k % COLORS.length];
    sp.appendChild(sw); sp.appendChild(document.createTextNode(s.label + " (last " + fmt(s.points[s.points.length - 1][1]) + ")"));
    lg.appendChild(sp);
  });
  card.appendChild(lg);
  return card;
}
function header() {
  document.getElementById("title").textContent = "ARL run report: " + D.run;
  var s = D.summary, parts = ["built " + D.built, D.steps + " steps"];
  if (D.elapsed !== null) parts.push(fmt(D.elapsed) + " s");
  if (s) parts.push(s.finished ? "finished" : "NOT finished" + (s.failure ? ": " + s.failure.slice(0, 200) : ""));
  else parts.push("running (no summary yet)");
  if (D.faults) parts.push(D.faults + " faults");
  parts.push(D.traces_total + " traces (" + D.traces.length + " shown)");
  document.getElementById("meta").textContent = parts.join(" | ");
  var box = document.getElementById("evals");
  if (!D.evals.length) { box.textContent = "no evaluation yet"; return; }
  var t = el("table"), hr = el("tr");
  ["step", "first-answer accuracy", "solved within all turns", "prompts", "seconds"].forEach(function (h) { hr.appendChild(el("th", {}, h)); });
  t.appendChild(hr);
  D.evals.forEach(function (e) {
    var r = el("tr");
    [e.step, fmt(e.first_acc), fmt(e.solved_acc), e.n, fmt(e.seconds)].forEach(function (v) { r.appendChild(el("td", {}, String(v))); });
    t.appendChild(r);
  });
  box.appendChild(t);
}
function fillSelect(id, values) {
  var s = document.getElementById(id);
  values.forEach(function (v) { s.appendChild(el("option", {value: v}, v)); });
  s.addEventListener("change", renderList);
}
function uniq(key) {
  var seen = {};
  D.traces.forEach(function (t) { seen[String(t[key] === null || t[key] === undefined ? "-" : t[key])] = 1; });
  return Object.keys(seen).sort();
}
var selected = -1;
function passes(t) {
  var r = document.getElementById("f-reward").value, term = document.getElementById("f-term").value,
      out = document.getElementById("f-outcome").value;
  if (r === "pos" && !(t.reward > 0)) return false;
  if (r === "zero" && t.reward !== 0) return false;
  if (r === "none" && t.reward !== null) return false;
  if (term && String(t.termination === null || t.termination === undefined ? "-" : t.termination) !== term) return false;
  if (out && t.outcome !== out) return false;
  return true;
}
function renderList() {
  var list = document.getElementById("tlist"); list.textContent = "";
  var n = 0;
  for (var i = D.traces.length - 1; i >= 0; i--) {  // newest first
    var t = D.traces[i];
    if (!passes(t)) continue;
    n++;
    var row = el("div", {"data-i": i});
    if (i === selected) row.className = "sel";
    row.textContent = "step " + t.step + " | reward " + fmt(t.reward) + " | " + (t.termination || "-") +
      (t.outcome !== "accepted" ? " | " + t.outcome : "") + (t.filtered ? " | filtered: " + t.filtered : "") +
      " | " + (t.prompt_id || t.group);
    row.addEventListener("click", (function (k, tr) { return function () { selected = k; renderList(); show(tr); }; })(i, t));
    list.appendChild(row);
  }
  document.getElementById("f-count").textContent = n + " of " + D.traces.length + " trajectories";
}
function show(t) {
  var v = document.getElementById("tview"); v.textContent = "";
  var tags = el("div");
  function tag(text, cls) { tags.appendChild(el("span", {"class": "tag " + (cls || "")}, text)); }
  tag("step " + t.step); tag("reward " + fmt(t.reward), t.reward > 0 ? "good" : "");
  tag("termination " + (t.termination || "-")); tag("outcome " + t.outcome, t.outcome === "accepted" ? "" : "bad");
  if (t.filtered) tag("filtered: " + t.filtered, "bad");
  if (t.reconstructed) tag("rebuilt from requests (agent returned no trajectory)", "bad");
  tag(t.why); tag("versions " + JSON.stringify(t.versions)); tag(t.n_generated + "/" + t.n_tokens + " tokens generated");
  if (t.admission_s !== null && t.admission_s !== undefined) tag("admission wait " + fmt(t.admission_s) + " s");
  if (t.turn_rewards && t.turn_rewards.length) tag("turn rewards " + JSON.stringify(t.turn_rewards));
  v.appendChild(tags);
  var body = el("div", {style: "margin-top:8px;line-height:1.7"});
  (t.segments || []).forEach(function (s) {
    body.appendChild(el("span", {"class": "role " + s.role}, s.role + (s.gen && s.v && s.v.length ? " v" + s.v.join("-") : "")));
    body.appendChild(el("span", {"class": "seg " + (s.gen ? "gen" : "ctx"), title: s.source + ", " + s.n + " tokens"}, s.text));
  });
  v.appendChild(body);
  if (t.turns && t.turns.length) {
    v.appendChild(el("h3", {style: "font-size:13px;margin:12px 0 4px"}, "Turns"));
    var tb = el("table"), hr = el("tr");
    ["turn", "sent at (s)", "inference (s)", "worker", "attempts", "tokens", "finish", "env/tool until next (s)"].forEach(function (h) { hr.appendChild(el("th", {}, h)); });
    tb.appendChild(hr);
    t.turns.forEach(function (u) {
      var r = el("tr");
      [u.turn, fmt(u.t_sent), fmt(u.inference_s), u.worker, u.attempts, u.n, u.finish, fmt(u.env_tool_s)].forEach(function (x) {
        r.appendChild(el("td", {}, x === undefined || x === null ? "-" : String(x)));
      });
      tb.appendChild(r);
    });
    v.appendChild(tb);
  }
  if (t.metadata && Object.keys(t.metadata).length) {
    v.appendChild(el("pre", {style: "font-size:11px;color:#555"}, JSON.stringify(t.metadata)));
  }
}
header();
var box = document.getElementById("charts");
D.charts.forEach(function (c) { box.appendChild(chart(c)); });
fillSelect("f-term", uniq("termination"));
fillSelect("f-outcome", uniq("outcome"));
document.getElementById("f-reward").addEventListener("change", renderList);
renderList();
if (D.traces.length) {  // open the newest real trajectory (not one rebuilt from requests) when there is one
  selected = D.traces.length - 1;
  for (var j = D.traces.length - 1; j >= 0; j--) if (!D.traces[j].reconstructed) { selected = j; break; }
  renderList(); show(D.traces[selected]);
}
document.body.setAttribute("data-rendered", "ok");
</script>
</body></html>
"""


__all__ = ["CHARTS", "MAX_TRACES", "ReportBuilder", "pick_traces", "report_data", "render_html", "write_report",
           "write_curves_png"]
