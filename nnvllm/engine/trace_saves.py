"""What a trace's saves send back from the engine (docs/engines.md, "What a trace sends back").

nnsight's worker pickles every request's saved values once the request ends
(``nnsight.modeling.vllm.collect.dumps_compact``), and the engine unpickles them. torch pickles each
tensor's storage as a ``torch.save`` archive of its own, read back by a ``torch.load`` of its own, and
a trace that keeps a block's output at every step of every prompt saves thousands of tensors.
:func:`saves_travel_as_bytes` makes nnsight's pickler write a plain tensor as its dtype, shape, device
and raw bytes instead (protocol 5 writes the bytes straight from the tensor's memory), rebuilt by
:func:`_tensor_from_bytes` on the same device (on the CPU in an isolated engine's server:
:func:`saves_arrive_on_the_cpu`).

What arrives has the dtype, shape, device and values torch's pickling gives; a tensor arrives
contiguous, where torch's pickling keeps a transposed view's strides, and a float8 tensor, which
torch's pickling writes but cannot load back, arrives too. Anything else (a tensor subclass, one that
requires grad, a sparse or quantized tensor, one on another device) is left to nnsight's reduction.
"""

from __future__ import annotations

import pickle

import torch

__all__ = ["saves_arrive_on_the_cpu", "saves_travel_as_bytes"]

_DEVICES = ("cpu", "cuda")
_ON_THE_CPU = False  # (saves_arrive_on_the_cpu)


def _tensor_from_bytes(data, dtype: torch.dtype, shape: tuple, device: str) -> torch.Tensor:
    """The tensor :func:`_reduce_tensor` wrote: its bytes viewed as ``dtype``, on ``device``."""
    if not len(data):
        return torch.empty(shape, dtype=dtype, device="cpu" if _ON_THE_CPU else device)
    if not isinstance(data, bytearray):  # (a read-only buffer loads as bytes)
        data = bytearray(data)
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    return flat if device == "cpu" or _ON_THE_CPU else flat.to(device)


def _reduce_tensor(obj):
    """A reduction that writes ``obj``'s elements as raw bytes, or ``NotImplemented`` where torch's
    own pickling has to keep something those bytes lose (a subclass, grad, a layout, a quantizer)."""
    if (type(obj) is not torch.Tensor or obj.requires_grad or obj.layout is not torch.strided
            or obj.is_quantized or obj.device.type not in _DEVICES):
        return NotImplemented
    flat = obj.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # (nnsight's pickler writes protocol 5, which copies a PickleBuffer's memory straight into the stream)
    data = pickle.PickleBuffer(flat.view(torch.uint8).numpy())
    return _tensor_from_bytes, (data, obj.dtype, tuple(obj.shape), str(obj.device))


def saves_travel_as_bytes() -> None:
    """Make nnsight's save pickler write plain tensors as raw bytes (idempotent; called by every
    worker at model load, :class:`nnvllm.engine.worker.runner.RecordingRunner`). What it leaves alone
    still goes through nnsight's own reduction (a view of a larger storage travels as a copy)."""
    from nnsight.modeling.vllm import collect

    pickler = collect._CompactPickler
    if getattr(pickler.reducer_override, "_nnvllm", False):
        return
    nnsight_reduce = pickler.reducer_override

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            reduced = _reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
        return nnsight_reduce(self, obj)

    reducer_override._nnvllm = True
    reducer_override.__wrapped__ = nnsight_reduce
    pickler.reducer_override = reducer_override


def saves_arrive_on_the_cpu() -> None:
    """Rebuild every saved tensor this process receives on the CPU, whatever device it left from.

    For an isolated engine's server (:mod:`nnvllm.engine.server`), which sends the saves on to its
    client on the CPU (:func:`nnvllm.engine.wire.to_data`): on a GPU, each tensor would otherwise be
    copied to the device on arrival and back to the host for the reply.
    """
    global _ON_THE_CPU
    _ON_THE_CPU = True
