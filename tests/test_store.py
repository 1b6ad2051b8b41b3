"""nnvllm.store: shards, the index, lazy reads, resume.

Most tests are pure: synthetic Runs, and ``collect`` driven by a synthetic stand-in for
``nnvllm.capture.generate`` (the store's bookkeeping does not depend on the engine). One test runs
the real engine on the embedded toy model.
"""

from __future__ import annotations

import hashlib
import json
import types

import pytest
import torch
from safetensors import safe_open

import nnvllm.capture
from nnvllm import store
from nnvllm.results import Run, Samples

D_MODEL, D_VOCAB, N_LAYERS = 8, 13, 3


def fake_run(prompts, max_tokens=3, layers="all", sites=(), logits=True, top_k=3, **_) -> Run:
    """What generate would return, made up deterministically from each prompt (independent of batching).

    Activations are views into one buffer per site, the way the engine may hand them over.
    """
    layer_ids = list(range(N_LAYERS)) if layers == "all" else list(layers or [])
    gens = [torch.Generator().manual_seed(int(hashlib.sha256(p.encode()).hexdigest()[:8], 16)) for p in prompts]
    prompt_ids = [[ord(c) % D_VOCAB for c in p] for p in prompts]
    steps = [max_tokens - (len(p) % 2) for p in prompts]  # some stop early
    lg = [torch.randn(s, D_VOCAB, generator=g) for s, g in zip(steps, gens)]
    samples = []
    for x in lg:
        pr = x.softmax(-1)
        top = pr.topk(top_k, -1)
        ids = top.indices[:, 0].clone()
        samples.append(Samples(ids, pr.gather(-1, ids[:, None])[:, 0], top.indices, top.values,
                               logprobs=torch.log_softmax(x, -1).gather(-1, ids[:, None])[:, 0]))
    n_pos = [len(a) + s - 1 for a, s in zip(prompt_ids, steps)]

    def acts(width, salt):
        parts = [torch.randn(len(layer_ids), n, width, generator=g) + salt for n, g in zip(n_pos, gens)]
        big = torch.cat(parts, dim=1)
        offs = [sum(n_pos[:i]) for i in range(len(prompts))]
        return [big[:, o:o + n] for o, n in zip(offs, n_pos)]

    return Run(prompts=list(prompts), prompt_ids=prompt_ids,
               tokens=[s.ids.tolist() for s in samples], text=[f"<{p}>" for p in prompts],
               logits=lg if logits else None, samples=samples,
               resid=acts(D_MODEL, 0) if layer_ids else None, layers=layer_ids,
               sites={s: acts(D_MODEL * 2, k + 1) for k, s in enumerate(sites)},
               sampling={"max_tokens": max_tokens}, meta={"engine": "synthetic"})


@pytest.fixture
def fake(monkeypatch):
    """A stand-in model, and nnvllm.capture.generate replaced by fake_run; records each call's prompts."""
    calls: list[list[str]] = []

    def generate(model, prompts, **kw):
        calls.append(list(prompts))
        if model.fail_on_call == len(calls):
            raise RuntimeError("engine died")
        return fake_run(prompts, **kw)

    monkeypatch.setattr(nnvllm.capture, "generate", generate)
    model = types.SimpleNamespace(checkpoint="fake", n_layers=N_LAYERS, tokenizer=None, fail_on_call=None,
                                  config=types.SimpleNamespace(hidden_size=D_MODEL, vocab_size=D_VOCAB))
    return model, calls


PROMPTS = [f"prompt number {i}" + "x" * (i % 3) for i in range(7)]


class _HalfPrecision(types.SimpleNamespace):
    """The stand-in model, with an engine that says it runs fp16 and at most 4 requests a step."""

    @staticmethod
    def _engine_adapter(model):
        return types.SimpleNamespace(info=lambda: {"dtype": "torch.float16", "max_num_seqs": 4})


# --- pure parts ---------------------------------------------------------------------------------


def test_parse_bytes():
    assert store.parse_bytes("4GB") == 4 * 10**9
    assert store.parse_bytes("512MB") == 512 * 10**6
    assert store.parse_bytes("1.5GiB") == 3 * 2**29
    assert store.parse_bytes(" 10 kb ") == 10_000
    assert store.parse_bytes(1234) == 1234
    for bad in ("4 parsecs", "GB", "-1GB", 0):
        with pytest.raises(ValueError, match="memory_budget"):
            store.parse_bytes(bad)
    with pytest.raises(TypeError):
        store.parse_bytes(4.0)


