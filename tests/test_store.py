"""nnvllm.store: shards, the index, lazy reads, resume.

Most tests are pure: synthetic Runs, and ``collect`` driven by a synthetic stand-in for
``nnvllm.capture.generate`` (the store's bookkeeping does not depend on the engine). One test runs
the real engine on the embedded toy model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import types

import pytest
import torch
from safetensors import safe_open

import nnvllm.capture
from nnvllm import store
from nnvllm.arch import arch_for
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
    """A stand-in model, and nnvllm.capture.generate replaced by fake_run; records each call's prompts
    (and in ``model.seeds`` each call's ``seed=``)."""
    calls: list[list[str]] = []

    def generate(model, prompts, **kw):
        calls.append(list(prompts))
        model.seeds.append(kw.get("seed"))
        if model.fail_on_call == len(calls):
            raise RuntimeError("engine died")
        return fake_run(prompts, **kw)

    monkeypatch.setattr(nnvllm.capture, "generate", generate)
    model = types.SimpleNamespace(checkpoint="fake", n_layers=N_LAYERS, tokenizer=None, fail_on_call=None, seeds=[],
                                  arch=arch_for(["GPT2LMHeadModel"]),
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
    calls.clear()  # a budget that holds one request at a time: chunks of one
    store.collect(model, PROMPTS, tmp_path / "one", max_tokens=4, memory_budget=3 * each, progress=False)
    assert [len(c) for c in calls] == [1] * 7
    calls.clear()  # less than that: refused before anything is written
    with pytest.raises(ValueError, match=rf"memory_budget='1KB' holds less than one request: one takes about "
                                         rf"{each:,} bytes.*memory_budget >= {3 * each:,}"):
        store.collect(model, PROMPTS, tmp_path / "b", max_tokens=4, memory_budget="1KB", progress=False)
    with pytest.raises(ValueError, match="memory_budget=1 holds less than one request"):
        store.collect(model, PROMPTS, tmp_path / "b", max_tokens=4, memory_budget=1, progress=False)
    assert calls == [] and not (tmp_path / "b").exists()


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


# Each bad argument is refused before the dataset folder is made; the corrected call then works.
BAD_COLLECT = [
    ({"seed": "x"}, TypeError, "seed='x'"),
    ({"seed": -1}, ValueError, "seed=-1"),
    ({"seed": [1, 2]}, ValueError, "seed holds 2 seeds for 7 prompt(s)"),
    ({"layers": 99}, ValueError, "layer=99 out of range for a 3-layer model"),
    ({"sites": ["bogus"]}, ValueError, "unknown ['bogus']"),
    ({"sites": ["mlp"], "layers": None}, ValueError, "needs layers"),
    ({"max_tokens": 0}, ValueError, "max_tokens=0"),
    ({"temperature": "hot"}, TypeError, "temperature='hot'"),
    ({"top_p": 0}, ValueError, "top_p=0"),
    ({"top_k": 0}, ValueError, "top_k=0"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos='no'"),
    ({"batch_size": 0}, ValueError, "batch_size=0"),
    ({"batch_size": 2.5}, TypeError, "batch_size=2.5"),
    ({"memory_budget": "lots"}, ValueError, "memory_budget='lots'"),
    ({"progress": "yes"}, TypeError, "progress='yes'"),
    ({"fsync": 1}, TypeError, "fsync=1"),
    ({"logits": "probs"}, ValueError, "logits='probs'"),
]


@pytest.mark.parametrize("kw,exc,needle", BAD_COLLECT, ids=[repr(r[0]) for r in BAD_COLLECT])
def test_collect_checks_every_argument_before_writing(tmp_path, fake, kw, exc, needle):
    model, calls = fake
    with pytest.raises(exc) as info:
        store.collect(model, PROMPTS, tmp_path / "ds", **{"max_tokens": 3, "progress": False, **kw})
    assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "ds").exists() and calls == []
    ds = store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    assert ds.complete
    with pytest.raises(TypeError, match="expected a model from nv.load"):
        store.collect(object(), PROMPTS, tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()


def test_a_seed_gives_each_prompt_its_own_draw_whatever_the_chunks(tmp_path, fake):
    """Each chunk's generate gets one seed per request, from the prompt's index in the whole list."""
    from nnvllm._validate import request_seed

    model, _ = fake
    want = [request_seed(5, i) for i in range(len(PROMPTS))]
    assert len(set(want)) == len(PROMPTS) and want != [request_seed(6, i) for i in range(len(PROMPTS))]
    for b in (2, 3, 7):
        model.seeds.clear()
        store.collect(model, PROMPTS, tmp_path / f"b{b}", seed=5, temperature=1.0, batch_size=b, progress=False)
        assert [x for chunk in model.seeds for x in chunk] == want, b
    model.seeds.clear()
    store.collect(model, PROMPTS, tmp_path / "none", temperature=1.0, batch_size=3, progress=False)
    assert model.seeds == [None] * 3
    model.seeds.clear()  # a list: one seed per prompt, used as given
    store.collect(model, PROMPTS, tmp_path / "list", seed=list(range(7)), temperature=1.0, batch_size=4,
                  progress=False)
    assert model.seeds == [[0, 1, 2, 3], [4, 5, 6]]
    assert store.open(tmp_path / "list").settings["seed"] == list(range(7))


def _shard_bytes(path):
    return bytearray(path.read_bytes())


def _flip_a_bit(path, tensor="resid"):
    """Flip one bit inside ``tensor``'s data of a safetensors file (same size, other numbers)."""
    data = _shard_bytes(path)
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + n])[tensor]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_resume_redoes_a_truncated_or_damaged_shard(tmp_path, fake):
    model, calls = fake
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    whole = fake_run(PROMPTS, max_tokens=3)
    truncated = tmp_path / "ds" / "shard-00001.safetensors"
    truncated.write_bytes(bytes(_shard_bytes(truncated)[:-50]))
    _flip_a_bit(tmp_path / "ds" / "shard-00002.safetensors")
    calls.clear()
    with pytest.warns(UserWarning, match=r"shard-00001.safetensors is \d[\d,]* bytes where the index lists "
                                         r".*truncated.*shard-00002.safetensors is damaged \(checksum mismatch\); "
                                         r"its 4 request\(s\) are collected again"):
        ds = store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    assert calls == [PROMPTS[3:6], PROMPTS[6:]]  # only the requests of the bad shards
    assert ds.complete and all(torch.equal(ds[i].resid, whole.resid[i]) for i in range(7))
    ds.verify()
    calls.clear()
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    assert calls == []  # sound shards: nothing to redo
    (tmp_path / "ds" / ds._index["shards"][0]["file"]).unlink()  # a missing shard is redone too
    with pytest.warns(UserWarning, match="is missing; its 3 request"):
        store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    assert calls == [PROMPTS[:3]]


def test_reads_check_each_shard_and_name_the_file(tmp_path, fake):
    model, _ = fake
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    want = fake_run(PROMPTS, max_tokens=3).resid
    shard = tmp_path / "ds" / "shard-00001.safetensors"  # requests 3-5
    clean = bytes(shard.read_bytes())
    _flip_a_bit(shard)
    ds = store.open(tmp_path / "ds")
    assert torch.equal(ds[0].resid, want[0])  # another shard still reads
    with pytest.raises(ValueError, match=r"dataset shard '.*shard-00001.safetensors' is damaged \(checksum "
                                         r"mismatch\); its requests 3-5 cannot be read"):
        ds[4]
    with pytest.raises(ValueError, match="shard-00001.safetensors' is damaged"):
        next(b for b in ds.iter_batches("resid", layer=0, batch_rows=10**6))
    unchecked = store.open(tmp_path / "ds", check=False)  # the sha256 is skipped: the flipped bit reads
    assert [torch.equal(unchecked[i].resid, want[i]) for i in (3, 4, 5)] == [True, False, True]
    shard.write_bytes(clean[:-50])  # a truncated shard: the size is checked even unchecked
    for d in (store.open(tmp_path / "ds"), store.open(tmp_path / "ds", check=False)):
        with pytest.raises(ValueError, match=r"shard-00001.safetensors' is [\d,]+ bytes where the index lists"):
            d[3]
    # A damaged header, same size: unchecked, safetensors' own error comes back naming the file.
    header = bytearray(clean)
    header[8:16] = b"\xff" * 8
    shard.write_bytes(bytes(header))
    with pytest.raises(ValueError, match=r"dataset shard '.*shard-00001.safetensors' cannot be read \(Safetensor"):
        store.open(tmp_path / "ds", check=False)[3]
    shard.write_bytes(clean)
    assert torch.equal(store.open(tmp_path / "ds")[4].resid, want[4])


def test_what_a_dataset_returns_is_its_own_memory(tmp_path, fake):
    """Records and batches are copies, not views of the memory-mapped shard: a shard rewritten in
    place afterwards leaves them as they were (a view of a file truncated in place kills the process
    when touched)."""
    model, _ = fake
    ds = store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    want = fake_run(PROMPTS, max_tokens=3)
    rec, batch = ds[4], next(ds.iter_batches("resid", layer=1, batch_rows=10**6))
    for shard in (tmp_path / "ds").glob("shard-*.safetensors"):
        data = _shard_bytes(shard)
        n = int.from_bytes(data[:8], "little")
        data[8 + n:] = bytes(len(data) - 8 - n)  # every tensor's data zeroed, in place
        with shard.open("r+b") as f:
            f.write(bytes(data))
    assert torch.equal(rec.resid, want.resid[4]) and rec.ids.tolist() == want.sequence(4)
    assert torch.equal(batch, torch.cat([t[1] for t in want.resid]))


@pytest.mark.parametrize("name", ["../outside/x.safetensors", "/etc/passwd", "..", "sub/shard.safetensors", "",
                                  None, 7])
def test_an_index_cannot_name_a_file_outside_the_dataset(tmp_path, fake, name):
    model, calls = fake
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    (tmp_path / "outside").mkdir()
    shutil.copy(tmp_path / "ds" / "shard-00000.safetensors", tmp_path / "outside" / "x.safetensors")
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][0]["file"] = name
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json' is damaged: shards\[0\].file=.* is not a file name inside "
                                         r"the dataset folder"):
        store.open(tmp_path / "ds")
    calls.clear()
    with pytest.raises(ValueError, match="is not a file name inside the dataset folder"):
        store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    assert calls == []


