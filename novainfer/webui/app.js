/* NovaInfer chat page. Plain JavaScript, no build step, nothing loaded from anywhere but this server.
 * It talks to two endpoints only: GET v1/models and POST v1/chat/completions (SSE when streaming).
 *
 * Sections: 1. state and storage · 2. API client (SSE parsing) · 3. safe markdown · 4. rendering
 *           5. actions (submitPrompt, cancelRequest, edit, regenerate) · 6. events and start-up
 *
 * Model output is never parsed as HTML: the markdown renderer builds DOM nodes and puts all text in
 * text nodes, so `<img src=x onerror=...>` in an answer is shown as those characters.
 */
"use strict";

(() => {
  // ==== 1. State and storage ============================================================================
  const STORE_KEY = "novainfer.webui.chats";
  const SETTINGS_KEY = "novainfer.webui.settings";
  const DEFAULT_SETTINGS = Object.freeze({
    model: "", systemPrompt: "", temperature: 0.8, topP: 0.95, maxTokens: null,
    stream: true, apiKey: "", theme: "system",
  });
  const NEAR_BOTTOM_PX = 80; // keep following a streaming answer while the reader is this close to the end

  const state = {
    sessions: [],            // ChatState[], see newSession()
    activeSessionId: null,
    settings: { ...DEFAULT_SETTINGS },
    models: [],              // ids from v1/models
    modelsKey: null,         // the API key the model list was fetched with
    running: new Map(),      // session id -> the Turn of its request in flight
    editingId: null,         // id of the user message being edited
    renamingId: null,        // id of the session being renamed
  };

  function makeId() {
    // crypto.randomUUID needs a secure context; getRandomValues works on plain http from another host too
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  /** ChatState: messages, the request in flight, and its unparsed SSE text. */
  function newSession() {
    const now = Date.now();
    return {
      id: makeId(), title: "", messages: [], request_id: null, stream_buffer: "",
      server: null, // {sessionId, count, fingerprint}: the history the server keeps under session_id
      createdAt: now, updatedAt: now,
    };
  }

  function activeSession() {
    return state.sessions.find((s) => s.id === state.activeSessionId) || null;
  }

  function loadJSON(key) {
    try {
      return JSON.parse(localStorage.getItem(key) || "null");
    } catch {
      return null;
    }
  }

  function loadState() {
    const settings = loadJSON(SETTINGS_KEY);
    if (settings && typeof settings === "object") {
      for (const key of Object.keys(DEFAULT_SETTINGS)) {
        if (key in settings) state.settings[key] = settings[key];
      }
    }
    const stored = loadJSON(STORE_KEY);
    const sessions = stored && Array.isArray(stored.sessions) ? stored.sessions : [];
    state.sessions = sessions.filter((s) => s && typeof s.id === "string" && Array.isArray(s.messages));
    for (const session of state.sessions) {
      // A request still marked in flight means the page was closed mid-answer: that answer is incomplete.
      for (const msg of session.messages) {
        if (msg.status === "streaming") msg.status = "interrupted";
      }
      session.request_id = null;
      session.stream_buffer = "";
    }
    state.activeSessionId = stored && state.sessions.some((s) => s.id === stored.activeSessionId)
      ? stored.activeSessionId : null;
    if (!state.activeSessionId) {
      const latest = sortedSessions()[0];
      if (latest && latest.messages.length === 0) {
        state.activeSessionId = latest.id;
      } else {
        const fresh = newSession();
        state.sessions.push(fresh);
        state.activeSessionId = fresh.id;
      }
    }
  }

  let saveTimer = null;

  function saveState() {
    clearTimeout(saveTimer);
    saveTimer = null;
    try {
      localStorage.setItem(STORE_KEY, JSON.stringify({
        sessions: state.sessions, activeSessionId: state.activeSessionId,
      }));
    } catch (err) {
      showNotice(`Could not save the conversations in this browser: ${err.message}`);
    }
  }

  /** While an answer streams in, save at most twice a second. */
  function saveSoon() {
    if (saveTimer === null) saveTimer = setTimeout(saveState, 500);
  }

  function saveSettings() {
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
    } catch (err) {
      showNotice(`Could not save the settings: ${err.message}`);
    }
  }

  function sortedSessions() {
    return [...state.sessions].sort((a, b) => b.updatedAt - a.updatedAt);
  }

  function touch(session) {
    session.updatedAt = Date.now();
  }

  function sessionTitle(session) {
    if (session.title) return session.title;
    const first = session.messages.find((m) => m.role === "user");
    if (!first) return "New chat";
    const line = first.content.replace(/\s+/g, " ").trim();
    return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
  }

  /** The messages sent to the model: the system prompt, then the conversation. Errors are left out, and so are
   * answers stopped or failed before any text; a finished answer stays even when empty, as the server kept it. */
  function apiMessagesFor(session) {
    const out = [];
    const system = (state.settings.systemPrompt || "").trim();
    if (system) out.push({ role: "system", content: system });
    for (const msg of session.messages) {
      if (msg.role === "user" || (msg.role === "assistant" && (msg.content || msg.status === "done"))) {
        out.push({ role: msg.role, content: msg.content });
      }
    }
    return out;
  }

  function fingerprint(messages) {
    // FNV-1a over the JSON text, plus its length: enough to tell whether a history is a prefix of a prompt
    const text = JSON.stringify(messages);
    let hash = 0x811c9dc5;
    for (let i = 0; i < text.length; i++) {
      hash ^= text.charCodeAt(i);
      hash = Math.imul(hash, 0x01000193) >>> 0;
    }
    return `${text.length}:${hash.toString(16)}`;
  }

  /** The session_id to send. The server continues its stored history only when the prompt starts with it;
   * after an edit, a regenerate or a changed system prompt it does not, so such a turn gets a fresh id. */
  function serverSessionFor(session, apiMessages) {
    const known = session.server;
    if (known && apiMessages.length > known.count &&
        fingerprint(apiMessages.slice(0, known.count)) === known.fingerprint) {
      return known.sessionId;
    }
    session.server = { sessionId: `${session.id}-${makeId().slice(0, 8)}`, count: 0, fingerprint: fingerprint([]) };
    return session.server.sessionId;
  }

  /** After a completed turn the server holds the prompt plus the answer under the session id. */
  function rememberServerHistory(session, apiMessages, answer) {
    const history = [...apiMessages, { role: "assistant", content: answer }];
    session.server = { sessionId: session.server.sessionId, count: history.length, fingerprint: fingerprint(history) };
  }

  // ==== 2. API client ===================================================================================
  class ApiError extends Error {
    constructor(message, { status = null, type = null, code = null, requestId = null, retryAfter = null } = {}) {
      super(message);
      Object.assign(this, { status, type, code, requestId, retryAfter });
    }
  }

  function authHeaders() {
    const key = (state.settings.apiKey || "").trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  function errorFromBody(info, fallbackId, status = null, retryAfter = null) {
    return new ApiError(info.message || (status ? `HTTP ${status}` : "error"), {
      status, type: info.type || null, code: info.code ?? null, requestId: info.request_id || fallbackId,
      retryAfter,
    });
  }

  async function errorFromResponse(resp, fallbackId) {
    let info = {};
    try {
      const body = await resp.json();
      if (body && typeof body.error === "object" && body.error) info = body.error;
    } catch {
      // not JSON (a proxy's page, say): status text only
    }
    if (!info.message) info = { ...info, message: resp.statusText || `HTTP ${resp.status}` };
    return errorFromBody(info, resp.headers.get("X-Request-Id") || fallbackId, resp.status,
      resp.headers.get("Retry-After"));
  }

  async function fetchModels() {
    const requestId = makeId();
    let resp;
    try {
      resp = await fetch("v1/models", { headers: { ...authHeaders(), "X-Request-Id": requestId } });
    } catch (err) {
      throw new ApiError(`Could not reach the server (${err.message}).`, { requestId });
    }
    if (!resp.ok) throw await errorFromResponse(resp, requestId);
    const body = await resp.json();
    return (body.data || []).map((m) => m.id);
  }

  function buildRequestBody(apiMessages, sessionId) {
    const s = state.settings;
    const body = { messages: apiMessages, stream: !!s.stream, session_id: sessionId };
    if (s.model) body.model = s.model;
    if (s.maxTokens !== null && s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
    if (s.temperature !== null && s.temperature !== "") body.temperature = Number(s.temperature);
    if (s.topP !== null && s.topP !== "") body.top_p = Number(s.topP);
    if (body.stream) body.stream_options = { include_usage: true };
    return body;
  }

  /** Reads the SSE body; every complete line goes to handleStreamChunk. The unparsed tail of the text lives
   * in the ChatState's stream_buffer until its line is complete. */
  async function readStream(resp, turn) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    const session = turn.session;
    for (;;) {
      const { value, done } = await reader.read();
      session.stream_buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      const lines = session.stream_buffer.split("\n");
      session.stream_buffer = done ? "" : lines.pop();
      for (const line of lines) handleStreamChunk(line, turn);
      if (done) return;
    }
  }

  /** One SSE line: `data: {chunk}` appends its delta to the answer; `data: [DONE]` ends it;
   * `data: {"error": ...}` is the server failing mid-stream. Blank lines and other fields are skipped. */
  function handleStreamChunk(line, turn) {
    line = line.replace(/\r$/, "");
    if (!line.startsWith("data:")) return;
    const data = line.slice(5).trim();
    if (data === "[DONE]") {
      turn.done = true;
      return;
    }
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch {
      throw new ApiError("The server sent a malformed stream chunk.", { requestId: turn.requestId });
    }
    if (chunk.error) throw errorFromBody(chunk.error, turn.requestId, chunk.error.code);
    const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
    if (choice) {
      // a thinking model's reasoning: vLLM's older `reasoning_content` and newer `reasoning` carry the same text
      const thought = choice.delta && (choice.delta.reasoning_content || choice.delta.reasoning);
      if (thought) {
        if (turn.firstTokenAt === null) turn.firstTokenAt = performance.now();
        turn.message.reasoning = (turn.message.reasoning || "") + thought;
        scheduleStreamRender(turn);
      }
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (turn.firstTokenAt === null) turn.firstTokenAt = performance.now();
        turn.message.content += piece;
        turn.pieces += 1;
        scheduleStreamRender(turn);
      }
      if (choice.finish_reason) turn.finishReason = choice.finish_reason;
    }
    if (chunk.usage) turn.usage = chunk.usage;
  }

  // ==== 3. Safe markdown ================================================================================
  // A small renderer for what models write: fenced code, headings, lists, quotes, tables, rules, and inline
  // code, bold, italic, strike-through and links. It creates elements by fixed tag names and puts every
  // piece of model text in a text node; links keep only http(s) and mailto targets.

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;
  const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEPARATOR = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function renderMarkdown(text) {
    const fragment = document.createDocumentFragment();
    renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment);
    return fragment;
  }

  function renderBlocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        i++;
        continue;
      }
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
                                     /^[`~]+$/.test(lines[i].trim()))) {
          body.push(lines[i]);
          i++;
        }
        i++; // the closing fence (absent while the answer is still streaming)
        parent.appendChild(codeBlock(body.join("\n"), m[2]));
      } else if ((m = HEADING.exec(line))) {
        const heading = el(`h${Math.min(m[1].length + 2, 6)}`); // h3..h6 inside a message
        renderInline(m[2], heading);
        parent.appendChild(heading);
        i++;
      } else if (RULE.test(line)) {
        parent.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i++;
        }
        const quote = el("blockquote");
        renderBlocks(inner, quote);
        parent.appendChild(quote);
      } else if (LIST_ITEM.test(line)) {
        i = renderList(lines, i, parent);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEPARATOR.test(lines[i + 1]) &&
                 lines[i + 1].includes("-")) {
        i = renderTable(lines, i, parent);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) {
          para.push(lines[i]);
          i++;
        }
        if (para.length === 0) { // a line that looks like a block start but is not one
          para.push(lines[i]);
          i++;
        }
        const p = el("p");
        para.forEach((text, n) => {
          if (n > 0) p.appendChild(el("br"));
          renderInline(text, p);
        });
        parent.appendChild(p);
      }
    }
  }

  function startsBlock(lines, i) {
    const line = lines[i];
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line) ||
      (line.includes("|") && i + 1 < lines.length && TABLE_SEPARATOR.test(lines[i + 1]) && lines[i + 1].includes("-"));
  }

  function codeBlock(code, language) {
    const wrap = el("div", "code-block");
    const head = el("div", "code-head");
    const lang = language.replace(/[^\w+#.-]/g, "").slice(0, 32);
    head.appendChild(el("span", "code-lang", lang || "code"));
    const copy = iconButton("copy", "Copy code", "code-copy");
    copy.addEventListener("click", () => copyText(code, copy));
    head.appendChild(copy);
    const pre = el("pre");
    const codeEl = el("code", lang ? `language-${lang}` : "", code);
    pre.appendChild(codeEl);
    wrap.append(head, pre);
    return wrap;
  }

  function renderList(lines, i, parent) {
    const first = LIST_ITEM.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const list = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
    let item = null;
    let itemLines = [];
    const flush = () => {
      if (item) {
        renderBlocks(itemLines, item);
        list.appendChild(item);
      }
    };
    while (i < lines.length) {
      const m = LIST_ITEM.exec(lines[i]);
      if (m && m[1].length <= first[1].length + 1 && /\d/.test(m[2]) === ordered) {
        flush();
        item = el("li");
        itemLines = [m[3]];
      } else if (lines[i].trim() && (/^\s/.test(lines[i]) || m)) {
        itemLines.push(lines[i].replace(/^\s{1,4}/, "")); // nested list or continuation of the item
      } else if (!lines[i].trim() && i + 1 < lines.length && (/^\s+\S/.test(lines[i + 1]) ||
                 (LIST_ITEM.test(lines[i + 1]) && /\d/.test(LIST_ITEM.exec(lines[i + 1])[2]) === ordered))) {
        itemLines.push(""); // a blank line inside the list
      } else {
        break;
      }
      i++;
    }
    flush();
    parent.appendChild(list);
    return i;
  }

  function splitRow(line) {
    let row = line.trim();
    if (row.startsWith("|")) row = row.slice(1);
    if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
    return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
  }

  function renderTable(lines, i, parent) {
    const header = splitRow(lines[i]);
    const aligns = splitRow(lines[i + 1]).map((c) =>
      c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
    const table = el("table");
    const row = (cells, tag) => {
      const tr = el("tr");
      header.forEach((_, n) => {
        const cell = el(tag, aligns[n] ? `align-${aligns[n]}` : "");
        renderInline(cells[n] || "", cell);
        tr.appendChild(cell);
      });
      return tr;
    };
    const thead = el("thead");
    thead.appendChild(row(header, "th"));
    const tbody = el("tbody");
    i += 2;
    while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
      tbody.appendChild(row(splitRow(lines[i]), "td"));
      i++;
    }
    table.append(thead, tbody);
    const scroller = el("div", "table-wrap");
    scroller.appendChild(table);
    parent.appendChild(scroller);
    return i;
  }

  // Inline spans, earliest match first: `code`, **bold**, __bold__, ~~strike~~, *em*, _em_, [text](url), bare URLs.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__(?!\w)|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)|\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)|\b(https?:\/\/[^\s<>"')\]]*[^\s<>"')\].,;:!?])/;

  function renderInline(text, parent) {
    while (text) {
      const m = INLINE.exec(text);
      if (!m) {
        parent.appendChild(document.createTextNode(text));
        return;
      }
      if (m.index > 0) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
      if (m[1] !== undefined) {
        parent.appendChild(el("code", "", m[2].replace(/^ (.+) $/, "$1")));
      } else if (m[3] !== undefined || m[4] !== undefined) {
        renderInline(m[3] !== undefined ? m[3] : m[4], parent.appendChild(el("strong")));
      } else if (m[5] !== undefined) {
        renderInline(m[5], parent.appendChild(el("del")));
      } else if (m[6] !== undefined || m[7] !== undefined) {
        renderInline(m[6] !== undefined ? m[6] : m[7], parent.appendChild(el("em")));
      } else if (m[8] !== undefined) {
        const href = safeUrl(m[9]);
        if (href) renderInline(m[8], parent.appendChild(link(href)));
        else parent.appendChild(document.createTextNode(m[0]));
      } else {
        const href = safeUrl(m[10]);
        if (href) parent.appendChild(link(href)).textContent = m[10];
        else parent.appendChild(document.createTextNode(m[10]));
      }
      text = text.slice(m.index + m[0].length);
    }
  }

  function safeUrl(raw) {
    try {
      const url = new URL(raw, document.baseURI);
      return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
    } catch {
      return null;
    }
  }

  function link(href) {
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    return a;
  }

  // ==== 4. Rendering ====================================================================================
  const $ = (id) => document.getElementById(id);
  const els = {};

  const ICONS = {
    plus: "M12 5v14M5 12h14",
    send: "M12 19V5M5.5 11.5 12 5l6.5 6.5",
    stop: "M7 7h10v10H7z",
    menu: "M4 6h16M4 12h16M4 18h16",
    close: "M6 6l12 12M18 6 6 18",
    sun: "M12 3v2M12 19v2M4.2 4.2l1.4 1.4M18.4 18.4l1.4 1.4M3 12h2M19 12h2M4.2 19.8l1.4-1.4M18.4 5.6l1.4-1.4M16 12a4 4 0 1 1-8 0 4 4 0 0 1 8 0z",
    moon: "M20 14.5A8 8 0 0 1 9.5 4 8 8 0 1 0 20 14.5z",
    sliders: "M4 7h9M17 7h3M15 5v4M4 17h3M11 17h9M9 15v4M4 12h12M20 12h0",
    pencil: "M4 20h4L19 9a2.8 2.8 0 0 0-4-4L4 16v4zM13.5 6.5l4 4",
    trash: "M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3",
    regenerate: "M20 12a8 8 0 1 1-2.4-5.7M20 4v5h-5",
    copy: "M9 9h11v11H9zM5 15H4V4h11v1",
    check: "M5 12.5l4.5 4.5L19 7",
    alert: "M12 8v5M12 16.5v.5M10.3 3.9 2.4 18a2 2 0 0 0 1.7 3h15.8a2 2 0 0 0 1.7-3L13.7 3.9a2 2 0 0 0-3.4 0z",
  };

  function icon(name) {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 24 24");
    svg.setAttribute("aria-hidden", "true");
    svg.setAttribute("class", `icon icon-${name}`);
    const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", ICONS[name]);
    svg.appendChild(path);
    return svg;
  }

  function iconButton(name, label, className = "") {
    const button = el("button", `icon-btn ${className}`.trim());
    button.type = "button";
    button.setAttribute("aria-label", label);
    button.title = label;
    button.appendChild(icon(name));
    return button;
  }

  function render() {
    renderSidebar();
    renderThread();
    updateComposer();
  }

  function renderSidebar() {
    const list = els.conversationList;
    list.replaceChildren();
    for (const session of sortedSessions()) {
      const active = session.id === state.activeSessionId;
      const item = el("li", `conversation${active ? " active" : ""}${state.running.has(session.id) ? " busy" : ""}`);
      item.dataset.sessionId = session.id;
      const title = sessionTitle(session);
      if (state.renamingId === session.id) {
        const input = el("input", "rename-input");
        input.value = session.title || title;
        input.setAttribute("aria-label", "Conversation name");
        input.addEventListener("keydown", (e) => {
          if (e.key === "Enter") finishRename(session, input.value);
          if (e.key === "Escape") finishRename(session, null);
        });
        input.addEventListener("blur", () => finishRename(session, input.value));
        item.appendChild(input);
        requestAnimationFrame(() => { input.focus(); input.select(); });
      } else {
        const open = el("button", "conversation-open", title);
        open.type = "button";
        if (active) open.setAttribute("aria-current", "page");
        open.addEventListener("click", () => switchSession(session.id));
        item.appendChild(open);
      }
      const rename = iconButton("pencil", `Rename conversation: ${title}`, "conversation-action");
      rename.addEventListener("click", () => { state.renamingId = session.id; renderSidebar(); });
      const remove = iconButton("trash", `Delete conversation: ${title}`, "conversation-action");
      remove.addEventListener("click", () => deleteSession(session.id));
      item.append(rename, remove);
      list.appendChild(item);
    }
  }

  function renderThread() {
    const session = activeSession();
    els.chatTitle.textContent = sessionTitle(session);
    document.title = session.messages.length ? `${sessionTitle(session)} · NovaInfer` : "NovaInfer chat";
    const thread = els.thread;
    thread.replaceChildren();
    if (session.messages.length === 0) {
      const empty = el("div", "empty-state");
      empty.appendChild(el("div", "empty-mark"));
      empty.appendChild(el("h2", "", "How can I help?"));
      const model = state.settings.model || state.models[0] || "the served model";
      empty.appendChild(el("p", "", `Answers stream from ${model} on this NovaInfer server.`));
      thread.appendChild(empty);
      return;
    }
    const lastAnswer = lastIndexWhere(session.messages, (m) => m.role !== "user");
    session.messages.forEach((msg, index) => {
      thread.appendChild(renderMessage(session, msg, index, index === lastAnswer));
    });
  }

  function lastIndexWhere(items, predicate) {
    for (let i = items.length - 1; i >= 0; i--) if (predicate(items[i])) return i;
    return -1;
  }

  function renderMessage(session, msg, index, isLastAnswer) {
    const busy = state.running.has(session.id);
    const row = el("article", `message ${msg.role}`);
    row.dataset.id = msg.id;
    row.dataset.status = msg.status || "done";
    if (msg.role === "user") {
      row.setAttribute("aria-label", "You");
      if (state.editingId === msg.id) {
        row.appendChild(renderEditor(session, msg, index));
        return row;
      }
      row.appendChild(el("div", "bubble", msg.content));
      const actions = el("div", "message-actions");
      const copy = iconButton("copy", "Copy message");
      copy.addEventListener("click", () => copyText(msg.content, copy));
      const edit = iconButton("pencil", "Edit message and regenerate");
      edit.disabled = busy;
      edit.addEventListener("click", () => startEdit(msg.id));
      actions.append(copy, edit);
      row.appendChild(actions);
      return row;
    }
    if (msg.role === "error") {
      const box = el("div", "error-box");
      box.appendChild(icon("alert"));
      const body = el("div", "error-body");
      const heading = [msg.httpStatus, msg.errorType].filter(Boolean).join(" · ");
      body.appendChild(el("strong", "error-title", heading ? `Error ${heading}` : "Error"));
      body.appendChild(el("p", "error-message", msg.content));
      const meta = el("p", "error-meta");
      meta.append("Request id: ", el("code", "request-id", msg.requestId || "none"));
      if (msg.retryAfter) meta.append(` · retry after ${msg.retryAfter} s`);
      body.appendChild(meta);
      box.appendChild(body);
      if (isLastAnswer) {
        const retry = el("button", "btn btn-small retry-btn");
        retry.type = "button";
        retry.append(icon("regenerate"), "Retry");
        retry.disabled = busy;
        retry.addEventListener("click", () => regenerate(session.id));
        box.appendChild(retry);
      }
      row.appendChild(box);
      return row;
    }
    row.setAttribute("aria-label", "Assistant");
    const content = el("div", "content markdown");
    fillAnswer(content, msg);
    row.appendChild(content);
    row.appendChild(renderAnswerFooter(session, msg, isLastAnswer, busy));
    return row;
  }

  function fillAnswer(content, msg) {
    const wasOpen = Boolean(content.querySelector("details.reasoning[open]"));
    content.replaceChildren(renderMarkdown(msg.content));
    if (msg.reasoning) content.prepend(renderReasoning(msg.reasoning, wasOpen));
    if (msg.status === "streaming") {
      content.appendChild(el("span", msg.content ? "cursor" : "typing", ""));
    } else if (!msg.content) {
      content.appendChild(el("span", "empty-answer", msg.status === "done" ? "(empty answer)" : "(no text)"));
    }
  }

  /** A thinking model's reasoning, collapsed above its answer (plain text: it is never parsed as markup). */
  function renderReasoning(text, open) {
    const details = el("details", "reasoning");
    details.open = open;
    details.appendChild(el("summary", "", "Reasoning"));
    details.appendChild(el("div", "reasoning-text", text));
    return details;
  }

  function renderAnswerFooter(session, msg, isLastAnswer, busy) {
    const footer = el("div", "message-footer");
    const badges = { stopped: "stopped", interrupted: "interrupted", error: "incomplete" };
    if (badges[msg.status]) footer.appendChild(el("span", `badge badge-${msg.status}`, badges[msg.status]));
    if (msg.stats) footer.appendChild(renderStats(msg));
    if (msg.status !== "streaming") {
      const actions = el("div", "message-actions");
      const copy = iconButton("copy", "Copy answer");
      copy.addEventListener("click", () => copyText(msg.content, copy));
      actions.appendChild(copy);
      if (isLastAnswer) {
        const again = iconButton("regenerate", "Regenerate answer");
        again.disabled = busy;
        again.addEventListener("click", () => regenerate(session.id));
        actions.appendChild(again);
      }
      footer.appendChild(actions);
    }
    return footer;
  }

  /** Per-answer numbers; the prefix-cache count shows how much of the prompt was reused. */
  function renderStats(msg) {
    const s = msg.stats;
    const stats = el("div", "stats");
    stats.setAttribute("aria-label", "Answer statistics");
    const add = (name, text, title) => {
      const item = el("span", `stat stat-${name}`, text);
      if (title) item.title = title;
      stats.appendChild(item);
    };
    stats.dataset.tokens = s.tokens;
    add("tokens", `${s.tokens} token${s.tokens === 1 ? "" : "s"}`, "completion tokens");
    if (s.tokensPerSecond !== null) add("speed", `${s.tokensPerSecond.toFixed(1)} tok/s`, "generation speed");
    if (s.ttftMs !== null) {
      stats.dataset.ttftMs = Math.round(s.ttftMs);
      add("ttft", `TTFT ${formatMs(s.ttftMs)}`, "time to first token");
    } else {
      add("total", `${formatMs(s.totalMs)} total`, "time for the whole (non-streamed) answer");
    }
    if (s.cachedTokens !== null) {
      stats.dataset.cached = s.cachedTokens;
      add("cached", `prefix cache ${s.cachedTokens}/${s.promptTokens ?? "?"}`,
        "prompt tokens reused from the server's prefix cache (KV blocks) / prompt tokens");
    }
    if (msg.model) add("model", msg.model);
    if (msg.requestId) add("request", `id ${msg.requestId.slice(0, 8)}`, `request id ${msg.requestId}`);
    return stats;
  }

  function formatMs(ms) {
    return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
  }

  function renderEditor(session, msg, index) {
    const form = el("form", "editor");
    const area = el("textarea", "editor-input");
    area.value = msg.content;
    area.setAttribute("aria-label", "Edit message");
    area.rows = Math.min(10, Math.max(2, msg.content.split("\n").length));
    const save = el("button", "btn btn-primary btn-small", "Save & regenerate");
    save.type = "submit";
    const cancel = el("button", "btn btn-small", "Cancel");
    cancel.type = "button";
    const buttons = el("div", "editor-actions");
    buttons.append(cancel, save);
    form.append(area, buttons);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      saveEdit(session.id, index, area.value);
    });
    cancel.addEventListener("click", () => { state.editingId = null; renderThread(); });
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        form.requestSubmit();
      } else if (e.key === "Escape") {
        e.preventDefault();
        state.editingId = null;
        renderThread();
      }
    });
    // caret to the end once the editor is on the page, unless the user (or a test driver) got there first: moving
    // the caret then would collapse their selection, and typing would append to the text instead of replacing it
    requestAnimationFrame(() => {
      if (document.activeElement === area) return;
      area.focus();
      area.setSelectionRange(area.value.length, area.value.length);
    });
    return form;
  }

  /** Streaming: re-render only the growing answer, once per frame. */
  function scheduleStreamRender(turn) {
    if (turn.renderQueued) return;
    turn.renderQueued = true;
    requestAnimationFrame(() => {
      turn.renderQueued = false;
      if (turn.session.id !== state.activeSessionId) return;
      const row = els.thread.querySelector(`article[data-id="${turn.message.id}"] .content`);
      if (!row) return;
      const follow = isNearBottom();
      fillAnswer(row, turn.message);
      if (follow) scrollToBottom();
      saveSoon();
    });
  }

  function isNearBottom() {
    const m = els.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < NEAR_BOTTOM_PX;
  }

  function scrollToBottom() {
    els.messages.scrollTop = els.messages.scrollHeight;
  }

  function updateComposer() {
    const busy = state.running.has(state.activeSessionId);
    els.send.hidden = busy;
    els.stop.hidden = !busy;
    els.send.disabled = !els.prompt.value.trim();
    els.composer.classList.toggle("busy", busy);
  }

  function renderModels() {
    const select = els.modelSelect;
    select.replaceChildren();
    const names = state.models.length ? state.models : [state.settings.model || ""];
    for (const name of names) {
      const option = el("option", "", name || "default model");
      option.value = name;
      select.appendChild(option);
    }
    select.value = state.settings.model || names[0];
  }

  function applyTheme() {
    // always the resolved theme, so styles.css needs one dark palette, keyed on data-theme
    document.documentElement.dataset.theme = effectiveTheme();
    const dark = effectiveTheme() === "dark";
    els.themeToggle.replaceChildren(icon(dark ? "sun" : "moon"));
    els.themeToggle.setAttribute("aria-label", dark ? "Switch to light theme" : "Switch to dark theme");
    els.themeToggle.title = els.themeToggle.getAttribute("aria-label");
  }

  function effectiveTheme() {
    const theme = state.settings.theme;
    if (theme === "light" || theme === "dark") return theme;
    return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  }

  let noticeTimer = null;

  function showNotice(text) {
    els.noticeText.textContent = text;
    els.notice.hidden = false;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => { els.notice.hidden = true; }, 8000);
  }

  function announce(text) {
    els.status.textContent = text;
  }

  async function copyText(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch {
      const area = el("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    button.replaceChildren(icon("check"));
    setTimeout(() => button.replaceChildren(icon("copy")), 1200);
  }

  function setSidebarOpen(open) {
    els.app.classList.toggle("sidebar-open", open);
    els.scrim.hidden = !open;
    els.openSidebar.setAttribute("aria-expanded", String(open));
  }

  // ==== 5. Actions ======================================================================================

  /** Sends what is in the input box as the next user message of the active conversation. */
  function submitPrompt() {
    const session = activeSession();
    const text = els.prompt.value;
    if (!text.trim() || state.running.has(session.id)) return;
    session.messages.push({ id: makeId(), role: "user", content: text });
    els.prompt.value = "";
    autosize();
    generate(session);
  }

  /** Stops the active conversation's answer: closing the connection makes the server cancel the request,
   * and the cancel endpoint covers a proxy that keeps the upstream connection open. */
  function cancelRequest(sessionId = state.activeSessionId) {
    const turn = state.running.get(sessionId);
    if (!turn || turn.stopped) return;
    turn.stopped = true;
    fetch(`v1/requests/${encodeURIComponent(turn.requestId)}/cancel`, {
      method: "POST", headers: authHeaders(), keepalive: true,
    }).catch(() => {});
    turn.controller.abort();
  }

  /** Asks for the next assistant message of the session and fills it in as it arrives. */
  async function generate(session) {
    const apiMessages = apiMessagesFor(session);
    const sessionId = serverSessionFor(session, apiMessages);
    const message = { id: makeId(), role: "assistant", content: "", status: "streaming", model: state.settings.model };
    session.messages.push(message);
    const turn = {
      session, message, requestId: makeId(), controller: new AbortController(), stream: !!state.settings.stream,
      startedAt: performance.now(), firstTokenAt: null, endedAt: null, usage: null, finishReason: null,
      pieces: 0, done: false, stopped: false, renderQueued: false,
    };
    session.request_id = turn.requestId;
    session.stream_buffer = "";
    state.running.set(session.id, turn);
    touch(session);
    saveState();
    render();
    scrollToBottom();
    announce("Generating an answer…");
    try {
      let resp;
      try {
        resp = await fetch("v1/chat/completions", {
          method: "POST",
          headers: { "Content-Type": "application/json", "X-Request-Id": turn.requestId, ...authHeaders() },
          body: JSON.stringify(buildRequestBody(apiMessages, sessionId)),
          signal: turn.controller.signal,
        });
      } catch (err) {
        if (turn.stopped) throw err;
        throw new ApiError(`Could not reach the server (${err.message}). Is it running?`,
          { requestId: turn.requestId });
      }
      if (!resp.ok) throw await errorFromResponse(resp, turn.requestId);
      turn.requestId = resp.headers.get("X-Request-Id") || turn.requestId;
      if (turn.stream) {
        await readStream(resp, turn);
        if (!turn.done) {
          throw new ApiError("The connection closed before the answer was complete.", { requestId: turn.requestId });
        }
      } else {
        const body = await resp.json();
        const choice = (body.choices || [])[0] || {};
        message.content = (choice.message && choice.message.content) || "";
        message.reasoning = (choice.message && (choice.message.reasoning_content || choice.message.reasoning)) || "";
        turn.usage = body.usage || null;
        turn.finishReason = choice.finish_reason || null;
        turn.pieces = 1;
      }
      message.status = "done";
      message.finishReason = turn.finishReason;
      rememberServerHistory(session, apiMessages, message.content);
      announce("Answer complete.");
    } catch (err) {
      if (turn.stopped) {
        message.status = "stopped";
        announce("Stopped.");
      } else {
        failTurn(turn, err);
      }
    } finally {
      turn.endedAt = performance.now();
      message.stats = statsFor(turn);
      message.requestId = turn.requestId;
      session.request_id = null;
      session.stream_buffer = "";
      state.running.delete(session.id);
      touch(session);
      saveState();
      render();
      if (session.id === state.activeSessionId && isNearBottom()) scrollToBottom();
    }
  }

  function failTurn(turn, err) {
    const { session, message } = turn;
    const apiError = err instanceof ApiError ? err : new ApiError(String(err && err.message || err),
      { requestId: turn.requestId });
    if (message.content) {
      message.status = "error";
    } else {
      session.messages.splice(session.messages.indexOf(message), 1);
      message.stats = null;
    }
    session.messages.push({
      id: makeId(), role: "error", content: apiError.message, httpStatus: apiError.status,
      errorType: apiError.type, requestId: apiError.requestId || turn.requestId, retryAfter: apiError.retryAfter,
    });
    announce(`Error: ${apiError.message}`);
  }

  function statsFor(turn) {
    const usage = turn.usage || {};
    const tokens = usage.completion_tokens ?? turn.pieces;
    const totalMs = turn.endedAt - turn.startedAt;
    const ttftMs = turn.stream && turn.firstTokenAt !== null ? turn.firstTokenAt - turn.startedAt : null;
    let tokensPerSecond = null; // left out when the tokens arrived all at once and the time says nothing
    if (ttftMs !== null && tokens > 1 && turn.endedAt - turn.firstTokenAt >= tokens / 4) {
      tokensPerSecond = (tokens - 1) / ((turn.endedAt - turn.firstTokenAt) / 1000); // decode speed
    } else if (!turn.stream && tokens > 0 && totalMs > 0) {
      tokensPerSecond = tokens / (totalMs / 1000);
    }
    const details = usage.prompt_tokens_details || {};
    return {
      tokens, tokensPerSecond, ttftMs, totalMs,
      promptTokens: usage.prompt_tokens ?? null,
      cachedTokens: details.cached_tokens ?? null,
    };
  }

  /** Drops the last answer (or error) and asks again. */
  function regenerate(sessionId) {
    const session = state.sessions.find((s) => s.id === sessionId);
    if (!session || state.running.has(session.id)) return;
    const lastUser = lastIndexWhere(session.messages, (m) => m.role === "user");
    if (lastUser < 0) return;
    session.messages.splice(lastUser + 1);
    generate(session);
  }

  function startEdit(messageId) {
    if (state.running.has(state.activeSessionId)) return;
    state.editingId = messageId;
    renderThread();
  }

  /** Replaces a user message, drops everything after it, and asks again from there. */
  function saveEdit(sessionId, index, text) {
    const session = state.sessions.find((s) => s.id === sessionId);
    state.editingId = null;
    if (!session || state.running.has(session.id) || !text.trim()) {
      renderThread();
      return;
    }
    session.messages.splice(index, session.messages.length - index,
      { ...session.messages[index], id: makeId(), content: text });
    generate(session);
  }

  function newChat() {
    const current = activeSession();
    if (current && current.messages.length === 0) {
      touch(current);
    } else {
      const session = newSession();
      state.sessions.push(session);
      state.activeSessionId = session.id;
    }
    state.editingId = null;
    saveState();
    render();
    setSidebarOpen(false);
    els.prompt.focus();
  }

  function switchSession(id) {
    if (id !== state.activeSessionId) {
      state.activeSessionId = id;
      state.editingId = null;
      saveState();
      render();
      scrollToBottom();
    }
    setSidebarOpen(false);
    els.prompt.focus();
  }

  function finishRename(session, value) {
    if (state.renamingId !== session.id) return;
    state.renamingId = null;
    if (value !== null) {
      session.title = value.trim();
      saveState();
    }
    render();
  }

  function deleteSession(id) {
    const session = state.sessions.find((s) => s.id === id);
    if (!session) return;
    if (session.messages.length && !confirm(`Delete the conversation “${sessionTitle(session)}”?`)) return;
    cancelRequest(id);
    state.sessions = state.sessions.filter((s) => s.id !== id);
    if (state.activeSessionId === id) {
      const next = sortedSessions()[0];
      if (next) {
        state.activeSessionId = next.id;
      } else {
        const fresh = newSession();
        state.sessions.push(fresh);
        state.activeSessionId = fresh.id;
      }
    }
    saveState();
    render();
  }

  async function refreshModels() {
    state.modelsKey = state.settings.apiKey;
    try {
      state.models = await fetchModels();
      els.notice.hidden = true; // an earlier failure to list them is stale now
      if (state.models.length && !state.models.includes(state.settings.model)) {
        state.settings.model = state.models[0];
        saveSettings();
      }
    } catch (err) {
      state.models = [];
      const hint = err.status === 401 ? " Set the API key in Settings." : "";
      const message = /[.!?]$/.test(err.message) ? err.message : `${err.message}.`;
      showNotice(`Could not list the models: ${message}${hint} (request id ${err.requestId})`);
    }
    renderModels();
    if (activeSession().messages.length === 0) renderThread();
  }

  // ==== 6. Events and start-up ==========================================================================
  function autosize() {
    const area = els.prompt;
    area.style.height = "auto";
    area.style.height = `${Math.min(area.scrollHeight, 240)}px`;
    updateComposer();
  }

  function fillSettingsForm() {
    const s = state.settings;
    els.setSystem.value = s.systemPrompt || "";
    els.setTemperature.value = s.temperature ?? "";
    els.setTopP.value = s.topP ?? "";
    els.setMaxTokens.value = s.maxTokens ?? "";
    els.setStream.checked = !!s.stream;
    els.setApiKey.value = s.apiKey || "";
    els.setTheme.value = s.theme || "system";
  }

  function readNumber(input) {
    const value = input.value.trim();
    if (value === "" || Number.isNaN(Number(value))) return null;
    return Number(value);
  }

  function onSettingsChanged() {
    const s = state.settings;
    s.systemPrompt = els.setSystem.value;
    s.temperature = readNumber(els.setTemperature);
    s.topP = readNumber(els.setTopP);
    s.maxTokens = readNumber(els.setMaxTokens);
    s.stream = els.setStream.checked;
    s.apiKey = els.setApiKey.value;
    s.theme = els.setTheme.value;
    saveSettings();
    applyTheme();
  }

  function bindEvents() {
    els.composer.addEventListener("submit", (e) => {
      e.preventDefault();
      submitPrompt();
    });
    els.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
        e.preventDefault();
        submitPrompt();
      } else if (e.key === "Escape" && state.running.has(state.activeSessionId)) {
        cancelRequest();
      }
    });
    els.prompt.addEventListener("input", autosize);
    els.stop.addEventListener("click", () => {
      cancelRequest();
      els.prompt.focus();
    });
    els.newChat.addEventListener("click", newChat);
    els.openSidebar.addEventListener("click", () => setSidebarOpen(true));
    els.closeSidebar.addEventListener("click", () => setSidebarOpen(false));
    els.scrim.addEventListener("click", () => setSidebarOpen(false));
    els.modelSelect.addEventListener("change", () => {
      state.settings.model = els.modelSelect.value;
      saveSettings();
    });
    els.themeToggle.addEventListener("click", () => {
      state.settings.theme = effectiveTheme() === "dark" ? "light" : "dark";
      saveSettings();
      applyTheme();
    });
    matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);
    els.openSettings.addEventListener("click", () => {
      fillSettingsForm();
      els.settingsDialog.showModal();
    });
    els.settingsForm.addEventListener("input", onSettingsChanged);
    els.settingsForm.addEventListener("change", onSettingsChanged);
    els.resetSettings.addEventListener("click", () => {
      const keep = { model: state.settings.model, apiKey: state.settings.apiKey };
      state.settings = { ...DEFAULT_SETTINGS, ...keep };
      fillSettingsForm();
      saveSettings();
      applyTheme();
    });
    els.settingsDialog.addEventListener("close", () => {
      if (state.settings.apiKey !== state.modelsKey) refreshModels(); // a new key may unlock the model list
      els.prompt.focus();
    });
    els.noticeClose.addEventListener("click", () => { els.notice.hidden = true; });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && els.app.classList.contains("sidebar-open")) setSidebarOpen(false);
    });
    // another tab of this page changed the conversations or settings: show them (unless this tab is busy)
    window.addEventListener("storage", (e) => {
      if ((e.key === STORE_KEY || e.key === SETTINGS_KEY) && state.running.size === 0) {
        loadState();
        applyTheme();
        render();
      }
    });
  }

  function start() {
    const ids = {
      app: "app", conversationList: "conversation-list", chatTitle: "chat-title", thread: "thread",
      messages: "messages", prompt: "prompt", send: "send", stop: "stop", composer: "composer",
      newChat: "new-chat", openSidebar: "open-sidebar", closeSidebar: "close-sidebar", scrim: "scrim",
      modelSelect: "model-select", themeToggle: "theme-toggle", openSettings: "open-settings",
      settingsDialog: "settings-dialog", settingsForm: "settings-form", resetSettings: "reset-settings",
      setSystem: "set-system", setTemperature: "set-temperature", setTopP: "set-top-p",
      setMaxTokens: "set-max-tokens", setStream: "set-stream", setApiKey: "set-api-key", setTheme: "set-theme",
      notice: "notice", noticeText: "notice-text", noticeClose: "notice-close", status: "status",
    };
    for (const [name, id] of Object.entries(ids)) els[name] = $(id);
    for (const button of document.querySelectorAll("[data-icon]")) button.prepend(icon(button.dataset.icon));
    loadState();
    applyTheme();
    renderModels();
    bindEvents();
    render();
    autosize();
    scrollToBottom();
    els.prompt.focus();
    refreshModels();
  }

  // Handles for tests and the browser console.
  window.novainfer = { state, submitPrompt, cancelRequest, handleStreamChunk, renderMarkdown };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
