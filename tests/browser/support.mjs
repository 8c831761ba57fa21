// Shared by the browser tests: the sluice binary as a child process, the system
// Chromium driven by playwright-core, screenshots under target/browser-screenshots/.
import { spawn } from "node:child_process";
import http from "node:http";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = path.resolve(here, "../..");
export const BIN = process.env.SLUICE_BIN || path.join(ROOT, "target/debug/sluice");
export const SHOTS = path.join(ROOT, "target/browser-screenshots");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";

export const DESKTOP = { width: 1280, height: 900 };
export const PHONE = { width: 390, height: 844 };

/**
 * The built-in policy (examples/policy.yaml) with each `[from, to]` of `edits` made
 * (each `from` must still be in it), written to DIR/policy.yaml; returns that path.
 */
export function examplePolicy(dir, edits) {
  let text = fs.readFileSync(path.join(ROOT, "examples/policy.yaml"), "utf8");
  for (const [from, to] of edits) {
    if (!text.includes(from)) throw new Error(`examples/policy.yaml no longer holds ${JSON.stringify(from)}`);
    text = text.replace(from, to);
  }
  const file = path.join(dir, "policy.yaml");
  fs.writeFileSync(file, text);
  return file;
}

/**
 * `sluice serve` on port 0 with its admin listener on port 0, its data in `dataDir`,
 * and `args` after; resolves as `startSluice` does, with `gateway` and `admin`, the two
 * listeners' base URLs.
 */
export async function startServe(dataDir, args = []) {
  const serve = await startSluice([
    "serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data-dir", dataDir, ...args,
  ], /listening on http:\/\/(\S+) \(admin http:\/\/(\S+),/);
  return { ...serve, gateway: "http://" + serve.match[1], admin: "http://" + serve.match[2] };
}

/** A fresh temporary directory, removed by `cleanup`. */
export function tempDir(prefix) {
  return fs.mkdtempSync(path.join(os.tmpdir(), prefix));
}

/**
 * Runs `sluice ARGS` and waits (at most `timeoutMs`) for a stdout line matching
 * `ready`; resolves with the match and a `stop()` that sends SIGTERM (SIGKILL after
 * 5 s) and waits for the exit.
 */
export function startSluice(args, ready, timeoutMs = 30_000) {
  const child = spawn(BIN, args, { stdio: ["ignore", "pipe", "pipe"] });
  let out = "";
  let err = "";
  child.stderr.on("data", (d) => { err += d; });
  const exited = new Promise((resolve) => child.on("exit", resolve));
  const stop = async () => {
    if (child.exitCode !== null || child.signalCode !== null) return;
    child.kill("SIGTERM");
    const killer = setTimeout(() => child.kill("SIGKILL"), 5_000);
    await exited;
    clearTimeout(killer);
  };
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      stop();
      reject(new Error(`sluice ${args.join(" ")}: no ready line in ${timeoutMs} ms\nstdout: ${out}\nstderr: ${err}`));
    }, timeoutMs);
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`sluice ${args.join(" ")} exited (${code}) before it was ready\nstdout: ${out}\nstderr: ${err}`));
    });
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(ready);
      if (m) {
        clearTimeout(timer);
        resolve({ match: m, stop, stderr: () => err });
      }
    });
  });
}

/**
 * The system Chromium, headless, on a fresh profile; flags as this network needs
 * (no background connections, which are refused here).
 */
export async function browser() {
  const profile = tempDir("sluice-chromium-");
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: DESKTOP,
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
  });
  const close = async () => {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  };
  return { context, close };
}

/** A page that fails the test on any script error it reports. */
export async function openPage(context, errors) {
  const page = await context.newPage();
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  return page;
}

/** Saves a screenshot of what the viewport shows as target/browser-screenshots/NAME.png. */
export async function screenshot(page, name, fullPage = false) {
  fs.mkdirSync(SHOTS, { recursive: true });
  const file = path.join(SHOTS, name + ".png");
  await page.screenshot({ path: file, fullPage });
  return file;
}

/** True when the page scrolls sideways (something wider than the viewport). */
export async function overflowsSideways(page) {
  return page.evaluate(() => document.scrollingElement.scrollWidth > window.innerWidth + 1);
}

/**
 * A provider on a free loopback port that answers every chat completion with its
 * usage, calling `onRequest()` for each request it gets.
 */
export function fakeProvider(onRequest) {
  const server = http.createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      const n = onRequest();
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({
        id: "chatcmpl-" + n, object: "chat.completion", created: 0, model: "fake",
        choices: [{ index: 0, finish_reason: "stop", message: { role: "assistant", content: "ok" } }],
        usage: { prompt_tokens: 12, completion_tokens: 8, total_tokens: 20 },
      }));
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}
