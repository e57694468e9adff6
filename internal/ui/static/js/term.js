// term.js: a terminal (xterm.js, vendored) attached to a shell in a PTY in
// the sandbox: output by server-sent events, keys and sizes by POSTs.
import { h, clear, api, state, onLeave, sandboxPath, signedOut } from "./core.js";

function fromBase64(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

export function terminalSection(box, id) {
  const open = h("button.primary#term-open", { type: "button" }, "Open terminal");
  const status = h("span.term-status#term-status", { "aria-live": "polite" }, "closed");
  const host = h("div.term#terminal");
  clear(box, h("h2#t-h", "Terminal"), h("div.bar", open, status), host);
  let current = null;
  open.addEventListener("click", async () => {
    if (current) current();
    current = null;
    // The stream cannot say why it was refused: ask first.
    let sb;
    try {
      sb = await api(sandboxPath(id));
    } catch (e) {
      status.textContent = e.message;
      return;
    }
    if (sb.state !== "running") {
      status.textContent = `the sandbox is ${sb.state}: resume it first`;
      return;
    }
    current = attach(host, id, status);
  });
  onLeave(() => { if (current) current(); });
}

function attach(host, id, status) {
  host.replaceChildren();
  const term = new window.Terminal({ cursorBlink: true, fontSize: 14, scrollback: 2000,
    fontFamily: "ui-monospace, 'DejaVu Sans Mono', monospace" });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(host);
  fit.fit();
  status.textContent = "connecting…";
  const base = "/ui/term/" + encodeURIComponent(id);
  const es = new EventSource(`${base}?cols=${term.cols}&rows=${term.rows}`);
  let tid = null;
  let chain = Promise.resolve();
  const enc = new TextEncoder();
  // post keeps the order of keys and sizes: one request after another.
  const post = (what, body, type) => {
    if (!tid) return;
    const url = `${base}/${encodeURIComponent(tid)}/${what}`;
    chain = chain.then(() => fetch(url, { method: "POST", body, credentials: "same-origin",
      headers: { "Content-Type": type, "X-CSRF-Token": state.csrf } }))
      .then((r) => { if (!r.ok) status.textContent = `${what} refused (${r.status})`; })
      .catch(() => { status.textContent = "disconnected"; });
  };
  const sendSize = () => post("resize", JSON.stringify({ cols: term.cols, rows: term.rows }), "application/json");
  es.addEventListener("start", (ev) => {
    const d = JSON.parse(ev.data);
    tid = d.term;
    status.textContent = `connected (pid ${d.pid}, ${term.cols}x${term.rows})`;
    host.dataset.ready = "1";
    sendSize();
    term.focus();
  });
  es.addEventListener("out", (ev) => term.write(fromBase64(JSON.parse(ev.data))));
  es.addEventListener("end", (ev) => {
    const d = JSON.parse(ev.data);
    status.textContent = `shell ended (${d.status || "exit " + d.exitCode})`;
    tid = null;
    es.close();
  });
  es.addEventListener("expired", () => { tid = null; es.close(); signedOut("Your session expired: sign in again."); });
  es.addEventListener("error", (ev) => {
    // No reconnect: a new stream would be a new shell.
    if (ev.data) status.textContent = JSON.parse(ev.data).message;
    else if (tid || status.textContent === "connecting…") status.textContent = "disconnected (open it again)";
    tid = null;
    es.close();
  });
  term.onData((d) => post("input", enc.encode(d), "application/octet-stream"));
  term.onBinary((d) => post("input", Uint8Array.from(d, (c) => c.charCodeAt(0) & 255), "application/octet-stream"));
  term.onResize(({ cols, rows }) => {
    sendSize();
    if (tid) status.textContent = status.textContent.replace(/\d+x\d+/, `${cols}x${rows}`);
  });
  const ro = new ResizeObserver(() => { try { fit.fit(); } catch (_) { /* hidden */ } });
  ro.observe(host);
  return () => {
    es.close();
    ro.disconnect();
    term.dispose();
    delete host.dataset.ready;
  };
}
