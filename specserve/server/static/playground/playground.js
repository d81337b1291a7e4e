// specserve playground: runs one prompt on two speculation settings at once over ONE WebSocket
// (GET /ws, see README "WebSocket protocol"), optionally also through another server's
// OpenAI-compatible streaming endpoint, and shows acceptance live. Plain JavaScript, no
// dependencies, nothing fetched from the network but this server (and side C's URL).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_PROTOCOL = "specserve.bearer."; // the page's API key, offered as a subprotocol
  const FALLBACK_METHODS = ["draft", "ngram", "suffix", "auto", "off"];

  // ---- one output panel -----------------------------------------------------------------

  class Side {
    constructor(name, speculative) {
      this.name = name;
      this.panel = $("panel-tpl").content.firstElementChild.cloneNode(true);
      this.panel.id = "panel-" + name;
      this.panel.setAttribute("aria-label", "side " + name.toUpperCase());
      this.panel.querySelector(".side-name").textContent = name.toUpperCase();
      this.panel.querySelector("[data-out]").setAttribute("aria-label",
        "side " + name.toUpperCase() + " output");
      if (!speculative) for (const div of this.panel.querySelectorAll("[data-spec]")) div.remove();
      $("panels").appendChild(this.panel);
      this.out = this.panel.querySelector("[data-out]");
      this.cfgLine = this.panel.querySelector(".cfg-line");
      this.cells = {};
      for (const dd of this.panel.querySelectorAll("[data-stat]")) this.cells[dd.dataset.stat] = dd;
      this.reset("");
    }

    reset(label) {
      this.out.replaceChildren();
      this.cfgLine.textContent = label ? "(" + label + ")" : "";
      this.label = label;
      this.text = "";
      this.tokens = 0;
      this.draftTokens = 0;
      this.drafted = 0;
      this.accepted = 0;
      this.steps = 0;
      this.t0 = null;
      this.tFirst = null;
      this.tEnd = null;
      this.finish = null;
      this.setState("idle");
      this.render();
    }

    start(now) {
      this.t0 = now;
      this.setState("running");
      this.render();
    }

    setState(state) {
      this.state = state;
      this.panel.dataset.state = state;
      this.panel.setAttribute("aria-busy", state === "running" ? "true" : "false");
    }

    // text arrives with [length in code points, from_draft] runs (old servers: none)
    addText(text, spans) {
      if (!text) return;
      this.text += text;
      const chars = Array.from(text);
      const runs = spans && spans.length ? spans : [[chars.length, false]];
      let pos = 0;
      for (const [n, fromDraft] of runs) {
        this.append(chars.slice(pos, pos + n).join(""), Boolean(fromDraft));
        pos += n;
      }
      if (pos < chars.length) this.append(chars.slice(pos).join(""), false);
      const nearBottom = this.out.scrollHeight - this.out.scrollTop - this.out.clientHeight < 40;
      if (nearBottom) this.out.scrollTop = this.out.scrollHeight;
    }

    append(piece, fromDraft) {
      if (!piece) return;
      const cls = fromDraft ? "tok-draft" : "tok-target";
      const last = this.out.lastElementChild;
      if (last && last.className === cls && last.firstChild) {
        last.firstChild.appendData(piece);
      } else {
        const span = document.createElement("span");
        span.className = cls;
        span.textContent = piece;
        this.out.appendChild(span);
      }
    }

    onToken(msg, now) {
      if (this.tFirst === null) this.tFirst = now;
      const ids = msg.token_ids || [];
      this.tokens += ids.length;
      this.draftTokens += (msg.from_draft || []).filter(Boolean).length;
      if (msg.num_drafted !== undefined) {
        this.drafted = msg.num_drafted;
        this.accepted = msg.num_accepted;
        this.steps = msg.num_verify_steps;
      }
      this.addText(msg.text, msg.text_spans);
      this.scheduleRender();
    }

    onDone(msg, now) {
      this.tEnd = now;
      this.finish = msg.finish_reason;
      const t = msg.timings || {};
      if (t.num_drafted !== undefined) {
        this.drafted = t.num_drafted;
        this.accepted = t.num_accepted;
        this.steps = t.num_verify_steps;
      }
      if (msg.usage) this.tokens = msg.usage.completion_tokens;
      // The final text is authoritative (e.g. a stop string held back text until the end).
      if (msg.text !== undefined && msg.text.startsWith(this.text)) {
        this.addText(msg.text.slice(this.text.length), null);
      }
      this.setState(msg.finish_reason === "abort" ? "cancelled" : "done");
      this.panel.dataset.finish = msg.finish_reason || "";
      this.render();
    }

    onError(message) {
      this.tEnd = performance.now();
      const p = document.createElement("p");
      p.className = "err";
      p.textContent = "Error: " + message;
      this.out.appendChild(p);
      this.setState("error");
      this.render();
    }

    get seconds() {
      if (this.t0 === null) return null;
      return ((this.tEnd ?? performance.now()) - this.t0) / 1000;
    }

    get tokensPerSecond() {
      const s = this.seconds;
      return s && this.tokens ? this.tokens / s : null;
    }

    scheduleRender() {
      if (this.pending) return;
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        this.render();
      });
    }

    render() {
      const c = this.cells;
      const status = this.state === "done" ? "done (" + this.finish + ")" : this.state;
      c.status.textContent = status;
      c.tokens.textContent = this.draftTokens
        ? this.tokens + " (" + this.draftTokens + " from drafts)" : String(this.tokens);
      const tps = this.tokensPerSecond;
      c.tps.textContent = tps === null ? "–" : tps.toFixed(1);
      c.ttft.textContent = this.tFirst === null ? "–" : Math.round(this.tFirst - this.t0) + " ms";
      if (c.mal) {
        c.mal.textContent = this.steps ? ((this.accepted + this.steps) / this.steps).toFixed(2) : "–";
        c.rate.textContent = this.drafted
          ? (100 * this.accepted / this.drafted).toFixed(1) + "%" : "–";
      }
    }
  }

  // ---- page state ---------------------------------------------------------------------------

  const sides = { a: new Side("a", true), b: new Side("b", true), c: new Side("c", false) };
  sides.c.panel.hidden = true;
  const active = new Map(); // WebSocket request id -> Side
  let ws = null;
  let wsKey = null;
  let runNo = 0;
  let sideC = null; // AbortController of side C's fetch while it runs
  let info = null;

  const conn = $("conn");
  const errors = $("errors");
  const runBtn = $("run");
  const cancelBtn = $("cancel");

  function showError(message) {
    const p = document.createElement("p");
    p.textContent = message;
    errors.appendChild(p);
  }

  function setConn(text, ok) {
    conn.textContent = text;
    conn.className = "conn " + (ok ? "ok" : "bad");
  }

  function apiKey() {
    return $("api-key").value.trim();
  }

  // ---- server info: model name and the speculation methods it runs -----------------------

  async function loadInfo() {
    const key = apiKey();
    try {
      const resp = await fetch("/playground/info", {
        headers: key ? { Authorization: "Bearer " + key } : {},
      });
      if (resp.status === 401) {
        setConn("this server needs an API key: enter it above", false);
        fillMethods(FALLBACK_METHODS, "draft", 4);
        return;
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      info = await resp.json();
      $("model-line").textContent = "Model: " + info.model;
      fillMethods(info.methods, info.default_method, info.num_speculative_tokens);
      setConn("ready", true);
    } catch (err) {
      setConn("cannot reach the server: " + err.message, false);
      fillMethods(FALLBACK_METHODS, "draft", 4);
    }
  }

  function fillMethods(methods, defaultMethod, k) {
    const specA = defaultMethod !== "off" ? defaultMethod
      : (methods.find((m) => m !== "off" && m !== "auto") || "off");
    for (const [name, pick] of [["a", specA], ["b", "off"]]) {
      const sel = $("method-" + name);
      const keep = sel.value;
      sel.replaceChildren(...methods.map((m) => new Option(m, m)));
      sel.value = methods.includes(keep) ? keep : (methods.includes(pick) ? pick : methods[0]);
      if (!keep) $("k-" + name).value = String(k || 4);
    }
  }

  // ---- the WebSocket -----------------------------------------------------------------------

  function connect() {
    const key = apiKey();
    if (ws && ws.readyState === WebSocket.OPEN && wsKey === key) return Promise.resolve(ws);
    if (ws) ws.close();
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws";
    const sock = key ? new WebSocket(url, [KEY_PROTOCOL + key]) : new WebSocket(url);
    ws = sock;
    wsKey = key;
    return new Promise((resolve, reject) => {
      sock.onopen = () => {
        setConn("connected", true);
        resolve(sock);
      };
      sock.onerror = () => reject(new Error("the WebSocket connection failed "
        + "(is the server up, and the API key right?)"));
      sock.onmessage = (ev) => onMessage(ev.data);
      sock.onclose = (ev) => {
        if (ws !== sock) return;
        ws = null;
        setConn("disconnected" + (ev.reason ? ": " + ev.reason : ""), false);
        for (const [id, side] of active) {
          side.onError("the connection closed before the request finished");
          active.delete(id);
        }
        maybeIdle();
      };
    });
  }

  function onMessage(data) {
    const now = performance.now();
    let msg;
    try {
      msg = JSON.parse(data);
    } catch (err) {
      showError("The server sent something that is not JSON: " + String(data).slice(0, 200));
      return;
    }
    const side = active.get(msg.id);
    if (msg.type === "error") {
      const e = msg.error || {};
      const where = side ? "Side " + side.name.toUpperCase() + ": " : "";
      const text = where + (e.message || "unknown error") + (e.param ? " (field " + e.param + ")" : "");
      showError(text);
      if (side) {
        side.onError(e.message || "unknown error");
        active.delete(msg.id);
      }
    } else if (!side) {
      return; // a late message of a request this page no longer tracks
    } else if (msg.type === "token") {
      side.onToken(msg, now);
    } else if (msg.type === "done") {
      side.onDone(msg, now);
      active.delete(msg.id);
    }
    maybeIdle();
  }

  // ---- a run --------------------------------------------------------------------------------

  function numberField(id) {
    const raw = $(id).value.trim();
    return raw === "" ? undefined : Number(raw);
  }

  function requestFields() {
    const kind = document.querySelector("input[name=kind]:checked").value;
    const prompt = $("prompt").value;
    const fields = kind === "chat" ? { messages: [{ role: "user", content: prompt }] } : { prompt };
    const maxTokens = numberField("max-tokens");
    const temperature = numberField("temperature");
    const seed = numberField("seed");
    if (maxTokens !== undefined) fields.max_tokens = maxTokens;
    if (temperature !== undefined) fields.temperature = temperature;
    if (seed !== undefined) fields.seed = seed;
    if ($("ignore-eos").checked) fields.ignore_eos = true;
    return { kind, fields };
  }

  async function run(ev) {
    if (ev) ev.preventDefault();
    if (active.size || sideC) return;
    errors.replaceChildren();
    $("summary").textContent = "";
    if (!$("prompt").value.trim()) {
      showError("Enter a prompt first.");
      $("prompt").focus();
      return;
    }
    const { kind, fields } = requestFields();
    let sock;
    try {
      sock = await connect();
    } catch (err) {
      showError(err.message);
      return;
    }
    runNo += 1;
    const now = performance.now();
    for (const name of ["a", "b"]) {
      const method = $("method-" + name).value;
      const k = numberField("k-" + name);
      const speculative = { method };
      if (method !== "off" && k !== undefined) speculative.num_tokens = k;
      const id = name + runNo;
      const side = sides[name];
      side.reset(method === "off" ? "plain" : method + ", k=" + (k ?? "server default"));
      side.start(now);
      active.set(id, side);
      sock.send(JSON.stringify({ type: "request", id, kind, ...fields, speculative }));
    }
    const useC = $("use-c").checked;
    $("panel-c").hidden = !useC;
    if (useC) runSideC(kind, fields);
    setRunning(true);
  }

  function cancel() {
    if (ws && ws.readyState === WebSocket.OPEN) {
      for (const id of active.keys()) ws.send(JSON.stringify({ type: "cancel", id }));
    }
    if (sideC) sideC.abort();
  }

  function setRunning(running) {
    runBtn.disabled = running;
    cancelBtn.disabled = !running;
    document.body.dataset.running = running ? "true" : "false";
  }

  function maybeIdle() {
    if (active.size || sideC || !runBtn.disabled) return;
    setRunning(false);
    summarize();
  }

  function summarize() {
    const { a, b, c } = sides;
    const parts = [];
    const finished = (s) => s.state === "done" && s.tokensPerSecond;
    if (finished(a) && finished(b)) {
      const ratio = a.tokensPerSecond / b.tokensPerSecond;
      parts.push("Speedup A over B: " + ratio.toFixed(2) + "x (" + a.tokensPerSecond.toFixed(1)
        + " vs " + b.tokensPerSecond.toFixed(1) + " tokens/s, end to end).");
      if (Number($("temperature").value) === 0) {
        parts.push(a.text === b.text ? "Texts identical (greedy is lossless)."
          : "Texts differ.");
      }
    }
    if (finished(c) && finished(b)) {
      parts.push("B over C: " + (b.tokensPerSecond / c.tokensPerSecond).toFixed(2) + "x.");
    }
    const summary = $("summary");
    summary.textContent = parts.join(" ");
    summary.dataset.speedup = finished(a) && finished(b)
      ? (a.tokensPerSecond / b.tokensPerSecond).toFixed(3) : "";
  }

  // ---- side C: another server's OpenAI-compatible streaming endpoint ---------------------

  async function runSideC(kind, fields) {
    const side = sides.c;
    let base = $("url-c").value.trim().replace(/\/+$/, "");
    const controller = new AbortController();
    sideC = controller;
    side.reset(base || "no URL");
    side.start(performance.now());
    try {
      if (!base) throw new Error("enter the other server's base URL");
      if (!/\/v1$/.test(base)) base += "/v1";
      const headers = { "Content-Type": "application/json" };
      const key = $("key-c").value.trim();
      if (key) headers.Authorization = "Bearer " + key;
      let model = $("model-c").value.trim();
      if (!model) {
        const r = await fetch(base + "/models", { headers, signal: controller.signal });
        if (!r.ok) throw new Error("GET /v1/models: HTTP " + r.status);
        model = (await r.json()).data[0].id;
      }
      side.cfgLine.textContent = "(" + model + " at " + base + ", plain)";
      const body = { model, ...fields, stream: true, stream_options: { include_usage: true } };
      const resp = await fetch(base + (kind === "chat" ? "/chat/completions" : "/completions"), {
        method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) throw new Error("HTTP " + resp.status + ": " + (await resp.text()).slice(0, 300));
      await readSse(resp, kind, side);
    } catch (err) {
      if (err.name === "AbortError") {
        side.onDone({ finish_reason: "abort" }, performance.now());
      } else {
        const msg = "Side C: " + err.message
          + " (check the URL, and that the server allows this page's origin: CORS)";
        showError(msg);
        side.onError(err.message);
      }
    } finally {
      sideC = null;
      maybeIdle();
    }
  }

  async function readSse(resp, kind, side) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let finish = null;
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const text = kind === "chat" ? (choice.delta || {}).content : choice.text;
        if (text) side.onToken({ text, token_ids: [0] }, performance.now()); // ~1 token a chunk
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    side.onDone({ finish_reason: finish || "stop", usage, text: side.text }, performance.now());
  }

  // ---- wiring ---------------------------------------------------------------------------------

  $("form").addEventListener("submit", run);
  cancelBtn.addEventListener("click", cancel);
  $("api-key").addEventListener("change", loadInfo);
  $("use-c").addEventListener("change", () => {
    const on = $("use-c").checked;
    $("c-fields").hidden = !on;
    $("use-c").setAttribute("aria-expanded", String(on));
    if (!sideC) $("panel-c").hidden = !on;
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) run(ev);
    else if (ev.key === "Escape" && !cancelBtn.disabled) cancel();
  });
  setRunning(false);
  // Connect at once when the server answered (with a key to ask for, the first Run connects).
  loadInfo().then(() => info && connect().catch((err) => setConn(err.message, false)));
})();
