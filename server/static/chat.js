// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions (SSE over
// fetch), a stop button that aborts the fetch (the server then frees the request's KV blocks).
"use strict";

(function () {
  const STORE_KEY = "mlx-infer.chat.v1";
  const API_KEY = "mlx-infer.api-key";
  const $ = (id) => document.getElementById(id);

  const state = {
    model: null,
    models: [],
    data: load(),
    controller: null, // AbortController of the request in flight
    streaming: null, // the conversation being answered
    reply: null, // its answer, the message streaming in this tab
    connecting: null, // the /v1/models request in flight
  };

  // ---- storage -----------------------------------------------------------------------------------
  // Other tabs of this page share the storage: every write first merges what is stored, and their writes
  // are merged in here, so no tab overwrites another's conversations or messages. A conversation merges
  // message by message (each has an id and the time it last changed, `at`): the newer copy of a message
  // wins, except that the answer streaming in this tab is this tab's; messages another tab added stay,
  // in the stored order, with this tab's new ones after them; a message cut anywhere (Edit, Regenerate)
  // stays cut (the conversation's `cut` ids), and a conversation deleted anywhere stays deleted.
  const MAX_DELETED = 500; // remembered deletions
  const MAX_CUT = 1000; // remembered cut messages, a conversation

  // The time of a change, later than any change before it here (two in one millisecond stay in order).
  let clock = 0;
  function now() {
    clock = Math.max(Date.now(), clock + 1);
    return clock;
  }

  function newId() {
    return String(Date.now()) + Math.random().toString(16).slice(2, 8);
  }

  // Ids for messages stored before they had them: from their place, the same in every tab.
  function normalize(data) {
    for (const conv of data.conversations) {
      conv.cut = conv.cut || [];
      conv.messages.forEach((m, index) => {
        if (!m.id) m.id = conv.id + "." + index;
      });
    }
    return data;
  }

  function parse(text) {
    try {
      const data = JSON.parse(text);
      if (data && Array.isArray(data.conversations)) return data;
    } catch (e) {
      /* unreadable: start afresh */
    }
    return null;
  }

  function load() {
    const data = parse(localStorage.getItem(STORE_KEY)) ||
      { conversations: [], current: null, settings: { temperature: 0.7, max_tokens: 512, extra: "" } };
    data.deleted = data.deleted || [];
    return normalize(data);
  }

  function merge(stored) {
    if (!stored) return;
    normalize(stored);
    const deleted = [...new Set([...state.data.deleted, ...(stored.deleted || [])])].slice(-MAX_DELETED);
    const gone = new Set(deleted);
    const byId = new Map(state.data.conversations.map((c) => [c.id, c]));
    for (const other of stored.conversations) {
      const own = byId.get(other.id);
      if (own) mergeConversation(own, other);
      else byId.set(other.id, other);
    }
    state.data.deleted = deleted;
    state.data.conversations = [...byId.values()]
      .filter((c) => !gone.has(c.id))
      .sort((a, b) => (b.updated || 0) - (a.updated || 0));
    // The answer streaming here was cut (or its conversation deleted) in another tab: stop it.
    const conv = state.streaming;
    if (conv && state.controller && (gone.has(conv.id) || !conv.messages.includes(state.reply))) {
      state.controller.abort();
    }
  }

  // Merges the stored copy of a conversation into this tab's (the same object: an answer streaming here
  // goes on streaming into it).
  function mergeConversation(own, other) {
    const stamp = (c) => c.edited || c.updated || 0; // (when its title or system prompt last changed)
    if (stamp(other) > stamp(own)) {
      own.title = other.title;
      own.system = other.system;
      own.edited = other.edited;
    }
    own.updated = Math.max(own.updated || 0, other.updated || 0);
    const cut = new Set([...own.cut, ...other.cut]);
    own.cut = [...cut].slice(-MAX_CUT);
    const mine = new Map(own.messages.map((m) => [m.id, m]));
    const newer = (m, o) => (m === state.reply ? m : (o.at || 0) >= (m.at || 0) ? o : m);
    const messages = other.messages
      .filter((o) => !cut.has(o.id))
      .map((o) => (mine.has(o.id) ? newer(mine.get(o.id), o) : o));
    const placed = new Set(messages.map((m) => m.id));
    // This tab's messages not stored yet: each after the one it follows here, and after the messages
    // other tabs added there (their turns came first).
    let next = 0;
    for (const m of own.messages) {
      if (cut.has(m.id)) continue;
      if (placed.has(m.id)) {
        next = messages.findIndex((x) => x.id === m.id) + 1;
        continue;
      }
      while (next < messages.length && !mine.has(messages[next].id)) next += 1;
      messages.splice(next, 0, m);
      placed.add(m.id);
      next += 1;
    }
    own.messages = messages;
  }

  // Takes in what other tabs stored (before an action on the conversation, so that it acts on all of it).
  function sync() {
    merge(parse(localStorage.getItem(STORE_KEY)));
  }

  // Cuts the conversation's messages from `index` on, in every tab.
  function cutFrom(conv, index) {
    for (const m of conv.messages.splice(index)) conv.cut.push(m.id);
  }

  function message(role, content) {
    return { id: newId(), role, content, at: now() };
  }

  function save() {
    sync();
    try {
      localStorage.setItem(STORE_KEY, JSON.stringify(state.data));
      $("storage-error").textContent = "";
    } catch (e) {
      // Over the browser's quota (a few MB): the page goes on from memory and says so.
      $("storage-error").textContent =
        "The browser's storage is full, so this chat is not saved: delete old conversations to make room.";
    }
  }

  window.addEventListener("storage", (e) => {
    if (e.key !== STORE_KEY) return;
    merge(parse(e.newValue));
    renderSidebar();
    // Not while this tab answers, or while the user types an edit or a system prompt here.
    const typing = document.querySelector("#messages .edit-box") || document.activeElement === $("system");
    if (!state.controller && !typing) refreshMessages();
  });

  // A reload or a closed tab mid-answer keeps the answer so far (saved as it streams, and here the rest).
  // The browser then cuts the request, and the answer's end still runs: that cut is no lost connection,
  // and the answer stays marked unfinished (shown as interrupted when the page is back).
  let leaving = false;
  window.addEventListener("pagehide", () => {
    leaving = true;
    if (state.streaming) {
      state.streaming.updated = state.reply.at = now();
      save();
    }
  });
  window.addEventListener("pageshow", () => (leaving = false)); // (back from the back-forward cache)

  function current() {
    return state.data.conversations.find((c) => c.id === state.data.current) || null;
  }

  // Cut by code points, not UTF-16 units: a cut through an emoji would leave half of it (shown as �).
  function titleOf(text) {
    return Array.from(text).slice(0, 48).join("");
  }

  function newConversation() {
    const conv = { id: newId(), title: "New chat", system: "", messages: [], cut: [], updated: now(),
      edited: now() };
    state.data.conversations.unshift(conv);
    state.data.current = conv.id;
    save();
    return conv;
  }

  // ---- server ------------------------------------------------------------------------------------
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(API_KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  const NO_SERVER = "cannot reach the server";

  // One /v1/models request at a time, whoever asks (the page loading, Send, the periodic re-check).
  function reconnect() {
    if (!state.connecting) {
      state.connecting = connect()
        .catch((e) => ($("model-name").textContent = "error: " + (e.message || e)))
        .finally(() => (state.connecting = null));
    }
    return state.connecting;
  }

  async function connect() {
    $("forget-key").hidden = !localStorage.getItem(API_KEY); // (nothing to forget without a stored key)
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      $("model-name").textContent = NO_SERVER;
      return;
    }
    if (response.status === 401) {
      $("model-name").textContent = "API key needed";
      $("key-form").hidden = false;
      $("api-key").focus();
      if (localStorage.getItem(API_KEY)) $("key-error").textContent = "the stored key was refused";
      return;
    }
    if (!response.ok) {
      $("model-name").textContent = "error: " + (await errorMessage(response));
      return;
    }
    $("key-form").hidden = true;
    $("send-error").textContent = "";
    // Several models (serve -m A -m B): a picker over those that chat; embedding models cannot.
    const models = (await response.json()).data.filter((m) => m.type !== "embeddings");
    if (!models.length) {
      $("model-name").textContent = "no chat model on this server";
      return;
    }
    state.models = models;
    const picker = $("model-select");
    picker.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    picker.hidden = models.length < 2;
    $("model-name").hidden = models.length > 1;
    const remembered = models.find((m) => m.id === state.data.settings.model);
    selectModel(remembered || models[0]);
    picker.onchange = () => {
      state.data.settings.model = picker.value;
      save();
      selectModel(models.find((m) => m.id === picker.value));
    };
  }

  function selectModel(model) {
    state.model = model.id;
    $("model-select").value = model.id;
    $("model-name").textContent = model.id;
    const info = [];
    if (model.state && model.state !== "loaded") info.push("loaded on first message");
    if (model.context_length) info.push(model.context_length + " tokens context");
    if (model.quantization) info.push(model.quantization);
    $("model-info").textContent = info.join(" · ");
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || response.statusText;
    } catch (e) {
      return response.status + " " + response.statusText;
    }
  }

  // Request fields the page sets itself: extra fields cannot replace them (one streamed answer a turn).
  const PAGE_FIELDS = ["model", "messages", "stream", "stream_options", "n"];

  // The conversation as sent: a turn whose answer failed or never began (an error, a stop before the
  // first token) is left out, as the terminal chat does: sent again, it would only fail again.
  function sentMessages(conv, reply) {
    const history = conv.messages.slice(0, conv.messages.indexOf(reply));
    const messages = [];
    if (conv.system.trim()) messages.push({ role: "system", content: conv.system });
    for (let i = 0; i < history.length; i++) {
      const m = history[i];
      const answer = history[i + 1];
      const unanswered = (a) => a.role === "assistant" && (a.error || !a.content);
      if (m.role === "user" && answer && unanswered(answer)) {
        i += 1;
        continue;
      }
      if (!unanswered(m)) messages.push({ role: m.role, content: m.content });
    }
    return messages;
  }

  function requestBody(conv, reply) {
    const settings = state.data.settings;
    const body = {};
    // An emptied field means the server's default, not 0.
    const temperature = numberSetting(settings.temperature);
    if (temperature !== null) body.temperature = temperature;
    const maxTokens = numberSetting(settings.max_tokens);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    Object.assign(body, parseExtra(settings.extra) || {});
    return Object.assign(body, {
      model: state.model,
      messages: sentMessages(conv, reply),
      stream: true,
      stream_options: { include_usage: true },
      n: 1,
    });
  }

  function numberSetting(value) {
    if (value === null || value === undefined || String(value).trim() === "") return null;
    const number = Number(value);
    return Number.isFinite(number) ? number : null;
  }

  function parseExtra(text) {
    if (!text || !text.trim()) return {};
    try {
      const value = JSON.parse(text);
      if (value && typeof value === "object" && !Array.isArray(value)) return value;
    } catch (e) {
      /* reported below */
    }
    return null;
  }

  // Streams the answer into `reply`, the conversation's last message here (an empty assistant message).
  async function complete(conv, reply) {
    const stats = (reply.stats = { chunks: 0 });
    reply.partial = true; // stored while it streams: what a reload finds, it shows as interrupted
    const controller = (state.controller = new AbortController());
    state.streaming = conv;
    state.reply = reply;
    setBusy(true);
    const started = performance.now();
    let first = null;
    let last = null;
    let response = null;
    try {
      response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody(conv, reply)), signal: controller.signal,
      });
      if (response.status === 401) {
        reply.error = "the server refused the API key";
        $("key-form").hidden = false;
        return;
      }
      if (!response.ok) {
        reply.error = await errorMessage(response);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const payload = line.slice(6);
            if (payload === "[DONE]") continue;
            const chunk = JSON.parse(payload);
            if (chunk.error) {
              reply.error = chunk.error.message;
              continue;
            }
            if (chunk.usage) stats.usage = chunk.usage;
            const choice = chunk.choices && chunk.choices.find((c) => c.index === 0);
            if (!choice) continue;
            const delta = choice.delta || {};
            // A reasoning model's thinking (a server with --reasoning-parser) comes as reasoning_content.
            if (delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
            if (delta.content) reply.content += delta.content;
            if (delta.content || delta.reasoning_content) {
              last = performance.now();
              if (first === null) first = last;
              stats.chunks += 1;
              scheduleRender(conv, reply);
              saveSoon(conv, reply);
            }
            if (choice.finish_reason) stats.finish = choice.finish_reason;
          }
        }
      }
    } catch (e) {
      if (leaving) return; // (the finally below still runs)
      if (e.name === "AbortError") stats.finish = "stopped";
      // The browser's words for a failed fetch ("Failed to fetch", "network error") tell a user nothing.
      else if (e instanceof TypeError) reply.error = response ? "lost connection to the server" : NO_SERVER;
      else reply.error = String(e.message || e);
    } finally {
      if (first !== null) {
        stats.ttft = (first - started) / 1000;
        const tokens = stats.usage ? stats.usage.completion_tokens : stats.chunks;
        if (tokens > 1 && last > first) stats.tps = (tokens - 1) / ((last - first) / 1000);
      }
      state.controller = null;
      state.streaming = null;
      state.reply = null;
      if (!leaving) delete reply.partial;
      conv.updated = reply.at = now();
      const model = state.models.find((m) => m.id === state.model);
      if (model && !reply.error && model.state && model.state !== "loaded") {
        model.state = "loaded"; // (its first answer loaded it)
        selectModel(model);
      }
      save();
      setBusy(false);
      refreshMessages();
    }
  }

  // The answer so far goes to storage at most every SAVE_EVERY_MS: a reload or a crash loses little of
  // it, and a long answer does not rewrite the whole store at every token.
  const SAVE_EVERY_MS = 500;
  let lastSave = 0;
  function saveSoon(conv, reply) {
    if (Date.now() - lastSave < SAVE_EVERY_MS) return;
    lastSave = Date.now();
    conv.updated = reply.at = now(); // (newer than the copy other tabs hold, so their merges take it)
    save();
  }

  // ---- actions -----------------------------------------------------------------------------------
  function send(text) {
    if (state.controller || !state.model) return;
    sync();
    const conv = current() || newConversation();
    if (!conv.messages.length) {
      conv.title = titleOf(text);
      conv.edited = now();
    }
    const reply = message("assistant", "");
    conv.messages.push(message("user", text), reply);
    conv.updated = now();
    save();
    renderSidebar();
    renderMessages();
    complete(conv, reply);
  }

  // Asks again for the answer `id` (the conversation's last message, the answers that end it all cut).
  function regenerate(id) {
    if (!current() || state.controller) return;
    sync();
    const conv = current();
    const last = conv && conv.messages[conv.messages.length - 1];
    if (!last || last.id !== id) return refreshMessages(); // (another tab went on meanwhile)
    let index = conv.messages.length;
    while (index > 0 && conv.messages[index - 1].role === "assistant") index -= 1;
    if (!index) return;
    cutFrom(conv, index);
    const reply = message("assistant", "");
    conv.messages.push(reply);
    conv.updated = now();
    save();
    renderMessages();
    complete(conv, reply);
  }

  // Cuts the conversation at the message `id` (in every tab) and sends `text` in its place.
  function editAndResend(id, text) {
    if (!current() || state.controller) return;
    sync();
    const conv = current();
    const index = conv ? conv.messages.findIndex((m) => m.id === id) : -1;
    if (index < 0) return refreshMessages(); // (cut or deleted in another tab meanwhile)
    cutFrom(conv, index);
    if (index === 0) {
      conv.title = titleOf(text);
      conv.edited = now();
    }
    const reply = message("assistant", "");
    conv.messages.push(message("user", text), reply);
    conv.updated = now();
    save();
    renderSidebar();
    renderMessages();
    complete(conv, reply);
  }

  // ---- rendering ---------------------------------------------------------------------------------
  let renderPending = false;
  function scheduleRender(conv, reply) {
    if (renderPending) return;
    renderPending = true;
    requestAnimationFrame(() => {
      renderPending = false;
      // Follow the answer only from the end: a reader who scrolled up to read stays where they are.
      const follow = atEnd();
      const item = document.querySelector('#messages .msg[data-id="' + CSS.escape(reply.id) + '"]');
      if (item && conv === current()) renderAnswer(item, reply);
      if (follow) scrollToEnd();
    });
  }

  // An answer: its thinking, when the model thinks, as plain dimmed text; then the answer as markdown.
  function renderAnswer(item, m) {
    const reasoning = item.querySelector(".reasoning");
    reasoning.hidden = !m.reasoning;
    reasoning.textContent = m.reasoning || "";
    window.renderMarkdown(item.querySelector(".content"), m.content);
  }

  function scrollToEnd() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function atEnd() {
    const box = $("messages");
    return box.scrollHeight - box.scrollTop - box.clientHeight < 40; // (within about two lines)
  }

  // The same conversation drawn again (an answer ended, another tab saved): the reader keeps their place.
  function refreshMessages() {
    const box = $("messages");
    const top = box.scrollTop;
    const follow = atEnd();
    renderMessages();
    if (!follow) box.scrollTop = top;
  }

  function statsLine(stats, interrupted) {
    if (!stats) return interrupted ? "interrupted" : "";
    const parts = [];
    if (stats.ttft !== undefined) parts.push("TTFT " + Math.round(stats.ttft * 1000) + " ms");
    if (stats.tps !== undefined) parts.push(stats.tps.toFixed(1) + " tok/s");
    if (stats.usage) {
      const cached = (stats.usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(stats.usage.prompt_tokens + " prompt tokens (" + cached + " cached)");
      parts.push(stats.usage.completion_tokens + " generated");
    } else if (stats.chunks) {
      parts.push("~" + stats.chunks + " generated");
    }
    if (stats.finish) parts.push(stats.finish);
    if (interrupted) parts.push("interrupted");
    return parts.join(" · ");
  }

  function button(label, className, onClick) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = className;
    b.textContent = label;
    b.addEventListener("click", onClick);
    return b;
  }

  function renderMessages() {
    const conv = current();
    const box = $("messages");
    box.replaceChildren();
    $("system").value = conv ? conv.system : "";
    if (!conv) return;
    // An answer stored mid-stream and not streaming in this tab: its page was reloaded or closed.
    const live = state.reply;
    conv.messages.forEach((m, index) => {
      const item = document.createElement("div");
      item.className = "msg " + m.role;
      item.dataset.id = m.id;
      const role = document.createElement("div");
      role.className = "role";
      role.textContent = m.role;
      const reasoning = document.createElement("div");
      reasoning.className = "reasoning";
      const content = document.createElement("div");
      content.className = "content";
      item.append(role, reasoning, content);
      // The user's own text is shown as typed; the model's is markdown.
      if (m.role === "assistant") renderAnswer(item, m);
      else {
        reasoning.hidden = true;
        content.textContent = m.content;
      }
      if (m.error) {
        const error = document.createElement("div");
        error.className = "error";
        error.textContent = m.error;
        item.append(error);
      }
      const actions = document.createElement("div");
      actions.className = "actions";
      if (m.role === "assistant") {
        const stats = document.createElement("span");
        stats.className = "stats";
        stats.textContent = statsLine(m.stats, m.partial && m !== live);
        actions.append(stats);
        if (index === conv.messages.length - 1) actions.append(button("Regenerate", "regenerate", () => regenerate(m.id)));
      } else if (m.role === "user") {
        actions.append(button("Edit", "edit", () => startEdit(item, m.id, m.content)));
      }
      item.append(actions);
      box.append(item);
    });
    scrollToEnd();
  }

  function startEdit(item, id, text) {
    if (state.controller) return;
    const area = document.createElement("textarea");
    area.className = "edit-box";
    area.setAttribute("aria-label", "Edit message");
    area.value = text;
    const actions = document.createElement("div");
    actions.className = "actions";
    actions.append(
      button("Send", "resend", () => area.value.trim() && editAndResend(id, area.value)),
      button("Cancel", "cancel", refreshMessages),
    );
    item.querySelector(".content").replaceWith(area);
    item.querySelector(".actions").replaceWith(actions);
    area.focus();
  }

  function renderSidebar() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conv of state.data.conversations) {
      const li = document.createElement("li");
      if (conv.id === state.data.current) li.className = "current";
      const open = button(conv.title || "New chat", "open", () => {
        if (state.controller) return;
        state.data.current = conv.id;
        save();
        renderSidebar();
        renderMessages();
      });
      const remove = button("×", "delete", () => {
        if (state.controller) return;
        state.data.conversations = state.data.conversations.filter((c) => c.id !== conv.id);
        state.data.deleted.push(conv.id);
        if (state.data.current === conv.id) state.data.current = null;
        save();
        renderSidebar();
        renderMessages();
      });
      remove.title = "delete this conversation";
      li.append(open, remove);
      list.append(li);
    }
  }

  function setBusy(busy) {
    // Send and Stop take each other's place: focus on the one hidden (or on a message's button that the
    // answer redraws) would drop to the page, so the keyboard user goes back to the message box.
    const focus = document.activeElement;
    const lost = !focus || focus === document.body || focus === $("send") || focus === $("stop");
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    if (lost) $("prompt").focus();
    for (const b of document.querySelectorAll("#messages .actions button")) b.disabled = busy;
  }

  // ---- wiring ------------------------------------------------------------------------------------
  function wire() {
    const settings = state.data.settings;
    $("temperature").value = settings.temperature;
    $("max-tokens").value = settings.max_tokens;
    $("extra").value = settings.extra || "";
    $("temperature").addEventListener("change", (e) => { settings.temperature = e.target.value; save(); });
    $("max-tokens").addEventListener("change", (e) => { settings.max_tokens = e.target.value; save(); });
    $("extra").addEventListener("change", (e) => {
      const extra = parseExtra(e.target.value);
      const owned = extra ? PAGE_FIELDS.filter((k) => k in extra) : [];
      $("extra-error").textContent = !extra
        ? "not a JSON object: ignored"
        : owned.length ? owned.join(", ") + ": set by the page, ignored" : "";
      settings.extra = extra ? e.target.value : "";
      save();
    });
    $("system").addEventListener("change", (e) => {
      const conv = current() || newConversation();
      conv.system = e.target.value;
      conv.updated = conv.edited = now();
      save();
      renderSidebar();
    });
    $("settings-toggle").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("api-key-save").addEventListener("click", () => {
      const key = $("api-key").value.trim();
      if (key) localStorage.setItem(API_KEY, key);
      else localStorage.removeItem(API_KEY);
      $("api-key").value = "";
      $("key-error").textContent = "";
      connect(); // (not one already under way: that one asks with the old key)
    });
    $("api-key").addEventListener("keydown", (e) => {
      if (e.key === "Enter") $("api-key-save").click();
    });
    $("forget-key").addEventListener("click", () => { localStorage.removeItem(API_KEY); connect(); });
    $("new-chat").addEventListener("click", () => {
      if (state.controller) return;
      newConversation();
      renderSidebar();
      renderMessages();
      $("prompt").focus();
    });
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("composer").addEventListener("submit", async (e) => {
      e.preventDefault();
      if (!$("prompt").value.trim() || state.controller) return;
      // No model yet (the server was unreachable, or refused the page, when it loaded): ask again now.
      if (!state.model) await reconnect();
      if (!state.model) {
        $("send-error").textContent =
          "Not sent: " + $("model-name").textContent + ". Your message is kept; Send tries again.";
        return;
      }
      const text = $("prompt").value;
      if (!text.trim() || state.controller) return;
      $("send-error").textContent = "";
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
  }

  // A server that was unreachable may come back: look again now and then, and when the tab is back in
  // front (not while the key form waits for the user: each 401 would take the focus to it again).
  const RECHECK_MS = 10000;
  function recheck() {
    if (!state.model && $("key-form").hidden) reconnect();
  }

  wire();
  renderSidebar();
  renderMessages();
  reconnect();
  setInterval(recheck, RECHECK_MS);
  window.addEventListener("focus", recheck);
})();
