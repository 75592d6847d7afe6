// The page: load a model into a kvdecode Session (wasm), decode token by token, show the text as
// it grows, tokens/s and the adapter. `?auto=N` loads the demo model and decodes N greedy tokens
// from a fixed prompt, then writes them to #tokens as JSON (the end-to-end test reads it).
import init, { Session } from "./pkg/kvdecode_web.js";

const $ = (id) => document.getElementById(id);
const DEMO_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8];
let session = null;

async function load() {
  $("status").textContent = "loading…";
  const which = document.querySelector("input[name=model]:checked").value;
  try {
    if (which === "gguf") {
      const f = $("file").files[0];
      if (!f) throw new Error("choose a .gguf file first");
      const bytes = new Uint8Array(await f.arrayBuffer());
      session = await Session.gguf(bytes, 2048);
    } else {
      session = await Session.demo(1024);
    }
    // the browser's own words for the adapter (wgpu may not see its name)
    let info = "";
    try {
      const a = await navigator.gpu.requestAdapter();
      const i = a.info ?? (await a.requestAdapterInfo?.());
      if (i) info = [i.vendor, i.architecture, i.description].filter(Boolean).join(" ");
    } catch (_) {}
    $("adapter").textContent = session.adapter() + (info ? ` [${info}]` : "");
    $("status").textContent = which === "gguf" ? "GGUF loaded" : "demo model loaded";
    $("run").disabled = false;
  } catch (e) {
    $("status").textContent = "error: " + e;
    throw e;
  }
}

async function generate(maxTokens, temperature) {
  const prompt = session.has_tokenizer() ? session.chat_prompt($("prompt").value) : DEMO_PROMPT;
  const out = [];
  $("out").textContent = "";
  const t0 = performance.now();
  let tok = await session.start(Uint32Array.from(prompt), temperature, 0);
  let t1 = performance.now();
  while (out.length < maxTokens) {
    if (session.is_stop(tok)) break;
    out.push(tok);
    $("out").textContent = session.decode(Uint32Array.from(out));
    $("count").textContent = String(out.length);
    if (out.length > 1) $("tps").textContent = ((out.length - 1) / ((performance.now() - t1) / 1000)).toFixed(1);
    if (out.length >= maxTokens) break;
    tok = await session.step(tok);
  }
  $("status").textContent = `done: prompt ${prompt.length} tokens in ${((t1 - t0) / 1000).toFixed(2)} s`;
  return out;
}

await init();
$("load").onclick = load;
$("run").onclick = () => generate(Number($("max").value), Number($("temp").value));

const auto = new URLSearchParams(location.search).get("auto");
if (auto) {
  try {
    await load();
    const toks = await generate(Number(auto), 0);
    $("tokens").textContent = JSON.stringify(toks);
  } catch (e) {
    $("tokens").textContent = JSON.stringify({ error: String(e) });
  }
  document.body.dataset.done = "1";
}
