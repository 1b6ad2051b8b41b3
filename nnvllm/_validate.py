"""Check the arguments of the verbs on the client, before anything reaches an engine.

An engine is shared and slow to start; a bad value that gets through (a seed beyond 64 bits, a NaN
temperature, ``max_tokens=10**9``) can crash or wedge it for everyone. So every argument is checked
here, in plain Python (no vLLM, no torch), and a refusal names the argument, what was expected and
what came: ``temperature='hot': expected a number >= 0``. Checkers return the value normalised to
a plain Python type (a numpy integer becomes an ``int``) and raise ``TypeError`` for a wrong kind of
value, ``ValueError`` for a right kind out of range.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .arch import HEAD_SITES, SITES

__all__ = ["DTYPES", "SEED_MAX", "boolean", "call_seed", "checkpoint", "conversation", "dtype", "engine_args",
           "engine_fits", "fits_context", "integer", "layers", "number", "parse_bytes", "prompts",
           "request_seed", "request_seeds", "rng_seed", "sampling", "sites", "token_id", "top_k_count"]

SEED_MAX = 2**63 - 1  # vLLM (and torch) seeds are signed 64-bit


def _show(value: Any, limit: int = 60) -> str:
    """``repr`` of a user's value, cut short, with its type where the repr alone could mislead."""
    r = repr(value)
    if len(r) > limit:
        r = r[: limit - 3] + "..."
    if type(value) in (str, bool, int, float, type(None), list, tuple):
        return r
    return f"{r} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    # bool is an int to Python, never to a researcher passing max_tokens=True by mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value: Any, *, lo: int | None = None, hi: int | None = None, why: str = "",
            expected: str | None = None) -> int:
    """Return ``value`` as an ``int`` in ``[lo, hi]``; refuse bools, floats, strings."""
    if expected is None:
        bounds = (f" >= {lo}" if hi is None else f" with {lo} <= {name} <= {hi}") if lo is not None else (
            f" <= {hi}" if hi is not None else "")
        expected = f"expected an int{bounds}{why}"
    if not _is_int(value):
        raise TypeError(f"{name}={_show(value)}: {expected}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={v}: {expected}")
    return v


def number(name: str, value: Any, *, lo: float = 0.0, lo_open: bool = False, hi: float | None = None) -> float:
    """Return a finite real ``value`` with ``lo <= value`` (``lo < value`` if ``lo_open``) and ``value <= hi``."""
    expected = (f"a number {'>' if lo_open else '>='} {lo:g}" if hi is None
                else f"a number with {lo:g} {'<' if lo_open else '<='} x <= {hi:g}")
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={_show(value)}: expected {expected}")
    v = float(value)
    if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return value if type(value) in (int, float) else v


