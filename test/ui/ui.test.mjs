// cage's dashboard in Debian's chromium, driven by playwright-core, against
// the daemons ui_test.go started. The tests run in order and share one
// browser; each states what it expects. Screenshots go to
// $CAGE_UI_ARTIFACTS, with results.json (load times, the sandbox made).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(k + " is not set (ui_test.go sets it)");
  return v;
};
const URL0 = env("CAGE_UI_URL");
const KEY = env("CAGE_UI_KEY");
const ADMIN = env("CAGE_UI_ADMIN_KEY");
const THEIRS = env("CAGE_UI_OTHER_SANDBOX");
const SHORT_URL = env("CAGE_UI_SHORT_URL");
const SHORT_KEY = env("CAGE_UI_SHORT_KEY");
const ART = env("CAGE_UI_ARTIFACTS");
const MAX_UPLOAD = Number(env("CAGE_UI_MAX_UPLOAD"));
const TEMPLATE = env("CAGE_UI_TEMPLATE"); // a template the templates page must list
const BUILD = env("CAGE_UI_BUILD"); // the template an admin builds from the page

const results = { created: "", loadMs: {}, passed: [], screenshots: {} };
let browser, ctx, page, sandbox;
const pageErrors = [], cspViolations = [];

async function shot(p, name) {
  const file = join(ART, name + ".png");
  await p.screenshot({ path: file, fullPage: true });
  results.screenshots[name] = file;
}

// screen is the terminal's text as the emulator shows it.
const screen = () => page.locator("#terminal .xterm-rows").innerText();
async function waitScreen(re, timeout = 15000) {
  await page.waitForFunction((src) => new RegExp(src, "m").test(document.querySelector("#terminal .xterm-rows")?.innerText || ""),
    re.source, { timeout });
  return (await screen()).match(new RegExp(re.source, "gm"));
}
async function typeLine(s) {
  await page.locator("#terminal .xterm-helper-textarea").focus();
  await page.keyboard.type(s + "\n");
}

// raw: a request with a cookie and headers of our choosing (what a forger
// can send, outside any browser's rules).
async function raw(method, path, headers = {}, body) {
  const r = await fetch(URL0 + path, { method, headers, body, redirect: "manual" });
  return { status: r.status, text: await r.text() };
}

async function signIn(p, base, key) {
  await p.goto(base + "/ui/");
  await p.locator("#key").fill(key);
  await p.locator("form.signin button[type=submit]").click();
  await p.locator("#signout").waitFor();
}

before(async () => {
  browser = await chromium.launch({ executablePath: env("CAGE_UI_CHROMIUM"), args: ["--no-sandbox", "--disable-gpu"] });
  ctx = await browser.newContext({ viewport: { width: 1280, height: 800 }, acceptDownloads: true });
  page = await ctx.newPage();
  page.on("pageerror", (e) => { pageErrors.push(e.message); console.log("page error:", e.message); });
  page.on("console", (m) => { if (/Content.Security.Policy/i.test(m.text())) cspViolations.push(m.text()); });
});

after(async () => {
  writeFileSync(join(ART, "results.json"), JSON.stringify(results, null, 2));
  if (browser) await browser.close();
});

test("a wrong key does not sign in", async () => {
  await page.goto(URL0 + "/ui/");
  await shot(page, "signin");
  await page.locator("#key").fill("e2b_" + "0".repeat(40));
  await page.locator("form.signin button[type=submit]").click();
  await page.locator("#signin-error", { hasText: "invalid API key" }).waitFor();
  assert.equal((await ctx.cookies()).filter((c) => c.name === "cage_ui").length, 0, "no session cookie for a wrong key");
  results.passed.push("wrong key");
});

test("sign in: the session cookie is HttpOnly, SameSite=Strict, Path=/ui; pages load fast", async () => {
  await signIn(page, URL0, KEY);
  const c = (await ctx.cookies()).find((x) => x.name === "cage_ui");
  assert.ok(c, "a session cookie");
  assert.equal(c.httpOnly, true);
  assert.equal(c.sameSite, "Strict");
  assert.equal(c.path, "/ui");
  assert.ok(!(await page.content()).includes(KEY), "the key is nowhere in the page");
  await page.locator("#sandbox-list table").waitFor();
  // A signed-in load, measured by the browser: navigation to load
  // event, and to the list drawn from its first event.
  await page.reload();
  await page.locator("#sandbox-list table").waitFor();
  const nav = await page.evaluate(() => {
    const n = performance.getEntriesByType("navigation")[0];
    const ready = performance.getEntriesByName("cage-page-ready")[0];
    return { load: n.loadEventEnd - n.startTime, dom: n.domContentLoadedEventEnd - n.startTime, ready: ready ? ready.startTime : -1 };
  });
  results.loadMs["first reload after sign-in: load event"] = nav.load;
  results.loadMs["first reload after sign-in: DOMContentLoaded"] = nav.dom;
  results.loadMs["first reload after sign-in: page ready"] = nav.ready;
  results.passed.push("sign in");
});

