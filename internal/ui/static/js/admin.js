// admin.js: templates (every key), keys and teams (admin keys, through the
// API's /admin routes), the host (admin keys).
import { h, clear, api, act, bytes, time, table, field, state, stream } from "./core.js";
import { confirmButton } from "./sandboxes.js";

export async function templatesPage(main) {
  clear(main, h("h1", "Templates"), h("p", "Loading…"));
  const list = h("section.card", { "aria-labelledby": "templates-h" });
  const reload = async () => {
    let ts;
    try {
      ts = (await api("/ui/templates")).templates;
    } catch (e) {
      clear(list, h("h2#templates-h", "Templates"), h("p.error", { role: "alert" }, e.message));
      return false;
    }
    clear(list, h("h2#templates-h", "Templates"), templateTable(ts));
    return true;
  };
  if (!(await reload())) {
    clear(main, h("h1", "Templates"), list);
    return;
  }
  if (!state.identity.admin) {
    clear(main, h("h1", "Templates"), h("p.note", "Admin keys build templates here; on the host, ", h("code", "cage template build DIR NAME"),
      " (or cage template import/pull)."), list);
    return;
  }
  const builder = buildForm(reload);
  clear(main, h("h1", "Templates"), builder.form, list);
  // A build still running (started before this page) is followed.
  const running = await api("/ui/api/admin/templates/builds").then((bs) => bs.find((b) => b.state === "building")).catch(() => null);
  if (running) builder.follow(running);
}

function templateTable(ts) {
  return table("Templates", [
    ["Name", (t) => h("strong", t.name)],
    ["ID", (t) => (t.id ? t.id.replace(/^sha256:/, "").slice(0, 12) : "–")],
    ["Size", (t) => (t.size ? bytes(t.size) : "–")],
    ["Layers", (t) => (t.layers && t.layers.length
      ? h("details", h("summary", String(t.layers.length)), h("ol.layers", t.layers.map((l) => h("li", h("code", l.id.replace(/^sha256:/, "").slice(0, 12)), " ", bytes(l.size)))))
      : "–")],
    ["Created", (t) => (t.created && !t.created.startsWith("0001") ? time(t.created) : "–")],
    ["Source", (t) => t.source || ""],
    ["Command", (t) => t.startCommand || ""],
  ], ts);
}

// buildForm: an admin key's build of a template (the API's
// /admin/templates routes), its log followed live.
function buildForm(reload) {
  const name = h("input#build-name", { name: "name", required: true, pattern: "[a-z0-9][a-z0-9._\\-]{0,62}", placeholder: "my-template", autocomplete: "off" });
  const dockerfile = h("textarea#build-dockerfile", { name: "dockerfile", required: true, rows: 6, spellcheck: "false", maxlength: 65536 });
  dockerfile.value = "FROM base\nRUN echo hello > /hello\n";
  const net = h("select#build-network", { name: "network" }, h("option", { value: "none" }, "none"), h("option", { value: "internet" }, "internet"));
  const go = h("button.primary", { type: "submit" }, "Build");
  const status = h("p#build-state", { "aria-live": "polite" });
  const log = h("pre#build-log.log", { tabindex: 0, "aria-label": "Build log", hidden: true });
  const form = h("form.card.build", { "aria-labelledby": "build-h" }, h("h2#build-h", "Build a template"),
    h("div.grid", field("Name", name), field("Network of the RUN steps", net)),
    field("Dockerfile", dockerfile, "RUN steps run in sandboxes. No COPY or ADD: a build here has no build context (for those, cage template build on the host)."),
    h("div.bar", go), status, log);
  const follow = (b) => {
    go.disabled = true;
    log.hidden = false;
    clear(log);
    clear(status, "Building template ", h("code", b.template), " (", b.buildID, ")…");
    stream("/ui/events/builds/" + encodeURIComponent(b.buildID), {
      log: (d) => {
        if (d.truncated) log.append("… (earlier output is no longer kept)\n");
        log.append(d.text);
        log.scrollTop = log.scrollHeight;
      },
      done: (d) => {
        go.disabled = false;
        if (d.state === "succeeded") {
          clear(status, h("span.state.running", "Built"), " template ", h("code", d.template), ".");
          reload();
        } else {
          clear(status, h("span.error", "Failed: " + (d.error || d.state)));
        }
      },
      failed: (e) => {
        go.disabled = false;
        clear(status, h("span.error", e.message));
      },
    }, form).addEventListener("done", (ev) => ev.target.close());
  };
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const b = await act(() => api("/ui/api/admin/templates/" + encodeURIComponent(name.value.trim()) + "/builds",
      { method: "POST", json: { dockerfile: dockerfile.value, network: net.value } }));
    if (b) follow(b);
  });
  return { form, follow };
}

function notAdmin(main, what) {
  clear(main, h("h1", what), h("p", "This page is for admin keys (", h("code", "cage keys create --admin"),
    "). You are signed in with key ", h("code", state.identity.keyID), state.identity.teamID ? [" of team ", h("code", state.identity.teamID)] : "", "."));
}

