"""nv.stream: a generation step by step while the engine runs it.

Each streamed step must agree with the Run the stream ends with (tokens, sampling probabilities, the
logit lens's top-1 at the position that produced each token), and that Run with nv.generate's for the
same call; Stop ends the generation and keeps what was produced; leaving the loop early leaves the
engine clean. The isolated engine's stream is tested in tests/test_isolated.py.
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from conftest import same_values, seed_engine
from nnvllm.analyses import unembedding
from nnvllm.lens import lens_topk

PROMPTS = ["The capital of France is", "Paris is the capital of", "The capital of Italy is"]


# Engines shared with other test files: conftest.SHARED_ENGINE_FILES.


# (run toy first with the other engine-sharing modules, then llama: conftest._one_engine_start_each)
@pytest.fixture(scope="module", params=["llama", "toy"])
def model(request, toy_path, tiny_paths, tp):
    path = toy_path if request.param == "toy" else tiny_paths["llama"]
    return request.param, seed_engine(request.param, path, tp)


def check_steps_match_run(m, steps, run) -> None:
    """What every streamed step showed is what the final Run holds."""
    n = len(run)
    assert [sum((s.tokens[i] for s in steps), []) for i in range(n)] == run.tokens
    assert steps[-1].text == run.text
    u = unembedding(m)
    k = [0] * n
    for s in steps:
        for i in range(n):
            for j in range(len(s.tokens[i])):
                assert abs(s.probs[i][j] - float(run.samples[i].probs[k[i] + j])) < 1e-5
            k[i] += len(s.tokens[i])
            if s.tokens[i]:  # the lens at the position that produced the newest token
                pos = len(run.prompt_ids[i]) + k[i] - 2
                ids, probs = lens_topk(run.resid[i][:, pos: pos + 1], u, k=1)
                assert s.lens_ids[i].tolist() == ids[:, 0, 0].tolist()
                assert torch.allclose(s.lens_probs[i], probs[:, 0, 0], atol=1e-5)
    assert all(steps[-1].finished) or any(len(t) < run.sampling["max_tokens"] for t in run.tokens)


def test_streamed_steps_equal_the_final_run_and_generate(model):
    kind, m = model
    s = nv.stream(m, PROMPTS, max_tokens=6, ignore_eos=True)
    assert s.run is None
    steps = list(s)
    # Usually one token per prompt per step; an engine core in its own process (a GPU) may deliver a
    # prompt's first token a step late, or two tokens in one step: the tokens and the lens at each
    # step's newest token are what must match (check_steps_match_run).
    assert len(steps) >= 2 and steps[0].lens_ids.shape == (len(PROMPTS), m.n_layers)
    check_steps_match_run(m, steps, s.run)
    ref = nv.generate(m, PROMPTS, max_tokens=6, ignore_eos=True)
    assert s.run.tokens == ref.tokens and not s.stopped
    for i in range(len(PROMPTS)):
        assert same_values(s.run.resid[i], ref.resid[i]) and same_values(s.run.logits[i], ref.logits[i])
    assert "running" not in repr(s) and "done" in repr(s)


def test_stop_keeps_what_was_produced_and_break_leaves_the_engine_clean(model):
    kind, m = model
    # An in-process engine checks the stop at every step. An isolated one (llama under TP=2:
    # conftest.seed_engine; every engine of the GPU lane) generates ahead of the frames its client
    # reads, so on a loaded machine a stop called mid-stream can land after the last token: the run is
    # then whole at its full length. A stop called before the first step travels with the request and
    # cuts on every engine.
    isolated = getattr(m, "_nnvllm_isolated", False)
    n = 40
    s = nv.stream(m, PROMPTS[:2], max_tokens=n, ignore_eos=True, layers=[0, -1])
    for step in s:
        if step.index == 2:
            s.stop()
    assert s.stopped and sum(map(len, s.run.tokens)) >= 3, [len(t) for t in s.run.tokens]
    assert all(1 <= len(t) <= n if isolated else 1 <= len(t) < n for t in s.run.tokens), \
        [len(t) for t in s.run.tokens]
    assert s.steps[0].lens_ids.shape == (2, 2)
    check_steps_match_run(m, s.steps, s.run)
    for i in range(2):  # the Run is whole for the tokens it has
        assert s.run.resid[i].shape[1] == len(s.run.prompt_ids[i]) + len(s.run.tokens[i]) - 1
    s = nv.stream(m, PROMPTS[:2], max_tokens=n, ignore_eos=True, layers=[0, -1])
    s.stop()
    steps = list(s)
    assert s.stopped and steps and all(1 <= len(t) < n for t in s.run.tokens), [len(t) for t in s.run.tokens]
    check_steps_match_run(m, s.steps, s.run)
    clean = nv.generate(m, PROMPTS[:2], max_tokens=3, ignore_eos=True)
    s = nv.stream(m, PROMPTS[:2], max_tokens=40, ignore_eos=True, edits=[nv.Edit.scale(0.5, layers=0)])
    for step in s:
        if step.index == 1:
            break  # abandon it: the generation is aborted and the edit disarmed
    again = nv.generate(m, PROMPTS[:2], max_tokens=3, ignore_eos=True)
    assert again.tokens == clean.tokens and same_values(again.resid[0], clean.resid[0])


def test_a_steered_stream_equals_the_steered_generate(model):
    kind, m = model
    v = torch.randn(m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    edits = [nv.Edit.add(v, layers=[1], scale=3.0, prompts=[0])]
    s = nv.stream(m, PROMPTS[:2], max_tokens=4, ignore_eos=True, edits=edits)
    steps = list(s)
    ref = nv.generate(m, PROMPTS[:2], max_tokens=4, ignore_eos=True, edits=edits)
    assert s.run.tokens == ref.tokens and same_values(s.run.resid[0], ref.resid[0])
    check_steps_match_run(m, steps, s.run)
    assert s.run.meta["edits"] == ref.meta["edits"]


def test_bad_stream_arguments_are_refused_before_the_engine_runs(model):
    kind, m = model
    with pytest.raises(ValueError, match="max_tokens"):
        nv.stream(m, PROMPTS[0], max_tokens=0)
    with pytest.raises(ValueError, match="prompt"):
        nv.stream(m, [], max_tokens=2)
    with pytest.raises(ValueError, match="the call has 1 prompt"):
        nv.stream(m, PROMPTS[0], edits=[nv.Edit.scale(2.0, layers=0, prompts=[1])])
    assert nv.generate(m, PROMPTS[0], max_tokens=2).tokens  # the engine keeps working
