// The chat page of `edge-spec serve`: streams /v1/chat/completions (fetch + a ReadableStream read as
// server-sent events), renders answers as Markdown and colours each token by its source, which the server
// sends when asked with x_edge_spec.provenance: the drafter model, text copied from earlier (suffix cache, prompt lookup), a grammar's forced token,
// a free guess (drafts the target accepted) or the target itself (the first token, corrections, bonuses).

import { renderMarkdown } from "./markdown.js";

const SETTINGS_KEY = "edge-spec-chat-settings";
const API_KEY = "edge-spec-api-key";
const DEFAULTS = { temperature: 0, maxTokens: 1024, system: "", colour: true };
const RENDER_MS = 150;
const DRAFTED = { model: "drafter", eagle: "EAGLE head", lookup: "lookup", suffix: "copied", forced: "forced", guess: "guess" };

const $ = (id) => document.getElementById(id);

const state = {
  settings: loadSettings(),
  messages: [],  // the conversation as sent: {role, content}
  model: null,
  mode: null,
  controller: null,  // the answer being streamed
};

// -- settings --------------------------------------------------------------------------------------

function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULTS };
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
}

function bindSettings() {
  const s = state.settings;
  $("temperature").value = s.temperature;
  $("max-tokens").value = s.maxTokens;
  $("system-prompt").value = s.system;
  $("colour").checked = s.colour;
  document.body.classList.toggle("plain", !s.colour);
  $("temperature").addEventListener("input", (e) => {
    const value = parseFloat(e.target.value);
    if (Number.isFinite(value) && value >= 0 && value <= 2) s.temperature = value;
    saveSettings();
  });
  $("max-tokens").addEventListener("input", (e) => {
    const value = parseInt(e.target.value, 10);
    if (Number.isInteger(value) && value >= 1) s.maxTokens = value;
    saveSettings();
  });
  $("system-prompt").addEventListener("input", (e) => {
    s.system = e.target.value;
    saveSettings();
  });
  $("colour").addEventListener("change", (e) => {
    s.colour = e.target.checked;
    document.body.classList.toggle("plain", !s.colour);
    saveSettings();
  });
  const drawer = $("settings");
  const toggle = (open) => {
    drawer.hidden = !open;
    $("settings-button").setAttribute("aria-expanded", String(open));
  };
  $("settings-button").addEventListener("click", () => toggle(drawer.hidden));
  $("settings-close").addEventListener("click", () => toggle(false));
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    for (const node of [...$("conversation").querySelectorAll(".msg")]) node.remove();
    $("empty").hidden = false;
    toggle(false);
  });
}

// -- the API key -----------------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(API_KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function askForKey(message) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    const input = $("api-key");
    const error = $("key-error");
    error.hidden = !message;
    error.textContent = message || "";
    dialog.hidden = false;
    input.value = "";
    input.focus();
    const done = () => {
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(API_KEY, key);
      dialog.hidden = true;
      $("key-save").removeEventListener("click", done);
      input.removeEventListener("keydown", onKey);
      resolve(key);
    };
    const onKey = (e) => {
      if (e.key === "Enter") done();
    };
    $("key-save").addEventListener("click", done);
    input.addEventListener("keydown", onKey);
  });
}

// Whether the API answers with the key this tab has (asking for one until it does).
async function ensureKey() {
  let message = null;
  for (;;) {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (response.status !== 401) {
      if (response.ok) {
        const body = await response.json();
        state.model = body.data && body.data.length ? body.data[0].id : null;
      }
      return;
    }
    if (sessionStorage.getItem(API_KEY)) message = "That key was refused; try again.";
    sessionStorage.removeItem(API_KEY);
    await askForKey(message);
  }
}

// -- the conversation ------------------------------------------------------------------------------

function addMessage(role) {
  $("empty").hidden = true;
  const node = document.createElement("div");
  node.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "model";
  const body = document.createElement("div");
  body.className = "body";
  const foot = document.createElement("div");
  foot.className = "foot muted";
  node.append(who, body, foot);
  $("conversation").append(node);
  return node;
}

function nearBottom() {
  const main = $("conversation");
  return main.scrollHeight - main.scrollTop - main.clientHeight < 80;
}

function scrollDown() {
  const main = $("conversation");
  main.scrollTop = main.scrollHeight;
}

// One streamed answer: its text, its tokens' ranges and sources, and the counts the status line shows.
class Answer {
  constructor(node) {
    this.node = node;
    this.text = "";
    this.tokens = [];  // {start, end, source}
    this.counts = {};
    this.firstAt = null;
    this.final = null;  // the last chunk's x_edge_spec
    this.timer = null;  // a rendering to come
    this.finished = false;
  }

  add(piece, source) {
    if (this.firstAt === null) this.firstAt = performance.now();
    const start = this.text.length;
    this.text += piece;
    if (source) {
      this.tokens.push({ start, end: this.text.length, source });
      this.counts[source] = (this.counts[source] || 0) + 1;
    }
  }

  get tokenCount() {
    return Object.values(this.counts).reduce((a, b) => a + b, 0);
  }

  render() {  // at most every RENDER_MS: the browser shares the CPU with the model on a small machine
    if (this.timer !== null || this.finished) return;
    this.timer = setTimeout(() => {
      this.timer = null;
      if (!this.finished) this.renderNow();
    }, RENDER_MS);
  }

