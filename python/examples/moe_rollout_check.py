"""A GRPO-style rollout on a mixture of experts, held to transformers: does the trainer see the
logprobs and the routes the rollout engine saw?

A prompt is prefilled once and forked into 4 rows; each row samples a turn at temperature 1
(its own seed), gets a tool result of 5 tokens, and samples a second turn. Then transformers
(fp32, eager attention, experts summed in its plain loop) teacher-forces every row's whole
sequence: its log-softmax at each sampled token against the engine's logprob, and the top-k
indices of every router against the engine's recorded routes (`record_routes=True`,
`Engine.routes`), at every token and MoE layer.

    python python/examples/moe_rollout_check.py [MODEL_DIR]   (default: tests/fixtures/hf/qwen3_moe)

Needs kvdecode and transformers (with torch) in one interpreter; it runs in no CI stage (the
CI venvs have no transformers). Prints the mean and largest |logp difference| and the share of
(token, layer) route decisions that agree.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import kvdecode

ROOT = Path(__file__).resolve().parents[2]
ROWS, TURN, TOOL = 4, 12, 5


def rollout(model_dir: Path, seed: int):
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
    seqs = [engine.history(r) + [last[r]] for r in range(ROWS)]
    routes = [engine.routes(r) for r in range(ROWS)]
    return seqs, sampled, routes


@torch.no_grad()
def teacher_force(model_dir: Path, seqs):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    routers = [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    out = []
    for seq in seqs:
        seen = []
        hooks = [r.register_forward_hook(lambda _m, _i, o: seen.append(o[2])) for r in routers]
        logits = model(torch.tensor([seq])).logits[0]
        for h in hooks:
            h.remove()
        logp = torch.log_softmax(logits.double(), dim=-1)
        out.append((logp.numpy(), torch.stack(seen, dim=1).numpy()))  # [T, V], [T, layers, k]
    return out


def main():
    model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fixtures/hf/qwen3_moe"
    diffs, agree, decisions = [], 0, 0
    for seed in range(3):
        seqs, sampled, routes = rollout(model_dir, seed)
        for r, (logp, hf_routes) in enumerate(teacher_force(model_dir, seqs)):
            for pos, tok, lp in sampled[r]:
                diffs.append(abs(lp - logp[pos - 1, tok]))
            fed = len(seqs[r]) - 1  # the last sampled token was never fed
            ours = routes[r].reshape(fed, *hf_routes.shape[1:])
            agree += int((ours == hf_routes[:fed]).all(axis=-1).sum())
            decisions += fed * hf_routes.shape[1]
    d = np.array(diffs)
    print(f"{model_dir.name}: {len(d)} sampled tokens over 3 seeds x {ROWS} rows (forks, a tool result, temperature 1)")
    print(f"|logp engine - transformers|: mean {d.mean():.2e}, max {d.max():.2e}")
    print(f"routes equal at {agree} of {decisions} (token, layer) decisions ({100 * agree / decisions:.2f}%)")


if __name__ == "__main__":
    main()
