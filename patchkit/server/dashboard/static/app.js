// The patchkit dashboard: reads the front-end's JSON routes (relative URLs, so it works under a proxy's path)
// with the deployment's bearer token, and sends questions to the streaming query route with steps on.
"use strict";

const TOKEN_KEY = "patchkit-token";
const REFRESH_MS = 2000;
let pipelines = [];

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

async function api(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  if (reply.status === 401) {
    askToken();
    throw new Error("this endpoint needs its bearer token");
  }
  return reply;
}

async function json(path) {
  const reply = await api(path);
  if (!reply.ok) throw new Error(path + ": " + reply.status);
  return reply.json();
}

function askToken() {
  document.getElementById("token-form").hidden = false;
  setStatus("needs the bearer token", "warn");
}

function setStatus(text, kind) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = kind || "muted";
}

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function fmt(value, digits = 1) {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : Number(value).toFixed(digits);
}

function quantile(sorted, q) {
  if (!sorted.length) return null;
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

// -- pipelines and their graphs ------------------------------------------------------------------
async function loadPipelines() {
  const data = await json("v1/pipelines");
  const names = data.pipelines.map((p) => p.name + "@" + p.version).join(",");
  if (names === pipelines.map((p) => p.name + "@" + p.version).join(",")) return;
  pipelines = data.pipelines;
  const box = document.getElementById("pipelines");
  box.replaceChildren();
  const select = document.getElementById("pipeline");
  const chosen = select.value;
  select.replaceChildren(...pipelines.map((p) => el("option", { value: p.name, text: p.name })));
  if (chosen) select.value = chosen;
  for (const p of pipelines) {
    const img = el("img", { alt: "the graph of " + p.name });
    const card = el("div", { class: "pipeline" },
      el("h3", { text: p.name + " — version " + p.version + " (" + p.digest + ")" }), img);
    box.append(card);
    const svg = await api("v1/pipelines/" + encodeURIComponent(p.name) + "/graph.svg");
    if (svg.ok) img.src = URL.createObjectURL(await svg.blob());
  }
  showInputs();
}

function showInputs() {
  const chosen = pipelines.find((p) => p.name === document.getElementById("pipeline").value) || pipelines[0];
  const box = document.getElementById("inputs");
  box.replaceChildren(...(chosen ? chosen.inputs : []).map((name) =>
    el("label", { text: name + " " }, el("input", { name, "data-input": name, placeholder: name }))));
}

// -- components, SLO, autoscaler, recent requests -------------------------------------------------
function device(replica) {
  const gpus = replica.resources && replica.resources.gpus;
  return gpus && gpus.length ? "GPU " + gpus.join(",") : "CPU";
}

function showComponents(stats, activity) {
  const durations = {};
  for (const request of activity.requests) {
    for (const call of request.calls) {
      if (call.duration_ms !== null) (durations[call.component] ||= []).push(call.duration_ms);
    }
  }
  const body = document.querySelector("#components tbody");
  body.replaceChildren();
  for (const [name, component] of Object.entries(stats.components)) {
    const methods = Object.values(component.methods);
    const sum = (key) => methods.reduce((total, m) => total + (m[key] || 0), 0);
    const sorted = (durations[name] || []).sort((a, b) => a - b);
    const replicas = el("td");
    for (const replica of component.replicas) {
      const healthy = replica.alive && replica.state === "serving" && replica.health === "ok";
      replicas.append(el("div", { class: healthy ? "ok" : "bad",
        text: replica.id + ": " + replica.state + (replica.health === "ok" ? "" : " (" + replica.health + ")") }));
    }
    const calls = sum("calls"), batches = sum("batches");
    body.append(el("tr", { "data-component": name },
      el("td", { text: name + " (" + component.class + ")" }),
      el("td", { class: component.state === "serving" ? "ok" : "bad", text: component.state }),
      replicas,
      el("td", { text: [...new Set(component.replicas.map(device))].join(", ") || "–" }),
      el("td", { text: String(sum("queue_length")) }),
      el("td", { text: fmt(batches ? calls / batches : 0) + " / " + Math.max(0, ...methods.map((m) => m.batch_size)) }),
      el("td", { text: fmt(sum("throughput_per_s"), 2) }),
      el("td", { text: fmt(quantile(sorted, 0.5)) }),
      el("td", { text: fmt(quantile(sorted, 0.99)) })));
  }
}

function showSlo(stats) {
  const slo = document.getElementById("slo");
  slo.replaceChildren();
  const rows = { "requests answered": stats.requests.ok || 0, "timed out": stats.requests.timeout || 0,
    "failed": stats.requests.error || 0, "in flight": stats.requests.inflight, ...stats.slo };
  for (const [key, value] of Object.entries(rows)) slo.append(el("dt", { text: key.replaceAll("_", " ") }), el("dd", { text: String(value) }));
}

function showDecisions(activity) {
  const list = document.getElementById("decisions");
  if (!activity.decisions.length) return;
  list.replaceChildren(...activity.decisions.map((d) => el("li", {
    text: new Date(d.at * 1000).toLocaleTimeString() + " " + d.kind.replace("_", " ") + " " + d.component + " to " +
      d.replicas + " replicas (" + d.replica + "): " + d.reason })));
}

function timeline(request) {
  const total = Math.max(request.latency_ms || 0, ...request.calls.map((c) => c.started_ms + (c.duration_ms || 0)), 1);
  const box = el("div", { class: "request" }, el("div", {
    text: new Date(request.arrived * 1000).toLocaleTimeString() + "  " + request.pipeline + "  " + request.request_id.slice(0, 12) +
      "  " + request.outcome + "  " + fmt(request.latency_ms) + " ms" }));
  for (const call of request.calls) {
    const width = Math.max(0.5, 100 * (call.duration_ms || 0) / total);
    const bar = el("div", { class: "bar" + (call.failed ? " failed" : ""),
      style: "left:" + (100 * call.started_ms / total) + "%;width:" + width + "%",
      title: call.component + "." + call.method + ": " + fmt(call.duration_ms) + " ms, waited " + fmt(call.wait_ms) +
        " ms, batch " + (call.batch ?? "–") + " on " + (call.replica ?? "–") });
    if (call.wait_ms && call.duration_ms) bar.append(el("span", { class: "wait", style: "width:" + (100 * call.wait_ms / call.duration_ms) + "%" }));
    bar.append(call.component + "." + call.method + " ×" + (call.batch ?? "–"));
    box.append(el("div", { class: "lane" }, bar));
  }
  return box;
}

async function refresh() {
  try {
    await loadPipelines();
    const [stats, activity] = await Promise.all([json("v1/stats"), json("v1/activity")]);
    showComponents(stats, activity);
    showSlo(stats);
    showDecisions(activity);
    document.getElementById("requests").replaceChildren(...activity.requests.slice(0, 15).map(timeline));
    setStatus(stats.backend + " backend, up " + fmt(stats.uptime_s, 0) + " s", "ok");
  } catch (error) {
    if (document.getElementById("token-form").hidden) setStatus(String(error.message || error), "bad");
  }
}

// -- asking a question, its steps and tokens as they arrive ----------------------------------------
function showStep(step) {
  const name = step.component + "." + step.method;
  let text;
  if (step.phase === "start") text = "▶ " + name + " started (node " + step.node + ")";
  else {
    text = "■ " + name + " ended: " + fmt(step.duration_ms) + " ms, waited " + fmt(step.wait_ms) + " ms, batch " +
      (step.batch ?? "–") + " on " + (step.replica ?? "–");
    if (step.error) text += " — " + step.error.type + ": " + step.error.message;
    else if (step.sensitive) text += " — (sensitive: no preview)";
    else if (step.preview !== undefined) text += " — " + step.preview;
  }
  document.getElementById("steps").append(el("li", {
    class: "step " + step.phase + (step.error ? " failed" : ""), "data-phase": step.phase, "data-call": String(step.call), text }));
}

function handle(event) {
  const answer = document.getElementById("answer");
  if ("step" in event) showStep(event.step);
  else if ("delta" in event) answer.textContent += event.delta;
  else if ("error" in event) document.getElementById("outcome").textContent = event.error.type + ": " + event.error.message;
  else {
    const output = typeof event.output === "string" ? event.output : JSON.stringify(event.output, null, 2);
    answer.textContent = output;
    document.getElementById("outcome").textContent = "answered in " + fmt(event.latency_ms) + " ms (request " + event.request_id + ")";
    answer.dataset.done = "true";
  }
}

async function ask(submit) {
  submit.preventDefault();
  const name = document.getElementById("pipeline").value;
  const inputs = {};
  for (const input of document.querySelectorAll("#inputs [data-input]")) if (input.value !== "") inputs[input.dataset.input] = input.value;
  document.getElementById("steps").replaceChildren();
  const answer = document.getElementById("answer");
  answer.textContent = "";
  delete answer.dataset.done;
  document.getElementById("outcome").textContent = "";
  const reply = await api("v1/pipelines/" + encodeURIComponent(name) + "/query", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ inputs, stream: true, steps: true }) });
  if (!(reply.headers.get("content-type") || "").startsWith("text/event-stream")) {
    handle(await reply.json());
    return;
  }
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) handle(JSON.parse(data));
    }
  }
  refresh();
}

document.getElementById("token-form").addEventListener("submit", (submit) => {
  submit.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
  document.getElementById("token-form").hidden = true;
  pipelines = [];
  refresh();
});
document.getElementById("pipeline").addEventListener("change", showInputs);
document.getElementById("ask").addEventListener("submit", (submit) => ask(submit).catch((error) => {
  document.getElementById("outcome").textContent = String(error.message || error);
}));
refresh();
setInterval(refresh, REFRESH_MS);
