// The live dashboard: polls /dashboard/status every second and turns successive
// snapshots (cumulative counters, histogram sums and counts) into rates and means over
// the last WINDOW_S seconds; the cluster's tables are shown as the snapshot holds them.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 5;
const KEEP_S = 120;  // snapshots and sparkline points kept

const $ = (id) => document.getElementById(id);
const snapshots = [];
const series = new Map();  // figure key -> [value or null], one per poll
let updates = 0;

const fixed = (digits) => (v) => v.toFixed(digits);
const TILES = [
  { key: "requests_per_s", label: "requests / s", format: fixed(2), why: "" },
  { key: "tokens_per_s", label: "generated tokens / s", format: fixed(1), why: "" },
  { key: "in_flight", label: "requests in flight (this gateway)", format: fixed(0), why: "" },
  { key: "running", label: "running (scheduler)", format: fixed(0), why: "the scheduler did not answer" },
  { key: "waiting", label: "waiting (scheduler)", format: fixed(0), why: "the scheduler did not answer" },
  { key: "ttft", label: "time to first token (mean)", format: formatMs, why: `no first token in the last ${WINDOW_S} s` },
  { key: "itl", label: "time between tokens (mean)", format: formatMs, why: `no token in the last ${WINDOW_S} s` },
  { key: "decode_batch", label: "decode batch (tokens per micro-batch step)", format: fixed(1),
    why: `no decode step in the last ${WINDOW_S} s` },
];

// --- figures from snapshots ------------------------------------------------------

function baseFor(current) {
  // The oldest snapshot within the window, else the one before `current`.
  const inWindow = snapshots.filter((s) => s !== current && current.time - s.time <= WINDOW_S + 0.5);
  if (inWindow.length) return inWindow[0];
  return snapshots.length > 1 ? snapshots[snapshots.length - 2] : null;
}

function meanOver(now, then) {
  const count = now.count - then.count;
  return count > 0 ? (now.sum - then.sum) / count : null;
}

function decodeBatch(now, then) {
  if (!now || !then || now.decode.steps === null || then.decode.steps === null) return null;
  const steps = now.decode.steps - then.decode.steps;
  if (steps <= 0) return null;
  const tokens = now.decode.steps * now.decode.mean_batch_size - then.decode.steps * then.decode.mean_batch_size;
  return tokens / steps;
}

function figures(current, base) {
  const g = current.gateway;
  const requests = current.cluster ? current.cluster.requests : { running: g.running, waiting: g.waiting };
  const out = { in_flight: g.in_flight, running: requests.running, waiting: requests.waiting,
                requests_per_s: null, tokens_per_s: null, ttft: null, itl: null, decode_batch: null };
  if (base) {
    const dt = current.time - base.time;
    const b = base.gateway;
    if (dt > 0) {
      out.requests_per_s = (g.requests - b.requests) / dt;
      out.tokens_per_s = (g.generation_tokens - b.generation_tokens) / dt;
    }
    out.ttft = meanOver(g.time_to_first_token, b.time_to_first_token);
    out.itl = meanOver(g.inter_token_latency, b.inter_token_latency);
    out.decode_batch = decodeBatch(current.cluster, base.cluster);
  }
  return out;
}

// --- drawing -------------------------------------------------------------------------

function buildTiles() {
  for (const tile of TILES) {
    const canvas = element("canvas", { width: "220", height: "40", "aria-hidden": "true" });
    $("tiles").append(element("div", { className: "tile", dataset: { figure: tile.key } },
      element("div", { className: "label" }, tile.label), element("div", { className: "value" }, "–"),
      element("div", { className: "why" }), canvas));
    series.set(tile.key, []);
  }
}

function sparkline(canvas, values) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const known = values.filter((v) => v !== null);
  if (!known.length) return;
  const top = Math.max(...known) || 1;
  const step = width / Math.max(KEEP_S - 1, 1);
  ctx.strokeStyle = "#3b82f6";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let drawing = false;
  values.forEach((v, i) => {
    if (v === null) { drawing = false; return; }
    const x = width - (values.length - 1 - i) * step;
    const y = height - 2 - (v / top) * (height - 4);
    if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    drawing = true;
  });
  ctx.stroke();
}

