// Shared by the chat and the dashboard: the API key field and the request headers.
// The key is kept in this tab's sessionStorage only (gone when the tab closes) and is
// sent to this gateway alone, as `Authorization: Bearer KEY`.
"use strict";

const KEY_STORAGE = "lamina-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// Wire the page's key field to the stored key; `onChange` runs after every edit.
function bindKeyField(input, onChange) {
  input.value = apiKey();
  input.addEventListener("change", () => {
    const key = input.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    onChange();
  });
}

// An error response's message: OpenAI's {"error": {"message"}} shape, else the status text.
async function errorMessage(response) {
  let text = "";
  try {
    text = await response.text();
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}${text ? ": " + text.slice(0, 200) : ""}`;
}

function formatMs(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

function element(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "dataset") Object.assign(el.dataset, value);
    else if (name === "className") el.className = value;
    else el.setAttribute(name, value);
  }
  for (const child of children) el.append(child);
  return el;
}
