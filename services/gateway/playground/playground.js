// radixserve playground: chat with the gateway's OpenAI-compatible API from a browser.
// The network part (listModels, streamChat) is plain fetch + SSE parsing, with no DOM, so it also runs
// under Node (tests/test_playground.py drives it against a live gateway). The page at the bottom runs
// only in a browser (tests/test_playground_browser.py drives it in headless Chromium).

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
 * an error event in the stream). Aborting `signal` closes the connection, which makes the gateway
 * abort the request on its worker; the promise then rejects with an AbortError.
 */
export async function streamChat(baseUrl, apiKey, request, onDelta = () => {}, signal = undefined) {
  const body = { ...request, stream: true, stream_options: { include_usage: true } };
  const response = await fetch(`${baseUrl}/v1/chat/completions`, {
    method: "POST", headers: headers(apiKey), body: JSON.stringify(body), signal,
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

/** "12 tokens · 30.5 tok/s · first token 0.21 s": decoding speed after the first token. */
export function speedLine(tokens, started, first, ended) {
  const decoding = first !== null && ended > first && tokens > 1 ? (tokens - 1) / ((ended - first) / 1000)
    : tokens / Math.max((ended - started) / 1000, 1e-3);
  const ttft = first === null ? "" : ` · first token ${((first - started) / 1000).toFixed(2)} s`;
  return `${tokens} tokens · ${decoding.toFixed(1)} tok/s${ttft}`;
}

async function copyText(text) {
  // navigator.clipboard exists only in secure contexts (https, localhost); a gateway reached over
  // plain http elsewhere gets the older selection-based copy.
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = Object.assign(document.createElement("textarea"), { value: text });
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused to copy");
}

function el(tag, className, text = "") {
  return Object.assign(document.createElement(tag), { className, textContent: text });
}

function startPage() {
  const $ = (id) => document.getElementById(id);
  const base = window.location.origin;
  const history = []; // the conversation sent with each turn: {role, content}
  let controller = null; // the running stream's AbortController
  let chat = 0; // bumped by "New chat": a stream of an earlier chat no longer touches the history
  const key = () => $("api-key").value.trim();

  function number(id) {
    const raw = $(id).value.trim();
    return raw === "" ? undefined : Number(raw);
  }

  function setStatus(text, isError = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", isError);
  }

  function scrollDown() { $("log").scrollTop = $("log").scrollHeight; }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  async function loadModels() {
    try {
      const chosen = $("model").value;
      const models = await listModels(base, key());
      $("model").replaceChildren(...models.map((m) => new Option(m, m, false, m === chosen)));
      setStatus(models.length ? "" : "no model is served yet");
    } catch (err) {
      setStatus(err.message, true);
    }
  }

  /** An assistant bubble: folded reasoning, the answer, and a line with its speed and a copy button. */
  function assistantBubble() {
    const bubble = el("div", "msg assistant");
    bubble.dataset.state = "streaming";
    const thinking = el("details", "reasoning");
    thinking.hidden = true;
    thinking.append(el("summary", "", "Reasoning"), el("div", "reasoning-text"));
    const answer = el("div", "answer");
    const copy = el("button", "copy", "Copy");
    copy.type = "button";
    copy.addEventListener("click", async () => {
      try {
        await copyText(answer.textContent);
        copy.textContent = "Copied";
      } catch (err) {
        copy.textContent = "Copy failed";
      }
      setTimeout(() => { copy.textContent = "Copy"; }, 1500);
    });
    const meta = el("div", "meta");
    meta.append(el("span", "stats"), copy);
    bubble.append(thinking, answer, meta);
    $("log").append(bubble);
    return { bubble, thinking, answer, stats: meta.firstChild };
  }

  async function send(content) {
    history.push({ role: "user", content });
    $("log").append(el("div", "msg user", content));
    const view = assistantBubble();
    scrollDown();
    const system = $("system").value.trim();
    const request = {
      model: $("model").value,
      messages: system ? [{ role: "system", content: system }, ...history] : [...history],
      temperature: number("temperature"),
      top_p: number("top-p"),
      max_tokens: number("max-tokens"),
    };
    const mine = chat;
    const stopper = new AbortController();
    controller = stopper;
    setBusy(true);
    setStatus("");
    const started = performance.now();
    let first = null;
    let pieces = 0;
    const onDelta = (delta, kind) => {
      if (first === null) first = performance.now();
      pieces += 1;
      if (kind === "reasoning") {
        view.thinking.hidden = false;
        view.thinking.lastChild.textContent += delta;
      } else {
        view.answer.textContent += delta;
      }
      // Live, each streamed piece counts as a token (one per scheduler step); the final line uses usage.
      view.stats.textContent = `≈ ${speedLine(pieces, started, first, performance.now())}`;
      scrollDown();
    };
    try {
      const out = await streamChat(base, key(), request, onDelta, stopper.signal);
      if (mine === chat) history.push({ role: "assistant", content: out.text });
      view.bubble.dataset.state = "done";
      const tokens = out.usage ? out.usage.completion_tokens : pieces;
      const details = out.usage && out.usage.prompt_tokens_details;
      const cached = details && details.cached_tokens
        ? ` · ${details.cached_tokens}/${out.usage.prompt_tokens} prompt tokens cached` : "";
      view.stats.textContent = `${speedLine(tokens, started, first, performance.now())} · ${out.finishReason}${cached}`;
    } catch (err) {
      if (err.name === "AbortError") {
        view.bubble.dataset.state = "stopped";
        view.stats.textContent = `stopped after ${pieces} pieces`;
        if (mine !== chat) return;
        // The partial answer stays in the conversation, as it stays on screen.
        if (view.answer.textContent) history.push({ role: "assistant", content: view.answer.textContent });
        else history.pop();
      } else {
        view.bubble.dataset.state = "error";
        view.answer.textContent += (view.answer.textContent ? "\n" : "") + err.message;
        view.stats.textContent = "error";
        setStatus(err.message, true);
        if (mine === chat) history.pop(); // the failed turn is not sent again
      }
    } finally {
      if (controller === stopper) {
        controller = null;
        setBusy(false);
      }
      scrollDown();
    }
  }

  $("form").addEventListener("submit", (e) => {
    e.preventDefault();
    const content = $("prompt").value.trim();
    if (!content || controller) return;
    $("prompt").value = "";
    send(content);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    controller = null;
    setBusy(false);
    chat += 1;
    history.length = 0;
    $("log").replaceChildren();
    setStatus("");
    $("prompt").focus();
  });
  $("settings-toggle").addEventListener("click", () => {
    const open = document.body.classList.toggle("settings-open");
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  $("api-key").addEventListener("change", loadModels);
  loadModels();
}

if (typeof document !== "undefined") startPage();