@pytest.mark.parametrize("policy", store.LOGITS)
def test_write_shard_layout(tmp_path, policy):
    run = fake_run(PROMPTS[:3], sites=("mlp",))
    assert not run.resid[1].is_contiguous()  # views into one buffer
    entry = store.write_shard(run, tmp_path / "s.safetensors", [10, 11, 12], policy)
    assert entry["file"] == "s.safetensors" and entry["requests"] == [10, 11, 12]
    assert entry["sha256"] == hashlib.sha256((tmp_path / "s.safetensors").read_bytes()).hexdigest()
    assert [r["positions"] for r in entry["records"]] == [run.positions(i) for i in range(3)]
    assert entry["records"][2]["tokens"] == run.tokens[2] and entry["records"][0]["prompt"] == PROMPTS[0]
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert json.loads(f.metadata()["requests"]) == [10, 11, 12]
    pos = [run.positions(i) for i in range(3)]
    assert got["offsets"].tolist() == [0, pos[0], pos[0] + pos[1], sum(pos)]
    assert torch.equal(got["resid"], torch.cat(run.resid, dim=1))
    assert torch.equal(got["sites/mlp"], torch.cat(run.sites["mlp"], dim=1))
    assert got["ids"].tolist() == [t for i in range(3) for t in run.sequence(i)]
    per_step = {"none": set(), "chosen": {"logprobs"}, "top_k": {"top_ids", "top_probs"}, "full": {"logits"}}[policy]
    assert set(got) == {"offsets", "ids", "resid", "sites/mlp"} | per_step | ({"step_offsets"} if per_step else set())
    if policy == "chosen":
        want = torch.cat([torch.log_softmax(x, -1).gather(-1, s.ids[:, None])[:, 0]
                          for x, s in zip(run.logits, run.samples)])
        assert torch.equal(got["logprobs"], want)
        assert torch.allclose(got["logprobs"].exp(), torch.cat([s.probs for s in run.samples]))  # greedy
    if policy == "full":
        assert torch.equal(got["logits"], torch.cat(run.logits))
    if policy == "top_k":
        assert torch.equal(got["top_ids"], torch.cat([s.top_ids for s in run.samples]))


def test_write_shard_refuses_what_it_cannot_write(tmp_path):
    run = fake_run(PROMPTS[:2], logits=False)
    with pytest.raises(ValueError, match="needs a run with logits"):
        store.write_shard(run, tmp_path / "s", [0, 1], "full")
    with pytest.raises(ValueError, match="request_ids has 1 entries for a run of 2"):
        store.write_shard(run, tmp_path / "s", [0], "none")
    with pytest.raises(ValueError, match="logits='some'"):
        store.write_shard(run, tmp_path / "s", [0, 1], "some")
    # With neither the engine's logprobs nor logits, "chosen" falls back to the sampler's probabilities.
    for s in run.samples:
        s.logprobs = None
    store.write_shard(run, tmp_path / "s", [0, 1], "chosen")
    with safe_open(str(tmp_path / "s"), framework="pt") as f:
        assert torch.equal(f.get_tensor("logprobs"), torch.cat([s.probs.log() for s in run.samples]))


# --- collect's bookkeeping, on the synthetic generate ------------------------------------------------