test("another key's sandbox never appears and cannot be reached", async () => {
  await page.goto(URL0 + "/ui/#/sandboxes");
  await page.locator("#sandbox-list table").waitFor();
  await page.waitForTimeout(2500); // a second event of the live list
  assert.equal(await page.locator(`[data-sandbox="${THEIRS}"]`).count(), 0, "the other key's sandbox is not in the list");
  assert.ok(!(await page.content()).includes(THEIRS));
  const cookie = (await ctx.cookies()).find((x) => x.name === "cage_ui");
  const h = { Cookie: "cage_ui=" + cookie.value };
  for (const path of [`/ui/api/sandboxes/${THEIRS}`, `/ui/events/sandboxes/${THEIRS}`, `/ui/term/${THEIRS}`,
    `/ui/files/${THEIRS}/list`, `/ui/files/${THEIRS}/download?path=/etc/hostname`]) {
    const r = await raw("GET", path, h);
    assert.equal(r.status, 404, `${path}: ${r.status} ${r.text}`);
  }
  const list = await raw("GET", "/ui/api/v2/sandboxes", h);
  assert.equal(list.status, 200);
  assert.ok(!list.text.includes(THEIRS), "the API's list through the UI lacks the other key's sandbox");
  await page.goto(URL0 + "/ui/#/sandboxes/" + THEIRS);
  await page.locator("p.error", { hasText: "not found" }).first().waitFor();
  results.passed.push("second key isolated");
});

test("create a sandbox from the UI", async () => {
  await page.goto(URL0 + "/ui/#/sandboxes");
  await page.locator("#sandbox-list table").waitFor();
  await shot(page, "sandboxes");
  const form = page.locator("form.create");
  await form.locator("input[name=template]").fill("host");
  await form.locator("input[name=metadata]").fill("owner=ui-test, purpose=<b>bold</b>");
  await form.locator("button[type=submit]").click();
  await page.waitForURL(/#\/sandboxes\/[0-9a-z]+$/, { timeout: 60000 });
  sandbox = decodeURIComponent(page.url().split("#/sandboxes/")[1]);
  results.created = sandbox;
  await page.locator("dl.info .state.running").waitFor({ timeout: 30000 });
  assert.equal(await page.locator("dl.info b").count(), 0, "metadata with HTML is shown as text");
  await page.locator("dl.info dd", { hasText: "purpose=<b>bold</b>" }).waitFor();
  results.passed.push("create");
});

test("the terminal runs a command, and the PTY follows the window's size", async () => {
  await page.locator("#term-open").click();
  await page.locator("#terminal[data-ready]").waitFor({ timeout: 20000 });
  await typeLine("echo ui-$((6*7))");
  await waitScreen(/^ui-42$/);
  await typeLine("stty size");
  const before = (await waitScreen(/^\d+ \d+$/)).pop();
  await page.setViewportSize({ width: 900, height: 720 });
  await page.waitForFunction((b) => {
    const m = document.querySelector("#term-status").textContent.match(/(\d+)x(\d+)/);
    return m && `${m[2]} ${m[1]}` !== b;
  }, before, { timeout: 10000 });
  const [, cols, rows] = (await page.locator("#term-status").textContent()).match(/(\d+)x(\d+)/);
  await typeLine("clear; stty size");
  const after = `${rows} ${cols}`;
  await waitScreen(new RegExp("^" + after + "$"));
  assert.notEqual(after, before, "the PTY's size changed with the window");
  await shot(page, "terminal");
  await page.setViewportSize({ width: 1280, height: 800 });
  results.passed.push("terminal and resize");
});

test("upload a file, cat it in the terminal, download it back", async () => {
  const text = "uploaded through the dashboard " + Date.now();
  await page.locator("#files-list table").waitFor();
  await page.locator("#upload-file").setInputFiles({ name: "hello-ui.txt", mimeType: "text/plain", buffer: Buffer.from(text + "\n") });
  await page.locator("form.bar[aria-label=Upload] button[type=submit]").click();
  await page.locator('#files-list tr[data-name="hello-ui.txt"]').waitFor();
  await typeLine("clear; cat ~/hello-ui.txt");
  await waitScreen(new RegExp("^" + text + "$"));
  const [dl] = await Promise.all([page.waitForEvent("download"),
    page.locator('#files-list tr[data-name="hello-ui.txt"] a.file').click()]);
  assert.equal(dl.suggestedFilename(), "hello-ui.txt");
  const chunks = [];
  for await (const c of await dl.createReadStream()) chunks.push(c);
  assert.equal(Buffer.concat(chunks).toString(), text + "\n", "the download is the upload");
  results.passed.push("upload, cat, download");
});

test("a file name with HTML in it is shown as text", async () => {
  const name = "<img src=x onerror=window.__pwned=1>.txt";
  await page.locator("#upload-file").setInputFiles({ name, mimeType: "text/plain", buffer: Buffer.from("x") });
  await page.locator("form.bar[aria-label=Upload] button[type=submit]").click();
  const row = page.locator("#files-list tr").filter({ hasText: name });
  await row.waitFor();
  assert.equal(await page.locator("#files-list img").count(), 0, "no element made of the name");
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "no script ran");
  const [dl] = await Promise.all([page.waitForEvent("download"), row.locator("a.file").click()]);
  const chunks = [];
  for await (const c of await dl.createReadStream()) chunks.push(c);
  assert.equal(Buffer.concat(chunks).toString(), "x", "the file downloads as an attachment, its odd name and all");
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "no script ran");
  await shot(page, "files");
  results.passed.push("HTML file name escaped");
});

