"""A GRPO-style rollout on a mixture of experts, held to transformers: does the trainer see the
logprobs and the routes the rollout engine saw?

A prompt is prefilled once and forked into 4 rows; each row samples a turn at temperature 1
(its own seed), gets a tool result of 5 tokens, and samples a second turn. Then transformers
(fp32, eager attention, experts summed in its plain loop) teacher-forces every row's whole
sequence: its log-softmax at each sampled token against the engine's logprob, and the top-k
indices of every router against the engine's recorded routes (`record_routes=True`,
`Engine.routes`), at every token and MoE layer.

    python python/examples/moe_rollout_check.py [MODEL_DIR]             compare now (needs transformers)
    python python/examples/moe_rollout_check.py MODEL_DIR --write FILE  keep transformers' side as a fixture

With transformers (and torch) in the interpreter beside kvdecode it teacher-forces at once and
prints the mean and largest |logp difference| and the share of (token, layer) route decisions
that agree. `--write` keeps what transformers computed for the engine's sequences in a JSON file
(tests/fixtures/rollout/, made by scripts/fixtures/make_rollout_fixtures.sh), so that
`python/tests/test_engine.py` replays the rollout and holds it to that file in CI, where the
venv has no transformers (`check`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import kvdecode

ROOT = Path(__file__).resolve().parents[2]
ROWS, TURN, TOOL, SEEDS = 4, 12, 5, 3


def rollout(model_dir: Path, seed: int):
    """Each row's whole sequence, its sampled (position, token, logprob) and its routes."""
    model = kvdecode.load(model_dir)
    engine = kvdecode.Engine(model, rows=ROWS, max_len=128, record_routes=True)
    rng = np.random.default_rng(seed)
    vocab = engine.vocab
    prompt = rng.integers(1, vocab, 10)
    engine.append(prompt[None, :-1], rows=[0])
    engine.fork(0, list(range(1, ROWS)))
    samplers = [kvdecode.Sampler(temperature=1.0, seed=seed * 100 + r) for r in range(ROWS)]
    sampled = [[] for _ in range(ROWS)]  # (position, token, logprob)
    first = [int(prompt[-1])] * ROWS
    for turn in range(2):
        lens = engine.lens
        turns = engine.decode_turns(list(range(ROWS)), first, TURN, sampler=samplers)
        for r, t in enumerate(turns):
            # `first` sits at lens[r]; the j-th sampled token at lens[r] + 1 + j
            sampled[r] += [(lens[r] + 1 + j, tok, lp) for j, (tok, lp) in enumerate(zip(t.tokens, t.logprobs))]
        if turn == 0:
            # each row's last token and a tool result go in; the result's last token starts turn 2
            for r, t in enumerate(turns):
                tool = rng.integers(1, vocab, TOOL)
                ids = np.concatenate([[t.tokens[-1]], tool[:-1]])
                engine.append(ids[None, :], rows=[r])
                first[r] = int(tool[-1])
        else:
            last = [t.tokens[-1] for t in turns]
    seqs = [[int(t) for t in engine.history(r)] + [int(last[r])] for r in range(ROWS)]
    routes = [engine.routes(r) for r in range(ROWS)]
    return seqs, sampled, routes


def teacher_force(model_dir: Path, seqs):
    """transformers' log-softmax ([T, V], f64) and routers' top-k ([T, layers, k]) per sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    routers = [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    out = []
    with torch.no_grad():
        for seq in seqs:
            seen = []
            hooks = [r.register_forward_hook(lambda _m, _i, o: seen.append(o[2])) for r in routers]
            logits = model(torch.tensor([seq])).logits[0]
            for h in hooks:
                h.remove()
            logp = torch.log_softmax(logits.double(), dim=-1)
            out.append((logp.numpy(), torch.stack(seen, dim=1).numpy()))
    return out


def transformers_side(model_dir: Path) -> dict:
    """The rollouts of every seed with transformers' logprob at each sampled token and its routes:
    what `check` holds a later rollout to."""
    seeds = []
    for seed in range(SEEDS):
        seqs, sampled, _ = rollout(model_dir, seed)
        rows = []
        for r, (logp, hf_routes) in enumerate(teacher_force(model_dir, seqs)):
            rows.append({
                "tokens": seqs[r],
                "sampled": [[pos, int(tok)] for pos, tok, _ in sampled[r]],
                "logp": [float(logp[pos - 1, tok]) for pos, tok, _ in sampled[r]],
                # the last sampled token was never fed, so it has no routes
                "routes": hf_routes[: len(seqs[r]) - 1].astype(int).tolist(),
            })
        seeds.append(rows)
    return {"model": model_dir.name, "rows": ROWS, "turn": TURN, "tool": TOOL, "seeds": seeds}


def check(model_dir: Path, want: dict) -> dict:
    """Replay the rollouts and compare them with transformers' side (`transformers_side`): the
    sampled tokens must be the ones transformers scored (else the fixture is stale), then the
    |logp| differences and the route decisions that agree."""
    diffs, agree, decisions = [], 0, 0
    for seed, rows in enumerate(want["seeds"]):
        seqs, sampled, routes = rollout(model_dir, seed)
        for r, row in enumerate(rows):
            if seqs[r] != row["tokens"]:
                raise AssertionError(f"seed {seed} row {r}: the engine sampled other tokens than the fixture's "
                                     "(regenerate it with scripts/fixtures/make_rollout_fixtures.sh)")
            assert [[p, t] for p, t, _ in sampled[r]] == row["sampled"]
            diffs += [abs(lp - theirs) for (_, _, lp), theirs in zip(sampled[r], row["logp"])]
            theirs = np.array(row["routes"])
            ours = routes[r].reshape(theirs.shape)
            agree += int((ours == theirs).all(axis=-1).sum())
            decisions += theirs.shape[0] * theirs.shape[1]
    d = np.array(diffs)
    return {"tokens": len(d), "mean": float(d.mean()), "max": float(d.max()), "agree": agree, "decisions": decisions}


def main():
    args = sys.argv[1:]
    write = args[args.index("--write") + 1] if "--write" in args else None
    dirs = [a for a in args if a != "--write" and a != write]
    model_dir = Path(dirs[0]) if dirs else ROOT / "tests/fixtures/hf/qwen3_moe"
    side = transformers_side(model_dir)
    if write:
        Path(write).write_text(json.dumps(side, separators=(",", ":")) + "\n")
        print(f"written: {write}")
    s = check(model_dir, side)
    print(f"{model_dir.name}: {s['tokens']} sampled tokens over {SEEDS} seeds x {ROWS} rows (forks, a tool result, "
          "temperature 1)")
    print(f"|logp engine - transformers|: mean {s['mean']:.2e}, max {s['max']:.2e}")
    print(f"routes equal at {s['agree']} of {s['decisions']} (token, layer) decisions "
          f"({100 * s['agree'] / s['decisions']:.2f}%)")


if __name__ == "__main__":
    main()
