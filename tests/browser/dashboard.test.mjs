// The admin dashboard of `sluice serve` (issue 17, item 1) in a real headless
// Chromium: live numbers after traffic, caller-chosen text shown as text, and a
// phone-width layout. Screenshots: target/browser-screenshots/serve-dashboard-*.png.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import {
  DESKTOP, PHONE, ROOT, browser, examplePolicy, fakeProvider, openPage, overflowsSideways, screenshot, startServe, tempDir,
} from "./support.mjs";

// A workspace name as an auth layer in front may pass it on: whatever a caller
// chose. The page must show it as text and never run it.
const HOSTILE = `<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">`;

let sluice;
let chrome;
let work;
let gateway;
let admin;

/** The built-in policy with loopback trusted as an auth layer naming workspaces. */
function policyFile(dir) {
  return examplePolicy(dir, [
    ["  trusted_proxies: []", "  trusted_proxies: [127.0.0.1]\n  principal_headers: { workspace: X-Workspace, user: X-User }"],
    // Windows no run can straddle: the counts the page shows never drop to a new window's.
    ["\nwindow_seconds: 60\n", "\nwindow_seconds: 4294967295\n"],
    // A plan no workspace is on until the admin API puts one there (SPEC P3, P4).
    ["\nheaders:\n", "\nplans:\n  pro:\n    classes: { expensive: 90 }\nheaders:\n"],
  ]);
}

before(async () => {
  work = tempDir("sluice-dash-");
  sluice = await startServe(path.join(work, "data"), [
    "--config", policyFile(work), "--demo-optimize-seconds", "6",
  ]);
  ({ gateway, admin } = sluice);
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  await sluice?.stop();
  if (work) fs.rmSync(work, { recursive: true, force: true });
});

async function send(method, route, headers = {}, body) {
  const r = await fetch(gateway + route, { method, headers, body });
  await r.arrayBuffer();
  return r.status;
}

const text = (page, selector) => page.locator(selector).first().innerText();

test("the dashboard shows traffic as it happens, refusals by reason, and caller text as text", { timeout: 60_000 }, async () => {
  const errors = [];
  const page = await openPage(chrome.context, errors);
  await page.setViewportSize(DESKTOP);
  await page.goto(admin + "/");
  await page.locator("#live.on").waitFor({ timeout: 10_000 });
  assert.equal(await text(page, "#kpi-refused .value"), "0");
  // The running policy's version (the file's), as /status gives it.
  const status = await (await fetch(admin + "/status")).json();
  assert.match(await text(page, "#policy-badge"), new RegExp("^policy " + status.limiter.policy.version.slice(0, 8) + "$"));
  assert.match(await text(page, "#refusals-body"), /nothing refused/);
  // SPEC T6: no LLM route in the built-in policy, so no tokens-and-money section.
  assert.equal(await page.locator("#usage").isHidden(), true, "the LLM usage section shows without LLM routes");
  assert.equal(await page.locator("#runs").isHidden(), true, "the agent runs section shows without LLM routes");

  // SPEC E1: 30 expensive calls a minute per caller; 35 from one key → 5 refused.
  const statuses = [];
  for (let i = 0; i < 35; i++) statuses.push(await send("POST", "/chats", { "x-api-key": "dash-one" }));
  assert.equal(statuses.filter((s) => s === 429).length, 5, String(statuses));
  for (let i = 0; i < 12; i++) await send("GET", "/search/fields", { "x-api-key": "dash-two" });
  // A lane call that runs for 6 s, from a workspace with a hostile name.
  const laneCall = fetch(gateway + "/messages/optimize", {
    method: "POST",
    headers: { "content-type": "application/json", "x-api-key": "dash-three", "x-workspace": HOSTILE, "x-user": HOSTILE },
    body: JSON.stringify({ text: "hello" }),
  });

  // The numbers change without a reload.
  await page.locator("#kpi-refused .value", { hasText: /^5$/ }).waitFor({ timeout: 10_000 });
  await page.locator('.chart[data-class="expensive"] .fill', { hasText: "100%" }).waitFor({ timeout: 10_000 });
  await page.locator('#refusals-body [data-reason="expensive"] .count', { hasText: /^5$/ }).waitFor({ timeout: 10_000 });
  await page.locator("#callers-body tr", { hasText: "30" }).first().waitFor({ timeout: 10_000 });
  assert.match(await text(page, '.chart[data-class="read"] .meta'), /300 per caller \/ 4294967295 s/);
  // The running lane call: its workspace, as text, in the lanes, the callers and the quotas.
  const laneRow = page.locator('#lanes-body tr').filter({ hasText: "window.__pwned" });
  await laneRow.first().waitFor({ timeout: 10_000 });
  assert.ok((await laneRow.first().innerText()).includes("<script>window.__pwned = 1</script>"));
  assert.ok((await text(page, "#callers-body")).includes(HOSTILE));
  await page.locator("#quotas-body", { hasText: "<img src=x" }).waitFor({ timeout: 10_000 });
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "caller text ran as script");
  assert.equal(await page.locator("main img, main script").count(), 0, "caller text became markup");
  assert.match(await text(page, '#lanes-body [data-lane="optimizer"]'), /1 of 20 running/);
  assert.match(await text(page, "#store-body"), /healthy/);
  await screenshot(page, "serve-dashboard-desktop", true);

  await page.setViewportSize(PHONE);
  await page.waitForTimeout(300);
  assert.equal(await overflowsSideways(page), false, "the page scrolls sideways at 390 px");
  assert.ok(await page.locator("#kpi-refused").isVisible());
  await screenshot(page, "serve-dashboard-phone");
  await page.locator("#classes").scrollIntoViewIfNeeded();
  await screenshot(page, "serve-dashboard-phone-charts");

  assert.equal((await laneCall).status, 200);
  assert.deepEqual(errors, []);
  await page.close();
});