def boolean(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool (numpy's included); a string such as ``"no"`` is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}={_show(value)}: expected True or False")


def rng_seed(value: Any, name: str = "seed") -> int | None:
    """``None`` (unseeded) or an int that fits vLLM's signed 64-bit seed, ``0..2**63-1``."""
    if value is None:
        return None
    return integer(name, value, lo=0, hi=SEED_MAX,
                   expected=f"expected None or an int with 0 <= {name} <= 2**63 - 1 (vLLM seeds are signed 64-bit)")


def request_seed(seed: int, index: int) -> int:
    """The seed that request ``index`` of a call made with ``seed`` draws with.

    The rule, one for :func:`nnvllm.generate`, :func:`nnvllm.stream`, :func:`nnvllm.collect` (where
    ``index`` is the prompt's place in the whole list, whatever the chunk) and :func:`nnvllm.reference`:
    the first 8 bytes of ``sha256(f"{seed}:{index}")`` as a big-endian integer, shifted right by one
    bit (a signed 64-bit seed). So the rows of a seeded batch are independent draws, the same call
    draws the same tokens again, and a row can be drawn again alone with
    ``seed=[request_seed(seed, index)]``.
    """
    digest = hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def call_seed(value: Any, n: int | None = None, name: str = "seed") -> int | list[int] | None:
    """``seed=`` of a verb: None (unseeded), an int (one per request derived by :func:`request_seed`),
    or, with ``n`` prompts, a list of ``n`` ints used as they are. Returned normalised."""
    if value is None or _is_int(value) or n is None:
        return rng_seed(value, name)
    expected = (f"expected None, an int with 0 <= {name} <= 2**63 - 1 (vLLM seeds are signed 64-bit), or one "
                "such int per prompt")
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{name}={_show(value)}: {expected}")
    if len(value) != n:
        raise ValueError(f"{name} holds {len(value)} seeds for {n} prompt(s); {expected}")
    return [integer(f"{name}[{i}]", v, lo=0, hi=SEED_MAX, expected=expected) for i, v in enumerate(value)]


def request_seeds(value: int | list[int] | None, n: int, first: int = 0) -> list[int] | None:
    """One seed per request from a checked ``seed=`` (:func:`call_seed`): None unseeded; an int gives
    ``request_seed(value, first + i)`` for request ``i`` (``first``: the global index of the first
    request, :func:`nnvllm.collect`'s chunks); a list is used as it is."""
    if value is None:
        return None
    if isinstance(value, list):
        return list(value)
    return [request_seed(value, first + i) for i in range(n)]


def top_k_count(value: Any, vocab_size: int | None, name: str = "top_k") -> int:
    """``top_k=``: alternatives reported per step, ``1..vocab_size`` (only ``>= 1`` when the size is unknown)."""
    if vocab_size is None:
        return integer(name, value, lo=1, why=" (alternatives reported per step)")
    return integer(name, value, lo=1, hi=vocab_size, expected=(
        f"expected an int with 1 <= {name} <= {vocab_size} (alternatives reported per step; the model's "
        f"vocabulary has {vocab_size} tokens)"))


def checkpoint(value: Any, name: str = "path") -> str:
    """A checkpoint directory that exists, or a hub id (``name`` or ``owner/name``); returned as a str."""
    import os
    from pathlib import Path

    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={_show(value)}: expected a checkpoint directory or a hub id (str)")
    text = os.fspath(value)
    p = Path(text).expanduser()
    if p.is_dir():
        return str(p)
    if p.exists():
        raise ValueError(f"{name}={text!r} is a file; pass the model's directory (the one holding config.json)")
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name}={text!r}: no such checkpoint directory (and not a hub id such as "
                                "'openai-community/gpt2'); pass the folder that holds config.json and the weights")
    return text


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def prompts(value: Any, name: str = "prompts") -> list:
    """One prompt or a non-empty list of them; returned as a list.

    A prompt is a non-empty ``str`` or a conversation: a list of ``{"role", "content"}`` messages
    (:func:`conversation`), which :mod:`nnvllm.chat` renders with the model's chat template.
    """
    rule = (f"every prompt must be a non-empty str or a conversation, a list of {{'role', 'content'}} messages "
            f"({name} must be a str, a conversation, or a non-empty list of them)")
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name}='': {rule}; an empty prompt has no token to start from")
        return [value]
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        return [conversation(value, name)]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name}={_show(value)}: {rule}")
    items = list(value)
    if not items:
        raise ValueError(f"{name}={_show(value)} is empty: {rule}")
    out: list = []
    for i, p in enumerate(items):
        if isinstance(p, Sequence) and not isinstance(p, (str, bytes, bytearray)) and p \
                and all(isinstance(m, Mapping) for m in p):
            out.append(conversation(p, f"{name}[{i}]"))
            continue
        if isinstance(p, Mapping):
            raise TypeError(f"{name}[{i}] is a message ({_show(p)}) beside other prompts; {rule}: put the "
                            "messages of one conversation in a list of their own")
        if not isinstance(p, str):
            raise TypeError(f"{name}[{i}] is {_show(p)}; {rule}")
        if not p:
            raise ValueError(f"{name}[{i}] is ''; {rule}")
        out.append(str(p))
    return out


def conversation(value: Any, name: str = "messages") -> list[dict]:
    """A conversation: a non-empty list of messages, each a dict with a non-empty str ``role`` and a
    ``content`` that is a str, a list of text parts (``{"type": "text", "text": str}`` or str), or
    None; returned as a list of (shallow-copied) dicts."""
    rule = ("a conversation is a non-empty list of messages such as {'role': 'user', 'content': 'The capital of "
            "France is'}")
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence) or not value:
        raise (ValueError if isinstance(value, Sequence) and not value else TypeError)(f"{name}={_show(value)}: {rule}")
    out = []
    for j, m in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(m, Mapping):
            raise TypeError(f"{where} is {_show(m)}; {rule}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise (TypeError if "role" in m and not isinstance(role, str) else ValueError)(
                f"{where} has role={_show(role)}: every message needs a role, a non-empty str such as 'system', "
                "'user' or 'assistant'")
        if "content" not in m:
            raise ValueError(f"{where} has no 'content'; {rule}")
        content = m["content"]
        if content is not None and not isinstance(content, str):
            parts = content if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)) else None
            ok = parts is not None and all(
                isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") == "text"
                                       and isinstance(p.get("text"), str)) for p in parts)
            if not ok:
                raise TypeError(f"{where}['content'] is {_show(content)}: expected a str, a list of text parts "
                                "({'type': 'text', 'text': '...'}) or None; nnvllm takes text conversations")
        out.append(dict(m))
    return out


