"""The Python package against kvdecode's CPU reference, the Rust API and itself (batched vs alone).

Random tests print their seed. Run with `bash scripts/test-python.sh` (builds the wheel first)."""

import gc
import json
import os
import subprocess
import tempfile
import sys
from pathlib import Path

import numpy as np
import pytest

import kvdecode

TOL = 1e-4  # engine vs reference, as in the Rust tests (f32 K/V)
ROOT = Path(__file__).resolve().parents[2]
# tiny random GGUF models the fuzzing seeds carry (scripts/fuzz-seeds makes them)
GGUF_Q4_1 = ROOT / "fuzz/seeds/gguf/llama-q4_1.gguf"
GGUF_CHATML = ROOT / "fuzz/seeds/gguf/llama-f32-chatml.gguf"


@pytest.fixture(scope="module")
def demo():
    return kvdecode.Model.demo()


def test_seed_calling_pattern_matches_reference(demo):
    """Right-padded chunks, sub-batches and resets, as the seed's training loop calls `append`;
    every row's logits equal the reference on that row's own token stream."""
    seed = int(os.environ.get("KVDECODE_SEED", "12345"))
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    rows, max_len = 3, 96
    engine = kvdecode.Engine(demo, rows=rows, max_len=max_len)
    streams = [[] for _ in range(rows)]
    checked = 0
    for step in range(10):
        if step == 6:  # reset one row mid-way: it starts over
            engine.reset([1])
            streams[1] = []
        sub = sorted(rng.choice(rows, size=int(rng.integers(1, rows + 1)), replace=False).tolist())
        n_new = [int(rng.integers(0, 9)) if max_len - len(streams[r]) > 8 else 0 for r in sub]
        if max(n_new) == 0:
            continue
        width = max(n_new)
        ids = np.zeros((len(sub), width), dtype=np.int64)  # right padding: zeros, never stored
        for i, (r, n) in enumerate(zip(sub, n_new)):
            toks = rng.integers(0, demo.vocab, size=n)
            ids[i, :n] = toks
            streams[r].extend(toks.tolist())
        logits = engine.append(ids, n_new, rows=sub if len(sub) < rows else None)
        assert logits.shape == (len(sub), demo.vocab) and logits.dtype == np.float32
        for i, (r, n) in enumerate(zip(sub, n_new)):
            if n == 0:
                assert np.isnan(logits[i]).all(), "rows that got no token are NaN"
                continue
            ref = demo.reference_logits(streams[r])[-1]
            diff = float(np.abs(ref - logits[i]).max())
            assert diff < TOL, f"step {step} row {r}: max |diff| {diff}"
            checked += 1
    assert engine.lens == [len(s) for s in streams]
    assert checked >= 5
    assert [engine.history(r) for r in range(rows)] == streams


def test_logits_bit_equal_to_rust_api(tmp_path):
    """The same appends through Python and through the Rust API (`examples/logits.rs`, built by
    scripts/test-python.sh) give the same bits, on a quantized GGUF model."""
    binary = Path(os.environ.get("KVDECODE_LOGITS_BIN", ROOT / "target/release/examples/logits"))
    assert binary.exists(), f"{binary} is missing: cargo build --release --example logits"
    model_path = str(GGUF_Q4_1)
    model = kvdecode.load(model_path)
    tokens = np.random.default_rng(5).integers(0, model.vocab, size=14)
    prefill = 9
    np.save(tmp_path / "tokens.npy", tokens)
    subprocess.run([binary, "--model", model_path, "--tokens", str(tmp_path / "tokens.npy"), "--prefill",
                    str(prefill), "--out", str(tmp_path / "rust.npy")], check=True)
    rust = np.load(tmp_path / "rust.npy")
    engine = kvdecode.Engine(model, rows=1, max_len=64)
    ours = [engine.append(tokens[:prefill])[0]]
    for t in tokens[prefill:]:
        ours.append(engine.append([[t]])[0])
    ours = np.stack(ours)
    assert rust.shape == ours.shape
    assert np.array_equal(rust.view(np.uint32), ours.view(np.uint32)), "logits differ in some bit"
    # a misspelt flag is an error that names it, not ignored (the example took any flag before)
    bad = subprocess.run([binary, "--model", model_path, "--token", "x.npy"], capture_output=True, text=True)
    assert bad.returncode != 0 and 'unknown argument "--token"' in bad.stderr, bad.stderr