test("the plans panel shows what each plan gives, and a workspace's limits as the admin API set them", { timeout: 60_000 }, async () => {
  const put = await fetch(admin + "/tenants/workspaces/acme", {
    method: "PUT",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ plan: "pro", limits: { classes: { read: 700 } } }),
  });
  assert.equal(put.status, 204, await put.text());
  const errors = [];
  const page = await openPage(chrome.context, errors);
  await page.setViewportSize(DESKTOP);
  await page.goto(admin + "/");
  await page.locator("#live.on").waitFor({ timeout: 10_000 });
  await page.locator('#plans-body [data-plan="pro"]').waitFor({ timeout: 10_000 });
  assert.match(await text(page, '#plans-body [data-plan="pro"]'), /expensive 90/);
  assert.match(await text(page, "#plans-note"), /1 workspace\(s\) on a named plan/);
  await page.fill("#limits-workspace", "acme");
  await page.click("#workspace-form button");
  await page.locator("#workspace-limits .plan").waitFor({ timeout: 10_000 });
  const shown = await text(page, "#workspace-limits");
  assert.match(shown, /acme · plan pro and limits of its own/);
  assert.match(shown, /expensive 90/);
  assert.match(shown, /read 700/);
  assert.match(shown, /standard 60/, "the profile's where neither sets it");
  await screenshot(page, "serve-dashboard-plans");
  assert.deepEqual(errors, []);
});

test("with LLM routes the dashboard charts each workspace's tokens and spend this month (SPEC T6)", { timeout: 60_000 }, async () => {
  let calls = 0;
  const provider = await fakeProvider(() => ++calls);
  const dir = tempDir("sluice-dash-llm-");
  const llm = await startServe(path.join(dir, "data"), [
    "--config", path.join(ROOT, "examples/llm-gateway.yaml"),
    "--upstream", "http://127.0.0.1:" + provider.address().port,
  ]);
  try {
    const chat = async (key, model, extra = {}) => {
      const r = await fetch(llm.gateway + "/v1/chat/completions", {
        method: "POST",
        headers: { "content-type": "application/json", authorization: "Bearer " + key, ...extra },
        body: JSON.stringify({ model, max_tokens: 16, messages: [{ role: "user", content: "hi" }] }),
      });
      await r.arrayBuffer();
      assert.equal(r.status, 200);
    };
    // The example's key table: research (ada) and support (grace). The provider
    // reports 12 input and 8 output tokens a call.
    await chat("sk-research-ada", "gpt-4o");
    await chat("sk-research-ada", "gpt-4o");
    await chat("sk-support-grace", "gpt-4o-mini");
    const errors = [];
    const page = await openPage(chrome.context, errors);
    await page.setViewportSize(DESKTOP);
    await page.goto(llm.admin + "/");
    await page.locator("#usage:not([hidden])").waitFor({ timeout: 10_000 });
    const tokens = '.chart[data-usage="tokens"]';
    const spend = '.chart[data-usage="spend"]';
    await page.locator(tokens + ' [data-workspace="research"] .count', { hasText: /^40$/ }).waitFor({ timeout: 10_000 });
    assert.equal(await text(page, tokens + ' [data-workspace="support"] .count'), "20");
    assert.equal(await page.locator(tokens + " svg rect").count() > 0, true, "the token chart draws bars");
    // Per call 12 × 2.50 + 8 × 10 per million dollars, rounded up to 10⁻⁵: most spent first.
    assert.equal(await text(page, spend + " .row .what"), "research");
    assert.equal(await text(page, spend + ' [data-workspace="research"] .count'), "$0.00022");
    assert.equal(await text(page, spend + ' [data-workspace="support"] .count'), "$0.00001");
    assert.match(await text(page, "#usage-note"), /This month \(\d{4}-\d{2}, UTC\): the 2 workspace\(s\)/);
    await page.locator("#usage").scrollIntoViewIfNeeded();
    await screenshot(page, "serve-dashboard-llm-usage");
    // A money budget's limit is told in dollars (the example's plan large: $500 a month).
    await page.locator('#plans-body [data-plan="large"]').waitFor({ timeout: 10_000 });
    assert.match(await text(page, '#plans-body [data-plan="large"]'), /usd_month \$500\.00 \/month/);
    // An agent run of the quick tier (10 turns) with 9 taken is near its budget (SPEC T7).
    for (let i = 0; i < 9; i++) {
      await chat("sk-research-ada", "gpt-4o", { "x-sluice-run": "agent-1", "x-sluice-depth": "quick" });
    }
    await page.locator('#runs [data-run="agent-1"] .count', { hasText: /^9 \/ 10$/ }).waitFor({ timeout: 15_000 });
    assert.match(await text(page, '#runs [data-run="agent-1"] .what'), /agent-1 \(quick\)/);
    await page.locator("#runs").scrollIntoViewIfNeeded();
    await screenshot(page, "serve-dashboard-runs");
    await page.setViewportSize(PHONE);
    await page.waitForTimeout(300);
    assert.equal(await overflowsSideways(page), false, "the page scrolls sideways at 390 px");
    assert.deepEqual(errors, []);
    await page.close();
  } finally {
    await llm.stop();
    provider.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