function showTiles(values, clusterMissing) {
  for (const tile of TILES) {
    const el = document.querySelector(`.tile[data-figure="${tile.key}"]`);
    const v = values[tile.key];
    const points = series.get(tile.key);
    points.push(v === null || v === undefined ? null : v);
    if (points.length > KEEP_S) points.shift();
    el.querySelector(".value").textContent = v === null || v === undefined ? "–" : tile.format(v);
    el.dataset.value = v === null || v === undefined ? "" : String(v);
    const needsCluster = ["running", "waiting", "decode_batch"].includes(tile.key);
    el.querySelector(".why").textContent = v !== null && v !== undefined ? ""
      : (needsCluster && clusterMissing ? "the cluster's state is unavailable" : (snapshots.length < 2 ? "" : tile.why));
    sparkline(el.querySelector("canvas"), points);
  }
}

function cell(text, className) {
  return element("td", className ? { className } : {}, text === null || text === undefined ? "–" : String(text));
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

function showServices(cluster) {
  const rows = (cluster ? cluster.services : []).map((s) => {
    const tr = element("tr", { dataset: { name: s.name, healthy: String(s.healthy) } },
      cell(s.kind), cell(s.name),
      element("td", {}, element("span", { className: s.healthy ? "badge ok" : "badge bad" }, s.healthy ? "healthy" : "down")),
      cell(s.host), cell(s.pid), cell(s.device), cell(s.endpoint, "endpoint"), cell(s.restarts));
    return tr;
  });
  document.querySelector("#services tbody").replaceChildren(...rows);
}

function showAttention(cluster) {
  const rows = (cluster ? cluster.attention : []).map((a) => {
    if (a.error) {
      return element("tr", { dataset: { name: a.name } }, cell(a.name),
        element("td", { colspan: "6", className: "error" }, `unavailable: ${a.error}`));
    }
    const used = a.capacity_tokens ? a.num_tokens / a.capacity_tokens : 0;
    const fill = element("div", { className: "fill" });
    fill.style.width = `${Math.min(100, 100 * used)}%`;
    return element("tr", { dataset: { name: a.name, tokens: String(a.num_tokens) } },
      cell(a.name), cell(a.num_sequences, "sequences"), cell(a.num_tokens, "kv-tokens"), cell(a.capacity_tokens),
      element("td", {}, element("div", { className: "meter" }, fill), ` ${percent(used)}`),
      cell(percent(a.occupancy)), cell(percent(a.fragmentation)));
  });
  document.querySelector("#attention tbody").replaceChildren(...rows);
}

function showPrefixCache(cluster) {
  const rows = (cluster ? cluster.prefix_cache : []).map((p) => {
    const tier = (t) => cell(`${p.tiers[t].blocks} blocks (${mib(p.tiers[t].bytes)})`, `tier-${t}`);
    const ratio = p.prompt_tokens ? p.hit_tokens / p.prompt_tokens : null;
    return element("tr", { dataset: { name: p.name } }, cell(p.name), tier("device"), tier("host"), tier("disk"),
      cell(percent(ratio)), cell(p.hit_tokens));
  });
  document.querySelector("#prefix-cache tbody").replaceChildren(...rows);
}

function showError(id, message) {
  $(id).hidden = !message;
  $(id).textContent = message || "";
}

function update(current) {
  snapshots.push(current);
  while (snapshots.length && current.time - snapshots[0].time > KEEP_S) snapshots.shift();
  showTiles(figures(current, baseFor(current)), !current.cluster);
  showError("cluster-error", current.cluster ? "" : `The cluster's state is unavailable: ${current.cluster_error}`);
  showServices(current.cluster);
  showAttention(current.cluster);
  showPrefixCache(current.cluster);
  updates += 1;
  document.body.dataset.updates = String(updates);
  $("updated").textContent = `updated ${new Date(current.time * 1000).toLocaleTimeString()}`;
}

async function poll() {
  try {
    const response = await fetch("/dashboard/status", { headers: authHeaders(), cache: "no-store" });
    if (response.ok) {
      showError("error", "");
      update(await response.json());
    } else {
      const why = await errorMessage(response);
      showError("error", response.status === 401 ? `${why} Enter the API key above.` : why);
    }
  } catch (err) {
    showError("error", `the gateway did not answer: ${err.message}`);
  }
  setTimeout(poll, POLL_MS);
}

$("window").textContent = String(WINDOW_S);
buildTiles();
bindKeyField($("api-key"), () => {});
poll();
