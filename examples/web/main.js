// The page: load a model into a kvdecode Session (wasm) with a progress bar, keep a picked GGUF in
// the browser's storage (OPFS), and chat in two conversations, each on its own cache row: a turn
// renders the whole conversation and the row prefills only what it does not hold yet; all
// conversations answering at that moment decode together, one batched step per token; Stop ends
// an answer. `?auto=N` loads the demo model and decodes N greedy tokens from a fixed prompt on row
// 0, then writes them to #tokens as JSON (the end-to-end test reads it); `&lose=K` destroys the
// GPU device after K tokens, and the answer must still come out whole; `&gguf=URL` takes the GGUF
// file at URL instead of the demo model (a file without a vocabulary: the prompt is those ids).
import init, { Session } from "./pkg/kvdecode_web.js";

const $ = (id) => document.getElementById(id);
const DEMO_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8];
const ROWS = 2;
const STORED = "model.gguf";
const params = new URLSearchParams(location.search);
let session = null;

// ---- the model: file or browser storage, with progress --------------------------------------

async function storage() {
  try {
    return await navigator.storage.getDirectory();
  } catch (_) {
    return null; // no OPFS (an old browser, a private window): the file is read each time
  }
}

async function showStored() {
  const dir = await storage();
  let file = null;
  try {
    file = dir && (await (await dir.getFileHandle(STORED)).getFile());
  } catch (_) {}
  $("stored-line").hidden = !file;
  if (file) {
    $("stored-name").textContent = `${localStorage.getItem("kvdecode-model-name") ?? STORED} (${(file.size / 1048576).toFixed(1)} MiB)`;
    if (!params.get("auto")) $("stored").checked = true;
  }
  return file;
}

async function keep(name, bytes) {
  const dir = await storage();
  if (!dir) return;
  try {
    const w = await (await dir.getFileHandle(STORED, { create: true })).createWritable();
    await w.write(bytes);
    await w.close();
    localStorage.setItem("kvdecode-model-name", name);
    await showStored();
  } catch (e) {
    console.log("could not keep the model in the browser's storage:", String(e));
  }
}

// The file's bytes, read in pieces so the progress bar moves.
async function readWithProgress(file) {
  const bar = $("progress");
  bar.hidden = false;
  bar.max = file.size;
  bar.value = 0;
  const bytes = new Uint8Array(file.size);
  const reader = file.stream().getReader();
  let at = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    bytes.set(value, at);
    at += value.length;
    bar.value = at;
    $("status").textContent = `reading ${(at / 1048576).toFixed(1)} of ${(file.size / 1048576).toFixed(1)} MiB…`;
  }
  return bytes;
}

async function load() {
  $("status").textContent = "loading…";
  const which = document.querySelector("input[name=model]:checked").value;
  // the old session's GPU buffers go now, not whenever the garbage collector gets to them
  session?.free();
  session = null;
  for (const c of convs) c.reset();
  const bar = $("progress");
  try {
    if (params.get("auto") && params.get("gguf")) {
      const bytes = new Uint8Array(await (await fetch(params.get("gguf"))).arrayBuffer());
      session = await Session.gguf(bytes, 2048, ROWS);
    } else if (which === "demo") {
      session = await Session.demo(1024, ROWS);
    } else {
      const f = which === "stored" ? await showStored() : $("file").files[0];
      if (!f) throw new Error(which === "stored" ? "nothing is kept in this browser" : "choose a .gguf file first");
      const bytes = await readWithProgress(f);
      bar.removeAttribute("value"); // indeterminate: parsing and uploading to the GPU
      $("status").textContent = "parsing and uploading to the GPU…";
      // keep a copy for the next visit (in the background: the model does not wait for it)
      if (which === "gguf") keep(f.name, bytes);
      // a LoRA adapter picked beside it goes over it, unmerged, on every row
      const lf = $("lora").files[0];
      session = lf
        ? await Session.gguf_with_lora(bytes, new Uint8Array(await lf.arrayBuffer()), 2048, ROWS)
        : await Session.gguf(bytes, 2048, ROWS);
    }
    // the browser's own words for the adapter (wgpu may not see its name)
    let info = "";
    try {
      const a = await navigator.gpu.requestAdapter();
      const i = a.info ?? (await a.requestAdapterInfo?.());
      if (i) info = [i.vendor, i.architecture, i.description].filter(Boolean).join(" ");
    } catch (_) {}
    $("adapter").textContent = session.adapter() + (info ? ` [${info}]` : "");
    $("status").textContent =
      which === "demo" ? "demo model loaded" : session.has_lora() ? "GGUF loaded, with its LoRA adapter" : "GGUF loaded";
    for (const c of convs) c.ready();
  } catch (e) {
    $("status").textContent = "error: " + e;
    throw e;
  } finally {
    bar.hidden = true;
  }
}

// ---- conversations, each on its own row ------------------------------------------------------

