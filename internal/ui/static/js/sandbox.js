// sandbox.js: one sandbox: its record, metrics chart, processes, network
// records and audit entries (live), a terminal and a file browser.
import { h, clear, api, stream, flash, bytes, time, table, sandboxPath } from "./core.js";
import { actions } from "./sandboxes.js";
import { terminalSection } from "./term.js";
import { filesSection } from "./files.js";

const SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

// chart: CPU % and memory used over time, one point per sample.
function chart(metrics) {
  const W = 640, H = 200, P = 30;
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": `CPU and memory over time: ${metrics.length} samples` });
  svg.append(s("rect", { x: P, y: 10, width: W - 2 * P, height: H - P - 10, class: "frame" }));
  if (!metrics.length) {
    svg.append(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no samples yet (one every 5 s)"));
    return svg;
  }
  const t0 = metrics[0].timestampUnix, t1 = Math.max(metrics[metrics.length - 1].timestampUnix, t0 + 1);
  const x = (t) => P + ((t - t0) / (t1 - t0)) * (W - 2 * P);
  const y = (frac) => H - P - Math.max(0, Math.min(1, frac)) * (H - P - 20);
  const series = [
    ["cpu", (m) => m.cpuUsedPct / 100],
    ["mem", (m) => (m.memTotal ? m.memUsed / m.memTotal : 0)],
  ];
  for (const [name, f] of series) {
    const pts = metrics.map((m) => `${x(m.timestampUnix).toFixed(1)},${y(f(m)).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { points: pts, class: "line " + name }));
    for (const m of metrics) {
      const c = s("circle", { cx: x(m.timestampUnix).toFixed(1), cy: y(f(m)).toFixed(1), r: 2.5, class: "pt " + name });
      c.append(s("title", {}, `${new Date(m.timestamp).toLocaleTimeString()}: ${name === "cpu" ? m.cpuUsedPct.toFixed(1) + "% CPU" : bytes(m.memUsed)}`));
      svg.append(c);
    }
  }
  svg.append(s("text", { x: P, y: H - 8, class: "axis" }, new Date(t0 * 1000).toLocaleTimeString()));
  svg.append(s("text", { x: W - P, y: H - 8, "text-anchor": "end", class: "axis" }, new Date(t1 * 1000).toLocaleTimeString()));
  svg.append(s("text", { x: 4, y: 20, class: "axis" }, "100%"));
  return svg;
}

function info(sb) {
  const n = sb.network || {};
  const rows = [
    ["State", h("span.state." + sb.state, sb.state)], ["Template", sb.templateID], ["Wall", sb.wall],
    ["CPUs", sb.cpuCount], ["Memory", sb.memoryMB + " MiB"], ["Disk", sb.diskSizeMB + " MiB"], ["Pids", sb.pids],
    ["Started", time(sb.startedAt)], ["Ends", sb.state === "running" ? time(sb.endAt) : "–"],
    ["Network", (n.mode || "") + (n.allowOut && n.allowOut.length ? " allow " + n.allowOut.join(", ") : "")],
    ["Metadata", Object.entries(sb.metadata || {}).map(([k, v]) => k + "=" + v).join(", ") || "–"],
  ];
  return h("dl.info", rows.map(([k, v]) => [h("dt", k), h("dd", v)]));
}

export async function sandboxPage(main, id) {
  const title = h("h1", "Sandbox ", h("code", id));
  const head = h("div.card");
  const metrics = h("section.card", { "aria-labelledby": "m-h" }, h("h2#m-h", "Metrics"), h("p", "Loading…"));
  const procs = h("section.card", { "aria-labelledby": "p-h" }, h("h2#p-h", "Processes"));
  const recs = h("section.card", { "aria-labelledby": "r-h" }, h("h2#r-h", "Network records"));
  const audit = h("section.card", { "aria-labelledby": "a-h" }, h("h2#a-h", "Audit entries"));
  const termBox = h("section.card", { "aria-labelledby": "t-h" });
  const filesBox = h("section.card", { "aria-labelledby": "f-h" });
  clear(main, title, head, h("div.cols", metrics, procs), termBox, filesBox, h("div.cols", recs, audit));
  let last = null;
  const refresh = () => {};
  terminalSection(termBox, id);
  filesSection(filesBox, id);
  stream("/ui/events/sandboxes/" + encodeURIComponent(id), {
    sandbox: (d) => {
      const sb = d.sandbox;
      if (!last || last.state !== sb.state || last.endAt !== sb.endAt || JSON.stringify(last.metadata) !== JSON.stringify(sb.metadata)) {
        clear(head, info(sb), actions(sb, refresh));
      }
      last = sb;
      const m = d.metrics || [];
      const lastM = m[m.length - 1];
      clear(metrics, h("h2#m-h", "Metrics"), chart(m),
        h("p.legend", h("span.key.cpu", "CPU"), " ", h("span.key.mem", "memory"),
          lastM ? ` — now ${lastM.cpuUsedPct.toFixed(1)}% CPU, ${bytes(lastM.memUsed)} of ${bytes(lastM.memTotal)}` : ""),
        d.note ? h("p.note", d.note) : null);
      clear(procs, h("h2#p-h", "Processes"), sb.state !== "running" ? h("p", "Not running.") :
        table("Processes", [["PID", (p) => p.pid], ["Command", (p) => [p.cmd, ...(p.args || [])].join(" ")], ["Tag", (p) => p.tag || ""]], d.processes || []));
      clear(recs, h("h2#r-h", "Network records"), (d.records || []).length === 0 ? h("p", "None.") :
        table("Network records", [["Time", (r) => time(r.time)], ["Kind", (r) => r.kind], ["Decision", (r) => r.decision],
          ["Destination", (r) => [r.proto, r.dest].filter(Boolean).join(" ")], ["Name", (r) => r.name || ""]], d.records.slice(-100).reverse()));
      clear(audit, h("h2#a-h", "Audit entries"), (d.audit || []).length === 0 ? h("p", "None.") :
        table("Audit entries", [["Time", (e) => time(e.time)], ["Kind", (e) => e.kind], ["Route", (e) => e.route || ""],
          ["Status", (e) => e.status || ""], ["Detail", (e) => e.detail ? JSON.stringify(e.detail) : ""]], d.audit.slice(-50).reverse()));
    },
    failed: (e) => {
      if (e.code === 404) {
        clear(head, h("p.error", { role: "alert" }, "This sandbox is gone: " + e.message));
      } else {
        flash(e.message, true);
      }
    },
  }, main).onerror = function () {
    if (this.readyState === EventSource.CLOSED && !last) {
      api(sandboxPath(id)).catch((e) => clear(head, h("p.error", { role: "alert" }, e.message)));
    }
  };
}
