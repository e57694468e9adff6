// sandboxes.js: the live list of the key's sandboxes, its filters, the
// create form, and the actions on a sandbox (kill, pause, resume, extend).
import { h, clear, api, stream, act, flash, bytes, duration, table, field, sandboxPath } from "./core.js";

export async function kill(id) {
  await api(sandboxPath(id), { method: "DELETE" });
}
export async function pause(id) {
  await api(sandboxPath(id) + "/pause", { method: "POST", json: {} });
}
export async function resume(id) {
  await api(sandboxPath(id) + "/resume", { method: "POST", json: { timeout: 300 } });
}
// extend: five more minutes than it has left.
export async function extend(id, endAt) {
  const left = Math.max(0, Math.round((new Date(endAt) - Date.now()) / 1000));
  await api(sandboxPath(id) + "/timeout", { method: "POST", json: { timeout: left + 300 } });
}

// confirmButton: a button whose first press asks again, the second acts.
// The armed state outlives a re-render of the list (key names it).
const armed = new Map();
export function confirmButton(label, ask, key, f) {
  const live = () => (armed.get(key) || 0) > Date.now();
  const b = h("button.danger", { type: "button" }, live() ? ask : label);
  b.addEventListener("click", async () => {
    if (!live()) {
      armed.set(key, Date.now() + 4000);
      b.textContent = ask;
      setTimeout(() => { if (!live() && b.isConnected) b.textContent = label; }, 4100);
      return;
    }
    armed.delete(key);
    b.disabled = true;
    await f();
    b.disabled = false;
  });
  return b;
}

export function actions(sb, after) {
  const id = sb.sandboxID;
  const out = [];
  if (sb.state === "running") {
    out.push(h("button", { type: "button", onclick: () => act(() => extend(id, sb.endAt), "Extended by 5 minutes").then(after) }, "Extend 5m"));
    out.push(h("button", { type: "button", onclick: () => act(() => pause(id), "Paused").then(after) }, "Pause"));
  } else if (sb.state === "paused") {
    out.push(h("button", { type: "button", onclick: () => act(() => resume(id), "Resumed").then(after) }, "Resume"));
  }
  out.push(confirmButton("Kill", "Really kill?", "kill:" + id, () => act(() => kill(id), "Killed " + id).then(after)));
  return h("div.actions", { "aria-label": "Actions for " + id }, out);
}

function metadataText(md) {
  return Object.entries(md || {}).map(([k, v]) => k + "=" + v).join(", ");
}

// parseMetadata: "k=v" pairs, one a line or separated by commas.
function parseMetadata(text) {
  const md = {};
  for (const part of text.split(/[\n,]/)) {
    const p = part.trim();
    if (!p) continue;
    const i = p.indexOf("=");
    if (i < 1) throw new Error("metadata: want key=value, got " + JSON.stringify(p));
    md[p.slice(0, i).trim()] = p.slice(i + 1).trim();
  }
  return md;
}

function createForm(templates) {
  const first = templates.some((t) => t.name === "base") ? "base" : (templates[0] || { name: "host" }).name;
  const tmpl = h("input", { name: "template", required: true, value: first, list: "template-names", autocomplete: "off" });
  const names = h("datalist#template-names", templates.map((t) => h("option", { value: t.name })));
  const wall = h("select", { name: "wall" }, ["", "process", "runc", "gvisor", "microvm"].map((w) => h("option", { value: w }, w || "(the daemon's default)")));
  const timeout = h("input", { name: "timeout", type: "number", min: 1, value: 300 });
  const cpus = h("input", { name: "cpus", type: "number", min: 0, step: "0.1", placeholder: "default" });
  const mem = h("input", { name: "memory", type: "number", min: 0, placeholder: "default" });
  const disk = h("input", { name: "disk", type: "number", min: 0, placeholder: "default" });
  const net = h("select", { name: "network" }, [["internet", "internet"], ["none", "none"], ["allowlist", "allowlist"]].map(([v, t]) => h("option", { value: v }, t)));
  const allow = h("input", { name: "allowOut", placeholder: "pypi.org, 1.1.1.1/32" });
  const md = h("input", { name: "metadata", placeholder: "owner=alice, job=42" });
  const submit = h("button.primary", { type: "submit" }, "Create sandbox");
  const form = h("form.create", { "aria-label": "Create a sandbox" },
    h("div.grid", field("Template", tmpl), names, field("Wall", wall), field("Timeout (s)", timeout),
      field("CPUs", cpus), field("Memory (MiB)", mem), field("Disk (MiB)", disk), field("Network", net),
      field("Allowed destinations", allow, "for allowlist"), field("Metadata", md, "key=value, comma separated")),
    submit);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { templateID: tmpl.value.trim(), timeout: Number(timeout.value) || 300 };
    try {
      body.metadata = parseMetadata(md.value);
    } catch (e) {
      flash(e.message, true);
      return;
    }
    if (wall.value) body.wall = wall.value;
    if (cpus.value) body.cpuCount = Number(cpus.value);
    if (mem.value) body.memoryMB = Number(mem.value);
    if (disk.value) body.diskSizeMB = Number(disk.value);
    body.network = { mode: net.value };
    if (net.value === "allowlist") body.network.allowOut = allow.value.split(",").map((s) => s.trim()).filter(Boolean);
    submit.disabled = true;
    const sb = await act(() => api("/ui/api/v2/sandboxes", { method: "POST", json: body }));
    submit.disabled = false;
    if (sb) {
      flash("Created " + sb.sandboxID);
      location.hash = "#/sandboxes/" + encodeURIComponent(sb.sandboxID);
    }
  });
  // Open on wide screens; on a phone the live list comes first.
  return h("details.card", { open: window.matchMedia("(min-width: 800px)").matches }, h("summary", "Create a sandbox"), form);
}

