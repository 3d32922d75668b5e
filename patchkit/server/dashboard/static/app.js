// The patchkit dashboard: reads the front-end's JSON routes (relative URLs, so it works under a proxy's path)
// with the deployment's bearer token, and sends questions to the streaming query route with steps on.
"use strict";

const TOKEN_KEY = "patchkit-token";
const REFRESH_MS = 2000; // the pause between the end of one refresh and the start of the next
const RECENT_WINDOW = 50; // the requests /v1/activity keeps, where its reply does not say ("window")
const NOT_OUTCOMES = new Set(["ok", "inflight", "mean_latency_ms"]); // /v1/stats' requests: every other key is a failure
let pipelines = []; // one entry per pipeline name: { name, serving: its row or null, retiring: [rows] }
let pipelinesKey = "";

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
// /v1/pipelines lists each version serving, then each older one still ending its requests ("retiring"): during
// an update a pipeline has two rows. The page lists each pipeline once, its retiring versions named in its card.
function byName(rows) {
  const names = new Map();
  for (const row of rows) {
    if (!names.has(row.name)) names.set(row.name, { name: row.name, serving: null, retiring: [] });
    const entry = names.get(row.name);
    if (row.state === "retiring") entry.retiring.push(row);
    else entry.serving = row;
  }
  return [...names.values()];
}

function versionsText(entry) {
  const parts = [];
  if (entry.serving && entry.serving.state !== "ready") parts.push(entry.serving.state);
  for (const old of entry.retiring) parts.push("version " + old.version + " retiring, " + old.inflight + " in flight");
  return parts.join("; ");
}

async function loadPipelines() {
  const data = await json("v1/pipelines");
  pipelines = byName(data.pipelines);
  const key = pipelines.map((p) => p.name + "@" + (p.serving ? p.serving.version + ":" + p.serving.digest : "-")).join(",");
  const changed = key !== pipelinesKey;
  pipelinesKey = key;
  const select = document.getElementById("pipeline");
  const chosen = select.value;
  const served = pipelines.filter((p) => p.serving);
  if (changed || select.options.length !== served.length) {
    select.replaceChildren(...served.map((p) => el("option", { value: p.name, text: p.name })));
    if (served.some((p) => p.name === chosen)) select.value = chosen;
  }
  showInputs();
  const box = document.getElementById("pipelines");
  if (changed) {
    box.replaceChildren();
    for (const p of pipelines) {
      const row = p.serving || p.retiring[0];
      const img = el("img", { alt: "the graph of " + p.name });
      box.append(el("div", { class: "pipeline", "data-pipeline": p.name },
        el("h3", { text: p.name + " — version " + row.version + " (" + row.digest + ")" }),
        el("p", { class: "versions muted" }), img));
      if (!p.serving) continue; // its graph is served while a version of it serves
      const svg = await api("v1/pipelines/" + encodeURIComponent(p.name) + "/graph.svg");
      if (svg.ok) img.src = URL.createObjectURL(await svg.blob());
    }
  }
  for (const p of pipelines) {
    const card = [...box.children].find((child) => child.dataset.pipeline === p.name);
    if (card) card.querySelector(".versions").textContent = versionsText(p);
  }
}

// -- the form: one field per input, typed by the pipeline's JSON Schema of its inputs ------------
const HINTS = { integer: "an integer", number: "a number", string: "text", boolean: "true or false",
  array: "a list, as JSON", object: "an object, as JSON", json: "any JSON value" };
const EXAMPLES = { array: '["a", 2]', object: '{"key": "value"}', json: '"text", 3, [1, 2] or {"key": 1}' };

function inputSchema(row) {
  if (row.input_schema) return row.input_schema;
  // a server that publishes no schema: every input a string, as its names list them
  return { type: "object", properties: Object.fromEntries(row.inputs.map((name) => [name, { type: "string" }])),
    required: row.inputs };
}

const KINDS = new Set(["integer", "number", "string", "boolean", "array", "object"]); // JSON Schema's types

function kindOf(property) {
  return KINDS.has(property.type) ? property.type : "json"; // no type (any JSON value), or several
}

