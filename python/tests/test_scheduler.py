"""The scheduler from Python: streaming, groups, cancellation, batched equals alone, bad requests,
and the GIL released while the GPU works."""

import threading
import time

import numpy as np
import pytest

import kvdecode


@pytest.fixture(scope="module")
def demo():
    return kvdecode.Model.demo()


def alone(model, prompt, max_new, sampler, stop=()):
    """The request on its own engine, in the seed's calling pattern: prefill, then one token per
    step, stopping on a stop id (returned, not appended)."""
    e = kvdecode.Engine(model, rows=1, max_len=128)
    tok, _ = e.append_sample([prompt], sampler=sampler)
    out = [tok[0]]
    while len(out) < max_new and out[-1] not in stop:
        tok, _ = e.append_sample([[out[-1]]], sampler=sampler)
        out.append(tok[0])
    return out


def test_stream_and_batched_equals_alone(demo):
    seed = 2024
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, demo.vocab, size=int(rng.integers(3, 40))).tolist() for _ in range(5)]
    samplers = [kvdecode.Sampler(0.9, seed=i) for i in range(4)] + [kvdecode.Sampler()]
    stop = [5, 6, 7]
    engine = kvdecode.Engine(demo, rows=3, max_len=128)  # 5 requests on 3 rows: some wait
    sched = kvdecode.Scheduler(engine, prefill_chunk=7)
    ids = [sched.submit(p, max_new=12, stop=stop, sampler=s) for p, s in zip(prompts, samplers)]
    assert ids == list(range(5)) and sched.queued == 5
    streamed = {i: [] for i in ids}
    done = {}
    for ev in sched.stream():
        if isinstance(ev, kvdecode.Token):
            assert ev.id not in done, "no token after its completion"
            streamed[ev.id].append(ev.token)
        else:
            done[ev.id] = ev
    assert sorted(done) == ids and sched.active == 0 and sched.queued == 0
    for i in ids:
        c = done[i]
        assert c.tokens == streamed[i] and len(c.logprobs) == len(c.tokens)
        assert c.finish in ("stop", "length") and c.prompt_tokens == len(prompts[i])
        assert (c.finish == "stop") == (c.tokens[-1] in stop)
        assert c.tokens == alone(demo, prompts[i], 12, samplers[i], stop), f"request {i}"


def test_group_and_cancel(demo):
    engine = kvdecode.Engine(demo, rows=4, max_len=128)
    sched = kvdecode.Scheduler(engine)
    prompt = [9, 8, 7, 6, 5, 4]
    samplers = [kvdecode.Sampler(1.0, seed=s) for s in (10, 11, 12)]
    group = sched.submit_group(prompt, samplers, max_new=10)
    other = sched.submit([1, 2, 3], max_new=30)
    for _ in range(4):
        sched.step()
    cancelled = sched.cancel(other)
    assert cancelled.finish == "cancelled" and 0 < len(cancelled.tokens) < 30
    assert sched.cancel(other) is None
    got = {c.id: c for c in sched.run()}
    assert sorted(got) == group
    for i, s in zip(group, samplers):
        assert got[i].tokens == alone(demo, prompt, 10, s), f"group member {i}"
    assert len({tuple(got[i].tokens) for i in group}) > 1


def test_bad_requests_change_nothing(demo):
    engine = kvdecode.Engine(demo, rows=2, max_len=32)
    sched = kvdecode.Scheduler(engine)
    sched.submit([1, 2], max_new=4)
    for call, words in [
        (lambda: sched.submit([1, 2], max_new=0), "max_new"),
        (lambda: sched.submit([1] * 30, max_new=8), "max_len"),
        (lambda: sched.submit([], max_new=4), "empty"),
        (lambda: sched.submit([999], max_new=4), "vocabulary"),
        (lambda: sched.submit([1], max_new=4, sampler=kvdecode.Sampler(top_k=0, top_p=1.0, temperature=float("nan"))),
         "temperature"),
        (lambda: sched.submit_group([1], [kvdecode.Sampler()] * 3, max_new=4), "group of 3"),
    ]:
        with pytest.raises(kvdecode.InvalidInput) as info:
            call()
        assert words in str(info.value), f"{info.value} does not say {words!r}"
        assert sched.queued == 1
    assert [c.id for c in sched.run()] == [0]
    with pytest.raises(kvdecode.InvalidInput):
        kvdecode.Sampler(temperature=float("nan"))


def test_gil_released_while_the_gpu_works(demo):
    """Another Python thread keeps running while an append waits for the GPU: the longest pause
    it sees is a small part of the append (holding the GIL, it would pause for all of it)."""
    engine = kvdecode.Engine(demo, rows=2, max_len=256)
    ids = np.random.default_rng(1).integers(1, demo.vocab, size=(2, 200))
    span = {}

    def work():
        span["start"] = time.perf_counter()
        engine.append(ids)
        span["end"] = time.perf_counter()

    t = threading.Thread(target=work)
    last, longest = time.perf_counter(), 0.0
    t.start()
    while t.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    t.join()
    took = span["end"] - span["start"]
    print(f"append took {took * 1e3:.0f} ms; the main thread's longest pause {longest * 1e3:.1f} ms")
    assert took > 0.1, "the append is too short to tell"
    assert longest < took / 2, "the main thread was blocked while the GPU worked"


def test_tokens_and_completions_carry_the_weights_version():
    """A request in flight across `load_weights(..., in_flight="keep")`: its streamed tokens and
    its completion say which weights sampled each token."""
    old, new = kvdecode.Model.random(seed=5), kvdecode.Model.random(seed=6)
    engine = kvdecode.Engine(old, rows=2, max_len=64)
    sched = kvdecode.Scheduler(engine)
    sched.submit([3, 4, 5], max_new=8, sampler=kvdecode.Sampler(1.0, seed=3))
    streamed, done = [], []
    for _ in range(3):
        for ev in sched.step():
            (streamed if isinstance(ev, kvdecode.Token) else done).append(ev)
    assert engine.load_weights(new.state_dict(), in_flight="keep") == 1
    for ev in sched.stream():
        (streamed if isinstance(ev, kvdecode.Token) else done).append(ev)
    versions = [t.weights_version for t in streamed]
    assert done[0].weights_versions == versions and len(versions) == len(done[0].tokens)
    assert versions[0] == 0 and versions[-1] == 1, versions
