"""GRPO that learns: a small Llama-shaped PyTorch policy learns to reverse a string of digits,
with kvdecode running the rollouts and taking the new weights after every optimizer step.

Each step:
  1. kvdecode runs the rollouts in GRPO groups: each prompt prefilled once and forked into
     ``--group`` rows, sampled at ``--temperature`` with per-token log-probabilities;
  2. PyTorch scores them (reward: the share of digits in the right place), computes the GRPO loss
     (group-normalised advantages times the log-probabilities, teacher-forced) and takes an Adam
     step; the same forward gives the trainer's log-probabilities of the sampled tokens, so the
     training-inference mismatch |logp_engine - logp_trainer| is measured on every token;
  3. ``engine.load_weights(policy.state_dict())`` pushes the new weights in, by their Hugging Face
     names, and the next step samples from them (every turn reports its weights version).

With ``--lora RANK`` the trainer trains a PEFT LoRA on every linear layer of a frozen base (five
times as wide, so that the adapter is a small part of the model, and first taught the task for
``--sft`` supervised steps, so that RL starts from a model that half knows it, as LoRA RL starts
from a pretrained model), the engine applies the adapter unmerged, and each
step pushes only the adapter's tensors: ``engine.update_lora(name, get_peft_model_state_dict(...))``
(every turn reports the adapter's version). It prints the adapter's bytes and sync time per step,
and at the end a full-model sync of the same engine beside them. ``--experiments N`` runs N GRPO
experiments on one engine, each its own adapter, seed and prompts, their rows mixed in every
rollout batch.

It prints per step the mean reward, rollout tokens/s, weight-sync ms and the mismatch (mean and
max), and writes a PNG of reward and mismatch per step (matplotlib).

    python python/examples/grpo.py                      # f32 weights and K/V: exact mismatch
    python python/examples/grpo.py --dtype bf16         # 16-bit engine, f32 trainer
    python python/examples/grpo.py --ray 2              # rollouts on 2 Ray actors
    python python/examples/grpo.py --lora 8             # a rank-8 LoRA, only the adapter pushed
    python python/examples/grpo.py --lora 8 --experiments 3   # three adapters on one engine
    python python/examples/grpo.py --steps 40 --check   # what the tests run

With ``--ray N`` the groups are split over N Ray actors that each own an engine and get the
weights through Ray's object store; on the first step the driver also runs every group on an
engine of its own and checks that the episodes are identical.
"""

import argparse
import copy
import json
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import kvdecode

DIGITS, EQ, EOS, BOS, VOCAB = 10, 10, 11, 12, 16