@pytest.mark.parametrize("policy", store.LOGITS)
def test_collect_reads_back_what_generate_made(tmp_path, fake, policy):
    model, calls = fake
    ds = store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=4, sites=("attn",), logits=policy,
                       batch_size=3, progress=False)
    assert [len(c) for c in calls] == [3, 3, 1]
    assert len(ds) == 7 and ds.complete and ds.layers == [0, 1, 2] and ds.sites == ["resid", "attn"]
    assert ds.widths == {"resid": D_MODEL, "attn": 2 * D_MODEL}
    assert sorted(p.name for p in ds.path.iterdir()) == ["index.json"] + [f"shard-0000{k}.safetensors" for k in range(3)]
    whole = fake_run(PROMPTS, max_tokens=4, sites=("attn",), top_k=5)  # collect's default top_k
    for i in (0, 4, 6, -1):
        r, j = ds[i], i % 7
        assert r.index == j and r.prompt == PROMPTS[j] and r.tokens == whole.tokens[j] and r.text == whole.text[j]
        assert r.ids.tolist() == whole.sequence(j)
        assert torch.equal(r.resid, whole.resid[j]) and torch.equal(r.sites["attn"], whole.sites["attn"][j])
        s = whole.samples[j]
        if policy == "chosen":
            assert torch.equal(r.logprobs, torch.log_softmax(whole.logits[j], -1).gather(-1, s.ids[:, None])[:, 0])
        if policy == "top_k":
            assert torch.equal(r.top_ids, s.top_ids) and torch.equal(r.top_probs, s.top_probs)
        if policy == "full":
            assert torch.equal(r.logits, whole.logits[j])
        if policy == "none":
            assert r.logprobs is None and r.logits is None and r.top_ids is None
    with pytest.raises(IndexError, match="request 7 out of range for a dataset of 7 requests"):
        ds[7]
    # Rows of one site and layer, in batches that cross shard boundaries.
    for site in ("resid", "attn"):
        per = whole.resid if site == "resid" else whole.sites[site]
        want = torch.cat([t[1] for t in per])
        batches = list(ds.iter_batches(site, layer=1, batch_rows=5))
        assert all(b.shape == (5, ds.widths[site]) for b in batches[:-1]) and 0 < len(batches[-1]) <= 5
        assert torch.equal(torch.cat(batches), want)
    with pytest.raises(ValueError, match="layer=5 was not collected"):
        next(ds.iter_batches("resid", layer=5))
    with pytest.raises(ValueError, match="site='mlp' was not collected"):
        next(ds.iter_batches("mlp", layer=0))
    ds.verify()
    assert "7/7 requests, 3 shards" in repr(store.open(tmp_path / "ds"))


def test_verify_finds_damaged_and_missing_shards(tmp_path, fake):
    model, _ = fake
    ds = store.collect(model, PROMPTS, tmp_path / "ds", batch_size=3, progress=False)
    p = tmp_path / "ds" / "shard-00001.safetensors"
    data = bytearray(p.read_bytes())
    data[-100:-36] = bytes(x ^ 0xFF for x in data[-100:-36])
    p.write_bytes(bytes(data))
    (tmp_path / "ds" / "shard-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard-00001.safetensors is damaged \(checksum mismatch\); "
                                         r"shard-00002.safetensors is missing"):
        ds.verify()


def test_chunks_cost_the_fewest_generate_steps():
    def plan(left, fits, wave):
        sizes = []
        while left:
            sizes.append(store._next_chunk(left, fits, wave))
            left -= sizes[-1]
        return sizes

    assert plan(1024, 283, None) == [256] * 4  # equal chunks, as few as the budget allows
    assert plan(1024, 283, 1024) == [256] * 4  # the budget holds less than a scheduler batch
    assert plan(3000, 2100, 1024) == [2048, 952]  # whole scheduler batches: 3 passes, not 2 + 2
    assert plan(1000, 5000, 1024) == [1000]
    assert plan(7, 3, None) == [3, 2, 2]
    assert plan(3, 0, None) == [1, 1, 1]  # never fewer than one prompt


