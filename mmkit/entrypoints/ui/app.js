// mmkit playground: one chat page over the server's own OpenAI-compatible API (api.js).
//
// The image goes as a `data:` URI in an `image_url` part of the user message that attached
// it. The whole conversation (every turn and its image) is sent again with each question, as
// the API is stateless. An API key is needed when `GET /v1/models` answers 401 without one;
// the key is kept in sessionStorage (this tab only) and sent as `Authorization: Bearer <key>`.
import { getModels, streamChat } from "./api.js";
import { setupAttachment } from "./attachment.js";

const KEY_STORAGE = "mmkit.apiKey";
const $ = (id) => document.getElementById(id);
const el = {
  main: $("main"), transcript: $("transcript"), emptyHint: $("empty-hint"), error: $("error"),
  composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  newChat: $("new-chat"), imageInput: $("image-input"), attachment: $("attachment"),
  preview: $("preview"), attachmentName: $("attachment-name"), removeImage: $("remove-image"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), modelName: $("model-name"),
  keySlot: $("key-slot"), keyTemplate: $("key-template"), dropOverlay: $("drop-overlay"),
};

const state = {
  model: null,          // the served model's id, from GET /v1/models
  apiKey: readStoredKey(),
  messages: [],         // the conversation in OpenAI form, only turns the server answered
  fileNames: [],        // per message: the name of the file its image came from (null: none)
  controller: null,     // AbortController of the answer being streamed
  chatId: 0,            // bumped by "New chat": a late answer of an old chat is dropped
};

// ---- small helpers -------------------------------------------------------------------

function readStoredKey() {
  try { return sessionStorage.getItem(KEY_STORAGE); } catch (e) { return null; }
}

function storeKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key); else sessionStorage.removeItem(KEY_STORAGE);
  } catch (e) { /* storage disabled: the key lives for this page load only */ }
}

function showError(message) {
  el.error.textContent = message;
  el.error.hidden = false;
}

// The server names a part of the request by its place in it (`messages[4].content[0]: ...`);
// the user knows that part as the file they attached: name the file instead.
function nameAttachments(message, messages, fileNames) {
  return message.replace(/messages\[(\d+)\]\.content\[(\d+)\](?:\.image_url(?:\.url)?)?/g, (where, m, p) => {
    const msg = messages[Number(m)];
    const part = msg && Array.isArray(msg.content) ? msg.content[Number(p)] : null;
    const name = fileNames[Number(m)];
    if (!part || part.type !== "image_url" || !name) return where;
    const turn = Math.floor(Number(m) / 2) + 1;  // user and assistant messages alternate
    return "the attached file \"" + name + "\"" + (Number(m) === messages.length - 1 ? "" : " (question " + turn + ")");
  });
}

function clearError() {
  el.error.textContent = "";
  el.error.hidden = true;
}

