"""What an engine's replies may hold on their way to a client: data, never code.

A client attached to an engine (``nv.load(isolate=True)``, ``nv.load(url=..., token=...)``) reads
every reply with :func:`load_data`: JSON, or ``torch.load(weights_only=True)``, whose unpickler
builds only the types below and calls no other function, so a reply from a compromised or hostile
server cannot run code in the researcher's kernel; anything else is refused with
:class:`UnsafeReply`. (Requests go the other way: the server runs the code its clients send, which is
why it listens on loopback and wants a token.)

What travels, in both the server's :func:`to_data` (which builds a trace's reply) and the client's
:func:`load_data` (which reads it):

- tensors (``torch.Tensor``, ``torch.nn.Parameter``; moved to the CPU), ``None``, ``bool``, ``int``,
  ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``, ``torch.Size``, ``torch.dtype``,
  ``torch.device``;
- ``list``, ``tuple``, ``dict``, ``collections.OrderedDict`` and ``set`` of those (a subclass arrives as
  its plain base: a namedtuple or ``torch.topk``'s result as a tuple);
- vLLM's output objects, what ``tracer.result`` holds (``RequestOutput``, its ``CompletionOutput`` s,
  their logprobs and metrics), as a :class:`Record`: the same attribute names and values, as data.

Refused, with the saved name and its type in the message: every other object (a numpy array, a
module, a function, a user's own class). Save it as one of the above (a tensor, a number, a list).

A trace's saves travel packed (:func:`pack_tensors`, :func:`unpack_tensors`): every tensor's bytes in
one buffer, and each tensor's place in the saves as a :class:`Packed` index. ``torch.save`` writes
each tensor's storage as a record of its own and ``torch.load`` reads each back, which a trace that
keeps a block's output at every step of every prompt pays thousands of times. A tensor arrives with
its dtype, shape and values, contiguous (a ``Parameter`` as a plain tensor); one saved under two
names is still one tensor.
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["Packed", "Record", "UnsafeReply", "load_data", "pack_tensors", "to_data", "unpack_tensors"]


class UnsafeReply(RuntimeError):
    """An engine's reply held something other than data (:mod:`nnvllm.engine.wire`); nothing in it ran."""


class Record:
    """One of vLLM's output objects (``tracer.result``'s ``RequestOutput``, its ``CompletionOutput`` s)
    as an attached engine's client receives it: its data attributes under the same names
    (``result.outputs[0].token_ids``), and ``kind``, the class it was."""

    def __init__(self, kind: str, fields: dict) -> None:
        # What the unpickler calls: strings and data only, set as attributes (no method is replaced:
        # Python looks special methods up on the class).
        if not isinstance(kind, str) or not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
            raise TypeError("a Record is built from a class name and a dict of str keys")
        self.__dict__.update(fields)
        self.__dict__["kind"] = kind

    def __reduce__(self):
        fields = {k: v for k, v in self.__dict__.items() if k != "kind"}
        return (Record, (self.kind, fields))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "kind")
        return f"{self.kind}({inner})" if len(inner) < 400 else f"{self.kind}({inner[:400]}...)"

    def __eq__(self, other) -> bool:
        return isinstance(other, Record) and self.__dict__ == other.__dict__


class Packed:
    """A tensor's place in a packed reply (:func:`pack_tensors`): ``index`` names its entry in the
    layout, or is -1, "the next entry of the order" (one object for every such place, which the
    unpickler builds once)."""

    def __init__(self, index: int) -> None:
        if type(index) is not int or index < -1:  # (what the unpickler calls: an index only)
            raise TypeError("a Packed holds a tensor's index, an int >= -1")
        self.index = index

    def __reduce__(self):
        return (Packed, (self.index,))

    def __repr__(self) -> str:
        return f"Packed({self.index})"


_NEXT = Packed(-1)