function field(name, property, required) {
  const kind = kindOf(property);
  const attributes = { name, "data-input": name, "data-kind": kind, "data-required": String(required), id: "input-" + name };
  let control;
  if (kind === "boolean") {
    control = el("input", { ...attributes, type: "checkbox" });
    control.checked = property.default === true;
  } else if (kind === "integer" || kind === "number") {
    control = el("input", { ...attributes, type: "number", step: kind === "integer" ? "1" : "any", placeholder: name });
    if (typeof property.default === "number") control.value = String(property.default);
  } else if (kind === "string") {
    control = el("input", { ...attributes, type: "text", placeholder: name });
    if (typeof property.default === "string") control.value = property.default;
  } else {
    control = el("textarea", { ...attributes, rows: "2", spellcheck: "false", placeholder: EXAMPLES[kind] });
    if (Object.hasOwn(property, "default")) control.value = JSON.stringify(property.default);
  }
  const hint = HINTS[kind] + (required ? "" : ", optional");
  return el("div", { class: "field" },
    el("label", { for: attributes.id }, el("span", { class: "name", text: name }), el("span", { class: "hint muted", text: " (" + hint + ") " })),
    control, el("span", { class: "input-error bad", "data-error-for": name, role: "alert" }));
}

function showInputs() {
  const entry = pipelines.find((p) => p.serving && p.name === document.getElementById("pipeline").value) ||
    pipelines.find((p) => p.serving);
  const box = document.getElementById("inputs");
  const schema = entry ? inputSchema(entry.serving) : { properties: {}, required: [] };
  const key = (entry ? entry.name : "") + " " + JSON.stringify(schema);
  if (box.dataset.schema === key) return; // the form as it is, with what was typed in it
  box.dataset.schema = key;
  const required = new Set(schema.required || []);
  box.replaceChildren(...Object.entries(schema.properties || {}).map(([name, property]) => field(name, property, required.has(name))));
}

// What a field gives: { value }, { skip: true } (left empty: the input keeps its default), or { error }.
function read(control) {
  const kind = control.dataset.kind, text = control.value;
  if (kind === "boolean") return { value: control.checked };
  if (kind === "integer" || kind === "number") {
    if (control.validity.badInput) return { error: "is not a number: type " + (kind === "integer" ? "an integer such as 3" : "a number such as 0.5") };
    if (text.trim() === "") return { skip: true };
    const number = Number(text);
    if (!Number.isFinite(number)) return { error: "must be a finite number; got " + text };
    if (kind === "integer" && !Number.isInteger(number)) return { error: "must be an integer (a whole number such as 3); got " + text };
    if (kind === "integer" && !Number.isSafeInteger(number)) return { error: "must be an integer of at most 15 digits; got " + text };
    return { value: number };
  }
  if (kind === "string") return text === "" ? { skip: true } : { value: text };
  if (text.trim() === "") return { skip: true };
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return { error: "is not valid JSON (" + error.message + "): write it as JSON, like " + EXAMPLES[kind] };
  }
  if (kind === "array" && !Array.isArray(value)) return { error: "must be a JSON list, like " + EXAMPLES.array };
  if (kind === "object" && (value === null || typeof value !== "object" || Array.isArray(value))) {
    return { error: "must be a JSON object, like " + EXAMPLES.object };
  }
  return { value };
}

// The form's inputs, typed; null when a field is wrong, each wrong one saying why beside it.
function formInputs() {
  const inputs = {};
  let wrong = false;
  for (const control of document.querySelectorAll("#inputs [data-input]")) {
    const name = control.dataset.input;
    let given = read(control);
    if (given.skip && control.dataset.required === "true") given = { error: "needs a value: this input has no default" };
    const message = document.querySelector('#inputs [data-error-for="' + CSS.escape(name) + '"]');
    message.textContent = given.error ? name + " " + given.error : "";
    control.setAttribute("aria-invalid", given.error ? "true" : "false");
    if (given.error) wrong = true;
    else if (!given.skip) inputs[name] = given.value;
  }
  return wrong ? null : inputs;
}

