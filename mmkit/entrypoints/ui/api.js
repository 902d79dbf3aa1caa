// The OpenAI-compatible API as the playground uses it: no DOM here.
//
// `getModels(apiKey)` is `GET /v1/models` (a 401 there is how the page learns that a key is
// needed); `streamChat(...)` is `POST /v1/chat/completions` with `stream: true`: server-sent
// events, one `data: {chat.completion.chunk}` per token, a last chunk with `usage`, then
// `data: [DONE]`. Paths are relative, so the page works behind a path prefix too.

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

// The server's message from an error response: OpenAI's {"error": {"message"}}, FastAPI's
// {"detail": "..."} or a list of validation errors, or the raw text.
export async function errorMessage(response) {
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

// -> {ok: true, card} with the first model's card ({id, max_model_len, ...}), or
//    {ok: false, status, message}; status 0 when the server cannot be reached.
export async function getModels(apiKey) {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers(apiKey) });
  } catch (e) {
    return { ok: false, status: 0, message: "Cannot reach the server: " + e.message };
  }
  if (!response.ok) return { ok: false, status: response.status, message: await errorMessage(response) };
  const body = await response.json();
  const cards = Array.isArray(body.data) ? body.data : [];
  return { ok: true, card: cards.length ? cards[0] : null, cards };
}

// Calls onChunk(object) for each `data:` event of a server-sent-events response until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
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

// Streams one answer: onDelta(text) for every piece of text as it arrives. Aborting `signal`
// closes the connection, which makes the server abort the request. Resolves to
//   {outcome: "done" | "stopped" | "failed", finish, usage, chunks, firstAt, lastAt,
//    error: {status, message} (when failed; status 0 when no HTTP status applies)}
// with times from performance.now(): firstAt at the first text, lastAt at the last token.
export async function streamChat(body, apiKey, signal, onDelta) {
  const result = { outcome: "done", finish: null, usage: null, chunks: 0, firstAt: null, lastAt: null, error: null };
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(apiKey), body: JSON.stringify(body), signal: signal,
    });
    if (!response.ok) {
      result.outcome = "failed";
      result.error = { status: response.status, message: await errorMessage(response) };
      return result;
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) {  // an error after the stream started
        const code = chunk.error.code;
        result.outcome = "failed";
        result.error = { status: typeof code === "number" ? code : 0,
                         message: chunk.error.message || JSON.stringify(chunk.error) };
        return;
      }
      if (chunk.usage) result.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        if (result.firstAt === null) result.firstAt = performance.now();
        result.chunks += 1;
        onDelta(delta);
      }
      if (choice.finish_reason) result.finish = choice.finish_reason;
      if (delta || choice.finish_reason) result.lastAt = performance.now();
    });
  } catch (e) {
    if (e.name === "AbortError") {
      result.outcome = "stopped";
    } else {
      result.outcome = "failed";
      result.error = { status: 0, message: "The connection to the server failed: " + e.message };
    }
  }
  return result;
}