def test_batched_equals_alone_bitwise(demo):
    """A row's logits never depend on what else is in the batch or how it was chunked."""
    toks = [7, 300, 12, 99, 5, 41, 17, 250, 3, 8, 60]
    alone = kvdecode.Engine(demo, rows=1, max_len=64)
    a = alone.append(toks)[0]
    batched = kvdecode.Engine(demo, rows=3, max_len=64)
    ids = np.zeros((3, 6), dtype=np.int64)
    ids[0, :5] = toks[:5]
    ids[1, :6] = [1, 2, 3, 4, 5, 6]
    ids[2, :2] = [9, 9]
    batched.append(ids, [5, 6, 2])
    b = batched.append(np.array([toks[5:], [7] * 6, [0] * 6]), [6, 6, 0])[0]
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


class DLPackOnly:
    """What a CPU torch tensor offers besides `__array__`: the DLPack protocol, here alone."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayLike:
    """Anything with `__array__` (pandas, CPU torch tensors, xarray ...)."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.tolist(),
        lambda t: t.astype(np.int32),
        lambda t: t.astype(np.uint16),
        lambda t: np.asfortranarray(t),
        lambda t: np.repeat(t, 2, axis=-1)[..., ::2],  # strided, not contiguous
        ArrayLike,
        DLPackOnly,
    ],
    ids=["list", "int32", "uint16", "fortran", "view", "__array__", "dlpack"],
)
def test_array_inputs(demo, make):
    ids = np.array([[5, 6, 7], [9, 10, 0]], dtype=np.int64)
    want = kvdecode.Engine(demo, rows=2, max_len=16).append(ids, [3, 2])
    got = kvdecode.Engine(demo, rows=2, max_len=16).append(make(ids), make(np.array([3, 2])))
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_logits_are_not_copied(demo):
    """The returned array views the buffer the engine read back into (numpy does not own it:
    its base keeps the Rust allocation alive)."""
    out = kvdecode.Engine(demo, rows=1, max_len=8).append([1, 2])
    assert not out.flags["OWNDATA"] and out.base is not None and out.flags["C_CONTIGUOUS"]


def bad_calls(e):
    return [
        (kvdecode.InvalidInput, "outside the vocabulary", lambda: e.append([[600]], rows=[1])),
        (kvdecode.InvalidInput, "ids[0] = -1 is not a token id", lambda: e.append([[-1]], rows=[0])),
        (kvdecode.InvalidInput, "rows", lambda: e.append([[1]], rows=[5])),
        (kvdecode.InvalidInput, "n_new", lambda: e.append([[1, 2]], [1, 1], rows=[0])),
        (kvdecode.InvalidInput, "chunk rows", lambda: e.append([[1]])),
        (kvdecode.InvalidInput, "integers", lambda: e.append([[1.5]], rows=[0])),
        (kvdecode.InvalidInput, "2-D", lambda: e.append(np.zeros((1, 1, 1), dtype=np.int64))),
        (kvdecode.InvalidInput, "ids: cannot read", lambda: e.append([[1], [2, 3]])),  # ragged
        (kvdecode.CacheFull, "max_len 16", lambda: e.append(np.ones((1, 20), dtype=np.int64), rows=[1])),
        (kvdecode.InvalidInput, "roll back", lambda: e.rollback([0], [9])),
        (kvdecode.InvalidInput, "samplers for", lambda: e.append_sample([[1], [2]], sampler=[kvdecode.Sampler()])),
        (kvdecode.InvalidInput, "steps", lambda: e.decode_steps([0], [1], 50)),
        (kvdecode.InvalidInput, "history: row 2 is outside the cache (2 rows)", lambda: e.history(2)),
        (kvdecode.InvalidInput, "max_rollback: row 9", lambda: e.max_rollback(9)),
        (kvdecode.InvalidInput, "max_new", lambda: e.decode_turns([0, 1], [1, 1], [3])),
    ]