test("an upload over ui.max_upload is refused and leaves nothing", async () => {
  await page.locator("#upload-file").setInputFiles({ name: "big.bin", mimeType: "application/octet-stream", buffer: Buffer.alloc(MAX_UPLOAD + 1) });
  await page.locator("form.bar[aria-label=Upload] button[type=submit]").click();
  await page.locator("#flash p.error", { hasText: "at most" }).waitFor();
  await page.locator("#files-path").fill("~");
  await page.locator("form.bar[aria-label=Directory] button[type=submit]").click();
  await page.locator('#files-list tr[data-name="hello-ui.txt"]').waitFor();
  assert.equal(await page.locator('#files-list tr[data-name="big.bin"]').count(), 0);
  const cookie = (await ctx.cookies()).find((x) => x.name === "cage_ui");
  const csrf = await page.evaluate(() => fetch("/ui/session").then((r) => r.json()).then((s) => s.csrf));
  const r = await raw("POST", `/ui/files/${sandbox}/upload?path=/tmp/big`, { Cookie: "cage_ui=" + cookie.value, "X-CSRF-Token": csrf,
    "Content-Type": "application/octet-stream" }, Buffer.alloc(MAX_UPLOAD + 1));
  assert.equal(r.status, 413, r.text);
  results.passed.push("huge upload bounded");
});

test("the metrics chart draws points", async () => {
  await page.waitForFunction(() => document.querySelectorAll("svg.chart circle.pt.cpu").length >= 2, null, { timeout: 30000 });
  await shot(page, "sandbox");
  results.passed.push("metrics chart");
});