def pack_tensors(x: Any) -> dict:
    """``x`` (what :func:`to_data` returned) with every tensor's bytes in one CPU buffer.

    Returns ``{"data", "buffer", "dtypes", "codes", "shapes", "offsets", "order"}``: ``data`` is ``x``
    with each tensor replaced by a :class:`Packed`; ``buffer`` a uint8 tensor; for tensor ``i``,
    ``dtypes[codes[i]]`` its dtype, ``shapes[i]`` its shape (padded with -1), ``offsets[i]`` where its
    bytes start; ``order`` the tensor of each ``Packed(-1)``, in the order a walk of ``data`` meets
    them. Everything but ``data`` is a tensor or a short list, which ``torch.load`` reads at once.
    """
    import torch

    kept: list = []
    index: dict[int, int] = {}
    order: list[int] = []

    def slot(t) -> int:
        if id(t) not in index:  # (one tensor under two names stays one)
            index[id(t)] = len(kept)
            kept.append(t)
        return index[id(t)]

    def walk(v, in_set=False):
        if type(v) in (torch.Tensor, torch.nn.Parameter):
            if in_set:  # (a set keeps one of equal members: each tensor there names its entry)
                return Packed(slot(v))
            order.append(slot(v))
            return _NEXT
        if isinstance(v, dict):
            return type(v)((k, walk(w)) for k, w in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(walk(w) for w in v)
        if isinstance(v, set):
            return {walk(w, True) for w in v}
        if isinstance(v, Record):
            return Record(v.kind, {k: walk(w) for k, w in v.__dict__.items() if k != "kind"})
        return v

    data = walk(x)
    dtypes = sorted({t.dtype for t in kept}, key=lambda d: (-d.itemsize, str(d)))
    code = {d: i for i, d in enumerate(dtypes)}
    # Widest elements first: every tensor then starts at a multiple of its own element size, which a
    # view of the buffer as its dtype needs.
    placed = sorted(range(len(kept)), key=lambda i: -kept[i].dtype.itemsize)
    raws, offsets, end = [], [0] * len(kept), 0
    for i in placed:
        t = kept[i].detach()
        t = t.resolve_conj() if t.is_conj() else t
        t = t.resolve_neg() if t.is_neg() else t
        raws.append(t.reshape(-1).contiguous().view(torch.uint8))
        offsets[i] = end
        end += raws[-1].numel()
    ndim = max((t.dim() for t in kept), default=0)
    return {
        "data": data,
        "buffer": torch.cat(raws) if raws else torch.empty(0, dtype=torch.uint8),
        "dtypes": dtypes,
        "codes": torch.tensor([code[t.dtype] for t in kept], dtype=torch.int64),
        "shapes": torch.tensor([list(t.shape) + [-1] * (ndim - t.dim()) for t in kept], dtype=torch.int64).reshape(
            len(kept), ndim),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "order": torch.tensor(order, dtype=torch.int64),
    }


def unpack_tensors(packed: Any, what: str) -> Any:
    """What :func:`pack_tensors` packed, each tensor a copy of its own bytes (``what`` names the reply
    in errors). A packing that does not fit together raises :class:`UnsafeReply`."""
    import torch

    def refuse(why: str):
        raise UnsafeReply(f"{what} is not a packed reply this client reads ({why}); it was refused")

    try:
        buffer, dtypes, data = packed["buffer"], packed["dtypes"], packed["data"]
        codes, shapes, offsets, order = (packed[k].tolist() for k in ("codes", "shapes", "offsets", "order"))
    except (KeyError, TypeError, AttributeError) as e:
        refuse(str(e))
    if not (isinstance(buffer, torch.Tensor) and buffer.dtype == torch.uint8 and buffer.dim() == 1):
        refuse("its buffer is not a 1-D uint8 tensor")
    if not (isinstance(dtypes, list) and all(isinstance(d, torch.dtype) for d in dtypes)):
        refuse("its dtypes are not a list of dtypes")
    if not len(codes) == len(shapes) == len(offsets):
        refuse("its layout's lengths differ")
    tensors = []
    for c, shape, off in zip(codes, shapes, offsets):
        shape = [n for n in shape if n != -1]
        if not (0 <= c < len(dtypes) and off >= 0 and all(n >= 0 for n in shape)):
            refuse(f"a layout entry is out of range: {(c, shape, off)}")
        n = torch.Size(shape).numel() * dtypes[c].itemsize
        if off + n > buffer.numel() or off % max(dtypes[c].itemsize, 1):
            refuse("a layout entry runs past the buffer or is not aligned")
        tensors.append(buffer[off: off + n].view(dtypes[c]).reshape(shape).clone())
    if not all(0 <= i < len(tensors) for i in order):
        refuse("its order names a tensor it does not hold")
    nexts = iter(order)

    def walk(v):
        if isinstance(v, Packed):
            i = next(nexts, None) if v.index == -1 else v.index
            if i is None or i >= len(tensors):
                refuse(f"it names tensor {i} of {len(tensors)}")
            return tensors[i]
        if isinstance(v, dict):
            return type(v)((k, walk(w)) for k, w in v.items())
        if isinstance(v, (list, tuple, set)):
            return type(v)(walk(w) for w in v)
        if isinstance(v, Record):
            return Record(v.kind, {k: walk(w) for k, w in v.__dict__.items() if k != "kind"})
        return v

    return walk(data)


def _atom_types() -> tuple:
    import torch

    return (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)


def _is_vllm_output(x) -> bool:
    return (type(x).__module__ or "").split(".")[0] == "vllm"


def _fields(x) -> dict | None:
    """The data fields of a vLLM object: a dataclass's, a msgspec Struct's, else its ``__dict__``."""
    import dataclasses

    if dataclasses.is_dataclass(x):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    names = getattr(type(x), "__struct_fields__", None)
    if names is not None:
        return {n: getattr(x, n) for n in names}
    return dict(vars(x)) if hasattr(x, "__dict__") else None


def to_data(x: Any, where: str) -> Any:
    """``x`` as what may travel (module docstring): containers copied to their plain types, vLLM's
    output objects as :class:`Record` s, tensors on the CPU. A ``TypeError`` names the first value
    that may not (``where`` and its path below it) and says what to save instead."""
    import torch

    if type(x) in (torch.Tensor, torch.nn.Parameter):
        return x.detach().cpu() if x.device.type != "cpu" else x
    if type(x) in _atom_types():
        return x
    if isinstance(x, (int, float, complex, str, bytes)) and not isinstance(x, torch.Tensor):
        # a subclass (an IntEnum, numpy's float64) as its plain base: pickled, it would name its class
        return next(base(x) for base in (int, float, complex, str, bytes) if isinstance(x, base))
    if isinstance(x, dict):
        out = collections.OrderedDict() if isinstance(x, collections.OrderedDict) else {}
        for k, v in x.items():
            out[to_data(k, f"{where} (a key)")] = to_data(v, f"{where}[{k!r}]")
        return out
    if isinstance(x, (list, tuple)):
        items = [to_data(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, set):
        return {to_data(v, f"{where} (an element)") for v in x}
    if _is_vllm_output(x) and not isinstance(x, torch.Tensor):
        fields = _fields(x)
        if fields is not None:
            kind = type(x).__name__
            return Record(kind, {k: to_data(v, f"{where}.{k}") for k, v in fields.items()})
    cls = type(x)
    raise TypeError(
        f"{where} is a {cls.__module__}.{cls.__qualname__}, which an attached engine does not send back: its "
        "replies are data only (tensors, numbers, strings, bytes, None, and lists, tuples, dicts and sets of "
        "them; vLLM's output objects as records). Save what you need from it as one of those, e.g. "
        "torch.as_tensor(...) for an array, or its fields one by one.")


def load_data(data: bytes, what: str) -> Any:
    """Read a ``torch.save`` reply (``what`` names it in errors) as data only (module docstring):
    ``torch.load(weights_only=True)`` with :class:`Record` the one class it may build. Anything
    else raises :class:`UnsafeReply`; nothing in the reply runs."""
    import io
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals([Record, Packed]):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError, UnicodeDecodeError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else "")
        raise UnsafeReply(
            f"{what} is not data this client reads ({type(e).__name__}: {detail[:300]}); it was refused and "
            "nothing in it ran. An engine's replies hold tensors, numbers, strings, bytes, None, lists, "
            "tuples, dicts and sets of them, and vLLM's outputs as records. Attach only to an nnvllm engine "
            "you trust (python -m nnvllm.engine.server)."
        ) from None
