// The doors (SPEC S2-S4) in a real headless Chromium: a page served from another
// origin (another loopback address and port) tries every request a page can send
// without asking first — fetch in no-cors mode, form posts (text/plain and
// url-encoded), image GETs — against `sluice serve`'s admin listener, `sluice pace`'s
// settings and the pacer proxy. Nothing may change and nothing may be forwarded;
// the operator's own pages keep working, with the token when one is set.
// Screenshots: target/browser-screenshots/doors-*.png.
import assert from "node:assert/strict";
import crypto from "node:crypto";
import fs from "node:fs";
import http from "node:http";
import path from "node:path";
import { after, before, test } from "node:test";
import { DESKTOP, browser, fakeProvider, openPage, screenshot, startServe, startSluice, tempDir } from "./support.mjs";

const KEY = "door-browser-key";
const WORKSPACE = "key:" + crypto.createHash("sha256").update(KEY).digest("hex");

let work;
let serve;
let pace;
let provider;
let attacker;
let chrome;
let gateway;
let admin;
let proxy;
let paceAdmin;
let forwarded = 0;

function listen(server, host) {
  return new Promise((resolve) => server.listen(0, host, () => resolve(server)));
}

/** The hostile page, on 127.0.0.2: every simple request a page may send. */
function attackerPage(targets) {
  const html = `<!doctype html><meta charset="utf-8"><title>a page elsewhere</title>
<body><h1>Nothing to see here</h1>
<script>
const t = ${JSON.stringify(targets)};
const tries = [];
const noCors = (url, body, type) => tries.push(fetch(url, { method: "POST", mode: "no-cors", body, headers: type ? { "content-type": type } : {} }).catch(() => null));
const image = (url) => tries.push(new Promise((done) => { const i = new Image(); i.onload = i.onerror = done; i.src = url; }));
const form = (url, enctype, name, value) => tries.push(new Promise((done) => {
  const frame = document.createElement("iframe");
  frame.name = "f" + tries.length; frame.style.display = "none";
  document.body.appendChild(frame);
  const f = document.createElement("form");
  f.method = "post"; f.action = url; f.enctype = enctype; f.target = frame.name;
  const input = document.createElement("input"); input.name = name; input.value = value; f.appendChild(input);
  document.body.appendChild(f);
  frame.onload = done; setTimeout(done, 5000);
  f.submit();
}));
for (const url of [t.reset, t.limits]) {
  noCors(url, '{"tpm":1}', "text/plain");
  noCors(url, '{"tpm":1}');
  noCors(url, "tpm=1", "application/x-www-form-urlencoded");
  form(url, "text/plain", '{"tpm":1,"x":"', '"}');
  form(url, "application/x-www-form-urlencoded", "tpm", "1");
  image(url);
}
noCors(t.chat, JSON.stringify({ model: "fake", messages: [{ role: "user", content: "spend my key" }] }), "text/plain");
noCors(t.chat, JSON.stringify({ model: "fake", messages: [{ role: "user", content: "spend my key" }] }));
form(t.chat, "text/plain", '{"model":"fake","messages":[],"x":"', '"}');
image(t.models);
Promise.all(tries).then(() => { window.__done = tries.length; });
</script></body>`;
  return listen(http.createServer((req, res) => {
    res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    res.end(html);
  }), "127.0.0.2");
}

async function evalsUsage(base = admin, headers = {}) {
  const r = await fetch(base + "/quotas?workspace=" + encodeURIComponent(WORKSPACE), { headers });
  assert.equal(r.status, 200);
  const body = await r.json();
  return body.quotas.find((q) => q.family === "evals").usage;
}

/** A POST as curl sends it: no Origin, no body (node's http, not fetch). */
function curlPost(url) {
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method: "POST" }, (res) => { res.resume(); res.on("end", () => resolve(res.statusCode)); });
    req.on("error", reject);
    req.end();
  });
}