test("the live list: CPU and memory, filters, extend, pause and resume", async () => {
  await page.goto(URL0 + "/ui/#/sandboxes");
  const row = page.locator(`#sandbox-list tr[data-sandbox="${sandbox}"]`);
  await row.waitFor();
  const cell = (i) => row.locator("td").nth(i);
  await page.waitForFunction((id) => {
    const tds = document.querySelectorAll(`#sandbox-list tr[data-sandbox="${id}"] td`);
    return tds.length > 7 && /% of/.test(tds[6].textContent) && !tds[7].textContent.startsWith("–");
  }, sandbox, { timeout: 15000 });
  assert.match(await cell(7).textContent(), /^[\d.]+ (B|KiB|MiB) \/ 512 MiB$/);
  const filter = async (md, state) => {
    await page.locator("#filter-metadata").fill(md);
    await page.locator("#filter-state").selectOption(state);
    await page.locator("form.filters button[type=submit]").click();
  };
  await filter("owner=nobody", "");
  await row.waitFor({ state: "detached" });
  await page.locator("p.count", { hasText: "0 sandboxes" }).waitFor();
  await filter("owner=ui-test", "");
  await row.waitFor();
  await filter("", "paused");
  await row.waitFor({ state: "detached" });
  await filter("owner=ui-test", "running");
  await row.waitFor();
  const endAt = () => page.evaluate((id) => fetch("/ui/api/sandboxes/" + id).then((r) => r.json()).then((d) => Date.parse(d.endAt)), sandbox);
  const end0 = await endAt();
  await row.locator("button", { hasText: "Extend 5m" }).click();
  await page.locator("#flash p.ok", { hasText: "Extended" }).waitFor();
  assert.ok((await endAt()) - end0 >= 250_000, "extend adds about five minutes");
  await filter("", "");
  await row.locator("button", { hasText: "Pause" }).click();
  await row.locator("td .state.paused").waitFor({ timeout: 20000 });
  await row.locator("button", { hasText: "Resume" }).click();
  await row.locator("td .state.running").waitFor({ timeout: 20000 });
  results.passed.push("list: usage, filters, extend, pause, resume");
});

test("forged requests: no CSRF token, a wrong one, another origin; no cookie", async () => {
  const cookie = (await ctx.cookies()).find((x) => x.name === "cage_ui");
  const csrf = await page.evaluate(() => fetch("/ui/session").then((r) => r.json()).then((s) => s.csrf));
  const c = { Cookie: "cage_ui=" + cookie.value, "Content-Type": "application/json" };
  const body = JSON.stringify({ templateID: "host" });
  const cases = [
    ["no token", { ...c }, 403],
    ["wrong token", { ...c, "X-CSRF-Token": csrf.replace(/.$/, (x) => (x === "0" ? "1" : "0")) }, 403],
    ["another origin", { ...c, "X-CSRF-Token": csrf, Origin: "http://evil.example" }, 403],
    ["cross-site fetch", { ...c, "X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site" }, 403],
    ["no cookie", { "Content-Type": "application/json", "X-CSRF-Token": csrf }, 401],
  ];
  for (const [what, headers, want] of cases) {
    const r = await raw("POST", "/ui/api/v2/sandboxes", headers, body);
    assert.equal(r.status, want, `${what}: ${r.status} ${r.text}`);
  }
  const out = await raw("DELETE", "/ui/session", { Cookie: c.Cookie });
  assert.equal(out.status, 403, "sign-out without the token is refused");
  const input = await raw("POST", `/ui/term/${sandbox}/x/input`, { Cookie: c.Cookie }, "rm -rf ~\n");
  assert.equal(input.status, 403, "terminal input without the token is refused");
  // The same request with the token and this origin reaches the API.
  const ok = await raw("POST", "/ui/api/sandboxes/nosuchsandbox/pause", { ...c, "X-CSRF-Token": csrf, Origin: URL0 }, "{}");
  assert.equal(ok.status, 404, `a proper request reaches the API: ${ok.status} ${ok.text}`);
  const list = await raw("GET", "/ui/api/v2/sandboxes", { Cookie: c.Cookie });
  assert.equal(JSON.parse(list.text).length, 1, "no sandbox was made by a forged request");
  results.passed.push("CSRF");
});

test("keyboard: the skip link and the navigation work without a mouse", async () => {
  await page.goto(URL0 + "/ui/#/sandboxes");
  await page.reload();
  await page.locator("#sandbox-list table").waitFor();
  await page.evaluate(() => document.activeElement && document.activeElement.blur());
  await page.keyboard.press("Tab");
  assert.equal(await page.evaluate(() => document.activeElement.textContent), "Skip to content");
  const seen = [];
  for (let i = 0; i < 6; i++) {
    await page.keyboard.press("Tab");
    const t = await page.evaluate(() => document.activeElement.textContent);
    seen.push(t);
    if (t === "Templates") break;
  }
  assert.equal(seen[seen.length - 1], "Templates", "Tab reaches the navigation: " + seen.join(" | "));
  await page.keyboard.press("Enter");
  await page.locator("h1", { hasText: "Templates" }).waitFor();
  assert.ok(page.url().endsWith("#/templates"));
  await page.locator("table[aria-label=Templates]").waitFor();
  const tmpl = page.locator("table[aria-label=Templates] tr", { has: page.locator("strong", { hasText: new RegExp("^" + TEMPLATE + "$") }) });
  await tmpl.waitFor();
  if (TEMPLATE !== "host") { // a built template: its layers, each with its size
    await tmpl.locator("details summary").click();
    assert.match(await tmpl.locator("ol.layers li").first().textContent(), /^[0-9a-f]{12} [\d.]+ (B|KiB|MiB|GiB)$/);
  }
  await shot(page, "templates");
  results.passed.push("keyboard");
});