def layers(value: Any, n_layers: int, name: str = "layers") -> list[int]:
    """Block indices from ``"all"``, ``None``, an int or an iterable of ints; negatives count from the end."""
    expected = "expected 'all', an int, a list of ints or None"
    if value is None:
        return []
    if isinstance(value, str):
        if value != "all":
            raise ValueError(f"{name}={value!r}: {expected}")
        return list(range(n_layers))
    if _is_int(value):
        items, single = [value], True
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, dict)):
        items, single = list(value), False
    else:
        raise TypeError(f"{name}={_show(value)}: {expected}")
    out = []
    for i, x in enumerate(items):
        where = name if single else f"{name}[{i}]"
        if not _is_int(x):
            raise TypeError(f"{where}={_show(x)}: {name} must hold ints (block indices); {expected}")
        if not -n_layers <= x < n_layers:
            raise ValueError(f"{name}={_show(value)}: layer={x} out of range for a {n_layers}-layer model "
                             f"(0-{n_layers - 1}, or -{n_layers}..-1 from the end)")
        out.append(int(x) % n_layers)
    return out


def sites(value: Any, name: str = "sites") -> tuple[str, ...]:
    """Extra per-block sites: a name, a list of names from ``SITES[1:]``, or ``None``/``()`` for none."""
    allowed = [s for s in SITES if s != "resid"] + list(HEAD_SITES)
    expected = f"expected a list of names from {allowed}"
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, (bytes, bytearray, dict)):
        raise TypeError(f"{name}={_show(value)}: {expected}")
    items = list(value)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}]={_show(s)}: {expected}")
    bad = [s for s in items if s not in allowed]
    if bad:
        extra = " (the residual stream is always kept for the chosen layers)" if "resid" in bad else ""
        raise ValueError(f"{name}={items!r}: unknown {bad}; choose from {allowed}{extra}")
    return tuple(dict.fromkeys(items))


def sampling(*, max_tokens: Any, temperature: Any, top_p: Any, seed: Any, top_k: Any, logits: Any,
             ignore_eos: Any, n_prompts: int | None = None, vocab_size: int | None = None) -> dict:
    """Check the sampling arguments shared by ``generate`` and ``reference``; return them normalised.

    ``n_prompts``: the call's prompt count (a ``seed`` list must hold one seed each); ``vocab_size``:
    the model's vocabulary (``top_k`` may not exceed it)."""
    return {
        "max_tokens": integer("max_tokens", max_tokens, lo=1, why=" (tokens to generate per prompt)"),
        "temperature": number("temperature", temperature, lo=0.0),
        "top_p": number("top_p", top_p, lo=0.0, lo_open=True, hi=1.0),
        "seed": call_seed(seed, n_prompts),
        "top_k": top_k_count(top_k, vocab_size),
        "logits": boolean("logits", logits),
        "ignore_eos": boolean("ignore_eos", ignore_eos),
    }


def fits_context(prompt_lens: Sequence[int] | None, max_tokens: int, context: int | None) -> None:
    """Refuse a request that cannot fit the model's context (``prompt + max_tokens <= context``).

    ``prompt_lens`` (token counts, one per prompt) may be ``None`` when no tokenizer is at hand: then
    only ``max_tokens`` itself is checked. ``context`` ``None``: nothing is known, nothing is checked.
    """
    if context is None:
        return
    if max_tokens >= context:
        raise ValueError(f"max_tokens={max_tokens}: the model's context is {context} tokens, prompt included; "
                         f"expected max_tokens <= {context - 1}")
    for i, n in enumerate(prompt_lens or ()):
        if n + max_tokens > context:
            room = context - n
            fix = (f"use max_tokens <= {room}" if room >= 1 else
                   "shorten the prompt (it alone fills the context)")
            raise ValueError(
                f"prompts[{i}] is {n} tokens and max_tokens={max_tokens}: {n} + {max_tokens} = {n + max_tokens} "
                f"exceeds the model's context length of {context}; {fix}")


# ---------------------------------------------------------------- nv.load's engine arguments

DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # vLLM's names (any case)
_TORCH_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")