export async function keysPage(main) {
  if (!state.identity.admin) {
    notAdmin(main, "Keys and teams");
    return;
  }
  const teamsBox = h("section.card", { "aria-labelledby": "teams-h" });
  const keysBox = h("section.card", { "aria-labelledby": "keys-h" });
  clear(main, h("h1", "Keys and teams"), teamsBox, keysBox);
  const reload = async () => {
    const [teams, keys] = await Promise.all([api("/ui/api/admin/teams"), api("/ui/api/admin/keys")]).catch((e) => {
      clear(teamsBox, h("p.error", { role: "alert" }, e.message));
      return [null, null];
    });
    if (!teams) return;
    const teamList = Array.isArray(teams) ? teams : teams.teams || [];
    const keyList = Array.isArray(keys) ? keys : keys.keys || [];
    const name = h("input", { name: "team", required: true, placeholder: "team name" });
    const newTeam = h("form.bar", { "aria-label": "New team" }, field("New team", name), h("button", { type: "submit" }, "Create team"));
    newTeam.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      if (await act(() => api("/ui/api/admin/teams", { method: "POST", json: { name: name.value.trim() } }), "Team created")) reload();
    });
    clear(teamsBox, h("h2#teams-h", "Teams"), newTeam, table("Teams", [
      ["Name", (t) => t.name], ["ID", (t) => h("code", t.teamID)],
      ["Quotas", (t) => Object.entries(t.quotas || {}).map(([k, v]) => k + " " + v).join(", ") || "none"],
      ["Rates", (t) => Object.entries(t.rateLimits || {}).map(([k, v]) => k + " " + v).join(", ") || "default"],
      ["Created", (t) => time(t.createdAt)],
      ["", (t) => confirmButton("Remove", "Really remove?", "team:" + t.teamID,
        () => act(() => api("/ui/api/admin/teams/" + encodeURIComponent(t.teamID), { method: "DELETE" }), "Team removed").then(reload))],
    ], teamList));
    const keyName = h("input", { name: "keyname", placeholder: "key name" });
    const team = h("select", { name: "keyteam" }, h("option", { value: "" }, "(no team)"), teamList.map((t) => h("option", { value: t.teamID }, t.name)));
    const shown = h("div.newkey", { "aria-live": "polite" });
    const newKey = h("form.bar", { "aria-label": "New key" }, field("Name", keyName), field("Team", team), h("button", { type: "submit" }, "Create key"));
    newKey.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = { name: keyName.value.trim() };
      if (team.value) body.teamID = team.value;
      const k = await act(() => api("/ui/api/admin/keys", { method: "POST", json: body }));
      if (k) {
        await reload();
        flashKey(k);
      }
    });
    const flashKey = (k) => clear(keysBox.querySelector(".newkey"), h("p", "New key (shown once): ", h("code.secret", k.key)));
    clear(keysBox, h("h2#keys-h", "Keys"), newKey, shown, table("Keys", [
      ["Name", (k) => k.name], ["ID", (k) => h("code", k.keyID)], ["Prefix", (k) => k.prefix], ["Team", (k) => k.teamID || "–"],
      ["Admin", (k) => (k.admin ? "yes" : "")], ["Created", (k) => time(k.createdAt)], ["Last used", (k) => time(k.lastUsed)],
      ["Revoked", (k) => (k.revokedAt ? time(k.revokedAt) : "")],
      ["", (k) => (k.revokedAt || k.keyID === state.identity.keyID ? "" : confirmButton("Revoke", "Really revoke?", "key:" + k.keyID,
        () => act(() => api("/ui/api/admin/keys/" + encodeURIComponent(k.keyID), { method: "DELETE" }), "Key revoked").then(reload)))],
    ], keyList));
  };
  await reload();
}

export async function hostPage(main) {
  if (!state.identity.admin) {
    notAdmin(main, "Host");
    return;
  }
  clear(main, h("h1", "Host"), h("p", "Asking the host…"));
  let r;
  try {
    r = await api("/ui/host");
  } catch (e) {
    clear(main, h("h1", "Host"), h("p.error", { role: "alert" }, e.message));
    return;
  }
  const c = r.capacity || {};
  const yes = (ok, t) => h("span.state." + (ok ? "running" : "paused"), t || (ok ? "ok" : "FAIL"));
  clear(main, h("h1", "Host"),
    h("section.card", h("h2", "Checks"), h("p", "Kernel ", h("code", r.kernel)),
      table("Checks", [["Check", (c) => c.name], ["", (c) => yes(c.ok)], ["", (c) => c.info]], r.checks || [])),
    h("section.card", h("h2", "Walls"),
      table("Walls", [["Wall", (w) => w.name], ["Available", (w) => yes(w.available, w.available ? "yes" : "no")],
        ["What the daemon says", (w) => w.info]], r.walls || []),
      h("p.note", "cage doctor on the host also starts a sandbox on each wall.")),
    h("section.card", h("h2", "Pools"), (r.pools || []).length === 0 ? h("p", "No pools.") :
      table("Pools", [["Template", (p) => p.Template], ["Wall", (p) => p.Wall], ["Ready", (p) => p.Ready + " / " + p.Size],
        ["Hits", (p) => p.Hits], ["Misses", (p) => p.Misses]], r.pools)),
    h("section.card", h("h2", "Capacity"), h("dl.info",
      [["Sandboxes", `${c.liveSandboxes} of ${c.maxSandboxes}`], ["Creates in flight", `${c.createsInFlight} of ${c.maxCreating}`],
        ["CPUs", `${c.cpus} (committed ${c.committedCPUs ?? "–"})`], ["Memory", `${bytes(c.memAvailable)} available of ${bytes(c.memTotal)} (committed ${bytes(c.committedMemory)})`],
        ["Disk committed", bytes(c.committedDisk)], ["Data dir free", bytes(c.dataFree)], ["Run dir free", bytes(c.runFree)]]
        .map(([k, v]) => [h("dt", k), h("dd", v)]))));
}