// -- components, SLO, autoscaler, recent requests -------------------------------------------------
function device(replica) {
  const gpus = replica.resources && replica.resources.gpus;
  return gpus && gpus.length ? "GPU " + gpus.join(",") : "CPU";
}

function showComponents(stats, activity) {
  const recent = activity.window || RECENT_WINDOW;
  for (const q of ["p50", "p99"]) document.getElementById(q + "-label").textContent = q + " ms (last " + recent + " requests)";
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

// /v1/stats counts requests by outcome: "ok", and each way one fails (error, timeout, overloaded, worker_died,
// cancelled, ...); every outcome but "ok" counts as failed, each shown beside the sum.
function failures(requests) {
  const outcomes = Object.entries(requests).filter(([key, count]) => !NOT_OUTCOMES.has(key) && !/_(ms|s|bytes)$/.test(key) && count);
  const total = outcomes.reduce((sum, [, count]) => sum + count, 0);
  return String(total) + (outcomes.length ? " (" + outcomes.map(([key, count]) => key.replaceAll("_", " ") + " " + count).join(", ") + ")" : "");
}

function showSlo(stats) {
  const slo = document.getElementById("slo");
  slo.replaceChildren();
  const rows = { "requests answered": stats.requests.ok || 0, "failed": failures(stats.requests),
    "in flight": stats.requests.inflight, ...stats.slo };
  for (const [key, value] of Object.entries(rows)) {
    slo.append(el("dt", { text: key.replaceAll("_", " ") }), el("dd", { "data-row": key, text: String(value) }));
  }
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
  const version = request.version ? " v" + String(request.version).split("-")[0] : "";
  const box = el("div", { class: "request" }, el("div", {
    text: new Date(request.arrived * 1000).toLocaleTimeString() + "  " + request.pipeline + version + "  " +
      request.request_id.slice(0, 12) + "  " + request.outcome + "  " + fmt(request.latency_ms) + " ms" }));
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

async function update() {
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

// One refresh at a time: the timer's next one starts REFRESH_MS after the last ended, however long it took; one
// asked for meanwhile (`again`: a new token, a question answered) runs once the one in flight has ended.
let refreshing = null, rerun = false;

function refresh(again = false) {
  if (refreshing) {
    rerun ||= again;
    return refreshing;
  }
  refreshing = (async () => {
    do {
      rerun = false;
      await update();
    } while (rerun);
  })().finally(() => { refreshing = null; });
  return refreshing;
}

async function tick() {
  await refresh();
  setTimeout(tick, REFRESH_MS);
}

// -- asking a question: its steps and tokens as they arrive -----------------------------------------
// A server-sent event stream, parsed as the HTML standard says: lines end in "\n", "\r\n" or "\r"; "field: value"
// (one space after the colon dropped; a line without a colon is a field with no value; one starting with ":" a
// comment); an event's data lines joined with "\n"; a blank line ends the event. `dispatch(type, data)` gets each
// event with data ("message" when it has no `event:` name); what a stream leaves unfinished is dropped.
function sseParser(dispatch) {
  let buffer = "", type = "", data = [];
  function line(text) {
    if (text === "") {
      if (data.length) dispatch(type || "message", data.join("\n"));
      type = "";
      data = [];
      return;
    }
    if (text.startsWith(":")) return;
    const colon = text.indexOf(":");
    const name = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? "" : text.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "event") type = value;
    else if (name === "data") data.push(value);
  }
  return (chunk) => {
    buffer += chunk;
    for (;;) {
      const end = buffer.search(/[\r\n]/);
      if (end < 0 || (buffer[end] === "\r" && end === buffer.length - 1)) return; // a "\r" may start a "\r\n"
      line(buffer.slice(0, end));
      buffer = buffer.slice(end + (buffer.startsWith("\r\n", end) ? 2 : 1));
    }
  };
}

function compact(value) {
  const text = JSON.stringify(value);
  return text === undefined ? String(value) : text;
}

function showStep(step) {
  const name = step.component + "." + step.method;
  const item = el("li", { class: "step " + step.phase + (step.error ? " failed" : ""), "data-phase": step.phase,
    "data-call": String(step.call) });
  if (step.phase === "start") item.textContent = "▶ " + name + " started (node " + step.node + ")";
  else {
    item.textContent = "■ " + name + " ended: " + fmt(step.duration_ms) + " ms, waited " + fmt(step.wait_ms) + " ms, batch " +
      (step.batch ?? "–") + " on " + (step.replica ?? "–");
    if (step.error) item.append(" — " + step.error.type + ": " + step.error.message);
    else if (step.sensitive) item.append(" — (sensitive: no preview)");
    else if (step.preview !== undefined) {
      item.append(" — ", el("code", { class: "preview", text: compact(step.preview) }));
      if (step.preview_truncated) item.append(el("span", { class: "truncated muted", title: "the preview is cut short", text: " …" }));
    }
  }
  document.getElementById("steps").append(item);
}

function showError(event) {
  const outcome = document.getElementById("outcome");
  outcome.textContent = event.error.type + ": " + event.error.message + (event.request_id ? " (request " + event.request_id + ")" : "");
  outcome.dataset.state = "error";
}

function showOutput(event) {
  const answer = document.getElementById("answer");
  answer.textContent = typeof event.output === "string" ? event.output : JSON.stringify(event.output, null, 2);
  const outcome = document.getElementById("outcome");
  outcome.textContent = "answered in " + fmt(event.latency_ms) + " ms (request " + event.request_id + ")";
  outcome.dataset.state = "ok";
  answer.dataset.done = "true";
}

// An unnamed event (or a JSON reply): told apart by its keys, as the server sent them before events had names.
function handle(event) {
  if ("step" in event) showStep(event.step);
  else if ("delta" in event) document.getElementById("answer").textContent += event.delta;
  else if ("error" in event) showError(event);
  else if ("output" in event) showOutput(event);
}

function showEnd(event) {
  const outcome = document.getElementById("outcome");
  if (event.status === "error" && outcome.dataset.state !== "error") {
    outcome.textContent = "the request failed (request " + event.request_id + ")";
    outcome.dataset.state = "error";
  }
}

// Reads a query's reply: a JSON one (an error before the stream started), or its events until `event: end` (or,
// from a server that sends none, until the stream closes).
async function readReply(reply) {
  if (!(reply.headers.get("content-type") || "").startsWith("text/event-stream")) {
    handle(await reply.json());
    return;
  }
  let ended = false;
  const feed = sseParser((type, data) => {
    if (ended) return;
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      showError({ error: { type: "StreamError", message: "an event's data is not JSON: " + data.slice(0, 80) } });
      return;
    }
    if (type === "step") showStep(event.step || event);
    else if (type === "error") showError(event);
    else if (type === "end") {
      ended = true;
      showEnd(event);
    } else if (type === "message") handle(event); // other names: events this page does not know, skipped
  });
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  while (!ended) {
    const { value, done } = await reader.read();
    if (done) break;
    feed(decoder.decode(value, { stream: true }));
  }
  if (ended) reader.cancel().catch(() => {});
  const outcome = document.getElementById("outcome");
  if (!outcome.dataset.state) {
    outcome.textContent = "the stream ended before its answer";
    outcome.dataset.state = "error";
  }
}

async function ask(submit) {
  submit.preventDefault();
  const name = document.getElementById("pipeline").value;
  const inputs = formInputs();
  if (inputs === null) return; // each wrong field says why; nothing is sent
  document.getElementById("steps").replaceChildren();
  const answer = document.getElementById("answer");
  answer.textContent = "";
  delete answer.dataset.done;
  const outcome = document.getElementById("outcome");
  outcome.textContent = "";
  delete outcome.dataset.state;
  const reply = await api("v1/pipelines/" + encodeURIComponent(name) + "/query", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ inputs, stream: true, steps: true }) });
  await readReply(reply);
  refresh(true);
}

document.getElementById("token-form").addEventListener("submit", (submit) => {
  submit.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
  document.getElementById("token-form").hidden = true;
  pipelinesKey = "";
  refresh(true);
});
document.getElementById("pipeline").addEventListener("change", showInputs);
document.getElementById("ask").addEventListener("submit", (submit) => ask(submit).catch((error) => {
  document.getElementById("outcome").textContent = String(error.message || error);
}));
tick();
