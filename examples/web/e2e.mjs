// End-to-end test of the page: serve examples/web, open it in a headless browser, let it load the
// demo model and decode N greedy tokens, and assert they equal the native engine's tokens for the
// same model and prompt (passed in EXPECTED as a JSON array). Saves a screenshot.
//   EXPECTED='[..]' node e2e.mjs [out.png]                  Chromium (Debian's; WebGPU on SwiftShader), playwright-core
//   EXPECTED='[..]' BROWSER_KIND=firefox node e2e.mjs [out.png]   Firefox ESR (WebGPU on lavapipe), puppeteer-core over WebDriver BiDi
//   LOSE=5 EXPECTED='[..]' node e2e.mjs [out.png]          Chromium: destroy the GPU device after 5 tokens; the page
//                                                                  must build a new session and still give EXPECTED
//   GGUF=model.gguf EXPECT_TEXT=Paris node e2e.mjs [out.png]      Chromium: pick the GGUF in the file input, ask the
//                                                                  page's default question greedily, expect the text
//   TWO=1 node e2e.mjs [out.png]                             Chromium: two conversations answering at once (one batch)
//                                                                  equal each answering alone; a second turn keeps the first
//   STORE_GGUF=model.gguf node e2e.mjs                       Chromium: a picked GGUF is kept in the browser's storage
//                                                                  (OPFS) and loads from there after a reload
//   AUTO_GGUF=model.gguf EXPECTED='[..]' node e2e.mjs [out.png]   Chromium: that GGUF (token ids, no vocabulary needed)
//                                                                  instead of the demo model, greedy tokens as above
import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import { chromium } from "playwright-core";
import puppeteer from "puppeteer-core";

const root = path.dirname(new URL(import.meta.url).pathname);
const expected = JSON.parse(process.env.EXPECTED ?? "null");
const shot = process.argv[2] ?? path.join(root, "screenshot.png");
const firefox = process.env.BROWSER_KIND === "firefox";
const browserPath = process.env.BROWSER ?? (firefox ? "/usr/bin/firefox-esr" : "/usr/bin/chromium");
const types = { ".html": "text/html", ".js": "text/javascript", ".wasm": "application/wasm", ".css": "text/css" };

const server = http.createServer((req, res) => {
  const url = new URL(req.url, "http://x");
  // AUTO_GGUF: the page's `&gguf=/model.gguf` is that file
  const auto = url.pathname === "/model.gguf" && process.env.AUTO_GGUF;
  const file = auto
    ? path.resolve(process.env.AUTO_GGUF)
    : path.join(root, url.pathname === "/" ? "index.html" : decodeURIComponent(url.pathname));
  if (!(auto || file.startsWith(root)) || !fs.existsSync(file)) { res.writeHead(404); res.end(); return; }
  res.writeHead(200, { "content-type": types[path.extname(file)] ?? "application/octet-stream" });
  fs.createReadStream(file).pipe(res);
});
await new Promise((r) => server.listen(0, "127.0.0.1", r));
const port = server.address().port;

const browser = firefox
  ? await puppeteer.launch({
      browser: "firefox",
      executablePath: browserPath,
      headless: true,
      extraPrefsFirefox: { "dom.webgpu.enabled": true, "gfx.webgpu.ignore-blocklist": true },
    })
  : await chromium.launch({
      executablePath: browserPath,
      headless: true,
      args: ["--no-sandbox", "--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"],
    });
