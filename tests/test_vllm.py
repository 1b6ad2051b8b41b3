"""The seed's four vLLM cases, made to pass for real. Run as ``pytest tests/test_vllm.py --tp N``.

With ``--tp 2`` every engine here runs under tensor parallelism (CPU: one core per rank) and the
TP-only test runs too. Bounds against transformers are CPU bounds; on a GPU the ``fidelity`` fixture
(conftest.py) compares with transformers on the same GPU and calibrates each bound from
transformers' own TF32-vs-CPU distance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import nnvllm as nv
from nnvllm.reference import load_reference

PROMPT = "The capital of France is"
# Engines shared with other test files: conftest.SHARED_ENGINE_FILES.


def test_max_token_generation_yields_one_logits_row_per_token(toy):
    run = nv.generate(toy, PROMPT, max_tokens=10, ignore_eos=True, layers=None)
    assert run.logits[0].shape == (10, len(toy.tokenizer))
    assert len(run.tokens[0]) == 10
    # the same through a plain nnsight trace on this engine
    with toy.trace(PROMPT, temperature=0.0, max_tokens=10, ignore_eos=True) as tracer:
        logits = list().save()
        for _ in tracer.iter[:]:
            logits.append(toy.logits.clone())
    assert len(logits) == 10
    assert (torch.stack([x[0].cpu() for x in logits]) - run.logits[0]).abs().max() < 1e-4


def test_sampling_exposes_the_sampled_tokens(toy):
    run = nv.generate(toy, [PROMPT, "Paris is the capital of"], max_tokens=3, temperature=0.8, top_p=0.95,
                      seed=7, layers=None)
    for i in range(2):
        ids = run.samples[i].ids.tolist()
        assert ids == run.tokens[i]
        assert toy.tokenizer.decode(ids, skip_special_tokens=True) == run.text[i]
    again = nv.generate(toy, [PROMPT, "Paris is the capital of"], max_tokens=3, temperature=0.8, top_p=0.95,
                        seed=7, layers=None)
    assert again.tokens == run.tokens
    # nnsight's own model.samples agree with what the engine returned
    with toy.trace(PROMPT, temperature=0.8, top_p=0.95, max_tokens=3, seed=7) as tracer:
        samples = list().save()
        for _ in tracer.iter[:3]:  # bounded: code after an open-ended iter never runs
            samples.append(toy.samples.clone())
        result = tracer.result.save()
    assert [int(s.flatten()[0]) for s in samples] == list(result.outputs[0].token_ids)


def _mlp_act_reference(toy_path, device="cpu"):
    """{block: [pos, 4d]} GPT-2 activation outputs (c_proj's input) for PROMPT, by transformers on ``device``."""
    hf, tok = load_reference(toy_path, "float32", device)
    ref = {}
    hooks = [hf.transformer.h[i].mlp.c_proj.register_forward_pre_hook(
        lambda m, a, i=i: ref.__setitem__(i, a[0][0].cpu().clone())) for i in range(3)]
    with torch.no_grad():
        hf(torch.tensor([tok.encode(PROMPT)], device=device))
    for h in hooks:
        h.remove()
    return ref


def test_multiply_referenced_module_gives_each_block_its_own_value(toy, toy_path, tp, fidelity):
    with toy.trace(PROMPT, temperature=0.0, max_tokens=1):
        acts = torch.stack([toy.transformer.h[i].mlp.act.output.clone() for i in range(3)]).save()
    acts = acts.cpu()  # a trace's saves stay on the engine's device
    hf = fidelity.calibrated(lambda device: _mlp_act_reference(toy_path, device))
    # Under TP a trace reads the activation module's output as this rank's slice of the width
    # (nnsight gathers parallel *linear* outputs, not an activation's): rank 0 holds the first slice.
    w = acts.shape[-1]
    assert w == 256 // tp
    assert (acts[0] - acts[1]).abs().max() > 1e-2  # nnsight alone returns block 0's value twice
    for i in range(3):
        hf.check(acts[i], 1e-3, lambda r, i=i: r[i][:, :w], f"trace h[{i}].mlp.act")
    # nnvllm's own capture gathers the full width under any TP size
    run = nv.generate(toy, PROMPT, max_tokens=1, layers=[0, 1, 2], sites=("mlp_act",))
    assert run.sites["mlp_act"][0].shape[-1] == 256
    for i in range(3):
        hf.check(run.sites["mlp_act"][0][i], 1e-3, lambda r, i=i: r[i], f"generate mlp_act[{i}]")


def _zero_cfc_reference(toy_path, cols, device="cpu"):
    hf, tok = load_reference(toy_path, "float32", device)

    def zero(m, a, o):
        o = o.clone()
        o[..., cols[0]:cols[1]] = 0
        return o

    h = hf.transformer.h[0].mlp.c_fc.register_forward_hook(zero)
    with torch.no_grad():
        logits = hf(torch.tensor([tok.encode(PROMPT)], device=device)).logits[0, -1]
    h.remove()
    return logits.cpu()


def test_column_parallel_intervention_covers_full_width_and_changes_the_token(toy, toy_path, tp, fidelity):
    """Zero columns 32..224 of block 0's c_fc output: under TP=2 that spans both ranks' slices."""
    d = 64
    cols = (32, 224)
    with toy.trace(PROMPT, temperature=0.0, max_tokens=1):
        out = toy.transformer.h[0].mlp.c_fc.output[0]
        out[:, cols[0]:cols[1]] = 0
        saved = out.clone().save()
        patched = toy.logits.clone().save()
    saved, patched = saved.cpu(), patched.cpu()
    n = len(toy.tokenizer.encode(PROMPT))
    assert saved.shape == (n, 4 * d)  # the full gathered width, whatever the TP size
    assert saved[:, cols[0]:cols[1]].abs().max() == 0
    assert saved[:, : cols[0]].abs().max() > 0 and saved[:, cols[1]:].abs().max() > 0
    clean = nv.generate(toy, PROMPT, max_tokens=1, layers=None)
    assert int(patched[0].argmax()) != clean.tokens[0][0]
    hf = fidelity.calibrated(lambda device: _zero_cfc_reference(toy_path, cols, device))
    hf.check(patched[0], 1e-3, what="logits after zeroing c_fc columns")


def test_an_edit_installed_on_the_engine_runs_for_every_request(toy, toy_path, fidelity):
    """nnsight's ``model.edit`` sends its block to the engine, which runs it for every request after
    (its envoys travel as ids, nnvllm.engine.trace_payload): a trace that edits nothing itself reads
    the logits transformers computes with the same columns zeroed by a hook, and ``clear_edits``
    brings the clean logits back."""
    cols = (32, 224)
    clean = nv.generate(toy, PROMPT, max_tokens=1, layers=None)
    with toy.edit(name="zero_cfc"):
        out = toy.transformer.h[0].mlp.c_fc.output[0]
        out[:, cols[0]:cols[1]] = 0
    try:
        with toy.trace(PROMPT, temperature=0.0, max_tokens=1):
            edited = toy.logits.clone().save()
    finally:
        toy.clear_edits()
    with toy.trace(PROMPT, temperature=0.0, max_tokens=1):
        after = toy.logits.clone().save()
    hf = fidelity.calibrated(lambda device: _zero_cfc_reference(toy_path, cols, device))
    hf.check(edited.cpu()[0], 1e-3, what="logits under an installed edit")
    assert (after.cpu()[0] - clean.logits[0][0]).abs().max() < 1e-4


def test_nnsight_tracks_a_steps_requests_only_where_a_trace_or_an_installed_edit_needs_it(toy, toy_path, fidelity):
    """nnsight's runner tracks every request of a step (a record per request, its span in the batch,
    the logits and samples served to its workers) only where it has work there. The steps of
    ``nv.generate`` and of the engine's own generate run vLLM's bookkeeping alone (counted as
    ``untraced``); a trace's steps, and every step while a ``model.edit`` is installed, run nnsight's.
    Between them the trace still reads what nv.generate captures, and the installed edit still
    reaches nv.generate's request: its logits are what transformers computes with the edit's hook."""
    from vllm import SamplingParams

    from conftest import engine_kwargs

    if not getattr(toy, "_nnvllm_isolated", False):  # the shared engine is in this process (the CPU's)
        _untraced_steps(toy, toy_path, fidelity, SamplingParams)
        return
    own = nv.load(toy_path, isolate=False, **engine_kwargs(1))  # in this process: its vllm.LLM is reachable
    try:
        _untraced_steps(own, toy_path, fidelity, SamplingParams)
    finally:
        own.close()


def _untraced_steps(toy, toy_path, fidelity, SamplingParams) -> None:
    def untraced() -> int:
        return toy.llm.collective_rpc("nnvllm_step_modes", kwargs={"reset": True})[0].get("untraced", 0)

    untraced()
    run = nv.generate(toy, PROMPT, max_tokens=3, layers=None)
    assert untraced() >= 3  # the prompt's step and two decode steps, at least
    toy.llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert untraced() >= 3
    with toy.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        logits = list().save()
        for _ in tracer.iter[:3]:
            logits.append(toy.logits.clone())
    # A step that schedules nothing runs no forward and is no untraced step. Under async scheduling
    # (the GPU default) one follows a request's last token. Elsewhere the test runs one in each
    # worker: there the engine core is in this process, and its RPCs take a function.
    from vllm.v1.engine.core_client import InprocClient

    config = toy.llm.llm_engine.vllm_config
    if isinstance(toy.llm.llm_engine.engine_core, InprocClient):
        assert toy.llm.collective_rpc(_empty_step) == [True] * config.parallel_config.tensor_parallel_size
    else:  # the engine core's own process: its RPCs take method names only
        assert config.scheduler_config.async_scheduling
    assert untraced() == 0
    for step in range(3):
        assert (logits[step].cpu()[0] - run.logits[0][step].float()).abs().max() < 1e-4
    assert nv.generate(toy, PROMPT, max_tokens=3, layers=None).text == run.text
    assert untraced() >= 3  # the trace's request is not tracked after it
    cols = (32, 224)
    with toy.edit(name="zero_cfc_generate"):
        out = toy.transformer.h[0].mlp.c_fc.output[0]
        out[:, cols[0]:cols[1]] = 0
    try:
        edited = nv.generate(toy, PROMPT, max_tokens=1, layers=None)
        assert untraced() == 0
    finally:
        toy.clear_edits()
    hf = fidelity.calibrated(lambda device: _zero_cfc_reference(toy_path, cols, device))
    hf.check(edited.logits[0][0].float(), 1e-3, what="nv.generate's logits under an installed edit")
    assert (edited.logits[0][0] - run.logits[0][0]).abs().max() > 1e-2  # the edit changed them


@pytest.mark.tp
def test_tp_activations_agree_with_transformers(toy, toy_path, tp, fidelity):
    """Under --tp N every captured quantity still matches the single-device reference."""
    prompts = [PROMPT, "The Eiffel Tower is in the city of"]
    run = nv.generate(toy, prompts, max_tokens=4, sites=("mlp_in", "mlp_act"), ignore_eos=True)
    assert run.meta["tp"] == tp
    hf = fidelity.reference(toy_path, prompts, tokens=run.tokens, sites=("mlp_in", "mlp_act"))
    for i in range(2):
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"resid[{i}]")
        hf.check(run.logits[i], 1e-3, lambda r, i=i: r.logits[i], f"logits[{i}]")
        for s in ("mlp_in", "mlp_act"):
            assert run.sites[s][i].shape[-1] == 256  # gathered, not one rank's slice
            hf.check(run.sites[s][i], 1e-3, lambda r, s=s, i=i: r.sites[s][i], f"{s}[{i}]")