class Conversation {
  constructor(row, ids) {
    this.row = row;
    this.ids = ids; // element ids: prompt, run, stop, out, log
    this.reset();
    $(ids.run).onclick = () => this.send();
    $(ids.stop).onclick = () => { this.stopAsked = true; };
  }
  reset() {
    this.msgs = [];
    this.answering = false;
    $(this.ids.log).replaceChildren();
    $(this.ids.out).textContent = "";
  }
  ready() {
    $(this.ids.run).disabled = false;
    $(this.ids.stop).disabled = true;
  }
  send() {
    const text = $(this.ids.prompt).value.trim();
    if (!text || this.answering || !session) return;
    // the last answer moves up into the log; the new one streams below it
    if (this.msgs.length > 0) this.log("assistant", this.msgs[this.msgs.length - 1].content);
    this.msgs.push({ role: "user", content: text });
    this.log("user", text);
    $(this.ids.out).textContent = "";
    this.pending = true;
    this.answering = true;
    this.stopAsked = false;
    $(this.ids.run).disabled = true;
    $(this.ids.stop).disabled = false;
    pump();
  }
  log(role, text) {
    const m = document.createElement("div");
    m.className = `msg ${role}`;
    m.textContent = text;
    $(this.ids.log).append(m);
    $(this.ids.log).scrollTop = 1e9;
  }
  // the whole conversation in the model's template; the row keeps what it holds of it
  begin() {
    const ids = session.conversation_ids(JSON.stringify(this.msgs));
    const t0 = performance.now();
    this.kept = session.continue_row(this.row, Uint32Array.from(ids));
    this.promptLen = ids.length;
    this.next = ids[ids.length - 1];
    this.answer = [];
    this.t0 = t0;
    this.pending = false;
  }
  take(token, max) {
    const done = this.stopAsked || session.is_stop(token) || this.answer.length >= max;
    if (!done) {
      this.answer.push(token);
      this.next = token;
      $(this.ids.out).textContent = session.decode(Uint32Array.from(this.answer));
    }
    return done;
  }
  finish() {
    const text = session.decode(Uint32Array.from(this.answer));
    $(this.ids.out).textContent = text;
    this.msgs.push({ role: "assistant", content: text });
    this.answering = false;
    $(this.ids.run).disabled = false;
    $(this.ids.stop).disabled = true;
    const secs = (performance.now() - this.t0) / 1000;
    $("status").textContent = `done: conversation ${this.row + 1}, prompt ${this.promptLen} tokens (${this.kept} kept on its row, ` +
      `${this.promptLen - this.kept} prefilled), ${this.answer.length} answered in ${secs.toFixed(2)} s` +
      (this.stopAsked ? " (stopped)" : "");
  }
}

const convs = [
  new Conversation(0, { prompt: "prompt", run: "run", stop: "stop", out: "out", log: "log1" }),
  new Conversation(1, { prompt: "prompt2", run: "run2", stop: "stop2", out: "out2", log: "log2" }),
];

// One loop decodes every answering conversation together, one batched step per token; a turn
// that starts meanwhile joins at the next step.
let pumping = false;
async function pump() {
  if (pumping) return;
  pumping = true;
  let tokens = 0;
  const t1 = performance.now();
  try {
    for (;;) {
      for (const c of convs) if (c.pending) c.begin();
      const act = convs.filter((c) => c.answering);
      if (act.length === 0) break;
      $("batch").textContent = String(act.length);
      const got = await session.step_rows(
        Uint32Array.from(act.map((c) => c.row)), Uint32Array.from(act.map((c) => c.next)), Number($("temp").value), 0);
      tokens += act.length;
      $("count").textContent = String(tokens);
      $("tps").textContent = (tokens / ((performance.now() - t1) / 1000)).toFixed(1);
      const max = Number($("max").value);
      act.forEach((c, i) => { if (c.take(got[i], max)) c.finish(); });
    }
  } catch (e) {
    if (!deviceLost(e)) {
      $("status").textContent = "error: " + e;
      for (const c of convs) if (c.answering) c.finish();
      throw e;
    }
    // a new session: the conversations keep their messages; the rows start over
    $("status").textContent = "GPU device lost: building a new session…";
    $("recovered").textContent = String(e);
    const again = convs.filter((c) => c.answering).map((c) => c.row);
    const msgs = convs.map((c) => c.msgs);
    await load();
    convs.forEach((c, i) => { c.msgs = msgs[i]; });
    for (const r of again) { convs[r].answering = true; convs[r].pending = true; }
  } finally {
    pumping = false;
    $("batch").textContent = "0";
  }
  if (convs.some((c) => c.pending)) pump();
}

// ---- the end-to-end test's path: N greedy tokens on row 0 -----------------------------------

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

// Decode up to maxTokens from the fixed prompt on row 0; with loseAfter >= 0, destroy the device
// after that many tokens (the recovery test, ?lose=N).
async function decode(maxTokens, temperature, loseAfter) {
  const out = [];
  $("out").textContent = "";
  const t0 = performance.now();
  let tok = await session.start(Uint32Array.from(DEMO_PROMPT), temperature, 0);
  const t1 = performance.now();
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
  $("status").textContent = `done: prompt ${DEMO_PROMPT.length} tokens in ${((t1 - t0) / 1000).toFixed(2)} s`;
  return out;
}

await init();
$("load").onclick = load;
$("forget").onclick = async () => {
  const dir = await storage();
  await dir?.removeEntry(STORED).catch(() => {});
  localStorage.removeItem("kvdecode-model-name");
  $("stored-line").hidden = true;
  document.querySelector("input[value=demo]").checked = true;
};
await showStored();
// Load works from here on: the button stays disabled while the module initializes, so a click
// then is not lost (a test clicking at once waited 300 s for a load that never began)
$("load").disabled = false;

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
