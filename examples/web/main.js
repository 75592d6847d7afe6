// The page: load a model into a kvdecode Session (wasm), decode token by token, show the text as
// it grows, tokens/s and the adapter. `?auto=N` loads the demo model and decodes N greedy tokens
// from a fixed prompt, then writes them to #tokens as JSON (the end-to-end test reads it);
// `&lose=K` destroys the GPU device after K tokens, and the answer must still come out whole.
import init, { Session } from "./pkg/kvdecode_web.js";

const $ = (id) => document.getElementById(id);
const DEMO_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8];
let session = null;

async function load() {
  $("status").textContent = "loading…";
  const which = document.querySelector("input[name=model]:checked").value;
  // the old session's GPU buffers go now, not whenever the garbage collector gets to them
  session?.free();
  session = null;
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

// A lost GPU device (a driver reset, the browser reclaiming a background tab's GPU) makes every
// later step an error saying "device lost": the page builds a new session and answers again.
const deviceLost = (e) => String(e).includes("device lost");

async function generate(maxTokens, temperature, loseAfter = -1) {
  try {
    return await decode(maxTokens, temperature, loseAfter);
  } catch (e) {
    if (!deviceLost(e)) {
      $("status").textContent = "error: " + e;
      throw e;
    }
    $("status").textContent = "GPU device lost: building a new session…";
    $("recovered").textContent = String(e);
    await load();
    return await decode(maxTokens, temperature, -1);
  }
}

// Decode up to maxTokens from the prompt; with loseAfter >= 0, destroy the device after that many
// tokens (the recovery test, ?lose=N).
async function decode(maxTokens, temperature, loseAfter) {
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
    if (out.length === loseAfter) session.lose_device();
    tok = await session.step(tok);
  }
  $("status").textContent = `done: prompt ${prompt.length} tokens in ${((t1 - t0) / 1000).toFixed(2)} s`;
  return out;
}

await init();
$("load").onclick = load;
$("run").onclick = () => generate(Number($("max").value), Number($("temp").value));

const params = new URLSearchParams(location.search);
const auto = params.get("auto");
if (auto) {
  try {
    await load();
    const toks = await generate(Number(auto), 0, Number(params.get("lose") ?? -1));
    $("tokens").textContent = JSON.stringify(toks);
  } catch (e) {
    $("tokens").textContent = JSON.stringify({ error: String(e) });
  }
  document.body.dataset.done = "1";
}