class Attention(torch.nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


def rope(x, cos, sin):
    """Rotate halves (Hugging Face's `rotate_half` layout, as kvdecode rotates)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Mlp(torch.nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, ffn, bias=False)
        self.up_proj = torch.nn.Linear(d, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                                   c["head_dim"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = Mlp(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Policy(torch.nn.Module):
    """A Llama (Hugging Face names: `model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02 if p.shape[0] != c["vocab_size"] else 0.1)

    def forward(self, ids):
        t, hd = ids.shape[1], self.c["head_dim"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
        cos, sin = [torch.cat([f(ang), f(ang)], -1).float() for f in (torch.cos, torch.sin)]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def config(args):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": args.d_model, "intermediate_size": 2 * args.d_model, "num_hidden_layers": args.layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.d_model // 4,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def save_hf(policy, path, dtype):
    """A Hugging Face directory kvdecode loads (config.json + model.safetensors), its tensors in
    `dtype`: kvdecode keeps 16-bit weights 16-bit on the GPU, and later updates are stored so."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(policy.c, f)
    t = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    save_file({k: v.detach().to(t).contiguous() for k, v in policy.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def make_engine(model_dir, rows, dtype, loras=0, rank=0):
    # weights as the directory holds them (f32, f16 or bf16), K/V in the same type; `loras`
    # adapter slots of rank `rank`
    return kvdecode.Engine(kvdecode.load(model_dir), rows=rows, max_len=32, kv=dtype, prompt_cache=False,
                           max_loras=loras, max_lora_rank=max(rank, 1))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_state(model):
    """A PEFT model's adapter tensors by PEFT's names (what a LoRA trainer pushes)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def run_groups(engine, groups, n_digits, temperature):
    """Each group: its prompt prefilled once (on the group's adapter, if it names one) and forked
    into one row per seed; one turn each. Returns one episode per (group, seed): (group id, seed,
    tokens, logprobs, weights version, adapter version)."""
    ro, out, pending = kvdecode.Rollouts(engine), [], list(groups)
    while pending:
        wave, used = [], 0
        while pending and used + len(pending[0]["seeds"]) <= engine.rows:
            g = pending.pop(0)
            wave.append((g, list(range(used, used + len(g["seeds"])))))
            used += len(g["seeds"])
        for g, rows in wave:
            samplers = [kvdecode.Sampler(temperature, seed=s) for s in g["seeds"]]
            ro.start([rows[0]], [g["prompt"]], sampler=samplers[0], adapter=g.get("adapter"))
            ro.fork(rows[0], rows[1:], sampler=samplers[1:])
        all_rows = [r for _, rows in wave for r in rows]
        ro.decode_turn(all_rows, max_new=n_digits + 1, stop=[EOS])
        for g, rows in wave:
            for r, seed in zip(rows, g["seeds"]):
                t = ro.finish(r)[0]
                out.append((g["id"], seed, list(t.tokens), list(t.logprobs), t.weights_version, t.adapter_version))
    return out


def reward(prompt, tokens, n_digits):
    want = prompt[1:1 + n_digits][::-1]
    return sum(int(i < len(tokens) and tokens[i] == d) for i, d in enumerate(want)) / n_digits


def trainer_step(ex, prompts, episodes, args):
    """One GRPO step of experiment `ex` on its episodes: the trainer's teacher-forced
    log-probabilities of the sampled tokens, the group-normalised loss, an Adam step. Returns the
    rewards and the |logp engine - logp trainer| of every sampled token."""
    seqs = [prompts[g] + toks for g, _, toks, *_ in episodes]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [EOS] * (width - len(s)) for s in seqs])
    logp_all = F.log_softmax(ex["model"](ids)[:, :-1].float() / args.temperature, dim=-1)
    plen = args.digits + 2
    logps, deltas, adv = [], [], []
    rewards = np.array([reward(prompts[g], toks, args.digits) for g, _, toks, *_ in episodes])
    for i, (g, _, toks, lps, *_) in enumerate(episodes):
        group = rewards[[j for j, e in enumerate(episodes) if e[0] == g]]
        a = (rewards[i] - group.mean()) / (group.std() + 1e-4)
        for k, (t, lp) in enumerate(zip(toks, lps)):
            trainer = logp_all[i, plen - 1 + k, t]
            logps.append(trainer)
            adv.append(a)
            deltas.append(abs(lp - trainer.item()))
    loss = -(torch.stack(logps) * torch.tensor(adv, dtype=torch.float32)).mean()
    ex["opt"].zero_grad()
    loss.backward()
    ex["opt"].step()
    return rewards, deltas


def supervised(policy, steps, args, rng):
    """`steps` Adam steps of teacher-forced reversal on the policy: a base that half knows the
    task, as a LoRA starts from a pretrained model rather than from noise."""
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(steps):
        digits = rng.integers(0, DIGITS, (64, args.digits))
        seqs = torch.tensor([[BOS] + d.tolist() + [EQ] + d[::-1].tolist() + [EOS] for d in digits])
        logits = policy(seqs[:, :-1])[:, args.digits + 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, args.digits + 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def nbytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (per experiment)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--d-model", type=int, help="the policy's width (default 64; 320 with --lora)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, help="Adam's learning rate (default 3e-3; 1.5e-3 with --lora)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32",
                    help="the engine's weights and K/V (the trainer is f32; 16-bit weights are the "
                    "trainer's rounded as the update is written)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train a PEFT LoRA of this rank on every linear layer of a frozen base; push only the adapter")
    ap.add_argument("--sft", type=int, help="supervised steps on the base before RL (default 0; 45 with --lora)")
    ap.add_argument("--experiments", type=int, default=1,
                    help="with --lora: GRPO experiments on one engine, each its own adapter, rows mixed")
    ap.add_argument("--ray", type=int, default=0, help="rollouts on this many Ray actors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="grpo.png")
    ap.add_argument("--json", help="write every step's figures here")
    ap.add_argument("--save-dir", help="keep the initial policy here as a Hugging Face directory "
                    "(kvdecode bench --model DIR --tables weights times its updates)")
    ap.add_argument("--check", action="store_true",
                    help="fail unless the reward rises (in every experiment), (f32) the mismatch stays within "
                    "1e-5 mean, 1e-3 max, and (--lora) a sync moves at most 5%% of the full model's bytes")
    args = ap.parse_args()
    if args.experiments < 1 or (args.experiments > 1 and not args.lora):
        ap.error("--experiments N (N >= 1) runs N adapters: it needs --lora")
    if args.lora and args.ray:
        ap.error("--lora runs its experiments on one engine: leave out --ray")
    args.d_model = args.d_model or (320 if args.lora else 64)
    args.sft = args.sft if args.sft is not None else (45 if args.lora else 0)
    args.lr = args.lr or (1.5e-3 if args.lora else 3e-3)
    print(f"seed {args.seed}")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    policy = Policy(config(args))
    if args.sft:
        supervised(policy, args.sft, args, np.random.default_rng(args.seed + 10**6))
    # one experiment: the full policy; with --lora, one PEFT model per experiment over a copy of
    # the frozen base, each with its own adapter initialisation and prompts
    if args.lora:
        from peft import LoraConfig, get_peft_model

        experiments = []
        for k in range(args.experiments):
            torch.manual_seed(args.seed + 1 + k)
            lora = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=LORA_TARGETS, lora_dropout=0.0)
            model = get_peft_model(copy.deepcopy(policy), lora)
            experiments.append({"name": f"exp{k}", "model": model, "rng": rng if k == 0 else np.random.default_rng(
                args.seed + k), "opt": torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)})
    else:
        experiments = [{"name": None, "model": policy, "rng": rng,
                        "opt": torch.optim.Adam(policy.parameters(), lr=args.lr)}]
    n_exp = len(experiments)
    rows = args.prompts * args.group * n_exp
    tmp = args.save_dir or tempfile.mkdtemp(prefix="kvdecode-grpo-")
    save_hf(policy, tmp, args.dtype)
    engine = make_engine(tmp, rows, args.dtype, loras=n_exp if args.lora else 0, rank=args.lora)
    for ex in experiments:
        if ex["name"]:
            engine.load_lora(ex["name"], adapter_state(ex["model"]), ex["model"].peft_config["default"])
    full_bytes = nbytes(policy.state_dict())
    actors = []
    if args.ray:
        import ray

        ray.init(num_cpus=max(2, args.ray), include_dashboard=False, log_to_driver=False)

        @ray.remote
        class Worker:
            def __init__(self, model_dir, rows, dtype):
                self.engine = make_engine(model_dir, rows, dtype)

            def rollout(self, state, groups, n_digits, temperature):
                t = time.perf_counter()
                self.engine.load_weights(state, in_flight="reset")
                sync_ms = (time.perf_counter() - t) * 1e3
                return run_groups(self.engine, groups, n_digits, temperature), sync_ms

        per = -(-args.prompts // args.ray)
        actors = [Worker.remote(tmp, per * args.group, args.dtype) for _ in range(args.ray)]
    trained = sum(p.numel() for p in experiments[0]["model"].parameters() if p.requires_grad)
    what = (f"{n_exp} rank-{args.lora} LoRA experiment(s), {trained} trained parameters each over a frozen base"
            if args.lora else "full weights trained")
    print(f"kvdecode on {kvdecode.device()}; policy {sum(p.numel() for p in policy.parameters())} parameters, "
          f"{what}; {args.prompts} prompts x {args.group} samples per step and experiment, engine {args.dtype}")
    per_exp = " rewards per experiment |" if n_exp > 1 else ""
    print(f"| step | reward |{per_exp} rollout tok/s | sync ms | sync bytes | mean abs dlogp | max abs dlogp | version |")
    print("|---:|---:|" + ("---|" if n_exp > 1 else "") + "---:|---:|---:|---:|---:|---:|")
    history, sync_ms, sync_bytes = [], 0.0, full_bytes
    all_d = []
    for step in range(args.steps):
        # each experiment's prompts from its own generator; the groups interleaved, so every
        # rollout batch mixes the experiments' rows (and adapters)
        prompts, groups = [], []
        for k, ex in enumerate(experiments):
            r = ex["rng"]
            ps = [[BOS] + r.integers(0, DIGITS, args.digits).tolist() + [EQ] for _ in range(args.prompts)]
            seeds = [[int(s) for s in r.integers(0, 2**31, args.group)] for _ in ps]
            for p, sd in zip(ps, seeds):
                groups.append({"id": len(prompts), "exp": k, "prompt": p, "seeds": sd, "adapter": ex["name"]})
                prompts.append(p)
        groups.sort(key=lambda g: (g["id"] % args.prompts, g["exp"]))
        t0 = time.perf_counter()
        if actors:
            state = {k: v.detach().numpy() for k, v in policy.state_dict().items()}
            ref = ray.put(state)  # once in the object store, read by every actor
            put_ms = (time.perf_counter() - t0) * 1e3
            per = -(-len(groups) // len(actors))
            parts = [groups[i * per:(i + 1) * per] for i in range(len(actors))]
            futures = [a.rollout.remote(ref, p, args.digits, args.temperature) for a, p in zip(actors, parts) if p]
            got = ray.get(futures)
            episodes = [e for part, _ in got for e in part]
            # the weights' trip: into the object store, then the slowest actor's load
            sync_ms = put_ms + max(ms for _, ms in got)
            if step == 0:
                alone = run_groups(engine, groups, args.digits, args.temperature)
                same = sorted(e[:4] for e in episodes) == sorted(e[:4] for e in alone)
                assert same, "the Ray actors' episodes differ from one engine's"
                print("Ray: every episode equals the single engine's")
        else:
            episodes = run_groups(engine, groups, args.digits, args.temperature)
        rollout_s = time.perf_counter() - t0
        n_tokens = sum(len(e[2]) for e in episodes)
        # every token was sampled under this step's weights (or adapter) version
        versions = {(e[4], e[5]) for e in episodes}
        want = {(0, step)} if args.lora else {(step, None)}
        assert versions == want or actors, f"step {step}: sampled under (weights, adapter) versions {versions}"
        # each experiment's trainer on its own episodes
        rewards, deltas = [], []
        exp_of = {g["id"]: g["exp"] for g in groups}
        for k, ex in enumerate(experiments):
            r, d = trainer_step(ex, prompts, [e for e in episodes if exp_of[e[0]] == k], args)
            rewards.append(float(r.mean()))
            deltas.extend(d)
        all_d.extend(deltas)
        # the new weights into the engine: the whole model by its Hugging Face names, or each
        # adapter's tensors by PEFT's
        if not actors:
            t1 = time.perf_counter()
            if args.lora:
                states = [adapter_state(ex["model"]) for ex in experiments]
                for ex, st in zip(experiments, states):
                    engine.update_lora(ex["name"], st, in_flight="reset")
                sync_bytes = nbytes(states[0])
            else:
                engine.load_weights(policy.state_dict(), in_flight="reset")
            sync_ms = (time.perf_counter() - t1) * 1e3 / n_exp
        rec = {"step": step, "reward": float(np.mean(rewards)), "rewards": rewards,
               "rollout_tok_s": n_tokens / rollout_s, "sync_ms": sync_ms, "sync_bytes": sync_bytes,
               "mismatch_mean": float(np.mean(deltas)), "mismatch_max": float(np.max(deltas)), "version": step}
        history.append(rec)
        each = " " + " ".join(f"{r:.2f}" for r in rewards) + " |" if n_exp > 1 else ""
        print(f"| {step} | {rec['reward']:.3f} |{each} {rec['rollout_tok_s']:.0f} | {sync_ms:.2f} | {sync_bytes} | "
              f"{rec['mismatch_mean']:.2e} | {rec['mismatch_max']:.2e} | {step} |", flush=True)
    starts = [np.mean([h["rewards"][k] for h in history[:5]]) for k in range(n_exp)]
    ends = [np.mean([h["rewards"][k] for h in history[-5:]]) for k in range(n_exp)]
    mean_d, max_d = float(np.mean(all_d)), float(np.max(all_d))
    rises = ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in zip(starts, ends))
    print(f"reward {rises} (first and last 5 steps); mismatch over {len(all_d)} sampled tokens: "
          f"mean {mean_d:.2e}, max {max_d:.2e}")
    summary = {"steps": history, "mismatch_mean": mean_d, "mismatch_max": max_d}
    if args.lora:
        # the full-model sync these adapters replace, on the same engine and, as the adapters'
        # syncs were, right after a rollout: the base's own tensors pushed whole (the adapters
        # stay resident)
        full_ms = []
        for _ in range(3):
            run_groups(engine, groups, args.digits, args.temperature)
            t1 = time.perf_counter()
            engine.load_weights(policy.state_dict(), in_flight="reset")
            full_ms.append((time.perf_counter() - t1) * 1e3)
        lora_ms = float(np.median([h["sync_ms"] for h in history]))
        share = sync_bytes / full_bytes
        print(f"sync per step and adapter: {sync_bytes} bytes in {lora_ms:.2f} ms (median); the full model: "
              f"{full_bytes} bytes in {np.median(full_ms):.2f} ms (median of 3); the adapter moves {share:.1%} "
              "of the full model's bytes")
        summary.update(adapter_bytes=sync_bytes, full_bytes=full_bytes, adapter_sync_ms=lora_ms,
                       full_sync_ms=float(np.median(full_ms)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        for k in range(n_exp):
            a.plot([h["rewards"][k] for h in history], label=experiments[k]["name"] or "full weights")
        what = f"rank-{args.lora} LoRA" if args.lora else "GRPO"
        a.set(xlabel="step", ylabel="mean reward", title=f"reverse {args.digits} digits ({what})", ylim=(0, 1))
        if n_exp > 1:
            a.legend()
        b.semilogy([h["mismatch_mean"] for h in history], label="mean")
        b.semilogy([h["mismatch_max"] for h in history], label="max")
        b.set(xlabel="step", ylabel="|logp engine - logp trainer|", title=f"mismatch ({args.dtype} engine)")
        b.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    if args.check:
        for k, (start, end) in enumerate(zip(starts, ends)):
            assert end > start + 0.1, f"experiment {k}: the reward did not rise: {start:.3f} -> {end:.3f}"
        if args.dtype == "f32":
            assert mean_d <= 1e-5 and max_d <= 1e-3, f"mismatch mean {mean_d:.2e}, max {max_d:.2e}"
        if args.lora:
            assert sync_bytes <= 0.05 * full_bytes, f"an adapter sync moves {sync_bytes} of {full_bytes} bytes"
        print("check passed")


if __name__ == "__main__":
    main()