def test_bad_input_raises_and_changes_nothing(demo):
    e = kvdecode.Engine(demo, rows=2, max_len=16)
    e.append([[1, 2, 3], [4, 5, 0]], [3, 2])
    before = (e.lens, e.history(0), e.history(1))
    for cls, words, call in bad_calls(e):
        with pytest.raises(cls) as info:
            call()
        assert words in str(info.value), f"{cls.__name__}: {info.value!r} does not say {words!r}"
        assert isinstance(info.value, kvdecode.Error)
        assert (e.lens, e.history(0), e.history(1)) == before, f"state changed by: {info.value}"
    with pytest.raises(kvdecode.InvalidInput, match="top_p"):
        kvdecode.Sampler(top_p=2.0)
    with pytest.raises(kvdecode.InvalidInput, match="min_p 1.5 must be in"):
        kvdecode.Sampler(0.9, min_p=1.5)
    with pytest.raises(kvdecode.InvalidInput, match="expected raw, scaled or processed"):
        kvdecode.Sampler(0.9, logprobs="cooked")
    with pytest.raises(kvdecode.InvalidInput, match="K/V type \"f8\""):
        kvdecode.Engine(demo, rows=1, max_len=8, kv="f8")
    with pytest.raises(kvdecode.ModelFileError):
        kvdecode.load(os.devnull)
    # the engine still works after all of it
    assert e.append([[6], [7]]).shape == (2, demo.vocab)


def test_fork_rollback_decode(demo):
    e = kvdecode.Engine(demo, rows=3, max_len=64, rollback=4)
    e.append([3, 4, 5, 6], rows=[0])
    e.fork(0, [1, 2])
    assert e.lens == [4, 4, 4] and e.history(2) == [3, 4, 5, 6]
    ids, lps = e.decode_steps([0, 1, 2], [7, 7, 7], 3, sampler=kvdecode.Sampler(0.9, seed=11))
    assert ids.shape == (3, 3) and lps.shape == (3, 3) and (lps <= 0).all()
    assert (ids[0] == ids[1]).all() and (ids[1] == ids[2]).all(), "same seed, same prefix: same draws"
    e.rollback([1], [2])
    assert e.lens == [7, 5, 7]
    # the rolled-back row decodes the same tokens again
    again, _ = e.decode_steps([1], [int(ids[1, 0])], 2, sampler=kvdecode.Sampler(0.9, seed=11))
    assert again[0].tolist() == ids[1, 1:].tolist()
    turns = e.decode_turns([0, 2], [int(ids[0, 2]), int(ids[2, 2])], max_new=[5, 2], stop=[[], []])
    assert [len(t) for t in turns] == [5, 2] and not turns[0].stopped
    e.reset()
    assert e.lens == [0, 0, 0]


def test_logprob_modes(demo):
    """The mode changes what is reported, not what is drawn: top-k 1 keeps one token, whose
    processed logprob is 0, while the scaled one is below it."""
    e = kvdecode.Engine(demo, rows=2, max_len=32)
    e.append([[3, 4, 5], [3, 4, 5]])
    s = dict(temperature=0.9, seed=4, top_k=1)
    ids, lps = e.decode_steps([0, 1], [7, 7], 3, sampler=[kvdecode.Sampler(**s), kvdecode.Sampler(**s, logprobs="processed")])
    assert ids[0].tolist() == ids[1].tolist()
    assert (lps[1] == 0).all() and (lps[0] < 0).all(), lps
    assert kvdecode.Sampler(0.5, min_p=0.1, logprobs="raw").logprobs == "raw"
    # prompt logprobs: a sequence scored in one append gets the logprobs its tokens were drawn with
    e.reset()
    sampler = kvdecode.Sampler(0.8, seed=2, top_k=8, logprobs="processed")
    prompt, drawn, lps = [3, 4, 5], [], []
    tok, lp = e.append_sample([prompt], rows=[0], sampler=sampler)
    for _ in range(5):
        drawn.append(tok[0])
        lps.append(lp[0])
        tok, lp = e.append_sample([[tok[0]]], rows=[0], sampler=sampler)
    scored = e.score([prompt + drawn], rows=[1], sampler=sampler, top=2)
    logprobs, kept, top = scored[0]
    assert len(logprobs) == len(prompt + drawn) - 1 and all(1 <= k <= 8 for k in kept)
    assert logprobs[len(prompt) - 1:] == lps, (logprobs, lps)
    assert all(len(t) == 2 for t in top)


