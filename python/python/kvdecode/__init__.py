"""kvdecode: incremental decoding of transformer language models on WebGPU (Vulkan, Metal, DX12,
GL), many sequences at once, with a small KV cache.

The seed's calling pattern maps one to one::

    import kvdecode, numpy as np
    model = kvdecode.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    engine = kvdecode.Engine(model, rows=4, max_len=512)
    logits = engine.append(ids, n_new, rows=None)   # ids: right-padded (B, C); logits: (B, vocab)

Everything that waits for the GPU releases the GIL. Errors are :class:`Error` subclasses whose
message names what was wrong (which row, id, limit); a call that fails leaves the engine as it was.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _kvdecode as _native
from ._kvdecode import (
    CHUNK,
    CacheFull,
    Completion,
    DeviceError,
    DeviceLost,
    Error,
    InvalidInput,
    ModelFileError,
    OutOfBlocks,
    Sampler,
    Token,
    Turn,
    device,
    device_memory,
)

__all__ = [
    "CHUNK",
    "CacheFull",
    "Completion",
    "DeviceError",
    "DeviceLost",
    "Engine",
    "Error",
    "InvalidInput",
    "Model",
    "ModelFileError",
    "OutOfBlocks",
    "Rollouts",
    "Sampler",
    "Scheduler",
    "Token",
    "Tokenizer",
    "Turn",
    "device",
    "device_memory",
    "load",
]

__version__ = "0.1.0"

SamplerArg = Union[None, Sampler, Sequence[Sampler]]
"""One sampler for every row, one per row, or ``None`` for greedy."""


def _as_numpy(x: Any, what: str) -> np.ndarray:
    """An array-like (numpy, a CPU torch tensor, anything with ``__array__`` or DLPack, lists)
    as a numpy array, without a copy where the source allows it."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array__"):
        try:
            return np.from_dlpack(x)
        except Exception as e:  # noqa: BLE001
            raise InvalidInput(f"invalid input: {what}: cannot read it as an array on the CPU ({e})") from e
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - a GPU tensor, a ragged list ...
        raise InvalidInput(f"invalid input: {what}: cannot read it as an array on the CPU ({e})") from e
    if a.dtype == object:
        raise InvalidInput(f"invalid input: {what}: cannot read {type(x).__name__} as an array of numbers")
    return a


def _host_tensor(name: str, t: Any) -> Tuple[str, str, List[int], np.ndarray]:
    """A weight as (name, dtype, shape, its bytes as a 1-D uint8 array), without a copy where
    the source is contiguous. torch is not imported: bfloat16, which numpy lacks, is read through
    the tensor's own ``view``."""
    if type(t).__module__.startswith("torch"):
        if t.device.type != "cpu":
            raise InvalidInput(f"invalid input: tensor `{name}`: on {t.device}, expected a CPU tensor")
        t = t.detach().contiguous()
        dtype = str(t.dtype)
        shape = list(t.shape)
        import torch  # already imported by whoever made the tensor

        raw = t.reshape(-1).view(torch.uint8).numpy()
        return name, dtype, shape, raw
    a = np.ascontiguousarray(_as_numpy(t, f"tensor `{name}`"))
    return name, a.dtype.name, list(a.shape), a.reshape(-1).view(np.uint8)


def _lora_tensors(weights: Any) -> List[Tuple[str, str, List[int], np.ndarray]]:
    """A PEFT state dict's LoRA tensors as host tensors (the base model's own are skipped)."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    return [_host_tensor(str(n), t) for n, t in items if ".lora_" in str(n)]


def _lora_config(config: Any) -> Dict[str, Any]:
    """A LoRA config as adapter_config.json's object (a PEFT ``LoraConfig`` or a dict)."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise InvalidInput(f"invalid input: config: expected a LoraConfig or a dict, got {type(config).__name__}")
    keys = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora", "bias",
            "modules_to_save", "fan_in_fan_out", "lora_bias")
    out = {k: config[k] for k in keys if k in config}
    if "peft_type" in out and not isinstance(out["peft_type"], str):
        out["peft_type"] = getattr(out["peft_type"], "value", str(out["peft_type"]))
    return out


