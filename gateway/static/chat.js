// The chat: streams answers from /v1/chat/completions (fetch and a server-sent events
// reader), stops them (aborting the fetch, which aborts the request in the stack), and
// keeps each answer's token ids and arrival times for its "tokens" panel.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of the turns so far, sent with each question
let model = null;
let controller = null;  // the answer being streamed, while there is one

// --- server-sent events ------------------------------------------------------

// Yields each event's data, with the time (performance.now()) its bytes arrived.
async function* sseEvents(response, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      const arrived = performance.now();
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield { data, arrived };
      }
    }
  } finally {
    if (signal.aborted) reader.cancel().catch(() => {});
  }
}

// --- one answer --------------------------------------------------------------

class Answer {
  constructor(container) {
    this.tokens = [];  // {id, text, logprob, arrived}: arrived in ms since the request was sent
    this.started = performance.now();
    this.finishReason = null;
    this.usage = null;
    this.content = element("div", { className: "content" });
    this.summary = element("summary", {}, "tokens");
    this.table = element("tbody");
    const head = element("tr", {}, ...["#", "id", "text", "logprob", "arrived", "gap"].map((h) => element("th", {}, h)));
    this.details = element("details", { className: "tokens" }, this.summary,
      element("table", {}, element("thead", {}, head), this.table));
    this.el = element("article", { className: "msg assistant", dataset: { state: "streaming" } },
      this.content, this.details);
    container.append(this.el);
  }

  get text() { return this.content.textContent; }

  addChunk(chunk, arrived) {
    const choice = (chunk.choices || [])[0];
    if (chunk.usage) this.usage = chunk.usage;
    if (!choice) return;
    const delta = choice.delta || {};
    if (delta.content) this.content.textContent += delta.content;
    const entries = (choice.logprobs && choice.logprobs.content) || [];
    (choice.token_ids || []).forEach((id, i) => {
      const lp = entries[i];
      this.tokens.push({ id, text: lp ? lp.token : null, logprob: lp ? lp.logprob : null,
                         arrived: arrived - this.started });
    });
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    this.el.dataset.tokens = String(this.tokens.length);
    this.summary.textContent = `tokens: ${this.tokens.length}`;
  }

  finish(state, note) {
    this.el.dataset.state = state;
    if (note) this.el.append(element("p", { className: "note" }, note));
    this.renderTokens();
  }

  renderTokens() {
    const t = this.tokens;
    const rows = t.map((tok, i) => {
      const gap = i === 0 ? null : tok.arrived - t[i - 1].arrived;
      return element("tr", {},
        element("td", {}, String(i + 1)),
        element("td", { className: "token-id" }, String(tok.id)),
        element("td", { className: "token-text" }, tok.text === null ? "" : JSON.stringify(tok.text)),
        element("td", {}, tok.logprob === null ? "" : tok.logprob.toFixed(4)),
        element("td", {}, `${tok.arrived.toFixed(1)} ms`),
        element("td", {}, gap === null ? "" : `${gap.toFixed(1)} ms`));
    });
    this.table.replaceChildren(...rows);
    const parts = [`tokens: ${t.length}`];
    if (t.length) parts.push(`first token ${t[0].arrived.toFixed(0)} ms`);
    if (t.length > 1) parts.push(`then ${((t[t.length - 1].arrived - t[0].arrived) / (t.length - 1)).toFixed(1)} ms/token`);
    if (this.finishReason) parts.push(`finish: ${this.finishReason}`);
    if (this.usage) parts.push(`prompt ${this.usage.prompt_tokens} tokens`);
    this.summary.textContent = parts.join(" · ");
    this.details.dataset.ttftMs = t.length ? t[0].arrived.toFixed(1) : "";
  }
}

// --- the request ---------------------------------------------------------------

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = { model, messages, stream: true, stream_options: { include_usage: true }, return_token_ids: true };
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"],
                             ["seed", "seed"]]) {
    const value = numberField(id);
    if (value !== undefined) body[field] = value;
  }
  if (body.seed !== undefined && !Number.isSafeInteger(body.seed)) {
    throw new Error("seed: this page sends whole numbers within ±2^53 only");
  }
  if ($("logprobs").checked) body.logprobs = true;
  return body;
}

function userMessage(text) {
  const el = element("article", { className: "msg user" }, element("div", { className: "content" }, text));
  $("messages").append(el);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("clear").disabled = busy;
}

async function ask(question) {
  if (!model) await loadModel();
  if (!model) return;
  $("status").textContent = "";
  let body;
  conversation.push({ role: "user", content: question });
  try {
    body = requestBody();
  } catch (err) {
    conversation.pop();
    $("status").textContent = err.message;
    return;
  }
  userMessage(question);
  const answer = new Answer($("messages"));
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const { data, arrived } of sseEvents(response, controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      answer.addChunk(chunk, arrived);
      answer.el.scrollIntoView({ block: "end" });
    }
    answer.finish("done");
  } catch (err) {
    if (err.name === "AbortError") answer.finish("stopped", "stopped");
    else answer.finish("error", err.message);
  } finally {
    controller = null;
    setBusy(false);
    // What was said stays in the conversation, a stopped answer's part too.
    if (answer.text) conversation.push({ role: "assistant", content: answer.text });
    else conversation.pop();
  }
}

async function loadModel() {
  $("model").textContent = "…";
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) {
      const why = await errorMessage(response);
      $("status").textContent = response.status === 401 ? `${why} Enter the API key above.` : why;
      $("model").textContent = "unknown";
      model = null;
      return;
    }
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
    $("status").textContent = "";
  } catch (err) {
    $("status").textContent = `the gateway did not answer: ${err.message}`;
  }
}

// --- wiring ------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question || controller) return;
  $("prompt").value = "";
  ask(question);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  conversation.length = 0;
  $("messages").replaceChildren();
  $("status").textContent = "";
});
bindKeyField($("api-key"), loadModel);
loadModel();
