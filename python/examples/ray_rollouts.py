"""Multi-turn RL rollouts on a pool of Ray actors, each owning one kvdecode engine.

The driver splits GRPO groups (a prompt, k seeds) over the actors, each actor runs its groups as
episodes with tool calls (prompt prefilled once, forked into k rows, turns that stop on a stop id,
a tool result appended after each turn) and returns token ids and log-probabilities, and the
driver gathers them as an RL trainer would. Ray is the distributed part; kvdecode adds none.

Then the driver runs the same groups on one engine alone, batched differently, and checks that
every episode comes back identical: a row's draws depend only on its seed and tokens.

    python python/examples/ray_rollouts.py --actors 2                      # local Ray, demo model
    python python/examples/ray_rollouts.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf
    python python/examples/ray_rollouts.py --address auto --gpus-per-actor 1   # a real cluster
"""

import argparse
import time

import numpy as np
import ray

import kvdecode


def tool_answer(turn_tokens, vocab):
    """A stand-in tool: a few ids that depend on what the model said (as a tool's answer would)."""
    h = sum(turn_tokens) * 31 + len(turn_tokens)
    return [(h + 7 * k) % vocab for k in range(3)]


def run_groups(engine, groups, turns, max_new, stop, temperature):
    """Run GRPO groups (`{"id", "prompt", "seeds"}`) on `engine`, as many at once as its rows hold.
    Returns one episode per (group, seed): `{"group", "seed", "turns": [{"tokens", "logprobs"}]}`."""
    ro = kvdecode.Rollouts(engine)
    vocab, out, pending = engine.vocab, [], list(groups)
    while pending:
        # fill the rows with whole groups
        wave, used = [], 0
        while pending and used + len(pending[0]["seeds"]) <= engine.rows:
            g = pending.pop(0)
            wave.append((g, list(range(used, used + len(g["seeds"])))))
            used += len(g["seeds"])
        if not wave:
            raise ValueError(f"a group of {len(pending[0]['seeds'])} does not fit in {engine.rows} rows")
        for g, rows in wave:
            samplers = [kvdecode.Sampler(temperature, seed=s) for s in g["seeds"]]
            ro.start([rows[0]], [g["prompt"]], sampler=samplers[0])  # the prompt once ...
            if len(rows) > 1:
                ro.fork(rows[0], rows[1:], sampler=samplers[1:])  # ... shared by the group
        all_rows = [r for _, rows in wave for r in rows]
        for t in range(turns):
            got = ro.decode_turn(all_rows, max_new=max_new, stop=stop)
            if t + 1 < turns:
                ro.tool_result(all_rows, [tool_answer(x.tokens, vocab) for x in got])
        for g, rows in wave:
            for r, seed in zip(rows, g["seeds"]):
                ep = ro.finish(r)
                out.append({"group": g["id"], "seed": seed,
                            "turns": [{"tokens": x.tokens, "logprobs": x.logprobs} for x in ep]})
    return out


def load_model(path):
    return kvdecode.Model.demo() if path == "demo" else kvdecode.load(path)


@ray.remote
class RolloutWorker:
    """One engine per actor (one GPU per actor on a cluster: `num_gpus=1`)."""

    def __init__(self, model_path, rows, max_len):
        self.engine = kvdecode.Engine(load_model(model_path), rows=rows, max_len=max_len)
        self.device = kvdecode.device()

    def rollouts(self, groups, turns, max_new, stop, temperature):
        t0 = time.perf_counter()
        eps = run_groups(self.engine, groups, turns, max_new, stop, temperature)
        return eps, time.perf_counter() - t0, self.device


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="a GGUF file, HF directory, safetensors file, or demo")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="cache rows per actor")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--address", default=None, help="a Ray cluster (default: start a local one)")
    ap.add_argument("--gpus-per-actor", type=float, default=0, help="1 on a GPU cluster")
    args = ap.parse_args()

    model = load_model(args.model)
    tok = model.tokenizer
    rng = np.random.default_rng(0)
    if tok is not None:
        topics = ["primes", "the moon", "rivers", "chess", "bread", "magnets", "owls", "glass"]
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % 8]}."}],
                                           tokenize=True) for i in range(args.groups)]
        stop = tok.end_of_turn
    else:
        prompts = [rng.integers(1, model.vocab, size=int(rng.integers(5, 30))).tolist() for _ in range(args.groups)]
        stop = [1, 2]
    groups = [{"id": i, "prompt": p, "seeds": [1000 * i + k for k in range(args.group_size)]}
              for i, p in enumerate(prompts)]

    ray.init(address=args.address, num_cpus=None if args.address else max(args.actors, 2),
             include_dashboard=False, log_to_driver=False)
    workers = [RolloutWorker.options(num_gpus=args.gpus_per_actor, num_cpus=1).remote(args.model, args.rows,
                                                                                        args.max_len)
               for _ in range(args.actors)]
    t0 = time.perf_counter()
    shares = [groups[a::args.actors] for a in range(args.actors)]
    futures = [w.rollouts.remote(s, args.turns, args.max_new, stop, args.temperature) for w, s in zip(workers, shares)]
    results = ray.get(futures)
    wall = time.perf_counter() - t0
    episodes = sorted((e for eps, _, _ in results for e in eps), key=lambda e: (e["group"], e["seed"]))
    tokens = sum(len(t["tokens"]) for e in episodes for t in e["turns"])
    for a, (eps, secs, dev) in enumerate(results):
        print(f"actor {a}: {len(eps)} episodes in {secs:.2f} s on {dev}")
    print(f"ray: {len(episodes)} episodes, {tokens} decoded tokens in {wall:.2f} s with {args.actors} actors")
    ray.shutdown()

    # the same groups on one engine alone, batched differently (rows for all groups at once)
    alone = kvdecode.Engine(model, rows=args.groups * args.group_size, max_len=args.max_len)
    t0 = time.perf_counter()
    reference = sorted(run_groups(alone, groups, args.turns, args.max_new, stop, args.temperature),
                       key=lambda e: (e["group"], e["seed"]))
    print(f"one engine: {len(reference)} episodes in {time.perf_counter() - t0:.2f} s")
    diff = [(e["group"], e["seed"]) for e, r in zip(episodes, reference) if e != r]
    if len(reference) != len(episodes) or diff:
        raise SystemExit(f"episodes differ from the single engine's: {diff}")
    print(f"identical: all {len(episodes)} episodes (tokens and logprobs) equal the single engine's")
    e = episodes[0]
    shown = [tok.decode(t["tokens"]) if tok else t["tokens"] for t in e["turns"]]
    print(f"group {e['group']} seed {e['seed']}: {shown}")


if __name__ == "__main__":
    main()