def dtype(value: Any, name: str = "dtype") -> Any:
    """vLLM's ``dtype=``: one of :data:`DTYPES` (any case) or ``torch.float32/float16/bfloat16``."""
    expected = (f"expected one of {list(DTYPES)} or a torch dtype ({', '.join(_TORCH_DTYPES)}); "
                "e.g. dtype='float32' for numbers comparable with transformers")
    if isinstance(value, str):
        if value.lower() not in DTYPES:
            raise ValueError(f"{name}={value!r}: {expected}")
        return value
    # A torch dtype, recognised without importing torch (this module stays free of it).
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        if str(value) not in _TORCH_DTYPES:
            raise ValueError(f"{name}={value}: {expected}")
        return value
    raise TypeError(f"{name}={_show(value)}: {expected}")


def engine_args(args: dict) -> dict:
    """Check the engine arguments :func:`nnvllm.load` knows the rules of; return them normalised.

    Only ``dtype``, ``max_model_len``, ``tensor_parallel_size``, ``exact``, ``cuda_graphs``, ``seed``,
    ``kv_cache_memory_bytes`` and ``compilation_config`` are checked here (a bad one failed deep inside
    vLLM's start, or not at all); every other argument goes to vLLM as given.
    """
    out = dict(args)
    if "dtype" in out:
        out["dtype"] = dtype(out["dtype"])
    if out.get("max_model_len") is not None:
        v = out["max_model_len"]
        expected = ("expected a positive int (the context length in tokens, prompt included), -1 to fit "
                    "what memory allows, or None for the model's own length")
        v = integer("max_model_len", v, expected=expected)
        if v < 1 and v != -1:
            raise ValueError(f"max_model_len={v}: {expected}")
        out["max_model_len"] = v
    for flag in ("exact", "cuda_graphs"):
        if flag in out:
            out[flag] = boolean(flag, out[flag])
    if "tensor_parallel_size" in out:
        out["tensor_parallel_size"] = integer(
            "tensor_parallel_size", out["tensor_parallel_size"], lo=1,
            why=" (the number of devices the model is split over; 1 for one device)")
    if "seed" in out:  # the engine's own seed (vLLM's default sampler state), not a call's
        out["seed"] = rng_seed(out["seed"])
    if out.get("kv_cache_memory_bytes") is not None:
        out["kv_cache_memory_bytes"] = parse_bytes(out["kv_cache_memory_bytes"], "kv_cache_memory_bytes")
    if out.get("compilation_config") is not None:
        out["compilation_config"] = compilation_config(out["compilation_config"])
    return out


def compilation_config(cc: Any) -> dict:
    """Refuse a ``compilation_config`` that sets the compilation mode, and return it without it:
    nnvllm sets the mode. A forward compiled with the plain hooks is traced once and vLLM drops
    Dynamo's guards (``TorchCompileWithNoGuardsWrapper``), so the hooks' state at that trace (no
    capture armed) would be baked in and every capture would read buffers nothing writes; under
    ``NNVLLM_COMPILE=1`` nnvllm compiles the forward with the taps as opaque ops instead
    (docs/capture.md). The other keys (``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``,
    ...) go to vLLM."""
    if not isinstance(cc, dict):
        raise TypeError(f"compilation_config={cc!r}: expected a dict of vLLM's compilation settings "
                        "(nnvllm sets its mode and cudagraph_mode)")
    for key in ("mode", "level"):  # ("level": vLLM's older name for the mode)
        v = cc.get(key)
        if v is None:
            continue
        name = getattr(v, "name", v)
        off = str(name).strip().upper() in ("NONE", "NO_COMPILATION", "0")
        if not off and not isinstance(v, (str, bool)):
            try:
                off = int(v) == 0
            except (TypeError, ValueError):
                off = False
        if not off:
            raise ValueError(
                f"compilation_config={{{key!r}: {v!r}}} turns torch.compile on, and nnvllm sets the mode itself: "
                "a forward compiled this way leaves out the hooks that record and edit activations, "
                f"so captures would read nothing. Leave {key!r} out of compilation_config (its other keys "
                "go to vLLM); on a GPU the engine still replays CUDA graphs (cuda_graphs=True), and "
                "NNVLLM_COMPILE=1 (set before nv.load) compiles the forward with the taps inside it.")
    return {k: v for k, v in cc.items() if k not in ("mode", "level")}


# Config keys vLLM reads a model's context length from (the smallest one present wins).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_sequence_length", "max_seq_length", "seq_len")


