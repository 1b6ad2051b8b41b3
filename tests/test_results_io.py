"""Run.save / Run.load: a safetensors file that round-trips bitwise and refuses what is unsafe or damaged.

Synthetic runs only (no engine): milliseconds.
"""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch

from nnvllm.results import Run, Samples


def make_run(n_req=3, prompt_len=4, steps=3, n_layers=3, d_model=8, d_vocab=11, sites=("attn", "mlp"),
             logits=True, views=False, dtype=torch.float32, seed=0) -> Run:
    """A run with random contents; ``views=True`` makes resid/sites views into one shared buffer,
    the way the engine may hand them over (``resid[i] = big[:, off:off + n]``)."""
    g = torch.Generator().manual_seed(seed)
    lens = [prompt_len + i for i in range(n_req)]  # unequal lengths: offsets matter
    n_pos = [n + steps - 1 for n in lens]

    def acts(width):
        if not views:
            return [torch.randn(n_layers, n, width, generator=g).to(dtype) for n in n_pos]
        big = torch.randn(n_layers, sum(n_pos), width, generator=g).to(dtype)
        offs = [sum(n_pos[:i]) for i in range(n_req)]
        return [big[:, o:o + n] for o, n in zip(offs, n_pos)]

    samples = []
    for _ in range(n_req):
        top_probs, top_ids = torch.rand(steps, d_vocab, generator=g).softmax(-1).topk(3, dim=-1)
        samples.append(Samples(top_ids[:, 0].clone(), top_probs[:, 0].clone(), top_ids, top_probs))
    return Run(
        prompts=[f"prompt {i} — é" for i in range(n_req)],
        prompt_ids=[list(range(i, i + n)) for i, n in enumerate(lens)],
        tokens=[[int(t) for t in s.ids] for s in samples],
        text=[f"out {i}\n" for i in range(n_req)],
        logits=[torch.randn(steps, d_vocab, generator=g) for _ in range(n_req)] if logits else None,
        samples=samples,
        resid=acts(d_model),
        layers=list(range(n_layers)),
        sites={s: acts(d_model + 2) for s in sites},
        sampling={"max_tokens": steps, "temperature": 0.0, "top_p": 1.0, "seed": None, "top_k": 3},
        meta={"engine": "synthetic", "model": "none", "dtype": str(dtype), "tp": 1},
    )


def assert_same(a: Run, b: Run) -> None:
    """Every field equal, tensors bitwise (dtype and shape included)."""

    def same(x, y):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)

    for f in ("prompts", "prompt_ids", "tokens", "text", "layers", "sampling", "meta"):
        assert getattr(a, f) == getattr(b, f), f
    assert (a.logits is None) == (b.logits is None) and (a.resid is None) == (b.resid is None)
    for x, y in zip(a.logits or [], b.logits or []):
        same(x, y)
    for x, y in zip(a.resid or [], b.resid or []):
        same(x, y)
    assert list(a.sites) == list(b.sites)
    for s in a.sites:
        for x, y in zip(a.sites[s], b.sites[s]):
            same(x, y)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        assert isinstance(y, Samples)
        for f in ("ids", "probs", "top_ids", "top_probs"):
            same(getattr(x, f), getattr(y, f))


@pytest.mark.parametrize("kw", [
    {},
    {"logits": False, "sites": ()},
    {"views": True},
    {"views": True, "n_layers": 1},  # contiguous views sharing one storage
    {"dtype": torch.bfloat16, "views": True},
    {"steps": 0},  # nothing generated: empty tensors
])
def test_round_trip_bitwise(tmp_path, kw):
    run = make_run(**kw)
    run.save(tmp_path / "run.safetensors")
    assert_same(run, Run.load(tmp_path / "run.safetensors"))


def test_round_trip_without_resid(tmp_path):
    run = make_run(sites=())
    run.resid, run.layers = None, []
    run.save(tmp_path / "r")
    back = Run.load(tmp_path / "r")
    assert back.resid is None and back.sites == {}
    assert_same(run, back)


