// SPEC D4 on the admin dashboard: `sluice serve` on a real redis-server with the
// built-in policy's read class and IP ceiling leased. After traffic the store
// panel shows the leases taken, returned and expired, the Redis calls saved and
// the over-admission seen, as /status gives them.
// Screenshot: target/browser-screenshots/serve-dashboard-leases.png.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import { DESKTOP, browser, examplePolicy, openPage, screenshot, startServe, tempDir } from "./support.mjs";

let redis;
let sluice;
let chrome;
let work;
let gateway;
let admin;

/** The built-in policy, its read class and IP ceiling leased, on windows no run straddles. */
function policyFile(dir) {
  return examplePolicy(dir, [["\nwindow_seconds: 60\n", "\nwindow_seconds: 4294967295\n" +
    "algorithms:\n  read: { consistency: leased, lease: 10, lease_ms: 1000 }\n" +
    "  ip: { consistency: leased, lease: 10, lease_ms: 1000 }\n"]]);
}

/** A redis-server on a Unix socket in `dir`; resolves once it answers. */
async function startRedis(dir) {
  const socket = path.join(dir, "redis.sock");
  const child = spawn("redis-server", [
    "--port", "0", "--save", "", "--appendonly", "no", "--unixsocket", socket, "--dir", dir,
  ], { stdio: "ignore" });
  for (let i = 0; i < 200 && !fs.existsSync(socket); i++) await new Promise((r) => setTimeout(r, 25));
  assert.ok(fs.existsSync(socket), "redis-server did not open its socket in 5 s");
  return { url: "redis+unix://" + socket, stop: () => child.kill("SIGKILL") };
}

before(async () => {
  work = tempDir("sluice-leases-");
  redis = await startRedis(work);
  sluice = await startServe(path.join(work, "data"), ["--config", policyFile(work), "--store", redis.url]);
  ({ gateway, admin } = sluice);
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  await sluice?.stop();
  redis?.stop();
  if (work) fs.rmSync(work, { recursive: true, force: true });
});

test("the store panel shows what leases did and the over-admission seen (SPEC D4)", { timeout: 60_000 }, async () => {
  for (let i = 0; i < 60; i++) {
    const r = await fetch(gateway + "/search/fields", { headers: { "x-api-key": "leases-one" } });
    await r.arrayBuffer();
    assert.equal(r.status, 200);
  }
  const leases = (await (await fetch(admin + "/status")).json()).limiter.leases;
  assert.ok(leases.taken > 0 && leases.calls_saved > 0, JSON.stringify(leases));
  assert.equal(typeof leases.over_admission_seen, "number", JSON.stringify(leases));

  const errors = [];
  const page = await openPage(chrome.context, errors);
  await page.setViewportSize(DESKTOP);
  await page.goto(admin + "/");
  await page.locator("#live.on").waitFor({ timeout: 10_000 });
  const row = page.locator('#store-body [data-fact="leases"] td');
  await row.waitFor({ timeout: 10_000 });
  assert.match(await row.innerText(), /^[\d,]+ taken · [\d,]+ returned · [\d,]+ expired$/);
  const saved = await page.locator('#store-body [data-fact="Redis calls saved"] td').innerText();
  assert.ok(Number(saved.replaceAll(",", "")) > 0, saved);
  const seen = page.locator('#store-body [data-fact="over-admission seen"] td');
  assert.match(await seen.innerText(), /^[\d,]+ units at most$/);
  await page.locator("#store").scrollIntoViewIfNeeded();
  // The panel's table stays inside its card.
  const [card, table] = await Promise.all(["#store", "#store-body table"].map((s) =>
    page.locator(s).evaluate((e) => e.getBoundingClientRect().right)));
  assert.ok(table <= card, `the store table overflows its card: ${table} > ${card}`);
  await screenshot(page, "serve-dashboard-leases");
  assert.deepEqual(errors, []);
  await page.close();
});
