// mmkit playground: one chat page over the server's own OpenAI-compatible API.
//
// Protocol: plain `POST /v1/chat/completions` with `stream: true` (server-sent events, one
// `data: {chat.completion.chunk}` per token, then `data: [DONE]`), the image as a
// `data:` URI in an `image_url` part of the user message that attached it. The whole
// conversation (every turn and its image) is sent again with each question, as the API is
// stateless. An API key is needed when `GET /v1/models` answers 401 without one; the key is
// kept in sessionStorage (this tab only) and sent as `Authorization: Bearer <key>`.
"use strict";

(function () {
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
    attachment: null,     // {url, name, type, size} waiting to go with the next question
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

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (state.apiKey) h["Authorization"] = "Bearer " + state.apiKey;
    return h;
  }

  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
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

  function formatBytes(n) {
    if (n < 1024) return n + " B";
    if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KB";
    return (n / 1024 / 1024).toFixed(1) + " MB";
  }

  // The server's message from an error response: OpenAI's {"error": {"message"}}, FastAPI's
  // {"detail": "..."} or a list of validation errors, or the raw text.
  async function errorMessage(response) {
    const text = await response.text();
    let message = text.trim();
    try {
      const body = JSON.parse(text);
      if (body && body.error) {
        message = typeof body.error === "string" ? body.error : (body.error.message || message);
      } else if (body && typeof body.detail === "string") {
        message = body.detail;
      } else if (body && Array.isArray(body.detail)) {
        message = body.detail.map((d) => (d.loc ? d.loc.join(".") + ": " : "") + d.msg).join("; ");
      }
    } catch (e) { /* not JSON: keep the text */ }
    return message || response.statusText || "no message";
  }

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

  // ---- connecting: which model, and is a key needed? -----------------------------------

  async function connect() {
    const sentKey = Boolean(state.apiKey);
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      el.modelName.textContent = "server unreachable";
      showError("Cannot reach the server: " + e.message);
      return false;
    }
    if (response.status === 401) {
      el.modelName.textContent = "API key needed";
      unauthorized(sentKey, await errorMessage(response));
      return false;
    }
    if (!response.ok) {
      el.modelName.textContent = "model unknown";
      showError("GET /v1/models failed (" + response.status + "): " + (await errorMessage(response)));
      return false;
    }
    const body = await response.json();
    const card = body.data && body.data.length ? body.data[0] : null;
    state.model = card ? card.id : null;
    if (card && Number.isInteger(card.max_model_len)) {
      // Prompt and answer share the context: the answer cannot be longer than all of it.
      el.maxTokens.max = String(card.max_model_len);
      $("max-tokens-help").textContent = "context: " + card.max_model_len + " tokens";
    }
    el.modelName.textContent = state.model ? "model: " + state.model : "model unknown";
    storeKey(state.apiKey);
    closeKeyForm();
    clearError();
    return true;
  }

  // ---- image: choose, drop, paste ------------------------------------------------------

  function attach(file) {
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      // Any file is sent as it is: the server says what is wrong with it (not an image, too
      // large), and its message is shown. The preview just says when it cannot show the file.
      state.attachment = { url: reader.result, name: file.name || "pasted image", type: file.type, size: file.size };
      el.preview.hidden = false;
      el.preview.src = reader.result;
      el.attachmentName.textContent = state.attachment.name + " (" + formatBytes(file.size) + ")";
      el.attachment.hidden = false;
      el.prompt.focus();
    };
    reader.onerror = () => showError("Could not read " + (file.name || "the file") + ": " + reader.error);
    reader.readAsDataURL(file);
  }

  function detach() {
    state.attachment = null;
    el.attachment.hidden = true;
    el.preview.removeAttribute("src");
    el.attachmentName.textContent = "";
    el.imageInput.value = "";
  }

  el.preview.addEventListener("error", () => {
    if (!state.attachment) return;
    el.preview.hidden = true;
    el.attachmentName.textContent = state.attachment.name + " (no preview: this may not be an image)";
  });

  el.imageInput.addEventListener("change", () => attach(el.imageInput.files[0]));
  el.removeImage.addEventListener("click", () => { detach(); el.prompt.focus(); });

  let dragDepth = 0;
  function hasFiles(event) {
    return event.dataTransfer && Array.from(event.dataTransfer.types || []).includes("Files");
  }
  document.addEventListener("dragenter", (event) => {
    if (!hasFiles(event)) return;
    event.preventDefault();
    dragDepth += 1;
    el.dropOverlay.hidden = false;
  });
  document.addEventListener("dragover", (event) => { if (hasFiles(event)) event.preventDefault(); });
  document.addEventListener("dragleave", () => {
    dragDepth = Math.max(0, dragDepth - 1);
    if (dragDepth === 0) el.dropOverlay.hidden = true;
  });
  document.addEventListener("drop", (event) => {
    if (!hasFiles(event)) return;
    event.preventDefault();
    dragDepth = 0;
    el.dropOverlay.hidden = true;
    attach(event.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (event) => {
    const files = event.clipboardData ? Array.from(event.clipboardData.files || []) : [];
    if (!files.length) return;  // plain text pastes into the question box as usual
    event.preventDefault();
    attach(files[0]);
  });

  // ---- the conversation ----------------------------------------------------------------

  function addUserTurn(text, attachment) {
    el.emptyHint.hidden = true;
    const turn = make("article", "turn user");
    turn.appendChild(make("h3", "who visually-hidden", "You"));
    if (attachment) {
      const img = make("img", "turn-image");
      img.src = attachment.url;
      img.alt = "Attached image: " + attachment.name;
      img.addEventListener("error", () => img.replaceWith(make("p", "file-chip", "Attached file: " + attachment.name)));
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
    state.controller = null;
    setStreaming(false);
    detach();
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
    if (s.finish === "stopped") parts.push("stopped by you");
    stats.textContent = parts.join(" · ");
    stats.title = "tokens: completion tokens; TTFT: time to first token; tokens/s: decode speed after the first token";
    turn.appendChild(stats);
  }

  // Reads the server-sent events of one streamed answer; calls onChunk for every parsed chunk.
  async function readEvents(response, onChunk) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }

  async function ask(event) {
    if (event) event.preventDefault();
    if (state.controller) return;  // one answer at a time
    const text = el.prompt.value.trim();
    if (!text && !state.attachment) { el.prompt.focus(); return; }
    let settings;
    try { settings = readSettings(); } catch (e) { showError(e.message); return; }
    clearError();

    const attachment = state.attachment;
    const content = [];
    if (attachment) content.push({ type: "image_url", image_url: { url: attachment.url } });
    if (text) content.push({ type: "text", text: text });
    const userMessage = { role: "user", content: content };
    const userTurn = addUserTurn(text, attachment);
    const answer = addAssistantTurn();
    el.prompt.value = "";
    detach();

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

    const s = { startAt: performance.now(), firstAt: null, lastAt: null, endAt: null, chunks: 0, tokens: 0, finish: null, usage: null };
    let text_ = "";
    let failure = null;   // {message, status}
    const sentKey = Boolean(state.apiKey);
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        failure = { status: response.status, message: await errorMessage(response) };
      } else {
        await readEvents(response, (chunk) => {
          if (chunk.error) {  // an error after the stream started
            const code = chunk.error.code;
            failure = { status: typeof code === "number" ? code : 0, message: chunk.error.message || JSON.stringify(chunk.error) };
            return;
          }
          if (chunk.usage) s.usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) return;
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (s.firstAt === null) s.firstAt = performance.now();
            s.chunks += 1;
            answer.textNode.appendData(delta);
            text_ += delta;
            if (pinned) scrollToEnd();
          }
          if (choice.finish_reason) s.finish = choice.finish_reason;
          if (delta || choice.finish_reason) s.lastAt = performance.now();  // the last token's arrival
        });
      }
    } catch (e) {
      if (e.name === "AbortError") s.finish = "stopped";
      else failure = { status: 0, message: "The connection to the server failed: " + e.message };
    }
    s.endAt = performance.now();
    if (chatId !== state.chatId) return;  // "New chat" was pressed meanwhile
    state.controller = null;
    setStreaming(false);
    answer.message.classList.remove("streaming");
    answer.message.removeAttribute("aria-busy");

    if (failure) {
      // The turn did not happen: it leaves the conversation, and the question and image go back
      // into the composer so the user can fix and resend them.
      answer.turn.remove();
      userTurn.classList.add("failed");
      userTurn.appendChild(make("p", "failed-note", "Not answered (see the error below)."));
      scrollToEnd();
      if (!el.prompt.value) el.prompt.value = text;
      if (attachment && !state.attachment) restoreAttachment(attachment);
      if (failure.status === 401) unauthorized(sentKey, failure.message);
      else showError("Error" + (failure.status ? " " + failure.status : "") + ": " + failure.message);
      return;
    }
    if (s.usage && typeof s.usage.completion_tokens === "number") s.tokens = s.usage.completion_tokens;
    else s.tokens = s.chunks;  // stopped or no usage: one chunk per token
    if (s.finish === "stopped") answer.message.classList.add("stopped");
    state.messages.push(userMessage, { role: "assistant", content: text_ });
    showStats(answer.turn, s);
    if (pinned) scrollToEnd();
    if (document.activeElement === document.body) el.prompt.focus();
  }

  function restoreAttachment(attachment) {
    state.attachment = attachment;
    el.preview.hidden = false;
    el.preview.src = attachment.url;
    el.attachmentName.textContent = attachment.name + " (" + formatBytes(attachment.size) + ")";
    el.attachment.hidden = false;
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
})();
