// The settings page of `sluice pace` (issue 17, item 1; SPEC C1) in a real headless
// Chromium: live windows against the limits, and a limit edited in the form that
// the next request uses. Screenshots: target/browser-screenshots/pace-settings-*.png.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import {
  DESKTOP, PHONE, browser, fakeProvider, openPage, overflowsSideways, screenshot, startSluice, tempDir,
} from "./support.mjs";

let provider;
let pace;
let chrome;
let work;
let proxy;
let admin;
let seen = 0;

before(async () => {
  work = tempDir("sluice-pace-");
  provider = await fakeProvider(() => { seen += 1; return seen; });
  const config = path.join(work, "pace.yaml");
  fs.writeFileSync(config, [
    "providers:",
    "  fake:",
    "    apiKey: not-a-secret",
    `    baseUrl: http://127.0.0.1:${provider.address().port}/v1`,
    "    rateLimits: { tpm: 100000, rpm: 600, rpd: 1000 }",
    "    maxWaitSeconds: 5",
    "",
  ].join("\n"));
  pace = await startSluice(
    ["pace", "--config", config, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"],
    /listening on http:\/\/(\S+), admin http:\/\/(\S+),/,
  );
  proxy = "http://" + pace.match[1];
  admin = "http://" + pace.match[2];
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  await pace?.stop();
  provider?.close();
  if (work) fs.rmSync(work, { recursive: true, force: true });
});

async function chat(maxTokens) {
  const r = await fetch(proxy + "/fake/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "fake", max_tokens: maxTokens, messages: [{ role: "user", content: "hello there" }] }),
  });
  return { status: r.status, body: await r.json() };
}

test("c1 the pace page shows the windows live, and a limit saved in its form applies to the next request", { timeout: 60_000 }, async () => {
  const errors = [];
  const page = await openPage(chrome.context, errors);
  await page.setViewportSize(DESKTOP);
  await page.goto(admin + "/");
  await page.locator("#live.on").waitFor({ timeout: 10_000 });
  const card = page.locator('section[data-provider="fake"]');
  await card.locator('.meter[data-axis="rpm"] .v', { hasText: "0 / 600" }).waitFor({ timeout: 10_000 });

  for (let i = 0; i < 3; i++) assert.equal((await chat(50)).status, 200);
  // The numbers change without a reload: requests in the minute and the day, tokens.
  await card.locator('.meter[data-axis="rpm"] .v', { hasText: "3 / 600" }).waitFor({ timeout: 10_000 });
  await card.locator('.meter[data-axis="rpd"] .v', { hasText: "3 / 1,000" }).waitFor({ timeout: 10_000 });
  assert.match(await card.locator('.meter[data-axis="tpm"] .v').innerText(), /^[1-9][\d,]* \/ 100,000$/);
  await card.locator('.stat[data-stat="admitted"] b', { hasText: /^3$/ }).waitFor({ timeout: 10_000 });
  await screenshot(page, "pace-settings-desktop", true);

  // Requests spaced for the RPM waited: each wait is a 429 avoided.
  const avoided = Number(await card.locator('.stat[data-stat="avoided"] b').innerText());
  assert.ok(avoided >= 0);

  // Edit the TPM in the form: a request asking for more than the new limit is
  // refused at once (it could never fit), naming the limit.
  const tpm = card.locator('input[name="tpm"]');
  await tpm.fill("40");
  await card.locator("button", { hasText: "Save" }).click();
  await card.locator(".msg.ok", { hasText: "TPM 40" }).waitFor({ timeout: 10_000 });
  const refused = await chat(100);
  assert.equal(refused.status, 413, JSON.stringify(refused.body));
  assert.match(JSON.stringify(refused.body), /40/);
  assert.equal(seen, 3, "the refused request never reached the provider");
  await card.locator('.meter[data-axis="tpm"] .v', { hasText: "/ 40" }).waitFor({ timeout: 10_000 });
  await card.locator('.stat[data-stat="avoided"] b', { hasText: new RegExp(`^${avoided + 1}$`) }).waitFor({ timeout: 10_000 });

  // Raise it again in the form: the same request goes through.
  await tpm.fill("100000");
  await card.locator("button", { hasText: "Save" }).click();
  await card.locator(".msg.ok", { hasText: "TPM 100,000" }).waitFor({ timeout: 10_000 });
  assert.equal((await chat(100)).status, 200);
  assert.equal(seen, 4);
  await card.locator('.meter[data-axis="rpm"] .v', { hasText: "4 / 600" }).waitFor({ timeout: 10_000 });
  assert.equal(await card.locator(".src").innerText(), "settings");

  await page.setViewportSize(PHONE);
  await page.waitForTimeout(300);
  assert.equal(await overflowsSideways(page), false, "the page scrolls sideways at 390 px");
  await screenshot(page, "pace-settings-phone");
  assert.deepEqual(errors, []);
  await page.close();
});