let failed = false;
let pageOf = null; // for the report when a wait times out
try {
  const page = await browser.newPage();
  pageOf = page;
  await page.setViewportSize?.({ width: 900, height: 640 });
  await page.setViewport?.({ width: 900, height: 640 });
  page.on("console", (m) => console.log("page:", m.text()));
  page.on("pageerror", (e) => console.log("page error:", e.message));
  const text = (sel) => page.evaluate((s) => document.querySelector(s).textContent, sel);
  const loaded = () => page.waitForFunction(() => !document.querySelector("#run").disabled || document.querySelector("#status").textContent.startsWith("error"), null, { timeout: 300_000 });
  if (process.env.TWO) {
    // conversation answers: both at once, then each alone after a reload; the same greedy tokens
    const answers = async (which) => {
      await page.goto(`http://127.0.0.1:${port}/`);
      await page.click("#load");
      await loaded();
      await page.fill("#max", "12");
      for (const w of which) await page.click(w === 1 ? "#run" : "#run2");
      await finished(which);
      return Promise.all(["#out", "#out2"].map((o) => text(o)));
    };
    // a conversation has answered when its Stop button is off again and its answer is shown
    const finished = (which) => page.waitForFunction((which) => which.every((i) =>
      document.querySelector(i === 1 ? "#stop" : "#stop2").disabled && document.querySelector(i === 1 ? "#out" : "#out2").textContent.length > 0),
      which, { timeout: 240_000 });
    const both = await answers([1, 2]);
    const one = (await answers([1]))[0];
    const two = (await answers([2]))[1];
    console.log(`together: ${JSON.stringify(both)}; alone: ${JSON.stringify([one, two])}`);
    if (both[0] !== one || both[1] !== two) { console.log("MISMATCH: conversations answering together differ from alone"); failed = true; }
    // a second turn in conversation 2 (the page's last run) keeps the first turn on its row
    await page.fill("#prompt2", "and again");
    await page.click("#run2");
    await finished([2]);
    const status = await text("#status");
    console.log(`second turn: ${status}`);
    const kept = Number((status.match(/\((\d+) kept/) ?? [])[1] ?? 0);
    if (!(kept > 0)) { console.log("MISMATCH: the second turn kept nothing of the first"); failed = true; }
    await page.screenshot({ path: shot });
  } else if (process.env.STORE_GGUF) {
    await page.goto(`http://127.0.0.1:${port}/`);
    await page.check("input[value=gguf]");
    await page.setInputFiles("#file", process.env.STORE_GGUF);
    await page.click("#load");
    await loaded();
    // the page keeps the file in the background: wait until it says so, then reload
    await page.waitForFunction(() => !document.querySelector("#stored-line").hidden, null, { timeout: 60_000 });
    await page.reload();
    await page.waitForFunction(() => !document.querySelector("#stored-line").hidden, null, { timeout: 30_000 });
    console.log(`after a reload: kept in this browser: ${await text("#stored-name")}`);
    await page.check("#stored");
    await page.click("#load");
    await loaded();
    const status = await text("#status");
    console.log(`loaded from the browser's storage: ${status}`);
    if (status !== "GGUF loaded") { console.log("MISMATCH: the kept model did not load"); failed = true; }
  } else if (process.env.GGUF) {
    // a real model chosen from disk through the page's file input (Chromium / playwright only)
    await page.goto(`http://127.0.0.1:${port}/`);
    await page.check("input[value=gguf]");
    await page.setInputFiles("#file", process.env.GGUF);
    await page.click("#load");
    const status = () => page.evaluate(() => document.querySelector("#status").textContent);
    await page.waitForFunction(() => !document.querySelector("#run").disabled || document.querySelector("#status").textContent.startsWith("error"), null, { timeout: 300_000 });
    await page.fill("#max", "16");
    await page.click("#run");
    await page.waitForFunction(() => /^(done|error)/.test(document.querySelector("#status").textContent), null, { timeout: 300_000 });
    const out = await page.evaluate(() => document.querySelector("#out").textContent);
    const tps = await page.evaluate(() => document.querySelector("#tps").textContent);
    await page.screenshot({ path: shot });
    console.log(`gguf: "${out}" at ${tps} tokens/s (${await status()}); screenshot ${shot}`);
    if (!out.includes(process.env.EXPECT_TEXT ?? "")) { console.log(`MISMATCH: expected the answer to contain ${process.env.EXPECT_TEXT}`); failed = true; }
  } else {
    const n = expected ? expected.length : 20;
    const lose = process.env.LOSE ? `&lose=${process.env.LOSE}` : "";
    const gguf = process.env.AUTO_GGUF ? "&gguf=/model.gguf" : "";
    await page.goto(`http://127.0.0.1:${port}/?auto=${n}${lose}${gguf}`);
    await page.waitForSelector("body[data-done='1']", { timeout: 240_000 });
    const got = JSON.parse(await text("#tokens"));
    const adapter = await text("#adapter");
    const tps = await text("#tps");
    await page.screenshot({ path: shot });
    console.log(`${firefox ? "firefox" : "chromium"}: adapter ${adapter}; ${n} tokens at ${tps} tokens/s; screenshot ${shot}`);
    console.log(`page tokens:   ${JSON.stringify(got)}`);
    if (lose) {
      const why = await text("#recovered");
      console.log(`device lost after ${process.env.LOSE} tokens: "${why}"`);
      if (!why.includes("device lost")) { console.log("MISMATCH: the page never saw the device lost"); failed = true; }
    }
    if (expected) {
      console.log(`native tokens: ${JSON.stringify(expected)}`);
      if (JSON.stringify(got) !== JSON.stringify(expected)) { console.log("MISMATCH: the page's tokens differ from the native engine's"); failed = true; }
      else console.log("page tokens equal the native engine's");
    }
  }
} catch (e) {
  console.log("e2e failed:", e.message);
  // where the page was when it stopped: its status line and adapter (a wait that timed out says
  // nothing of why)
  const at = await pageOf
    ?.evaluate(() => ({ status: document.querySelector("#status")?.textContent, adapter: document.querySelector("#adapter")?.textContent }))
    .catch((err) => ({ unreadable: String(err) }));
  console.log("the page at that moment:", JSON.stringify(at));
  failed = true;
} finally {
  await browser.close();
  server.close();
}
process.exit(failed ? 1 : 0);