def _int_array(x: Any, what: str, ndim: Tuple[int, ...]) -> np.ndarray:
    a = _as_numpy(x, what)
    if a.ndim not in ndim:
        dims = " or ".join(f"{d}-D" for d in ndim)
        raise InvalidInput(f"invalid input: {what}: expected a {dims} array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise InvalidInput(f"invalid input: {what}: expected integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidInput(f"invalid input: {what}: {int(a.max())} is not a token id")
    return np.ascontiguousarray(a, dtype=np.int64)


def _ids2d(ids: Any) -> np.ndarray:
    """A chunk of ids as a contiguous int64 ``(B, C)`` array; 1-D is one row."""
    a = _int_array(ids, "ids", (1, 2))
    return a[None, :] if a.ndim == 1 else a


def _int_list(x: Any, what: str) -> List[int]:
    return _int_array(x, what, (0, 1)).reshape(-1).tolist()


def _opt_int_list(x: Any, what: str) -> Optional[List[int]]:
    return None if x is None else _int_list(x, what)


class Tokenizer:
    """A model's tokenizer and chat template (Hugging Face's tokenizers underneath)."""

    def __init__(self, native: _native.Tokenizer):
        self._t = native

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``; special tokens written in it are parsed, BOS added when the
        model asks for it."""
        return self._t.encode(text)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self._t.decode(_int_list(ids, "ids"), skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        tokenize: bool = False,
    ) -> Union[str, List[int]]:
        """Render the model's chat template (Jinja, run under limits: it comes from the model
        file) for ``messages`` (``{"role", "content"}`` dicts, OpenAI-style ``tool_calls``
        allowed). ``tokenize=True`` returns token ids, as in Hugging Face transformers."""
        try:
            messages_json = json.dumps(list(messages))
            tools_json = None if tools is None else json.dumps(list(tools))
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"invalid input: messages: not JSON-serializable ({e})") from e
        return self._t.apply_chat_template_json(messages_json, add_generation_prompt, tools_json, tokenize)

    def token_id(self, token: str) -> Optional[int]:
        """The id of a token string, or ``None``."""
        return self._t.token_id(token)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included."""
        return self._t.vocab_size

    @property
    def end_of_turn(self) -> List[int]:
        """Ids that end an assistant turn (EOS and the usual end-of-turn markers)."""
        return self._t.end_of_turn

    def __repr__(self) -> str:
        return repr(self._t)


class Model:
    """A model's weights on the CPU, and its tokenizer when the files carry one. Build engines
    from it; the weights can be dropped once the engines exist."""

    def __init__(self, native: _native.Model):
        self._m = native
        t = native.tokenizer
        self.tokenizer: Optional[Tokenizer] = None if t is None else Tokenizer(t)
        """The tokenizer, or ``None`` (kvdecode safetensors files and the demo model have none)."""

    @staticmethod
    def demo() -> "Model":
        """The built-in demo model: seeded random weights in the TinyAgent layout (global and
        sliding-window layers, Engram), vocabulary 512. Needs no download."""
        return Model(_native.Model.demo())

    @staticmethod
    def random(**shape: int) -> "Model":
        """A seeded random TinyAgent-layout model. Keywords (defaults): vocab=256, d_model=64,
        heads=4, kv_heads=2, head_dim=16, ffn=128, layers=4, group=2, window=8, seed=7."""
        return Model(_native.Model.random(**shape))

    @property
    def config(self) -> dict:
        """The model's configuration (layers, heads, window, RoPE, ...)."""
        return json.loads(self._m.config_json)

    def state_dict(self, naming: str = "kvdecode") -> Dict[str, np.ndarray]:
        """The weights by name as float32 arrays, what :meth:`Engine.load_weights` takes.
        ``naming``: ``"kvdecode"`` (every model), ``"hf"`` or ``"gguf"`` (Hugging Face and GGUF
        names, for the families that have them)."""
        return dict(self._m.state_dict(naming))

    @property
    def vocab(self) -> int:
        """Vocabulary size: the width of the logits."""
        return self._m.vocab

    def reference_logits(self, tokens: Any) -> np.ndarray:
        """Logits ``(len(tokens), vocab)`` from kvdecode's CPU reference (f32, no cache): what the
        GPU engine is tested against. Slow; for tests."""
        return self._m.reference_logits(_int_array(tokens, "tokens", (1,)))

    def __repr__(self) -> str:
        return repr(self._m)


