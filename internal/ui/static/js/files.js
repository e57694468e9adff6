// files.js: the file browser: a directory's entries, downloads, uploads
// (bounded by the daemon's ui.max_upload).
import { h, clear, api, flash, bytes, time, table, field } from "./core.js";

export function filesSection(box, id) {
  const base = "/ui/files/" + encodeURIComponent(id);
  const pathIn = h("input#files-path", { name: "path", value: "~", autocomplete: "off" });
  const go = h("form.bar", { "aria-label": "Directory" }, field("Directory", pathIn), h("button", { type: "submit" }, "List"),
    h("button", { type: "button", onclick: () => { pathIn.value = parent(pathIn.value); list(); } }, "Up"));
  const fileIn = h("input#upload-file", { type: "file", name: "file" });
  const upload = h("form.bar", { "aria-label": "Upload" }, field("Upload a file here", fileIn), h("button", { type: "submit" }, "Upload"));
  const out = h("div#files-list", { "aria-live": "polite" });
  clear(box, h("h2#f-h", "Files"), go, upload, out);

  function parent(p) {
    if (p === "~" || p === "/" || p === "") return "/";
    const trimmed = p.replace(/\/+$/, "");
    const i = trimmed.lastIndexOf("/");
    return i <= 0 ? "/" : trimmed.slice(0, i);
  }

  async function list() {
    let l;
    try {
      l = await api(`${base}/list?path=${encodeURIComponent(pathIn.value || "~")}`);
    } catch (e) {
      clear(out, h("p.error", { role: "alert" }, e.message));
      return;
    }
    pathIn.value = l.path;
    clear(out, l.truncated ? h("p.note", "Only the first 2000 entries are shown.") : null,
      table("Files in " + l.path, [
        ["Name", (e) => e.type === "dir"
          ? h("a.dir", { href: "#", onclick: (ev) => { ev.preventDefault(); pathIn.value = e.path; list(); } }, e.name + "/")
          : e.type === "file"
            ? h("a.file", { href: `${base}/download?path=${encodeURIComponent(e.path)}`, download: e.name }, e.name)
            : h("span", e.name + (e.target ? " → " + e.target : ""))],
        ["Size", (e) => (e.type === "file" ? bytes(e.size) : "")],
        ["Mode", (e) => e.mode],
        ["Modified", (e) => time(e.modified)],
      ], l.entries, { rowAttrs: (e) => ({ "data-name": e.name }) }));
  }

  go.addEventListener("submit", (ev) => { ev.preventDefault(); list(); });
  upload.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = fileIn.files[0];
    if (!f) {
      flash("Choose a file first.", true);
      return;
    }
    const dir = (pathIn.value || "~").replace(/\/+$/, "");
    try {
      await api(`${base}/upload?path=${encodeURIComponent(dir + "/" + f.name)}`, { method: "POST", body: f,
        headers: { "Content-Type": "application/octet-stream" } });
      flash("Uploaded " + f.name);
      fileIn.value = "";
      list();
    } catch (e) {
      flash("Upload of " + f.name + " refused: " + e.message, true);
    }
  });
  list();
}
