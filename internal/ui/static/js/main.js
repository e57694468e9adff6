// main.js: sign-in, the navigation and the pages' routes (#/...).
import { h, clear, api, state, closePage, setSignedOutHandler, flash, HTTPError } from "./core.js";
import { sandboxesPage } from "./sandboxes.js";
import { sandboxPage } from "./sandbox.js";
import { templatesPage, keysPage, hostPage } from "./admin.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const who = document.getElementById("who");

const pages = [
  ["#/sandboxes", "Sandboxes"],
  ["#/templates", "Templates"],
  ["#/keys", "Keys and teams"],
  ["#/host", "Host"],
];

function signInPage(msg) {
  closePage();
  nav.replaceChildren();
  who.replaceChildren();
  const key = h("input#key", { type: "password", name: "key", required: true, autocomplete: "off", spellcheck: "false", placeholder: "e2b_…" });
  const err = h("p.error#signin-error", { role: "alert" }, msg || "");
  const form = h("form.card.signin", { "aria-labelledby": "signin-h" },
    h("h1#signin-h", "Sign in to cage"),
    h("p", "Sign in with an API key (", h("code", "cage keys create"), "). You see what that key's team sees."),
    h("div.field", h("label", { for: "key" }, "API key"), key), err,
    h("button.primary", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    err.textContent = "";
    try {
      const s = await api("/ui/session", { method: "POST", json: { key: key.value } });
      key.value = "";
      signedIn(s);
      if (!location.hash || location.hash === "#/signin") location.hash = "#/sandboxes";
      else route();
    } catch (e) {
      err.textContent = e.message;
      key.focus();
    }
  });
  clear(main, form);
  key.focus();
}

function signedIn(s) {
  state.csrf = s.csrf;
  state.identity = s.identity;
  clear(nav, h("ul", pages.map(([href, label]) => h("li", h("a", { href, "data-page": href }, label)))));
  const out = h("button#signout", { type: "button" }, "Sign out");
  out.addEventListener("click", async () => {
    try {
      await api("/ui/session", { method: "DELETE" });
    } catch (_) { /* signed out anyway */ }
    state.identity = null;
    signInPage("Signed out.");
  });
  const id = s.identity;
  clear(who, h("span", { title: "key " + id.keyID }, (id.name || id.keyID) + (id.admin ? " (admin)" : "") + (id.teamID ? " · " + id.teamID : "")), " ", out);
}

async function route() {
  if (!state.identity) return;
  closePage();
  const hash = location.hash || "#/sandboxes";
  for (const a of nav.querySelectorAll("a")) {
    if (hash.startsWith(a.getAttribute("href"))) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const m = hash.match(/^#\/sandboxes\/(.+)$/);
  // Each route draws into a view of its own: a page still loading when
  // another replaces it draws into a view no longer shown.
  const view = h("div.view");
  clear(main, view);
  try {
    if (m) await sandboxPage(view, decodeURIComponent(m[1]));
    else if (hash.startsWith("#/templates")) await templatesPage(view);
    else if (hash.startsWith("#/keys")) await keysPage(view);
    else if (hash.startsWith("#/host")) await hostPage(view);
    else await sandboxesPage(view);
  } catch (e) {
    if (!(e instanceof HTTPError && e.status === 401)) flash(e.message, true);
  }
  if (!view.isConnected) return;
  document.title = "cage · " + (view.querySelector("h1") ? view.querySelector("h1").textContent : "");
  performance.mark("cage-page-ready");
}

setSignedOutHandler((msg) => signInPage(msg));
window.addEventListener("hashchange", () => route());

(async () => {
  try {
    signedIn(await api("/ui/session"));
    await route();
  } catch (_) {
    signInPage("");
  }
})();