export async function sandboxesPage(main) {
  const stateSel = h("select#filter-state", { name: "state" }, [["", "running and paused"], ["running", "running"], ["paused", "paused"]].map(([v, t]) => h("option", { value: v }, t)));
  const mdIn = h("input#filter-metadata", { name: "metadata", placeholder: "key=value&key2=value2" });
  const tmplIn = h("input#filter-template", { name: "template", placeholder: "any" });
  const filters = h("form.filters", { role: "search", "aria-label": "Filter sandboxes" },
    field("State", stateSel), field("Metadata", mdIn), field("Template", tmplIn), h("button", { type: "submit" }, "Filter"));
  const count = h("p.count", { "aria-live": "polite" }, "Loading…");
  const list = h("div#sandbox-list");
  const templates = await api("/ui/templates").then((r) => r.templates).catch(() => []);
  clear(main, h("h1", "Sandboxes"), createForm(templates), h("section.card", { "aria-labelledby": "live-h" },
    h("h2#live-h", "Live"), filters, count, list));
  let es = null;
  let rows = [];
  const render = () => {
    count.textContent = (rows.length === 1 ? "1 sandbox" : rows.length + " sandboxes") +
      (rows.length >= 100 ? " (the first 100, newest first: filter to see others)" : "");
    const now = Date.now();
    clear(list, table("Sandboxes", [
      ["ID", (r) => h("a.sbid", { href: "#/sandboxes/" + encodeURIComponent(r.sandboxID) }, r.sandboxID)],
      ["State", (r) => h("span.state." + r.state, r.state)],
      ["Wall", (r) => r.wall],
      ["Template", (r) => r.templateID],
      ["Age", (r) => duration(now - new Date(r.startedAt))],
      ["Time left", (r) => r.state === "running" ? duration(new Date(r.endAt) - now) : "–"],
      ["CPU", (r) => r.cpuPct === undefined ? "–" : r.cpuPct.toFixed(1) + "% of " + r.cpuCount],
      ["Memory", (r) => (r.memUsed === undefined ? "–" : bytes(r.memUsed)) + " / " + r.memoryMB + " MiB"],
      ["Metadata", (r) => metadataText(r.metadata)],
      ["", (r) => actions(r, () => {})],
    ], rows, { rowAttrs: (r) => ({ "data-sandbox": r.sandboxID }) }));
  };
  const start = () => {
    if (es) es.close();
    const q = new URLSearchParams();
    if (stateSel.value) q.set("state", stateSel.value);
    if (mdIn.value.trim()) q.set("metadata", mdIn.value.trim());
    if (tmplIn.value.trim()) q.set("template", tmplIn.value.trim());
    es = stream("/ui/events/sandboxes?" + q, {
      list: (r) => { rows = r; render(); },
      failed: (e) => { count.textContent = e.message; },
    }, main);
    if (!main.isConnected) es.close();
    es.onerror = () => { if (es.readyState === EventSource.CLOSED) count.textContent = "Filter refused or connection lost."; };
  };
  filters.addEventListener("submit", (ev) => { ev.preventDefault(); start(); });
  start();
}