def test_rollouts_with_forks_and_tool_results(demo):
    """GRPO-style: one prompt forked into 3 rows with different seeds, a tool result, a second
    turn. The same episodes come back when each row runs alone on a fresh engine."""
    prompt = [10, 11, 12, 13, 14]
    tool = [[40, 41], [42], [43, 44, 45]]
    samplers = [kvdecode.Sampler(0.8, seed=s) for s in (1, 2, 3)]
    stop = [17, 99]

    e = kvdecode.Engine(demo, rows=3, max_len=64)
    ro = kvdecode.Rollouts(e)
    ro.start([0], [prompt], sampler=samplers[0])
    ro.fork(0, [1, 2], sampler=samplers[1:])
    first = ro.decode_turn([0, 1, 2], max_new=6, stop=stop)
    ro.tool_result([0, 1, 2], tool)
    second = ro.decode_turn([0, 1, 2], max_new=[4, 5, 6], stop=stop)
    assert ro.episode(1) is not None and len(ro.episode(1)) == 2
    batched = [ro.finish(r) for r in range(3)]
    assert ro.episode(0) is None
    assert len({tuple(t.tokens) for t in first}) > 1, "different seeds drew different turns"

    for r in range(3):
        alone = kvdecode.Engine(demo, rows=1, max_len=64)
        ra = kvdecode.Rollouts(alone)
        ra.start([0], [prompt], sampler=samplers[r])
        t1 = ra.decode_turn([0], max_new=6, stop=stop)[0]
        ra.tool_result([0], [tool[r]])
        t2 = ra.decode_turn([0], max_new=[4, 5, 6][r], stop=stop)[0]
        assert (t1.tokens, t2.tokens) == (batched[r][0].tokens, batched[r][1].tokens), f"row {r}"
        assert (t1.logprobs, t2.logprobs) == (batched[r][0].logprobs, batched[r][1].logprobs), f"row {r}"
        assert first[r].tokens == t1.tokens and second[r].tokens == t2.tokens


def test_no_leak_over_many_engines(demo):
    """Engines give their GPU buffers back when collected, and host memory stays flat."""

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    gc.collect()  # engines of earlier tests
    base_gpu = kvdecode.device_memory()[0]
    for _ in range(5):  # warm-up: allocator pools, pipeline caches
        kvdecode.Engine(demo, rows=2, max_len=64).append([1, 2, 3], rows=[1])
    gc.collect()
    start = rss()
    for i in range(40):
        e = kvdecode.Engine(demo, rows=2, max_len=64)
        e.append([1, 2, 3], rows=[1])
        assert kvdecode.device_memory()[0] > base_gpu
        del e
        gc.collect()
        assert kvdecode.device_memory()[0] == base_gpu, f"engine {i} left buffers behind"
    grown = rss() - start
    print(f"RSS grew {grown / 2**20:.1f} MiB over 40 engines")
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 40 engines"