_TP1_SCRIPT = """
import sys, torch, nnvllm as nv
gpu = ({"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 1 << 30, "exact": True}
       if torch.cuda.is_available() else {})  # as tests/conftest.py's engine_kwargs
m = nv.load(sys.argv[1], tensor_parallel_size=1, dtype="float32", **gpu)
run = nv.generate(m, sys.argv[3:], max_tokens=4, ignore_eos=True, sites=("mlp_in",))
run.save(sys.argv[2] + "/run.pt")
res = nv.patch(m, "The capital of France is", "The capital of Italy is", " Paris", " Rome", progress=False)
torch.save(res.patched_diff, sys.argv[2] + "/patch.pt")
m.close()
"""


@pytest.mark.tp
def test_tp_vs_tp1_discrepancy_report_and_same_intervention(toy, toy_path, tp, tmp_path):
    """TP=N against TP=1 (run in a fresh process): activations, logits, tokens and a patch sweep."""
    import subprocess
    import sys

    prompts = [PROMPT, "The Eiffel Tower is in the city of"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    subprocess.run([sys.executable, "-c", _TP1_SCRIPT, toy_path, str(tmp_path), *prompts],
                   check=True, env=env, timeout=600)
    tp1 = nv.Run.load(tmp_path / "run.pt")
    tpn = nv.generate(toy, prompts, max_tokens=4, ignore_eos=True, sites=("mlp_in",))
    assert tp1.meta["tp"] == 1 and tpn.meta["tp"] == tp
    d = nv.compare(tp1, tpn, names=("tp1", f"tp{tp}"))
    s = d.summary()
    print(f"TP1 vs TP{tp}:", s)
    assert s["token_agreement"] == 1.0 and d.fork == [None, None]
    assert s["max_abs"] < 1e-3 and s["min_cosine"] > 0.9999 and s["max_kl"] < 1e-5
    assert d.per_layer("max_abs", site="mlp_in").max() < 1e-3
    # the same intervention under both: the patch sweep's logit differences agree
    res = nv.patch(toy, PROMPT, "The capital of Italy is", " Paris", " Rome", progress=False)
    diff = (res.patched_diff - torch.load(tmp_path / "patch.pt")).abs().max()
    print(f"patch sweep TP1 vs TP{tp}: max |Δ logit diff| = {float(diff):.2e}")
    assert diff < 1e-3


@pytest.mark.tp
def test_tp_logit_lens_gathers_the_unembedding(toy, toy_path, tp, fidelity):
    from test_analyses import _hf_lens_probs

    lens = nv.logit_lens(toy, PROMPT, max_tokens=2, ignore_eos=True)
    assert lens.unembed.weight.shape[0] == len(toy.tokenizer)  # every rank's vocab slice, padding dropped
    seq = toy.tokenizer.encode(PROMPT) + lens.generated[:-1]
    hf = fidelity.calibrated(lambda device: _hf_lens_probs(toy_path, seq, device))
    hf.check(lens.top_probs, 1e-4, lambda ref: ref.topk(5, dim=-1).values, "top-5 lens probs")


def _empty_step(worker) -> bool:
    """Run one engine step that schedules no token on this worker's runner."""
    from vllm.v1.core.sched.output import SchedulerOutput

    worker.model_runner.execute_model(SchedulerOutput.make_empty())
    return True


def _busy_loop_default(_worker=None) -> float:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return SpinCondition.__init__.__defaults__[-1]


@pytest.mark.tp
def test_tp_ranks_spin_briefly_after_a_read_on_cpu(toy):
    """_compat.shorter_busy_loop: on CPU the executor (here, this process: the engine core runs
    in-process) and every worker read vLLM's message queues spinning 0.1 s after a read, not vLLM's 1 s
    (spinning readers took the cores the ranks compute on)."""
    import torch

    from nnvllm.engine.compat import CPU_BUSY_LOOP_S

    if torch.cuda.is_available():
        pytest.skip("CPU engines only: on a GPU vLLM's 1 s stays")
    assert _busy_loop_default() == CPU_BUSY_LOOP_S
    assert toy.llm.collective_rpc(_busy_loop_default) == [CPU_BUSY_LOOP_S] * toy.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size


def _trace_every_step(model, prompts, steps, edit=None, site=None, kept=False, inplace=False):
    """Per prompt: every block's output (or each block's ``site`` submodule's) at every step, the rows
    of all steps concatenated ``[layer, position, width]``; with ``edit``, block 1's output is replaced
    by itself plus ``edit`` at every step (a swap; ``inplace``: added to it in place) before the later
    blocks are read. ``kept``: the trace keeps the values it is served themselves (no clone, no copy
    inside the trace)."""
    h = model.transformer.h
    with model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        for p in prompts:
            with tracer.invoke(p):
                got = list().save()
                for _ in tracer.iter[:steps]:
                    vals = []
                    for i in range(len(h)):  # in the forward's order
                        if edit is not None and i == 1 and inplace:
                            h[1].output.add_(edit.to(h[1].output.device))
                        elif edit is not None and i == 1:
                            h[1].output = h[1].output + edit.to(h[1].output.device)
                        out = (h[i] if site is None else getattr(h[i], site)).output
                        vals.append(out if kept else out.clone())
                    got.append(vals if kept else torch.stack(vals).cpu())
    step = got[0][0] if kept else got[0]  # (a step's values: a list when kept, else a tensor)
    got = got if isinstance(step, list) else [got]  # one invoke: its list itself
    return [torch.cat([torch.stack(v).cpu() if kept else v for v in g], dim=1) for g in got]


def _late_read(model, steps):
    """A trace that reads block 0's output at every step, and a submodule inside the forward (block
    1's MLP) only at step 3."""
    h = model.transformer.h
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        out = list().save()
        for step in tracer.iter[:steps]:
            h[0].output.clone()
            if step == 3:
                out.append(h[1].mlp.output.clone())
    return out


def test_a_trace_leaves_behind_what_its_block_assigns_before_reading(toy, toy_path, fidelity):
    """A name the block assigns before reading it (``got = list().save()``, then ``got.append``) does
    not travel with the trace: a value left under that name by earlier code (here one that cannot be
    pickled, a lock) neither breaks nor slows the trace, and the trace reads what transformers
    computes. A name the block reads before assigning (``scale``) travels as before."""
    import threading

    prompts, steps = [PROMPT, "Paris is the capital of"], 3
    h = toy.transformer.h
    got = threading.Lock()  # as a notebook's earlier cell may leave it; pickling it raises
    scale = 2.0
    with toy.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        for p in prompts:
            with tracer.invoke(p):
                got = list().save()
                for _ in tracer.iter[:steps]:
                    got.append(torch.stack([h[i].output.clone() * scale for i in range(len(h))]).cpu())
    run = nv.generate(toy, prompts, max_tokens=steps, ignore_eos=True)
    hf = fidelity.reference(toy_path, prompts, tokens=run.tokens)
    for i in range(len(prompts)):
        read = torch.cat(got[i], dim=1) / scale
        hf.check(read, 1e-3, lambda r, i=i: r.resid[i], f"trace resid[{i}]")


def _saves_travel_as_bytes_in_the_worker(worker) -> bool:
    from nnsight.modeling.vllm import collect

    return getattr(collect._CompactPickler.reducer_override, "_nnvllm", False)


def test_a_traces_saved_tensors_come_back_as_transformers_computes_them(toy, toy_path, fidelity):
    """Every worker writes a trace's saved tensors back as raw bytes (nnvllm.engine.trace_saves), and
    what arrives is what transformers computes: a block's output (a view into the step's rows), a
    transposed view of it, a half-precision copy, an empty slice, a 0-dim maximum, the sampled ids,
    a boolean mask, one tensor under two names (still one object), and a list of every block's output
    at every step."""
    if not getattr(toy, "_nnvllm_isolated", False):  # (an isolated engine's: tests/test_isolated.py)
        assert all(toy.llm.collective_rpc(_saves_travel_as_bytes_in_the_worker))
    _saved_tensors_arrive_as_transformers_computes_them(toy, toy_path, fidelity)


def _saved_tensors_arrive_as_transformers_computes_them(toy, toy_path, fidelity):
    prompts, steps = [PROMPT, "Paris is the capital of"], 3
    h = toy.transformer.h
    with toy.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        for p in prompts:
            with tracer.invoke(p):
                every = list().save()
                ids = list().save()
                for step in tracer.iter[:steps]:
                    every.append([h[i].output[0] if isinstance(h[i].output, tuple) else h[i].output
                                  for i in range(len(h))])
                    if step == 0:
                        first = every[0][2].save()
                        again = first.save()
                        turned = first.T.save()
                        half = first.half().save()
                        none = first[:0].save()
                        mask = (first > 0).save()
                        top = toy.logits.max().save()
                    ids.append(toy.samples)
    run = nv.generate(toy, prompts, max_tokens=steps, ignore_eos=True)
    hf = fidelity.reference(toy_path, prompts, tokens=run.tokens)
    for i in range(len(prompts)):  # (a name each invoke binds comes back as a list, one per invoke)
        read = torch.stack([torch.cat([s[b] for s in every[i]]) for b in range(len(h))]).cpu()
        hf.check(read, 1e-3, lambda r, i=i: r.resid[i], f"trace resid[{i}]")
        assert [int(x.flatten()[0]) for x in ids[i]] == run.tokens[i]
        assert again[i] is first[i] and torch.equal(first[i], every[i][0][2])
        assert torch.equal(turned[i], first[i].T) and turned[i].shape == first[i].T.shape
        assert half[i].dtype == torch.float16 and torch.equal(half[i], first[i].half())
        assert none[i].shape == (0, first[i].shape[1]) and none[i].dtype == first[i].dtype
        assert top[i].dim() == 0 and abs(float(top[i]) - float(run.logits[i][0].max())) < 1e-4
        assert torch.equal(mask[i], first[i] > 0)


def test_a_trace_of_every_step_reads_and_edits_what_nv_generate_captures(toy, tp):
    """A trace that reads every block's output at every generated step reads what ``nv.generate``
    captures (``run.resid``), whether it copies what it keeps or keeps the served values themselves;
    one that adds a vector to block 1's output at every step generates what
    ``Edit.add`` on block 1 generates; reading each block's MLP gives the ``mlp`` site. On a GPU graph
    engine the trace's decode steps replay the graphs in pieces with the trace served at the blocks'
    outputs (docs/capture.md, "nnsight traces on a graph engine"), the MLP reads run eagerly, and a
    place inside the forward first asked for in a later step is refused there (served on an eager
    engine)."""
    from conftest import same_values

    from nnvllm.engine.models import uses_cuda_graphs

    prompts, steps = [PROMPT, "Paris is the capital of", "The capital of Italy is"], 5
    edit = torch.randn(toy.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3.0
    run = nv.generate(toy, prompts, max_tokens=steps, ignore_eos=True, sites=("mlp",) if tp == 1 else ())
    read = _trace_every_step(toy, prompts, steps)
    kept = _trace_every_step(toy, prompts, steps, kept=True)  # (on a graph engine: its own copy of each step)
    for i in range(len(prompts)):
        assert same_values(read[i], run.resid[i]), (i, float((read[i] - run.resid[i]).abs().max()))
        assert same_values(kept[i], run.resid[i]), (i, float((kept[i] - run.resid[i]).abs().max()))
    steered = nv.generate(toy, prompts, max_tokens=steps, ignore_eos=True, edits=[nv.Edit.add(edit, layers=[1])])
    swapped = _trace_every_step(toy, prompts, steps, edit=edit)
    for i in range(len(prompts)):
        assert same_values(swapped[i], steered.resid[i]), (i, float((swapped[i] - steered.resid[i]).abs().max()))
        assert (swapped[i][2:] - read[i][2:]).abs().max() > 0.1  # the swap reached the blocks after it
    if tp == 1:  # (under TP a trace reads a submodule's output as this rank's slice or whole, by kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mlp = _trace_every_step(toy, prompts, steps, site="mlp")
        for i in range(len(prompts)):
            assert same_values(mlp[i], run.sites["mlp"][i])
        # On a graph engine its decode steps ran eagerly, and one notice says why; elsewhere none.
        notices = [str(w.message) for w in caught if "ran eagerly" in str(w.message)]
        if uses_cuda_graphs(toy):
            assert len(notices) == 1 and "mlp.output" in notices[0], notices
        else:
            assert not notices, notices
    if uses_cuda_graphs(toy):
        with pytest.raises(Exception, match="in pieces"):
            _late_read(toy, steps)
    else:
        assert len(_late_read(toy, steps)) == 1