test("pages at 1280x800 and at phone width have no sideways scroll", async () => {
  for (const [w, hgt, tag] of [[1280, 800, "desktop"], [390, 844, "phone"]]) {
    await page.setViewportSize({ width: w, height: hgt });
    for (const [hash, name, ready] of [["#/sandboxes", "sandboxes", "#sandbox-list table"], ["#/sandboxes/" + sandbox, "sandbox", "dl.info"],
      ["#/templates", "templates", "table[aria-label=Templates]"], ["#/keys", "keys", "h1"], ["#/host", "host", "h1"]]) {
      await page.goto(URL0 + "/ui/" + hash);
      if (tag === "desktop") { // a fresh load of the page, timed by the browser
        await page.reload();
        await page.waitForFunction(() => performance.getEntriesByName("cage-page-ready").length > 0);
        const t = await page.evaluate(() => ({ load: performance.getEntriesByType("navigation")[0].loadEventEnd,
          ready: performance.getEntriesByName("cage-page-ready")[0].startTime }));
        results.loadMs[name + ": load event"] = t.load;
        results.loadMs[name + ": page ready"] = t.ready;
      }
      await page.locator(ready).first().waitFor();
      const over = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
      assert.ok(over <= 1, `${name} at ${w}x${hgt} scrolls sideways by ${over} px`);
      if (tag === "phone") await shot(page, "phone-" + name);
    }
  }
  await page.setViewportSize({ width: 1280, height: 800 });
  results.passed.push("viewports");
});

test("kill the sandbox from the list: it leaves the list without a reload", async () => {
  await page.goto(URL0 + "/ui/#/sandboxes");
  const row = page.locator(`#sandbox-list tr[data-sandbox="${sandbox}"]`);
  await row.waitFor();
  await row.locator("button", { hasText: "Kill" }).click();
  await row.locator("button", { hasText: "Really kill?" }).click();
  await page.locator(`#sandbox-list tr[data-sandbox="${sandbox}"]`).waitFor({ state: "detached", timeout: 15000 });
  results.passed.push("kill");
});

test("sign out ends the session on the server", async () => {
  const cookie = (await ctx.cookies()).find((x) => x.name === "cage_ui");
  await page.locator("#signout").click();
  await page.locator("form.signin").waitFor();
  const r = await raw("GET", "/ui/api/v2/sandboxes", { Cookie: "cage_ui=" + cookie.value });
  assert.equal(r.status, 401, "the old cookie opens nothing after sign-out");
  results.passed.push("sign out");
});

test("an admin key sees keys, teams and the host", async () => {
  const actx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const p = await actx.newPage();
  await signIn(p, URL0, ADMIN);
  await p.goto(URL0 + "/ui/#/keys");
  await p.locator("table[aria-label=Teams]").waitFor();
  await p.locator("form[aria-label='New team'] input").fill("ui-team");
  await p.locator("form[aria-label='New team'] button").click();
  await p.locator("table[aria-label=Teams] td", { hasText: "ui-team" }).waitFor();
  await p.locator("table[aria-label=Keys]").waitFor();
  await shot(p, "keys");
  await p.goto(URL0 + "/ui/#/host");
  await p.locator("table[aria-label=Walls] td", { hasText: "process" }).first().waitFor({ timeout: 30000 });
  await p.locator("table[aria-label=Checks] td", { hasText: "cgroups" }).first().waitFor();
  await shot(p, "host");
  await actx.close();
  results.passed.push("admin pages");
});