def test_tokenizer_and_chat_template():
    model = kvdecode.load(GGUF_CHATML)
    tok = model.tokenizer
    assert tok is not None and tok.vocab_size == model.vocab
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(text)
    assert tok.token_id("<|im_end|>") in tok.end_of_turn
    with pytest.raises(kvdecode.InvalidInput, match="messages"):
        tok.apply_chat_template([{"role": "user", "content": object()}])
    with pytest.raises(kvdecode.InvalidInput, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_random_model_sizes_are_checked_before_allocating():
    with pytest.raises(kvdecode.InvalidInput, match="random model of about"):
        kvdecode.Model.random(vocab=10**6, d_model=4096)
    with pytest.raises(kvdecode.ModelFileError, match="larger than"):
        kvdecode.Model.random(d_model=2**40)
    with pytest.raises(kvdecode.ModelFileError, match="layers"):
        kvdecode.Model.random(layers=10**6)
    with pytest.raises(OverflowError):
        kvdecode.Model.random(vocab=-5)


def test_model_and_module_surface(demo):
    cfg = demo.config
    assert cfg["vocab"] == 512 and len(cfg["layers"]) == 6
    assert demo.tokenizer is None
    assert "Vulkan" in kvdecode.device() or "Gl" in kvdecode.device() or "GL" in kvdecode.device()
    e = kvdecode.Engine(demo, rows=2, max_len=256, kv="f16")
    assert e.kv == "f16" and e.rows == 2 and e.max_len == 256 and e.nbytes < e.naive_nbytes
    small = kvdecode.Model.random(vocab=64, layers=2, seed=3)
    assert small.vocab == 64 and small.reference_logits([1, 2]).shape == (2, 64)


def test_threads_create_engines_at_once():
    """In a fresh process (no device yet), threads making engines at once share one device and
    finish (the device is made with the GIL released and no lock held across it)."""
    code = """
import threading, kvdecode
model = kvdecode.Model.demo()
out = []
def work(i):
    e = kvdecode.Engine(model, rows=1, max_len=16)
    out.append(e.append([[1 + i, 2, 3]]).shape)
threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(len(out), kvdecode.device_memory()[0] >= 0)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["4", "True"]


def test_paged_kv_forks_share_blocks_and_the_prompt_cache_hits(demo):
    """Forks share the prompt's global K/V blocks; a pool too small is OutOfBlocks (a CacheFull)
    that changes nothing; on a Llama-layout model a later sequence reuses cached blocks and
    gets the logits it would have computed."""
    e = kvdecode.Engine(demo, rows=4, max_len=128, block_len=16)
    prompt = list(range(1, 41))
    e.append(prompt, rows=[0])
    e.fork(0, [1, 2, 3])
    u = e.block_usage()
    assert (u["used"], u["shared"], u["referenced"]) == (3, 3, 12), u
    assert e.used_nbytes < e.nbytes
    e.reset()
    assert e.block_usage()["used"] == 0

    small = kvdecode.Engine(demo, rows=2, max_len=64, block_len=16, pool_blocks=4)
    small.append(prompt, rows=[0])
    with pytest.raises(kvdecode.OutOfBlocks, match="row 1"):
        small.append(prompt, rows=[1])
    assert small.lens == [40, 0]

    llama = kvdecode.load(GGUF_CHATML)
    a = kvdecode.Engine(llama, rows=2, max_len=96)
    b = kvdecode.Engine(llama, rows=1, max_len=96, prompt_cache=False)
    system = [(7 * i + 3) % 50 + 1 for i in range(40)]
    a.append(system, rows=[0])
    a.reset([0])
    mine = system + [5, 6, 7]
    n = a.reuse_prefix(1, mine)
    assert n == 32
    got = a.append(mine[n:], rows=[1])
    want = b.append(mine, rows=[0])
    assert np.array_equal(got, want), "a prompt-cache hit changed the logits"
    lookups, looked_up, found, _ = a.prompt_cache_stats()
    assert (lookups, found) == (1, 32) and looked_up == len(mine)


def test_load_weights_recompute_equals_a_fresh_engine_and_versions_rise():
    """Weights pushed in by name (a state_dict of numpy arrays, f32 and f16): after a recompute
    the logits equal a fresh engine's of the new model, bit for bit; a bad tensor changes nothing."""
    old, new = kvdecode.Model.random(seed=3), kvdecode.Model.random(seed=4)
    tokens = np.arange(2, 14, dtype=np.int64).reshape(2, 6)
    engine = kvdecode.Engine(old, rows=2, max_len=32)
    engine.append(tokens)
    assert engine.weights_version == 0
    bad = dict(new.state_dict())
    name = next(iter(bad))
    bad[name] = bad[name][:-1]
    with pytest.raises(kvdecode.ModelFileError, match=name):
        engine.load_weights(bad, in_flight="recompute")
    assert engine.weights_version == 0
    assert engine.load_weights(new.state_dict().items(), in_flight="recompute") == 1
    fresh = kvdecode.Engine(new, rows=2, max_len=32)
    fresh.append(tokens)
    nxt = np.array([[3], [4]])
    assert np.array_equal(engine.append(nxt), fresh.append(nxt))
    # 16-bit host data is taken too; every turn says which version sampled it
    half = {k: v.astype(np.float16) for k, v in old.state_dict().items()}
    assert engine.load_weights(half) == 2
    turns = engine.decode_turns([0, 1], [5, 6], max_new=3)
    assert [t.weights_version for t in turns] == [2, 2]


def test_sleep_and_wake_are_exact(demo):
    engine = kvdecode.Engine(demo, rows=2, max_len=64)
    twin = kvdecode.Engine(demo, rows=2, max_len=64)
    ids = np.arange(1, 21, dtype=np.int64).reshape(2, 10)
    engine.append(ids)
    twin.append(ids)
    before = engine.memory_report()
    engine.sleep()
    asleep = engine.memory_report()
    print(f"memory: {before} -> {asleep}")
    assert engine.asleep == (True, True)
    assert asleep["engine"] < before["engine"]
    with pytest.raises(kvdecode.InvalidInput, match="asleep"):
        engine.append(ids[:, :1])
    engine.wake()
    assert engine.memory_report()["engine"] == before["engine"]
    nxt = np.array([[7], [8]])
    assert np.array_equal(engine.append(nxt), twin.append(nxt))


MOE_FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("family", ["qwen2", "llama3", "mistral", "smollm3", "gemma2", "olmo2", "phi3"] + MOE_FAMILIES)
def test_hugging_face_families_match_transformers(family):
    """Each newer family's fixture directory (tests/fixtures/hf, made by transformers) loads through
    the Python package and reproduces transformers' logits: the last of a 300-token prompt in one
    append, then a prefill of 16 and single tokens for 8 more positions. A mixture of experts
    also returns the experts transformers routed every token to."""
    d = ROOT / "tests/fixtures/hf" / family
    model = kvdecode.load(d)
    tokens = np.load(d / "tokens.npy")[0]
    want = np.load(d / "logits_full.npy")[0]
    moe = family in MOE_FAMILIES
    engine = kvdecode.Engine(model, rows=1, max_len=320, record_routes=moe)
    last = engine.append(tokens[None, :])[0]
    assert np.abs(last - want[-1]).max() <= 1e-4
    if moe:
        want_routes = np.load(d / "routes.npy")
        assert np.array_equal(engine.routes(0), want_routes)
        # through the scheduler: the prompt's routes are transformers' (causal: what came later
        # changes nothing before it), one entry per fed token
        engine.reset()
        sched = kvdecode.Scheduler(engine)
        sched.submit(tokens[:20], max_new=4, return_routes=True)
        (done,) = sched.run()
        routes = np.array(done.routes).reshape(-1, *engine.route_shape)
        assert routes.shape[0] == 20 + 4 - 1
        assert np.array_equal(routes[:20], want_routes[:20])
    engine.reset()
    got = [engine.append(tokens[None, :16])[0]] + [engine.append([[t]])[0] for t in tokens[16:24]]
    assert np.abs(np.stack(got) - want[15:24]).max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_moe_rollout_matches_transformers(family):
    """#35's RL bar: a GRPO-style rollout (a prompt forked into 4 rows, a turn at temperature 1, a
    tool result, a second turn; 3 seeds) on a tiny mixture of experts, held to transformers'
    teacher-forced fp32 log-softmax at every sampled token and its routers' top-k at every fed
    token and MoE layer (tests/fixtures/rollout, scripts/fixtures/make_rollout_fixtures.sh). The
    only test of logprobs and routes through forks, decode_turns and a tool result's append
    against an independent implementation; the rows' tokens must also be the fixture's, so the
    engine's seeded sampling is checked to be reproducible."""
    sys.path.insert(0, str(ROOT / "python/examples"))
    from moe_rollout_check import check

    want = json.loads((ROOT / "tests/fixtures/rollout" / f"{family}.json").read_text())
    got = check(ROOT / "tests/fixtures/hf" / family, want)
    print(got)
    assert got["mean"] <= 1e-5, got
    assert got["agree"] >= 0.999 * got["decisions"], got


def _safetensors(path):
    """A safetensors file's f32 tensors by name (the format: a length, a JSON header, the data)."""
    import json
    import struct

    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        assert h["dtype"] == "F32"
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(h["shape"])
    return out


def test_lora_from_a_folder_or_a_state_dict_and_pushed_by_a_trainer():
    """A PEFT adapter loads from its folder or as a state dict with its config, both giving PEFT's
    logits (the fixtures of tests/lora.rs); a scheduler's requests pick it by name beside the base
    model; `update_lora` pushes new tensors and the adapter's version rises."""
    import json

    d = ROOT / "tests/fixtures/lora/llama-r8"
    model = kvdecode.load(ROOT / "tests/fixtures/hf/llama")
    tokens = np.load(d / "tokens.npy").reshape(-1)[:48]
    want = np.load(d / "logits.npy").reshape(len(np.load(d / "tokens.npy").reshape(-1)), -1)[47]
    engine = kvdecode.Engine(model, rows=3, max_len=64, max_loras=2)
    engine.load_lora("dir", d)
    state = _safetensors(d / "adapter_model.safetensors")
    config = json.loads((d / "adapter_config.json").read_text())
    engine.load_lora("dict", state, config=config)
    assert engine.loras == [("dir", 0), ("dict", 0)]
    with pytest.raises(kvdecode.Error, match="max_loras"):
        engine.load_lora("third", d)
    engine.set_adapter(0, "dir")
    engine.set_adapter(1, "dict")
    got = engine.append(np.stack([tokens, tokens, tokens]))
    assert np.abs(got[0] - want).max() <= 1e-4
    assert np.array_equal(got[0], got[1])
    assert np.abs(got[2] - want).max() > 0.1, "row 2 is on the base model"
    assert engine.adapter(1) == ("dict", 0)
    # the Rust API's `logits --lora` (examples/logits.rs) gives the same bits
    binary = Path(os.environ.get("KVDECODE_LOGITS_BIN", ROOT / "target/release/examples/logits"))
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", tokens)
        subprocess.run([binary, "--model", str(ROOT / "tests/fixtures/hf/llama"), "--tokens", str(Path(tmp) / "tokens.npy"),
                        "--lora", str(d), "--out", str(Path(tmp) / "rust.npy")], check=True)
        rust = np.load(Path(tmp) / "rust.npy")
    assert np.array_equal(rust[0].view(np.uint32), got[0].view(np.uint32))
    # the scheduler: requests name their adapter; the base model's request has none
    engine.reset()
    sched = kvdecode.Scheduler(engine)
    ids = [sched.submit(tokens[:20], max_new=4, adapter=a) for a in ("dir", None, "dict")]
    done = {c.id: c for c in sched.run()}
    assert done[ids[0]].tokens == done[ids[2]].tokens
    assert done[ids[0]].adapter_versions == [0] * 4 and done[ids[1]].adapter_versions == []
    # a trainer's push: every B of block 0 scaled; the version rises and the logits move
    pushed = {k: v * 2 for k, v in state.items() if "layers.0." in k and "lora_B" in k}
    assert engine.update_lora("dict", pushed) == 1
    engine.reset()  # back on the base model: each row names its adapter again
    engine.set_adapter(0, "dir")
    engine.set_adapter(1, "dict")
    again = engine.append(np.stack([tokens, tokens, tokens]))
    assert np.array_equal(again[0], got[0]) and not np.array_equal(again[1], got[1])
    with pytest.raises(kvdecode.Error, match="not finite"):
        engine.update_lora("dict", {k: v * np.nan for k, v in pushed.items()})
    assert engine.loras == [("dir", 0), ("dict", 1)]
    # adapters held in f16: their rounding moves the logits by about 4e-4 from PEFT's f32 ones
    # (tests/lora.rs holds them to the reference of their rounded values); an unknown dtype is
    # named
    half = kvdecode.Engine(model, rows=1, max_len=64, max_loras=1, lora_dtype="f16")
    half.load_lora("dir", d)
    half.set_adapter(0, "dir")
    moved = np.abs(half.append(tokens[None])[0] - want).max()
    assert 0 < moved <= 2e-3, moved
    with pytest.raises(kvdecode.InvalidInput, match="lora_dtype"):
        kvdecode.Engine(model, rows=1, max_len=64, max_loras=1, lora_dtype="bf16")