function make(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function nearBottom() {
  const t = el.transcript;
  return t.scrollHeight - t.scrollTop - t.clientHeight < 48;
}

function scrollToEnd() { el.transcript.scrollTop = el.transcript.scrollHeight; }

// The conversation follows new text while the reader is at its end (also when the composer
// grows, e.g. an image preview appears); scrolling up to read stops that until they return.
let pinned = true;
el.transcript.addEventListener("scroll", () => { pinned = nearBottom(); });
new ResizeObserver(() => { if (pinned) scrollToEnd(); }).observe(el.transcript);

// ---- API key -------------------------------------------------------------------------

// A clear message for a 401, with the server's own words after it.
function keyMessage(sentKey, serverMessage) {
  const said = serverMessage ? " (server: " + serverMessage + ")" : "";
  return sentKey
    ? "401 Unauthorized: the server rejected this API key" + said + ". Enter the key `mmkit serve --api-key` was started with."
    : "401 Unauthorized: this server needs an API key" + said + ". Enter it above.";
}

function askForKey() {
  if ($("key-form")) { $("api-key").focus(); return; }
  el.keySlot.appendChild(el.keyTemplate.content.cloneNode(true));
  $("key-form").addEventListener("submit", onKeySubmit);
  $("api-key").focus();
}

function closeKeyForm() {
  const form = $("key-form");
  if (form) form.remove();
}

async function onKeySubmit(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  state.apiKey = key;
  if (await connect()) el.prompt.focus();
}

// A 401: forget the key (it is wrong or missing) and ask for one.
function unauthorized(sentKey, serverMessage) {
  state.apiKey = null;
  storeKey(null);
  askForKey();
  showError(keyMessage(sentKey, serverMessage));
}

// ---- the model picker: the base model and its LoRA adapters (cards with a `parent`) -----
function showModelPicker(cards) {
  const picker = $("model-picker");
  const label = $("model-picker-label");
  if (cards.length < 2) { label.hidden = true; return; }
  const previous = state.model;
  picker.replaceChildren(...cards.map((card) => {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.parent ? card.id + " (adapter of " + card.parent + ")" : card.id;
    return option;
  }));
  if (cards.some((c) => c.id === previous)) picker.value = previous;
  state.model = picker.value;
  picker.onchange = () => {
    state.model = picker.value;
    el.modelName.textContent = "model: " + state.model;
  };
  el.modelName.textContent = "model: " + state.model;
  label.hidden = false;
}

// ---- connecting: which model, and is a key needed? -----------------------------------

async function connect() {
  const sentKey = Boolean(state.apiKey);
  const models = await getModels(state.apiKey);
  if (!models.ok) {
    if (models.status === 401) {
      el.modelName.textContent = "API key needed";
      unauthorized(sentKey, models.message);
    } else {
      el.modelName.textContent = models.status ? "model unknown" : "server unreachable";
      showError(models.status ? "GET /v1/models failed (" + models.status + "): " + models.message : models.message);
    }
    return false;
  }
  const card = models.card;
  state.model = card ? card.id : null;
  if (card && Number.isInteger(card.max_model_len)) {
    // Prompt and answer share the context: the answer cannot be longer than all of it.
    el.maxTokens.max = String(card.max_model_len);
    $("max-tokens-help").textContent = "context: " + card.max_model_len + " tokens";
  }
  el.modelName.textContent = state.model ? "model: " + state.model : "model unknown";
  showModelPicker(models.cards || []);
  storeKey(state.apiKey);
  closeKeyForm();
  clearError();
  return true;
}

// ---- the image for the next question -------------------------------------------------

const attachment = setupAttachment(
  { input: el.imageInput, box: el.attachment, preview: el.preview, name: el.attachmentName,
    remove: el.removeImage, overlay: el.dropOverlay },
  () => el.prompt.focus(), showError);

// ---- the conversation ----------------------------------------------------------------

function addUserTurn(text, image) {
  el.emptyHint.hidden = true;
  const turn = make("article", "turn user");
  turn.appendChild(make("h3", "who visually-hidden", "You"));
  if (image) {
    const img = make("img", "turn-image");
    img.src = image.url;
    img.alt = "Attached image: " + image.name;
    img.addEventListener("error", () => img.replaceWith(make("p", "file-chip", "Attached file: " + image.name)));
    turn.appendChild(img);
  }
  turn.appendChild(make("p", "text", text));
  el.transcript.appendChild(turn);
  pinned = true;
  scrollToEnd();
  return turn;
}

function addAssistantTurn() {
  const turn = make("article", "turn assistant");
  turn.appendChild(make("h3", "who visually-hidden", "Assistant"));
  const message = make("div", "text streaming");
  message.setAttribute("data-testid", "assistant-message");
  message.setAttribute("aria-busy", "true");
  const textNode = document.createTextNode("");
  message.appendChild(textNode);
  turn.appendChild(message);
  el.transcript.appendChild(turn);
  scrollToEnd();
  return { turn, message, textNode };
}

function setStreaming(on) {
  el.send.hidden = on;
  el.stop.hidden = !on;
  el.composer.classList.toggle("busy", on);
  if (!on && document.activeElement === el.stop) el.prompt.focus();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.chatId += 1;
  state.messages = [];
  state.fileNames = [];
  state.controller = null;
  setStreaming(false);
  attachment.clear();
  clearError();
  el.transcript.querySelectorAll(".turn").forEach((node) => node.remove());
  el.emptyHint.hidden = false;
  el.prompt.value = "";
  el.prompt.focus();
}

function readSettings() {
  const body = {};
  const temperature = el.temperature.value.trim();
  if (temperature !== "") {
    const t = Number(temperature);
    if (!Number.isFinite(t) || t < 0) throw new Error("Temperature must be a number of 0 or more (0 = greedy); got " + temperature);
    body.temperature = t;
  }
  const maxTokens = el.maxTokens.value.trim();
  if (maxTokens !== "") {
    const m = Number(maxTokens);
    if (!Number.isInteger(m) || m < 1) throw new Error("Max tokens must be a whole number of 1 or more; got " + maxTokens);
    body.max_tokens = m;
  }
  return body;
}

// Figures after an answer: tokens, time to first token, and the decode rate (tokens after the
// first over the time from the first to the last one; with a single token, over the whole answer).
function showStats(turn, s) {
  const stats = make("p", "stats");
  stats.setAttribute("data-testid", "stats");
  const ttftMs = s.firstAt === null ? null : s.firstAt - s.startAt;
  const decodeS = s.firstAt === null ? 0 : ((s.lastAt || s.endAt) - s.firstAt) / 1000;
  let rate = null;
  if (s.tokens > 1 && decodeS > 0.001) rate = (s.tokens - 1) / decodeS;
  else if (s.tokens > 0 && s.endAt > s.startAt) rate = s.tokens / ((s.endAt - s.startAt) / 1000);
  stats.dataset.tokens = String(s.tokens);
  if (ttftMs !== null) stats.dataset.ttftMs = ttftMs.toFixed(0);
  if (rate !== null) stats.dataset.tokensPerSecond = rate.toFixed(1);
  const parts = [s.tokens + (s.tokens === 1 ? " token" : " tokens")];
  parts.push("TTFT " + (ttftMs === null ? "-" : ttftMs.toFixed(0) + " ms"));
  parts.push((rate === null ? "-" : rate.toFixed(1)) + " tokens/s");
  if (s.finish === "length") parts.push("stopped at max tokens");
  if (s.outcome === "stopped") parts.push("stopped by you");
  stats.textContent = parts.join(" · ");
  stats.title = "tokens: completion tokens; TTFT: time to first token; tokens/s: decode speed after the first token";
  turn.appendChild(stats);
}

async function ask(event) {
  if (event) event.preventDefault();
  if (state.controller) return;  // one answer at a time
  const text = el.prompt.value.trim();
  if (!text && !attachment.current()) { el.prompt.focus(); return; }
  let settings;
  try { settings = readSettings(); } catch (e) { showError(e.message); return; }
  // A key typed into the key field counts even when the user pressed Send instead of Enter
  // there: take it, and connect again with it.
  const keyField = $("api-key");
  const typedKey = keyField ? keyField.value.trim() : "";
  if (typedKey && typedKey !== state.apiKey) {
    state.apiKey = typedKey;
    state.model = null;
  }
  // Not connected yet (the server was starting, or a key is still missing): try again now.
  if (!state.model && !(await connect())) return;
  if (state.controller) return;  // a second Enter while connecting
  clearError();

  const image = attachment.current();
  const content = [];
  if (image) content.push({ type: "image_url", image_url: { url: image.url } });
  if (text) content.push({ type: "text", text: text });
  const userMessage = { role: "user", content: content };
  const userTurn = addUserTurn(text, image);
  const answer = addAssistantTurn();
  el.prompt.value = "";
  attachment.clear();

  const chatId = state.chatId;
  const controller = new AbortController();
  state.controller = controller;
  setStreaming(true);

  const body = Object.assign({
    messages: state.messages.concat([userMessage]),
    stream: true,
    stream_options: { include_usage: true },
  }, settings);
  if (state.model) body.model = state.model;

  const startAt = performance.now();
  const sentKey = Boolean(state.apiKey);
  let answerText = "";
  const result = await streamChat(body, state.apiKey, controller.signal, (delta) => {
    answer.textNode.appendData(delta);
    answerText += delta;
    if (pinned) scrollToEnd();
  });
  const s = { ...result, startAt: startAt, endAt: performance.now() };
  if (chatId !== state.chatId) return;  // "New chat" was pressed meanwhile
  state.controller = null;
  setStreaming(false);
  answer.message.classList.remove("streaming");
  answer.message.removeAttribute("aria-busy");

  if (result.outcome === "failed") {
    // The turn did not happen: it leaves the conversation, and the question and image go back
    // into the composer so the user can fix and resend them.
    answer.turn.remove();
    userTurn.classList.add("failed");
    userTurn.appendChild(make("p", "failed-note", "Not answered (see the error below)."));
    scrollToEnd();
    if (!el.prompt.value) el.prompt.value = text;
    if (image && !attachment.current()) attachment.restore(image);
    const error = result.error;
    if (error.status === 401) unauthorized(sentKey, error.message);
    else showError("Error" + (error.status ? " " + error.status : "") + ": "
                   + nameAttachments(error.message, body.messages, state.fileNames.concat([image ? image.name : null])));
    return;
  }
  if (s.usage && typeof s.usage.completion_tokens === "number") s.tokens = s.usage.completion_tokens;
  else s.tokens = s.chunks;  // stopped or no usage: one chunk per token
  if (s.outcome === "stopped") answer.message.classList.add("stopped");
  state.messages.push(userMessage, { role: "assistant", content: answerText });
  state.fileNames.push(image ? image.name : null, null);
  showStats(answer.turn, s);
  if (pinned) scrollToEnd();
  if (document.activeElement === document.body) el.prompt.focus();
}

function stop() {
  if (state.controller) state.controller.abort();  // closing the stream aborts the request on the server
}

// ---- wiring --------------------------------------------------------------------------

el.composer.addEventListener("submit", ask);
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", newChat);
el.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ask();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.controller) { event.preventDefault(); stop(); }
});

connect().then(() => { if (!$("key-form")) el.prompt.focus(); });
