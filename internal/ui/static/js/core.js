// core.js: DOM building (text only: never HTML strings), the session's
// fetch (CSRF token on every change), server-sent event streams, and
// formatting. Every value from the server reaches the page as textContent
// or an attribute set through the DOM.

export const state = { csrf: "", identity: null, streams: new Set(), cleanups: new Set() };

// h("tag.class#id", {attrs}, children...): an element. Strings become text nodes.
export function h(spec, attrs, ...children) {
  const m = spec.match(/^([a-z0-9]+)((?:[.#][\w-]+)*)$/i);
  const el = document.createElement(m ? m[1] : "div");
  if (m) {
    for (const part of m[2].match(/[.#][\w-]+/g) || []) {
      if (part[0] === ".") el.classList.add(part.slice(1));
      else el.id = part.slice(1);
    }
  }
  if (attrs && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = String(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export class HTTPError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// api: a request as the session. opts: {method, json, body, headers}.
export async function api(path, opts = {}) {
  const method = opts.method || "GET";
  const headers = Object.assign({}, opts.headers || {});
  let body = opts.body;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.json);
  }
  if (method !== "GET" && method !== "HEAD") headers["X-CSRF-Token"] = state.csrf;
  const r = await fetch(path, { method, headers, body, credentials: "same-origin" });
  if (r.status === 401 && path !== "/ui/session") signedOut("Your session ended: sign in again.");
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try {
      const e = await r.json();
      if (e && e.message) msg = e.message;
    } catch (_) { /* not JSON */ }
    throw new HTTPError(r.status, msg);
  }
  if (r.status === 204) return null;
  const ct = r.headers.get("Content-Type") || "";
  return ct.includes("json") ? r.json() : r.text();
}

let onSignedOut = () => {};
export function setSignedOutHandler(f) { onSignedOut = f; }
export function signedOut(msg) {
  state.identity = null;
  state.csrf = "";
  closePage();
  onSignedOut(msg);
}

// stream: an event source whose named events go to handlers; closed
// when the page changes, and as soon as owner (the page's element) is no
// longer shown: a page still loading when another replaced it streams
// nothing.
export function stream(url, handlers, owner) {
  const es = new EventSource(url);
  for (const [name, f] of Object.entries(handlers)) {
    es.addEventListener(name, (ev) => {
      if (owner && !owner.isConnected) {
        es.close();
        return;
      }
      f(JSON.parse(ev.data));
    });
  }
  es.addEventListener("expired", () => { es.close(); signedOut("Your session expired: sign in again."); });
  es.addEventListener("error", (ev) => {
    if (ev.data) {
      es.close();
      const e = JSON.parse(ev.data);
      if (e.code === 401) signedOut("Your session expired: sign in again.");
      else if (handlers.failed) handlers.failed(e);
      else flash(e.message, true);
    } else if (es.readyState === EventSource.CLOSED) {
      // Refused at its (re)connection, whose status an event source
      // hides: a session gone while no stream was telling (a restarted
      // daemon keeps no sessions) must still send the page to sign-in,
      // not leave it on a list that no longer moves.
      fetch("/ui/session", { credentials: "same-origin" }).then((r) => {
        if (r.status === 401 && state.identity) signedOut("Your session expired: sign in again.");
      }, () => {});
    }
  });
  state.streams.add(es);
  return es;
}

// onLeave runs f when the page changes.
export function onLeave(f) { state.cleanups.add(f); }

export function closePage() {
  for (const es of state.streams) es.close();
  state.streams.clear();
  for (const f of state.cleanups) {
    try { f(); } catch (_) { /* ignore */ }
  }
  state.cleanups.clear();
}

export function flash(msg, isError) {
  const el = document.getElementById("flash");
  clear(el, h("p", { class: isError ? "error" : "ok", role: isError ? "alert" : null }, msg));
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => el.replaceChildren(), 8000);
}

// run an action, flashing its error.
export async function act(f, okMsg) {
  try {
    const v = await f();
    if (okMsg) flash(okMsg);
    return v;
  } catch (e) {
    flash(e.message, true);
    return undefined;
  }
}

export function bytes(n) {
  if (n === undefined || n === null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}

export function duration(ms) {
  const neg = ms < 0;
  let s = Math.floor(Math.abs(ms) / 1000);
  const d = Math.floor(s / 86400); s %= 86400;
  const hh = Math.floor(s / 3600); s %= 3600;
  const mm = Math.floor(s / 60); s %= 60;
  const out = d ? `${d}d ${hh}h` : hh ? `${hh}h ${mm}m` : mm ? `${mm}m ${s}s` : `${s}s`;
  return neg ? "-" + out : out;
}

export function time(t) {
  if (!t) return "–";
  const d = new Date(t);
  return isNaN(d) ? String(t) : d.toLocaleString();
}

// table(columns, rows): columns are [heading, row => cell].
export function table(label, columns, rows, opts = {}) {
  const head = h("tr", columns.map(([name]) => h("th", { scope: "col" }, name)));
  const body = rows.map((r) => h("tr", opts.rowAttrs ? opts.rowAttrs(r) : null, columns.map(([, f]) => h("td", f(r)))));
  return h("div.scroll", h("table", { "aria-label": label }, h("thead", head), h("tbody", body)));
}

export function field(label, input, hint) {
  const id = input.id || "f-" + Math.random().toString(36).slice(2);
  input.id = id;
  return h("div.field", h("label", { for: id }, label), input, hint ? h("small", hint) : null);
}

export function sandboxPath(id) { return "/ui/api/sandboxes/" + encodeURIComponent(id); }