  finish() {  // the last rendering: nothing redraws the answer after it
    this.finished = true;
    clearTimeout(this.timer);
    this.timer = null;
    this.renderNow();
  }

  renderNow() {
    const follow = nearBottom();
    const body = this.node.querySelector(".body");
    body.replaceChildren(renderMarkdown(this.text, this.tokens));
    showStats(this);
    if (follow) scrollDown();
  }
}

function fmt(value, digits) {
  return value === null || value === undefined || !Number.isFinite(value) ? "–" : value.toFixed(digits);
}

// The decode speed counts the tokens after the first (the prompt's pass gives that one): none under two.
function speed(x) {
  return x.new_tokens >= 2 ? x.tokens_per_second : null;
}

// τ and tok/s: live from the tokens' sources (each target pass gives exactly one target token; τ counts
// the passes after the first token's, as the server does), then the server's own figures at the end.
function showStats(answer, stateText) {
  const n = answer.tokenCount;
  const targets = answer.counts.target || 0;
  let tau = targets > 1 ? (n - 1) / (targets - 1) : null;
  const seconds = answer.firstAt === null ? 0 : (performance.now() - answer.firstAt) / 1000;
  let tps = seconds > 0 && n > 1 ? (n - 1) / seconds : null;
  const x = answer.final;
  if (x) {
    if (x.tau !== null && x.tau !== undefined) tau = x.tau;
    else if (x.mode === "ar") tau = 1;
    tps = speed(x);
  }
  $("stat-tau").textContent = "τ " + fmt(tau, 2);
  $("stat-tps").textContent = fmt(tps, 1) + " tok/s";
  $("stat-tokens").textContent = (x ? x.new_tokens : n) + " tokens";
  const shares = Object.entries(answer.counts)
    .sort((a, b) => b[1] - a[1])
    .map(([source, count]) => {
      const share = (100 * count) / Math.max(n, 1);
      return `${DRAFTED[source] || source} ${share > 0 && share < 1 ? "<1" : Math.round(share)}%`;
    });
  $("stat-sources").textContent = shares.length ? "· " + shares.join(" · ") : "";
  if (stateText) $("stat-state").textContent = stateText;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

// The events of a server-sent event stream, as parsed JSON (stops at [DONE]).
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function request() {
  const s = state.settings;
  const messages = s.system.trim() ? [{ role: "system", content: s.system }, ...state.messages] : state.messages;
  const body = { messages, stream: true, temperature: s.temperature, max_tokens: s.maxTokens,
                 x_edge_spec: { provenance: true } };
  if (state.model) body.model = state.model;
  return body;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  const user = addMessage("user");
  user.querySelector(".body").textContent = text;
  const node = addMessage("assistant");
  const answer = new Answer(node);
  scrollDown();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  showStats(answer, "waiting…");
  let outcome = "";
  try {
    for (let attempt = 0; ; attempt++) {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(request()),
        signal: controller.signal,
      });
      if (response.status === 401 && attempt < 3) {
        sessionStorage.removeItem(API_KEY);
        await askForKey(await errorText(response));
        continue;
      }
      if (!response.ok) throw new Error(await errorText(response));
      showStats(answer, "streaming…");
      for await (const chunk of events(response.body)) {
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        const x = chunk.x_edge_spec;
        if (x && x.provenance) {
          for (const [piece, source] of x.provenance) answer.add(piece, source);
        } else if (choice && choice.delta && choice.delta.content) {
          answer.add(choice.delta.content, null);
        }
        if (x && x.stop_reason !== undefined) {
          answer.final = x;
          outcome = choice && choice.finish_reason === "length" ? "stopped at max tokens" : "done";
        }
        answer.render();
      }
      break;
    }
  } catch (error) {
    if (error.name === "AbortError") outcome = "stopped";
    else {
      outcome = "error";
      const problem = document.createElement("p");
      problem.className = "error";
      problem.textContent = error.message;
      node.append(problem);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    answer.finish();
    showStats(answer, outcome || "done");
    const x = answer.final;
    node.querySelector(".foot").textContent = x
      ? `${x.new_tokens} tokens · τ ${fmt(x.tau, 2)} · ${fmt(speed(x), 1)} tok/s · ${x.mode}`
      : outcome;
    if (answer.text) state.messages.push({ role: "assistant", content: answer.text });
    else state.messages.pop();  // nothing came back: the question is not part of the conversation
  }
}

// -- start -----------------------------------------------------------------------------------------

function bindComposer() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (!text || state.controller) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (state.controller) state.controller.abort();  // closing the stream cancels the answer on the server
  });
  $("conversation").addEventListener("click", (e) => {
    const button = e.target.closest("button.copy");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("code").textContent;
    navigator.clipboard.writeText(code).then(() => {
      button.textContent = "copied";
      setTimeout(() => (button.textContent = "copy"), 1200);
    });
  });
}

async function start() {
  bindSettings();
  bindComposer();
  setBusy(false);
  try {
    const health = await (await fetch("/health")).json();
    state.mode = health.mode;
    $("model-name").textContent = health.model;
    $("model-name").title = health.model;  // the header may cut it short
    $("model-mode").textContent = health.mode;
  } catch {
    $("model-name").textContent = "server unreachable";
  }
  await ensureKey();
  document.body.dataset.ready = "true";
  $("prompt").focus();
}

start();