def load(path: Union[str, os.PathLike]) -> Model:
    """Load a GGUF file, a Hugging Face model directory (``config.json``, ``*.safetensors``,
    ``tokenizer.json``) or a kvdecode safetensors file. Model files are untrusted input: a bad one
    raises :class:`ModelFileError` naming the tensor or field."""
    return Model(_native.load(path))


class Engine:
    """The model's weights on the GPU and a KV cache of ``rows`` rows of ``max_len`` tokens.

    Args:
        model: a :class:`Model`.
        rows: sequences decoded side by side.
        max_len: capacity of each row, in tokens.
        kv: K/V storage, ``"f32"`` (default, exact against the reference), ``"f16"`` or ``"bf16"``
            (half the memory).
        weights: ``"f32"`` or ``"f16"`` for weights that are not already quantized or 16-bit.
        rollback: tokens a row can roll back exactly; also bounds ``decode_steps`` windows
            (``rollback + 1`` steps).
        beyond_trained_context: allow ``max_len`` past the model's trained context.
        block_len: positions per block of the global K/V pool (a power of two).
        pool_blocks: blocks in the pool (``None``: enough for every row to reach ``max_len``); a
            smaller pool holds more rows than it could fill at once, and an append it cannot hold
            raises :class:`OutOfBlocks`.
        prompt_cache: keep full K/V blocks for later sequences that start with the same tokens
            (models with sliding-window layers recompute a few blocks before the reuse point).
        record_routes: a mixture of experts keeps the experts every token was routed to
            (:meth:`routes`; vLLM's ``return_routed_experts``), for a trainer to replay. It turns
            the prompt cache off.
        max_loras: LoRA adapters the engine holds at once (:meth:`load_lora`); 0: none.
        max_lora_rank: the largest adapter rank a slot holds (at most 256).
        lora_dtype: how the slots hold adapters' A and B: ``"f32"`` (as given) or ``"f16"``
            (rounded to halves: half the memory and the bytes an update writes; sums in f32).

    A row's results never depend on what else is in the batch or how its tokens were chunked
    (bit for bit). One engine is used from one thread at a time.
    """

    def __init__(
        self,
        model: Model,
        rows: int,
        max_len: int,
        *,
        kv: str = "f32",
        weights: str = "f32",
        rollback: int = 8,
        beyond_trained_context: bool = False,
        block_len: int = 16,
        pool_blocks: Optional[int] = None,
        prompt_cache: bool = True,
        record_routes: bool = False,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        lora_dtype: str = "f32",
    ):
        if not isinstance(model, Model):
            raise InvalidInput(f"invalid input: model: expected a kvdecode.Model, got {type(model).__name__}")
        self._e = _native.Engine(
            model._m, rows, max_len, kv=kv, weights=weights, rollback=rollback,
            beyond_trained_context=beyond_trained_context, block_len=block_len, pool_blocks=pool_blocks,
            prompt_cache=prompt_cache, record_routes=record_routes, max_loras=max_loras,
            max_lora_rank=max_lora_rank, lora_dtype=lora_dtype,
        )

    def append(self, ids: Any, n_new: Any = None, rows: Any = None) -> np.ndarray:
        """Feed a right-padded chunk ``ids`` of shape ``(B, C)`` (a 1-D array is one row); row
        ``b`` has ``n_new[b]`` real tokens (default ``C``; 0 leaves the row untouched).
        ``rows``: the cache rows ``ids`` refers to (a sub-batch); by default ``ids`` covers every
        cache row in order, as in the seed.

        Returns float32 logits ``(B, vocab)`` at each row's last new token, a numpy array that
        owns the engine's readback (no copy); rows with ``n_new == 0`` are NaN."""
        return self._e.append(_ids2d(ids), _opt_int_list(n_new, "n_new"), _opt_int_list(rows, "rows"))

    def append_sample(
        self, ids: Any, n_new: Any = None, rows: Any = None, sampler: SamplerArg = None
    ) -> Tuple[List[Optional[int]], List[Optional[float]]]:
        """:meth:`append`, but each row's next token is sampled on the GPU and only the ids (and
        their log-probabilities) are read back. Rows that received no token give ``None``."""
        return self._e.append_sample(_ids2d(ids), _opt_int_list(n_new, "n_new"), _opt_int_list(rows, "rows"), sampler)

    def score(
        self, ids: Any, n_new: Any = None, rows: Any = None, sampler: SamplerArg = None, top: int = 0
    ) -> List[Tuple[List[float], List[int], List[List[Tuple[int, float]]]]]:
        """:meth:`append`, and every token after each row's first reported as a draw at its
        position would report it (prompt logprobs, for scoring and distillation): per row, the
        log-probabilities of tokens 1.. (of the sampler's ``logprobs`` mode, at its temperature
        and truncation), how many tokens were kept, and the ``top`` most likely alternatives. The
        same bits as the tokens would get sampled there. One chunk at most: 64 tokens in all
        (rows x the longest), the engine's all-position budget."""
        return self._e.score(_ids2d(ids), _opt_int_list(n_new, "n_new"), _opt_int_list(rows, "rows"), sampler, top)

    def decode_steps(
        self, rows: Any, first: Any, steps: int, sampler: SamplerArg = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Multi-step decode with one readback: step 0 feeds ``first[i]`` to ``rows[i]``, each later
        step the token sampled before, straight from GPU memory. Returns int64 ids and float32
        log-probabilities, both ``(len(rows), steps)``; the last id of each row is not yet appended
        (feed it next). ``steps`` is at most :attr:`max_window`."""
        return self._e.decode_steps(_int_list(rows, "rows"), _int_list(first, "first"), steps, sampler)

    def decode_turns(
        self,
        rows: Any,
        first: Any,
        max_new: Union[int, Sequence[int]],
        stop: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
        window: Optional[int] = None,
        sampler: SamplerArg = None,
    ) -> List[Turn]:
        """Decode one turn per row: feed ``first[i]``, then sampled tokens, until the row samples a
        stop id (``stop``: shared by all rows, or one list per row) or has ``max_new`` tokens.
        ``window`` steps run per readback (default :attr:`max_window`); rows that stopped inside a
        window are rolled back exactly. The stop token is returned, not appended."""
        return self._e.decode_turns(_int_list(rows, "rows"), _int_list(first, "first"), max_new, stop, window, sampler)

    def fork(self, src: int, dst: Any) -> None:
        """Copy row ``src`` (its K/V, sliding-window rings and token history) into each row of
        ``dst``: they continue from the same prefix without recomputing it."""
        self._e.fork(int(src), _int_list(dst, "dst"))

    def rollback(self, rows: Any, n: Any) -> None:
        """Drop the last ``n[i]`` tokens of ``rows[i]``, exactly (at most :meth:`max_rollback`)."""
        self._e.rollback(_int_list(rows, "rows"), _int_list(n, "n"))

    def reset(self, rows: Any = None) -> None:
        """Empty ``rows`` (every row when ``None``)."""
        self._e.reset(_opt_int_list(rows, "rows"))

    def history(self, row: int) -> List[int]:
        """The token ids row ``row`` holds, in order."""
        return self._e.history(int(row))

    @property
    def route_shape(self) -> Optional[Tuple[int, int]]:
        """``(MoE layers, top_k)`` of a mixture of experts' routes (``None``: a dense model)."""
        return self._e.route_shape

    def routes(self, row: int) -> np.ndarray:
        """The experts every position of row ``row`` was routed to: uint32 ``(len, MoE layers,
        top_k)``, aligned with :meth:`history`, each token's experts in the router's order (the
        engine needs ``record_routes=True``)."""
        return self._e.routes(int(row))

    def max_rollback(self, row: int) -> int:
        """Tokens row ``row`` can roll back exactly now."""
        return self._e.max_rollback(int(row))

    @property
    def lens(self) -> List[int]:
        """Tokens held by each row."""
        return self._e.lens

    @property
    def nbytes(self) -> int:
        """Bytes of the KV cache on the GPU."""
        return self._e.nbytes

    @property
    def naive_nbytes(self) -> int:
        """Bytes a cache keeping every layer's K/V for every position would take."""
        return self._e.naive_nbytes

    @property
    def used_nbytes(self) -> int:
        """Bytes of K/V the rows use now: global blocks held by rows (once each, however many
        forks share them) plus the sliding-window rings."""
        return self._e.used_nbytes

    def block_usage(self) -> Dict[str, int]:
        """The global K/V block pool: ``block_len``, ``total``, ``free``, ``used``, ``shared``,
        ``referenced`` (what per-row copies would hold), ``cached``, ``evictable``."""
        return self._e.block_usage()

    def reuse_prefix(self, row: int, prompt: Sequence[int]) -> int:
        """Start the empty ``row`` on the longest prefix of ``prompt`` whose K/V blocks the prompt
        cache holds (from earlier sequences); returns how many tokens it now holds: append
        ``prompt[n:]`` next. 0 when nothing is cached (sliding-window models: nothing longer than
        the positions they recompute before the reuse point)."""
        return self._e.reuse_prefix(int(row), [int(t) for t in prompt])

    def prompt_cache_stats(self) -> Tuple[int, int, int, int]:
        """What the prompt cache did: (lookups, prompt tokens looked up, tokens found, evictions)."""
        return self._e.prompt_cache_stats()

    @property
    def rows(self) -> int:
        """Cache rows."""
        return self._e.rows

    @property
    def max_len(self) -> int:
        """Capacity of each row, in tokens."""
        return self._e.max_len

    @property
    def vocab(self) -> int:
        """Vocabulary size."""
        return self._e.vocab

    @property
    def max_window(self) -> int:
        """Most steps per ``decode_steps`` call or per ``decode_turns`` readback."""
        return self._e.max_window

    @property
    def kv(self) -> str:
        """K/V storage type."""
        return self._e.kv

    def load_weights(self, weights: Any, in_flight: str = "keep") -> int:
        """Replace weights in place, between steps, as a training loop does after each optimizer
        step; returns the new :attr:`weights_version`.

        Args:
            weights: a ``state_dict()`` (any mapping of name to tensor) or an iterable of
                ``(name, tensor)`` pairs; CPU torch tensors in float32, bfloat16 or float16, or
                numpy arrays. Names as in the model's file: Hugging Face
                (``model.layers.3.self_attn.q_proj.weight``), GGUF (``blk.3.attn_q.weight``) or
                kvdecode's. A subset updates just those tensors; a tied model's
                ``lm_head.weight`` and RoPE's ``inv_freq`` buffers are ignored.
            in_flight: rows holding tokens ``"keep"`` their K/V (partial rollouts: the versions
                of their tokens say so), are ``"recompute"``-d under the new weights (they then
                hold what a fresh engine would), or are ``"reset"``.

        Everything is checked before anything is written: an unknown name, a wrong shape or
        dtype, or a value that is not finite raises :class:`ModelFileError` naming the tensor and
        changes nothing. The prompt cache is flushed. The GIL is released during the upload.
        """
        items = weights.items() if isinstance(weights, Mapping) else weights
        tensors = [_host_tensor(str(name), t) for name, t in items]
        version, _, _, _ = self._e.load_weights(tensors, in_flight)
        return version

    def load_lora(self, name: str, adapter: Any, config: Any = None) -> None:
        """Make a LoRA adapter resident under ``name`` (the engine needs ``max_loras > 0``); rows
        then pick it with :meth:`set_adapter` and requests with ``adapter=name``.

        Args:
            adapter: a PEFT adapter folder (``adapter_config.json`` and
                ``adapter_model.safetensors``) or a GGUF LoRA file (llama.cpp's
                ``convert_lora_to_gguf.py``), or PEFT tensors by their names: a mapping such as
                ``get_peft_model_state_dict(peft_model)`` or ``peft_model.state_dict()`` (the base
                model's own tensors in it are skipped), or ``(name, tensor)`` pairs.
            config: with tensors, the adapter's settings: ``peft_model.peft_config["default"]``,
                a ``LoraConfig``, or a dict of ``adapter_config.json``'s keys (``r``,
                ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``).

        The adapter is applied unmerged (``W x + scale * B (A x)``, A and B in f32): the base
        weights never change. DoRA, embedding or LM-head adapters and modules the model lacks
        raise :class:`ModelFileError` by name, and nothing changes."""
        if isinstance(adapter, (str, os.PathLike)):
            self._e.load_lora_path(str(name), os.fspath(adapter))
            return
        if config is None:
            raise InvalidInput("invalid input: config: adapter tensors need the adapter's config (r, lora_alpha)")
        self._e.load_lora(str(name), json.dumps(_lora_config(config)), _lora_tensors(adapter))

    def update_lora(self, name: str, weights: Any, in_flight: str = "keep") -> int:
        """Replace some of adapter ``name``'s tensors in place (PEFT's names; each module keeps its
        rank and scale), as a trainer pushes only its adapter after a step; returns the adapter's
        new version. Only that adapter's rows holding tokens are kept, ``"recompute"``-d or
        ``"reset"``; other adapters' rows decode on. A bad tensor raises and changes nothing."""
        version, _, _, _ = self._e.update_lora(str(name), _lora_tensors(weights), in_flight)
        return version

    def unload_lora(self, name: str) -> None:
        """Free adapter ``name``'s slot; raises while a row uses it (reset the row first)."""
        self._e.unload_lora(str(name))

    def set_adapter(self, row: int, name: Optional[str]) -> None:
        """Make the empty ``row`` decode with adapter ``name`` (``None``: the base model). A reset
        puts a row back on the base model; forks take their source's adapter."""
        self._e.set_adapter(int(row), None if name is None else str(name))

    def adapter(self, row: int) -> Optional[Tuple[str, int]]:
        """``(name, version)`` of the adapter ``row`` decodes with, or ``None``."""
        return self._e.adapter(int(row))

    @property
    def loras(self) -> List[Tuple[str, int]]:
        """The resident adapters' ``(name, version)``."""
        return self._e.loras

    def load_weights_from_path(self, path: Union[str, os.PathLike], in_flight: str = "keep") -> int:
        """:meth:`load_weights` from a file: safetensors, a Hugging Face directory or GGUF with
        this model's shapes. Returns the new :attr:`weights_version`."""
        return self._e.load_weights_from_path(os.fspath(path), in_flight)

    @property
    def weights_version(self) -> int:
        """0 for the weights the engine was built with, plus one per :meth:`load_weights`; every
        :class:`Turn`, :class:`Token` and :class:`Completion` carries the version it was sampled
        under."""
        return self._e.weights_version

    def sleep(self, weights: bool = True, kv: bool = True) -> None:
        """Release the GPU memory of the weights and/or the K/V cache (kept on the host) while a
        trainer uses the GPU; every call that needs the GPU raises until :meth:`wake`."""
        self._e.sleep(weights=weights, kv=kv)

    def wake(self) -> None:
        """Bring back what :meth:`sleep` released; decoding continues exactly where it stopped."""
        self._e.wake()

    @property
    def asleep(self) -> Optional[Tuple[bool, bool]]:
        """``(weights, kv)`` released by :meth:`sleep`, or ``None`` when awake."""
        return self._e.asleep

    def memory_report(self) -> Dict[str, Any]:
        """Device memory in bytes: ``engine`` (this engine's buffers), ``device`` (every engine on
        the device) and ``allocator`` (wgpu's allocated and reserved bytes, where the backend
        reports them, else ``None``)."""
        engine, device_bytes, allocator = self._e.memory_report()
        return {"engine": engine, "device": device_bytes, "allocator": allocator}

    def __repr__(self) -> str:
        return repr(self._e)


class Rollouts:
    """Multi-turn episodes for RL rollouts, one per engine row: a prompt, turns the model decodes
    (each with its own stops), tool results appended between turns, forks that continue one
    prompt in k rows (GRPO groups) without recomputing it, per-token log-probabilities.

    Each row keeps its last token un-appended: the next turn's first step appends it and samples
    with the row's own sampler, so forked rows draw different answers from the same prompt."""

    def __init__(self, engine: Engine):
        if not isinstance(engine, Engine):
            raise InvalidInput(f"invalid input: engine: expected a kvdecode.Engine, got {type(engine).__name__}")
        self.engine = engine
        """The engine the episodes live on."""
        self._r = _native.Rollouts(engine._e)

    def start(self, rows: Any, prompts: Sequence[Any], sampler: SamplerArg = None,
              adapter: Optional[str] = None) -> None:
        """Reset ``rows`` and prefill ``prompts[i]`` into ``rows[i]`` (one batched append), on LoRA
        adapter ``adapter`` (:meth:`Engine.load_lora`, by name; ``None``: the base model). Forks
        of these rows keep their adapter; each turn's ``adapter_version`` says which version of it
        decoded the turn."""
        self._r.start(_int_list(rows, "rows"), [_int_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)],
                      sampler, None if adapter is None else str(adapter))

    def fork(self, src: int, dst: Any, sampler: SamplerArg = None) -> None:
        """Continue ``src``'s episode in each row of ``dst``, each with its own sampler."""
        self._r.fork(int(src), _int_list(dst, "dst"), sampler)

    def tool_result(self, rows: Any, chunks: Sequence[Any]) -> None:
        """Append ``chunks[i]`` (token ids, e.g. a tool's answer) to ``rows[i]`` after its last
        turn, batched."""
        self._r.tool_result(_int_list(rows, "rows"), [_int_list(c, f"chunks[{i}]") for i, c in enumerate(chunks)])

    def decode_turn(
        self,
        rows: Any,
        max_new: Union[int, Sequence[int]],
        stop: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
        window: Optional[int] = None,
    ) -> List[Turn]:
        """Decode the next turn on each row (batched), until its stop ids or ``max_new``."""
        return self._r.decode_turn(_int_list(rows, "rows"), max_new, stop, window)

    def episode(self, row: int) -> Optional[List[Turn]]:
        """The turns of the episode in ``row`` so far (``None``: no episode there)."""
        return self._r.episode(int(row))

    def finish(self, row: int) -> Optional[List[Turn]]:
        """End the episode in ``row`` and return its turns; the row is reset (its K/V blocks
        go back to the pool) and free again."""
        return self._r.finish(int(row))