def test_memory_budget_sets_the_chunk_size(tmp_path, fake):
    model, calls = fake
    model.tokenizer = lambda texts: {"input_ids": [[0] * len(t) for t in texts]}  # fake_run's: a token a char
    # (longest prompt 17 tokens + 1 for BOS + 4 steps) * (3 layers * 8 * 4 B); three chunks in flight
    each = (17 + 1 + 4) * 3 * 8 * 4
    assert store.IN_FLIGHT == 3
    store.collect(model, PROMPTS, tmp_path / "a", max_tokens=4, memory_budget=3 * 3 * each, logits="none",
                  progress=False)
    assert [len(c) for c in calls] == [3, 2, 2]  # 3 fit: as few chunks as that allows, equal
    calls.clear()
    store.collect(model, PROMPTS, tmp_path / "a2", max_tokens=4, memory_budget=3 * 3 * each - 1, progress=False)
    assert [len(c) for c in calls] == [2, 2, 2, 1]
    calls.clear()  # logits="full" adds 4 steps * 13 * 4 B a request
    store.collect(model, PROMPTS, tmp_path / "a3", max_tokens=4, memory_budget=3 * 3 * (each + 4 * 13 * 4),
                  logits="full", progress=False)
    assert [len(c) for c in calls] == [3, 2, 2]
    calls.clear()  # an engine in half precision (2 bytes a value: 6 fit) that runs 4 requests at once
    half = _HalfPrecision(**vars(model))
    half.tokenizer = model.tokenizer
    store.collect(half, PROMPTS, tmp_path / "h", max_tokens=4, memory_budget=3 * 3 * each, logits="none",
                  progress=False)
    assert [len(c) for c in calls] == [4, 3]  # one whole scheduler batch, then the rest
    calls.clear()
    model.tokenizer = None  # chars / 2 + 1 = 9 tokens: a larger first chunk, then the measured widths
    store.collect(model, PROMPTS, tmp_path / "b", max_tokens=4, memory_budget="1KB", progress=False)
    assert [len(c) for c in calls] == [1] * 7  # never fewer than one prompt


def test_interrupted_collect_resumes(tmp_path, fake):
    model, calls = fake
    model.fail_on_call = 2
    with pytest.raises(RuntimeError, match="engine died"):
        store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=2, progress=False)
    part = store.open(tmp_path / "ds")
    assert len(part) == 2 and not part.complete and part.n_prompts == 7
    with pytest.raises(IndexError, match="5 prompts not collected yet"):
        part[3]
    assert not [p for p in (tmp_path / "ds").iterdir() if p.suffix == ".tmp"]
    model.fail_on_call, calls[:] = None, []
    ds = store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=4, progress=False)
    assert calls == [PROMPTS[2:6], PROMPTS[6:]]  # only what was missing
    whole = fake_run(PROMPTS, max_tokens=3)
    assert len(ds) == 7 and all(torch.equal(ds[i].resid, whole.resid[i]) for i in range(7))
    calls.clear()
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, progress=False)  # complete: nothing to do
    assert calls == []


def test_collect_writes_while_the_engine_generates(tmp_path, fake, monkeypatch):
    """Shard k is written while chunk k + 1 is generated; a failed write raises, keeps the shards
    before it, and the collection resumes."""
    import threading

    model, calls = fake
    real = store.write_shard
    next_generate_started = threading.Event()
    overlapped = []

    def slow_first_write(run, path, ids, policy, fsync):
        if path.name == "shard-00000.safetensors":  # waits for the engine to start on chunk 1
            overlapped.append(next_generate_started.wait(timeout=20))
        return real(run, path, ids, policy, fsync)

    fake_generate = nnvllm.capture.generate

    def generate(model, prompts, **kw):
        if calls:
            next_generate_started.set()
        return fake_generate(model, prompts, **kw)

    monkeypatch.setattr(store, "write_shard", slow_first_write)
    monkeypatch.setattr(nnvllm.capture, "generate", generate)
    ds = store.collect(model, PROMPTS, tmp_path / "a", max_tokens=3, batch_size=2, progress=False)
    assert overlapped == [True] and len(ds) == 7 and ds.complete
    assert [s["file"] for s in ds._index["shards"]] == [f"shard-0000{k}.safetensors" for k in range(4)]
    ds.verify()

    def second_write_fails(run, path, ids, policy, fsync):
        if path.name == "shard-00001.safetensors":
            raise OSError("disk full")
        return real(run, path, ids, policy, fsync)

    monkeypatch.setattr(store, "write_shard", second_write_fails)
    with pytest.raises(OSError, match="disk full"):
        store.collect(model, PROMPTS, tmp_path / "b", max_tokens=3, batch_size=2, progress=False)
    part = store.open(tmp_path / "b")
    assert len(part) >= 2 and 0 in part._where and 2 not in part._where
    monkeypatch.setattr(store, "write_shard", real)
    ds = store.collect(model, PROMPTS, tmp_path / "b", max_tokens=3, batch_size=2, progress=False)
    whole = fake_run(PROMPTS, max_tokens=3)
    assert ds.complete and all(torch.equal(ds[i].resid, whole.resid[i]) for i in range(7))
    ds.verify()