test("an admin builds a template from the page and follows its log", async () => {
  const actx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const p = await actx.newPage();
  p.on("pageerror", (e) => { pageErrors.push(e.message); console.log("page error:", e.message); });
  p.on("console", (m) => { if (/Content.Security.Policy/i.test(m.text())) cspViolations.push(m.text()); });
  await signIn(p, URL0, ADMIN);
  await p.goto(URL0 + "/ui/#/templates");
  await p.locator("form.build").waitFor();
  await p.locator("#build-name").fill(BUILD);
  // A COPY is refused before anything runs: the API's 400, flashed.
  await p.locator("#build-dockerfile").fill("FROM base\nCOPY secrets /x\n");
  await p.locator("form.build button[type=submit]").click();
  await p.locator("#flash", { hasText: "COPY on line 2" }).waitFor();
  const build = TEMPLATE === "base";
  // Without base in the store, a build FROM a template the store lacks
  // fails and says why.
  await p.locator("#build-dockerfile").fill(build ? `FROM base\nRUN echo made-by-${BUILD} && echo hi > /hello\n` : `FROM nosuch-${BUILD}\nRUN true\n`);
  await p.locator("form.build button[type=submit]").click();
  await p.locator("#build-log", { hasText: "step 1/2: FROM " }).waitFor({ timeout: 30000 });
  if (build) {
    await p.locator("#build-log", { hasText: new RegExp("^made-by-" + BUILD + "$", "m") }).waitFor({ timeout: 60000 });
    await p.locator("#build-state", { hasText: "Built template " + BUILD }).waitFor({ timeout: 60000 });
    assert.match(await p.locator("#build-log").textContent(), new RegExp("built template " + BUILD));
    await p.locator("table[aria-label=Templates] strong", { hasText: new RegExp("^" + BUILD + "$") }).waitFor();
  } else {
    await p.locator("#build-state", { hasText: "Failed: " }).waitFor({ timeout: 30000 });
    assert.match(await p.locator("#build-state").textContent(), new RegExp("FROM nosuch-" + BUILD));
    assert.equal(await p.locator("table[aria-label=Templates] strong", { hasText: BUILD }).count(), 0);
  }
  assert.ok(await p.locator("form.build button[type=submit]").isEnabled(), "the form takes another build once this one ended");
  await shot(p, "template-build");
  await actx.close();
  results.passed.push("template build");
});

test("a tenant key gets 403 for the host page", async () => {
  const tctx = await browser.newContext();
  const p = await tctx.newPage();
  await signIn(p, URL0, KEY);
  const st = await p.evaluate(() => fetch("/ui/host").then((r) => r.status));
  assert.equal(st, 403);
  const adm = await p.evaluate(() => fetch("/ui/api/admin/teams").then((r) => r.status));
  assert.equal(adm, 403, "the API's own admin check answers");
  const ev = await p.evaluate(() => fetch("/ui/events/builds/build_x").then((r) => r.status));
  assert.equal(ev, 403, "a build's log stream is an admin key's");
  await p.goto(URL0 + "/ui/#/templates");
  await p.locator("table[aria-label=Templates]").waitFor();
  assert.equal(await p.locator("form.build").count(), 0, "no build form for a tenant key");
  await tctx.close();
  results.passed.push("host page for admins only");
});

test("an expired session (ui.session_idle 2s) goes back to sign-in", async () => {
  const sctx = await browser.newContext();
  const p = await sctx.newPage();
  await signIn(p, SHORT_URL, SHORT_KEY);
  await p.locator("#sandbox-list table").waitFor();
  // The live list's stream says the session expired; the page signs in again.
  await p.locator("form.signin").waitFor({ timeout: 15000 });
  const st = await p.evaluate(() => fetch("/ui/api/v2/sandboxes").then((r) => r.status));
  assert.equal(st, 401);
  await shot(p, "expired");
  await sctx.close();
  results.passed.push("expired session");
});

test("signed out in another tab: the tab holding the live list goes to sign-in", async () => {
  const sctx = await browser.newContext();
  const p = await sctx.newPage();
  await signIn(p, URL0, KEY);
  await p.locator("#sandbox-list table").waitFor();
  // The same browser's other tab signs out (the same cookie): the list's
  // stream is ended by the session check and must say why, or the page
  // reconnects, is refused, and stays on a list that no longer moves.
  const other = await sctx.newPage();
  await other.goto(URL0 + "/ui/#/templates");
  await other.locator("#signout").click();
  await other.locator("form.signin").waitFor();
  await p.locator("form.signin").waitFor({ timeout: 15000 });
  await sctx.close();
  results.passed.push("signed out in another tab");
});

test("no script error and no Content-Security-Policy violation on any page", () => {
  assert.deepEqual(cspViolations, [], "the CSP blocked something the dashboard needs");
  assert.deepEqual(pageErrors, [], "uncaught errors in the page");
  results.passed.push("no CSP violations, no page errors");
});