before(async () => {
  work = tempDir("sluice-doors-");
  provider = await fakeProvider(() => { forwarded += 1; return forwarded; });
  serve = await startServe(path.join(work, "data"));
  ({ gateway, admin } = serve);
  const config = path.join(work, "pace.yaml");
  fs.writeFileSync(config, [
    "providers:",
    "  fake:",
    "    apiKey: the-users-provider-key",
    `    baseUrl: http://127.0.0.1:${provider.address().port}/v1`,
    "    rateLimits: { tpm: 100000, rpm: 600, rpd: 1000 }",
    "",
  ].join("\n"));
  pace = await startSluice(
    ["pace", "--config", config, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"],
    /listening on http:\/\/(\S+), admin http:\/\/(\S+),/,
  );
  proxy = "http://" + pace.match[1];
  paceAdmin = "http://" + pace.match[2];
  attacker = await attackerPage({
    reset: `${admin}/quotas/reset?workspace=${encodeURIComponent(WORKSPACE)}`,
    limits: `${paceAdmin}/limits/fake`,
    chat: `${proxy}/fake/chat/completions`,
    models: `${proxy}/fake/v1/models`,
  });
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  await serve?.stop();
  await pace?.stop();
  provider?.close();
  attacker?.close();
  if (work) fs.rmSync(work, { recursive: true, force: true });
});

test("a page from another origin changes nothing and has nothing forwarded", { timeout: 90_000 }, async () => {
  for (let i = 0; i < 3; i++) {
    const r = await fetch(gateway + "/evals", { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: "{}" });
    assert.equal(r.status, 200);
  }
  assert.equal(await evalsUsage(), 3);
  const limitsBefore = await (await fetch(paceAdmin + "/limits")).json();
  assert.equal(limitsBefore.providers.fake.tpm, 100000);

  const page = await openPage(chrome.context, []);
  await page.goto(`http://127.0.0.2:${attacker.address().port}/`);
  await page.waitForFunction(() => window.__done > 0, null, { timeout: 60_000 });
  await screenshot(page, "doors-attacker-page");
  await page.close();

  assert.equal(await evalsUsage(), 3, "the quota was not reset");
  const limitsAfter = await (await fetch(paceAdmin + "/limits")).json();
  assert.equal(limitsAfter.providers.fake.tpm, 100000, "the pace limit was not changed");
  assert.equal(forwarded, 0, "nothing reached the provider with the user's key");

  // The operator's habits: curl resets the quota; an SDK's call is forwarded.
  assert.equal(await curlPost(`${admin}/quotas/reset?workspace=${encodeURIComponent(WORKSPACE)}`), 200);
  assert.equal(await evalsUsage(), 0);
  const chat = await fetch(proxy + "/fake/v1/chat/completions", {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "fake", messages: [{ role: "user", content: "hi" }] }),
  });
  assert.equal(chat.status, 200);
  assert.equal(forwarded, 1);
  assert.ok(serve.stderr().includes("sluice::audit"), "the reset left an audit line");
});

test("the operator's own pages still work: the dashboard and the pace settings", { timeout: 60_000 }, async () => {
  const errors = [];
  const page = await openPage(chrome.context, errors);
  await page.goto(admin + "/");
  await page.locator("#live.on").waitFor({ timeout: 10_000 });
  await page.goto(paceAdmin + "/");
  await page.locator("form").first().waitFor({ timeout: 10_000 });
  assert.deepEqual(errors, []);
  await page.close();
});

test("with a token the dashboard asks once and keeps it in an HttpOnly cookie", { timeout: 90_000 }, async () => {
  const file = path.join(work, "admin.token");
  fs.writeFileSync(file, "browser-test-token\n", { mode: 0o600 });
  const guarded = await startServe(path.join(work, "data2"), ["--admin-token-file", file]);
  try {
    const base = guarded.admin;
    assert.equal((await fetch(base + "/status")).status, 401);
    const errors = [];
    const page = await openPage(chrome.context, errors);
    await page.setViewportSize(DESKTOP);
    const first = await page.goto(base + "/");
    assert.equal(first.status(), 401);
    await page.locator("#token").waitFor({ timeout: 10_000 });
    await screenshot(page, "doors-login");
    await page.fill("#token", "not-the-token");
    await page.click("button[type=submit]");
    await page.locator("#why", { hasText: /not valid/ }).waitFor({ timeout: 10_000 });
    await page.fill("#token", "browser-test-token");
    await page.click("button[type=submit]");
    await page.locator("#live.on").waitFor({ timeout: 10_000 });
    assert.equal(await page.evaluate(() => document.cookie), "", "the cookie is HttpOnly");
    const cookies = await chrome.context.cookies(base);
    const cookie = cookies.find((c) => c.name.startsWith("sluice_admin_"));
    assert.ok(cookie && cookie.httpOnly && cookie.sameSite === "Strict", JSON.stringify(cookies));
    await screenshot(page, "doors-dashboard-after-login");
    // The console errors of a login are the two 401s the page was answered with.
    assert.ok(errors.every((e) => /401/.test(e)), errors.join("\n"));
    await page.close();
  } finally {
    await guarded.stop();
  }
});