def _text_config(config: dict) -> dict:
    """The language model's part of a config (a multimodal one nests it under ``text_config``)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _model_context(config: dict) -> tuple[int, str] | None:
    """(the context length vLLM derives from ``config``, the key it comes from), or None if unknown.

    A RoPE scaling factor (``rope_scaling`` / ``rope_parameters``) multiplies it: an upper bound of
    what vLLM allows, so the check below never refuses a length vLLM takes."""
    cfg = _text_config(config)
    found = [(v, k) for k in _CONTEXT_KEYS if _is_int(v := cfg.get(k)) and v > 0]
    if not found:
        return None
    n, key = min(found)
    for rope in (cfg.get("rope_scaling"), cfg.get("rope_parameters")):
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
            n = int(n * factor)
    return n, key


def _kv_bytes_per_token(config: dict, args: dict) -> int | None:
    """A lower bound of the KV cache bytes one token takes in every attention layer (None where the
    config does not say plainly: latent attention, no head counts)."""
    cfg = _text_config(config)
    if cfg.get("kv_lora_rank") is not None:  # latent attention caches a compressed vector
        return None
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("hidden_size", cfg.get("n_embd"))
    head_dim = cfg.get("head_dim") or (d // heads if _is_int(d) and _is_int(heads) and heads else None)
    if not all(_is_int(x) and x > 0 for x in (layers, kv_heads, head_dim)):
        return None
    kv_dtype = str(args.get("kv_cache_dtype", "auto"))
    value = 1 if "fp8" in kv_dtype else (4 if str(args.get("dtype", "")).removeprefix("torch.") in ("float32", "float")
                                         else 2)
    return 2 * layers * kv_heads * head_dim * value  # keys and values


def engine_fits(args: dict, config: dict) -> None:
    """Refuse engine arguments the model's ``config`` (its config.json) already shows cannot work.

    ``max_model_len`` above the model's context (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set, as
    vLLM allows then), and a ``kv_cache_memory_bytes`` below what one sequence of ``max_model_len``
    tokens needs in the KV cache (vLLM refuses to start then, advising a GPU setting). Both are checked
    against lower bounds: what passes here may still be refused by vLLM at start.
    """
    import os

    if not isinstance(config, dict) or "hf_overrides" in args:
        return
    context = _model_context(config)
    asked = args.get("max_model_len")
    if context is not None and _is_int(asked) and asked > context[0] \
            and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise ValueError(f"max_model_len={asked}: the model's context is {context[0]} tokens (config.json "
                         f"{context[1]}); expected max_model_len <= {context[0]}, -1 (what memory allows) or None "
                         "(the model's own length)")
    kv = args.get("kv_cache_memory_bytes")
    per_token = _kv_bytes_per_token(config, args)
    if kv is None or per_token is None:
        return
    tokens = asked if _is_int(asked) and asked > 0 else (context[0] if context is not None else None)
    if tokens is None:
        return
    window = _text_config(config).get("sliding_window")
    if _is_int(window) and window > 0:
        tokens = min(tokens, window)
    need = per_token * tokens
    if kv < need:
        raise ValueError(
            f"kv_cache_memory_bytes={kv}: one sequence of {tokens} tokens (max_model_len) needs at least "
            f"{need:,} bytes of KV cache in this model ({per_token:,} bytes a token); pass "
            f"kv_cache_memory_bytes >= {_human_bytes(need)}, or a smaller max_model_len")


def _human_bytes(n: int) -> str:
    """A size the user can paste back: the smallest MiB (or KiB) count that holds ``n`` bytes."""
    if n >= 2**20:
        return f"'{-(-n // 2**20)}MiB'"
    return f"'{-(-n // 2**10)}KiB'"


def token_id(name: str, value: Any, vocab_size: int | None) -> int | None:
    """An int token id in ``0..vocab_size-1`` (``vocab_size`` None: only ``>= 0`` is checked)."""
    hi = None if vocab_size is None else vocab_size - 1
    rng = f"0..{hi}" if hi is not None else ">= 0"
    expected = (f"expected a token id in {rng} (the model's vocabulary has {vocab_size} tokens)"
                if hi is not None else f"expected a token id {rng}")
    return integer(name, value, lo=0, hi=hi, expected=expected)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(size: int | str, name: str = "memory_budget") -> int:
    """Return a size in bytes from an int or a string such as ``"4GB"``, ``"512MB"``, ``"1.5GiB"``.

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{name}={size!r}; expected an int of bytes or a str like '4GB'")
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ValueError(f"{name}={size!r}; expected a number and a unit, like '4GB', '512MB', "
                             "'1.5GiB', or an int of bytes") from None
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{name}={size!r}; expected a positive size")
    return n