def _mangle(index, how):
    shards = index["shards"]
    {"no shards": lambda: index.pop("shards"),
     "shards not a list": lambda: index.update(shards={"a": 1}),
     "no settings": lambda: index.pop("settings"),
     "unknown logits policy": lambda: index["settings"].update(logits="most"),
     "n_requests a string": lambda: index.update(n_requests="7"),
     "a request out of range": lambda: shards[1]["requests"].append(99),
     "a request listed twice": lambda: shards[1]["requests"].__setitem__(0, 0),
     "records shorter than requests": lambda: shards[0]["records"].pop(),
     "a record without a prompt": lambda: shards[0]["records"][0].pop("prompt"),
     "an entry not a dict": lambda: shards.__setitem__(0, "shard-00000.safetensors"),
     "no sha256": lambda: shards[2].pop("sha256"),
     "bytes negative": lambda: shards[2].update(bytes=-1),
     "layers not ints": lambda: index.update(layers=["a"]),
     "widths not ints": lambda: index.update(widths={"resid": "8"}),
     }[how]()


@pytest.mark.parametrize("how", ["no shards", "shards not a list", "no settings", "unknown logits policy",
                                 "n_requests a string", "a request out of range", "a request listed twice",
                                 "records shorter than requests", "a record without a prompt", "an entry not a dict",
                                 "no sha256", "bytes negative", "layers not ints", "widths not ints"])