def test_unserialisable_meta_is_refused(tmp_path):
    run = make_run()
    run.meta["dtype"] = torch.float32
    with pytest.raises(TypeError, match="JSON"):
        run.save(tmp_path / "r")
    assert not os.listdir(tmp_path)  # no temporary file left behind


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["torch", "pickle"])
def test_pickle_is_refused_without_running_it(tmp_path, how):
    marker = tmp_path / "pwned"
    path = tmp_path / "run.pt"
    if how == "torch":
        torch.save({"prompts": [], "evil": _Evil(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_Evil(marker)))
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"torch-pickle.*weights_only=False"):
        Run.load(path)
    assert not marker.exists()


def test_flipped_bytes_are_refused(tmp_path):
    path = tmp_path / "run.safetensors"
    make_run().save(path)
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]  # the tensor payload begins after the header
    mid = start + (len(data) - start) // 2
    for j in range(mid, mid + 64):
        data[j] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged: checksum mismatch; re-create it"):
        Run.load(path)


def test_damaged_header_is_refused(tmp_path):
    path = tmp_path / "run.safetensors"
    make_run().save(path)
    data = bytearray(path.read_bytes())
    data[9:20] = b"#" * 11
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        Run.load(path)


@pytest.mark.parametrize("keep", [0, 5, 100, -1000, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    path = tmp_path / "run.safetensors"
    make_run().save(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="truncated") as e:
        Run.load(path)
    assert str(path) in str(e.value)


def test_other_safetensors_file_is_refused(tmp_path):
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not a nnvllm.run/2 file"):
        Run.load(tmp_path / "model.safetensors")


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    from nnvllm import results

    path = tmp_path / "run.safetensors"
    old = make_run(seed=1)
    old.save(path)
    before = path.read_bytes()
    real = results._byte_views

    def dies_midway(parts):
        yield from list(real(parts))[:1]  # some bytes reach the file
        raise KeyboardInterrupt  # as if killed (Ctrl-C) during the write

    monkeypatch.setattr(results, "_byte_views", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        make_run(seed=2).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["run.safetensors"]  # the temporary file is gone
    monkeypatch.undo()
    assert_same(old, Run.load(path))


def test_run_repr_is_short_whatever_its_size():
    import torch

    from nnvllm.results import Run

    big = torch.zeros(12, 4000, 768)
    run = Run(prompts=["a"] * 3, prompt_ids=[[1]] * 3, tokens=[[2, 3]] * 3, text=[" Paris."] * 3, logits=None,
              samples=[], resid=[big] * 3, layers=list(range(12)), sites={}, meta={"engine": "vllm"})
    text = repr(run)
    assert len(text) < 200 and "3 requests" in text and "layers 0..11 (12)" in text


def test_write_safetensors_from_pieces_is_a_plain_safetensors_file(tmp_path):
    """The streaming writer: views and concatenations written piece by piece read back (with the
    safetensors library itself) as the tensors they stand for, and the digest is the file's."""
    import hashlib

    import safetensors.torch
    import torch

    from nnvllm.results import Pieces, write_safetensors

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(3, 50, 8, generator=g).to(torch.bfloat16)  # like the engine's arena
    tr = torch.randn(4, 6, generator=g).t()
    views = [buf[:, 0:7], buf[:, 7:20], buf[:, 30:31]]  # per-request slices: not contiguous
    assert not views[0].is_contiguous()
    t = {
        "cat1": Pieces.cat(views, dim=1),
        "cat0": Pieces.cat([torch.arange(5), torch.arange(3) * 7], dim=0),
        "view": Pieces.of(buf[:, 3:9]),
        "transposed": Pieces.of(tr),
        "flags": Pieces.of(torch.tensor([True, False, True])),
        "half": Pieces.of(torch.randn(2, 3, generator=g).half()),
        "empty": Pieces.of(torch.zeros(0, 4)),
        "scalar": Pieces.of(torch.tensor(2.5)),
    }
    sha = write_safetensors(tmp_path / "x.safetensors", t, {"format": "test", "k": "v"})
    assert sha == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    got = safetensors.torch.load_file(str(tmp_path / "x.safetensors"))
    want = {"cat1": torch.cat(views, dim=1), "cat0": torch.tensor([0, 1, 2, 3, 4, 0, 7, 14]),
            "view": buf[:, 3:9], "transposed": tr, "flags": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    for k, w in want.items():
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k
    with pytest.raises(ValueError, match="pieces hold"):
        write_safetensors(tmp_path / "y", {"bad": Pieces(torch.float32, (3,), [torch.zeros(2)])}, {})
    assert not (tmp_path / "y").exists()