class Scheduler:
    """Continuous batching over an engine's rows: free rows admit queued requests (prompts
    prefilled ``prefill_chunk`` tokens per step, sharing steps with decoding rows), every step
    decodes all active rows, tokens stream as they come. A request's tokens do not depend on what
    else shares the batch, so seeded sampling gives what it gets alone.

    ``step()`` returns the step's :class:`Token` and :class:`Completion` objects in order;
    ``stream()`` iterates over them until no work is left; ``run()`` returns the completions. Each
    step releases the GIL while the GPU works."""

    def __init__(self, engine: Engine, prefill_chunk: int = 32):
        if not isinstance(engine, Engine):
            raise InvalidInput(f"invalid input: engine: expected a kvdecode.Engine, got {type(engine).__name__}")
        self.engine = engine
        """The engine whose rows serve the requests."""
        self._s = _native.Scheduler(engine._e, prefill_chunk)

    def submit(
        self,
        tokens: Any,
        max_new: int = 32,
        stop: Any = (),
        sampler: Optional[Sampler] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        return_routes: bool = False,
        adapter: Optional[str] = None,
    ) -> int:
        """Queue a request (prompt ids, at most ``max_new`` new tokens, ending early on a ``stop``
        id, which is returned but not appended); returns its id. A request that could never fit
        a row, or has bad ids or parameters, raises here, so nothing fails mid-way.
        ``return_routes``: its :class:`Completion` carries the experts every fed token was
        routed to (a mixture of experts on an engine with ``record_routes=True``). ``adapter``:
        the LoRA adapter it decodes with (:meth:`Engine.load_lora`), by name."""
        return self._s.submit(_int_list(tokens, "tokens"), int(max_new), _int_list(list(stop), "stop"), sampler,
                              _bias(logit_bias), float(presence_penalty), float(frequency_penalty),
                              bool(return_routes), adapter)

    def submit_group(
        self,
        tokens: Any,
        samplers: Sequence[Sampler],
        max_new: int = 32,
        stop: Any = (),
        logit_bias: Optional[Mapping[int, float]] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        return_routes: bool = False,
        adapter: Optional[str] = None,
    ) -> List[int]:
        """Queue one request per sampler sharing the prompt (a GRPO group, OpenAI's ``n``): the
        prompt is prefilled once and forked on the GPU. Returns the ids in sampler order."""
        return self._s.submit_group(_int_list(tokens, "tokens"), int(max_new), _int_list(list(stop), "stop"),
                                    list(samplers), _bias(logit_bias), float(presence_penalty),
                                    float(frequency_penalty), bool(return_routes), adapter)

    def step(self) -> List[Union[Token, Completion]]:
        """One step: admit, append a chunk per active row, sample, release finished rows."""
        return self._s.step()[0]

    def stream(self) -> Iterator[Union[Token, Completion]]:
        """Step until every request has finished, yielding tokens and completions as they come."""
        while self.queued or self.active:
            yield from self._s.step()[0]

    def run(self) -> List[Completion]:
        """Step until every request has finished; completions in id order."""
        done = [e for e in self.stream() if isinstance(e, Completion)]
        return sorted(done, key=lambda c: c.id)

    def cancel(self, request_id: int) -> Optional[Completion]:
        """Stop a queued or running request now; its completion (tokens so far, finish
        ``"cancelled"``) or ``None`` when there is no such request."""
        return self._s.cancel(int(request_id))

    @property
    def queued(self) -> int:
        """Requests waiting for a row."""
        return self._s.queued

    @property
    def active(self) -> int:
        """Requests holding a row."""
        return self._s.active

    def accounting(self) -> Tuple[int, int, int]:
        """The seed's accounting in tokens, at block granularity: used (stored for running
        requests), allocated (their rows' blocks, shared ones counted per row) and reserved
        (blocks taken from the pool, each once; at most used plus one block per row)."""
        return self._s.accounting()


def _bias(logit_bias: Optional[Mapping[int, float]]) -> List[Tuple[int, float]]:
    return [] if logit_bias is None else [(int(t), float(b)) for t, b in logit_bias.items()]