def test_a_crafted_index_is_refused_with_what_is_wrong(tmp_path, fake, how):
    """Not a bare KeyError or IndexError from deep inside: a ValueError naming the index and the entry."""
    model, _ = fake
    store.collect(model, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, progress=False)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    _mangle(index, how)
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json' is damaged: .*Re-create the dataset"):
        store.open(tmp_path / "ds")


def test_a_file_is_not_a_dataset(tmp_path):
    (tmp_path / "f.txt").write_text("not a dataset")
    with pytest.raises(ValueError, match=r"'.*f.txt' is a file, not a dataset"):
        store.open(tmp_path / "f.txt")
    with pytest.raises(ValueError, match="is a file, not a dataset"):
        store.Dataset(str(tmp_path / "f.txt"))
    with pytest.raises(TypeError, match="path=42"):
        store.Dataset(42)


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


def test_a_seeded_collect_draws_what_one_generate_draws_whatever_the_chunks(toy, tmp_path):
    """Each prompt draws with the seed of its index in the whole list: chunks of 2, of 3 or one chunk
    draw the same tokens as one nv.generate over every prompt, and identical prompts draw apart."""
    import nnvllm as nv

    prompts = ["The capital of"] * 5 + ["Paris is", "The cat"]
    kw = {"max_tokens": 4, "temperature": 1.5, "seed": 11, "layers": [1]}
    direct = nv.generate(toy, prompts, **kw)
    assert len({tuple(t) for t in direct.tokens[:5]}) > 1
    for b in (2, 3, None):
        ds = nv.collect(toy, prompts, tmp_path / f"b{b}", batch_size=b, progress=False, **kw)
        assert [ds[i].tokens for i in range(len(prompts))] == direct.tokens, b


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