def test_collect_refuses_another_dataset(tmp_path, fake):
    model, _ = fake
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(max_tokens: 3 there, 4 here\)"):
        store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=4, progress=False)
    with pytest.raises(ValueError, match="dataset of 7 other prompts"):
        store.collect(model, PROMPTS[::-1], tmp_path / "ds", max_tokens=3, progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an nnvllm dataset"):
        store.collect(model, PROMPTS, tmp_path / "junk", progress=False)
    with pytest.raises(ValueError, match="logits='probs'"):
        store.collect(model, PROMPTS, tmp_path / "x", logits="probs", progress=False)
    with pytest.raises(ValueError, match="no nnvllm dataset"):
        store.open(tmp_path / "junk")


# --- the real engine ----------------------------------------------------------------------------


def test_collect_on_the_engine_matches_generate_and_resumes(toy, tmp_path, monkeypatch):
    import nnvllm as nv

    prompts = ["The cat", "A dog ran", "Once upon a time", "the", "Hello there friend", "It was"]
    kw = {"max_tokens": 3, "sites": ("mlp",), "ignore_eos": True}
    direct = nv.generate(toy, prompts, **kw)
    ds = nv.collect(toy, prompts, tmp_path / "a", batch_size=2, progress=False, **kw)
    assert len(ds) == 6 and ds.complete

    # Bitwise on CPU. On a GPU, batches of 2 and of 6 run different GEMM tilings: fp32 rounding apart.
    tol = 1e-4 if torch.cuda.is_available() else 0.0

    def same(a, b):
        return a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= tol

    def check(ds):
        for i in range(6):
            r = ds[i]
            assert r.tokens == direct.tokens[i] and r.prompt_ids == direct.prompt_ids[i]
            assert same(r.resid, direct.resid[i]), i
            assert same(r.sites["mlp"], direct.sites["mlp"][i]), i
            want = torch.log_softmax(direct.logits[i], -1).gather(-1, direct.samples[i].ids[:, None])[:, 0]
            assert same(r.logprobs, want)

    check(ds)
    ds.verify()
    # What the chunk sizes are cut by: the engine's value size and its scheduler's batch limit (an
    # isolated engine's, on a GPU, as its server reports them; test_isolated checks that report).
    if getattr(toy, "_nnvllm_isolated", False):
        info = toy._info
        dtype, seqs = getattr(torch, info["dtype"].removeprefix("torch.")), info["max_num_seqs"]
    else:
        dtype = toy.llm.llm_engine.model_config.dtype
        seqs = toy.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    assert store._engine_facts(toy) == ({torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}[dtype], seqs)

    real = nnvllm.capture.generate
    calls, fail_on = [], [2]

    def dies_on_second_call(model, chunk, **k):
        calls.append(list(chunk))
        if len(calls) in fail_on:
            raise RuntimeError("interrupted")
        return real(model, chunk, **k)

    monkeypatch.setattr(nnvllm.capture, "generate", dies_on_second_call)
    with pytest.raises(RuntimeError, match="interrupted"):
        nv.collect(toy, prompts, tmp_path / "b", batch_size=2, progress=False, **kw)
    assert len(store.open(tmp_path / "b")) == 2
    calls.clear()
    fail_on.clear()
    ds = nv.collect(toy, prompts, tmp_path / "b", batch_size=2, progress=False, **kw)
    assert calls == [prompts[2:4], prompts[4:6]]
    check(ds)
    with pytest.raises(ValueError, match="max_tokens: 3 there, 4 here"):
        nv.collect(toy, prompts, tmp_path / "b", batch_size=2, progress=False, **{**kw, "max_tokens": 4})


def test_fsync_is_asked_for(tmp_path, fake, monkeypatch):
    """Shards and the index wait for the disk only with fsync=True (the default trusts the page cache)."""
    import os

    model, _ = fake
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    store.collect(model, PROMPTS, tmp_path / "a", max_tokens=3, batch_size=4, progress=False)
    # no shard, and no index after the one that creates the dataset
    assert not any("shard-" in p for p in synced) and sum("index.json" in p for p in synced) <= 1
    synced.clear()
    ds = store.collect(model, PROMPTS, tmp_path / "b", max_tokens=3, batch_size=4, progress=False, fsync=True)
    assert sum("shard-" in p for p in synced) == 2 and sum("index.json" in p for p in synced) >= 2
    ds.verify()
