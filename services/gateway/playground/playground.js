// radixserve playground: chat with the gateway's OpenAI-compatible API from a browser.
// The network part (listModels, streamChat) is plain fetch + SSE parsing, with no DOM, so it also runs
// under Node (tests/test_playground.py drives it against a live gateway). The DOM wiring at the
// bottom runs only in a browser.

/** Split an SSE byte stream into the JSON payloads of its `data:` lines ("[DONE]" ends it). */
export async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trimEnd();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message += `: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return new Error(message);
}

/** The model ids the gateway serves. */
export async function listModels(baseUrl, apiKey) {
  const response = await fetch(`${baseUrl}/v1/models`, { headers: headers(apiKey) });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data.map((m) => m.id);
}

/**
 * Stream one chat completion; onDelta(text, kind) gets each piece as it arrives, kind "content" or,
 * from a gateway started with --reasoning-parser, "reasoning". Resolves to
 * { text, reasoning, finishReason, usage }; rejects with the server's error message (HTTP status or
 * an error event in the stream).
 */
export async function streamChat(baseUrl, apiKey, request, onDelta = () => {}) {
  const body = { ...request, stream: true, stream_options: { include_usage: true } };
  const response = await fetch(`${baseUrl}/v1/chat/completions`, {
    method: "POST", headers: headers(apiKey), body: JSON.stringify(body),
  });
  if (!response.ok) throw await failure(response);
  let text = "";
  let reasoning = "";
  let finishReason = null;
  let usage = null;
  for await (const event of sseEvents(response.body)) {
    if (event.error) throw new Error(event.error.message);
    if (event.usage) usage = event.usage;
    for (const choice of event.choices || []) {
      const thought = (choice.delta && choice.delta.reasoning_content) || "";
      if (thought) { reasoning += thought; onDelta(thought, "reasoning"); }
      const delta = (choice.delta && choice.delta.content) || "";
      if (delta) { text += delta; onDelta(delta, "content"); }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
  }
  return { text, reasoning, finishReason, usage };
}

// ---- the page ----------------------------------------------------------------------------------

function startPage() {
  const $ = (id) => document.getElementById(id);
  const base = window.location.origin;
  const history = [];
  const key = () => $("api-key").value.trim();

  function show(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("log").appendChild(div);
    $("log").scrollTop = $("log").scrollHeight;
    return div;
  }

  async function loadModels() {
    try {
      const models = await listModels(base, key());
      $("model").replaceChildren(...models.map((m) => new Option(m, m)));
      $("status").textContent = models.length ? "" : "no model is served yet";
    } catch (err) {
      $("status").textContent = err.message;
    }
  }

  $("form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const content = $("prompt").value.trim();
    if (!content) return;
    $("prompt").value = "";
    history.push({ role: "user", content });
    show("user", content);
    const reply = show("assistant", "");
    const thinking = document.createElement("details");
    thinking.className = "thinking";
    thinking.hidden = true;
    thinking.append(Object.assign(document.createElement("summary"), { textContent: "reasoning" }),
      document.createElement("div"));
    const answer = document.createElement("span");
    reply.append(thinking, answer);
    const system = $("system").value.trim();
    const request = {
      model: $("model").value,
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value),
    };
    $("send").disabled = true;
    const started = performance.now();
    try {
      const out = await streamChat(base, key(), request, (d, kind) => {
        if (kind === "reasoning") { thinking.hidden = false; thinking.lastChild.textContent += d; }
        else answer.textContent += d;
      });
      history.push({ role: "assistant", content: out.text });
      const secs = (performance.now() - started) / 1000;
      const u = out.usage || {};
      $("status").textContent = `${out.finishReason}; ${u.completion_tokens ?? "?"} tokens in ${secs.toFixed(2)} s` +
        (u.prompt_tokens_details ? `; ${u.prompt_tokens_details.cached_tokens} prompt tokens from the cache` : "");
    } catch (err) {
      reply.classList.add("error");
      answer.textContent += `\n[${err.message}]`;
      history.pop();
    } finally {
      $("send").disabled = false;
    }
  });
  $("clear").addEventListener("click", () => { history.length = 0; $("log").replaceChildren(); });
  $("api-key").addEventListener("change", loadModels);
  loadModels();
}

if (typeof document !== "undefined") startPage();
