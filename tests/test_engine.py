"""Foundation: the engine runs for real on CPU, matches transformers, refuses bad input clearly."""

from __future__ import annotations

import json

import pytest
import torch

import nnvllm as nv
from nnvllm.reference import load_reference


def test_greedy_tokens_equal_transformers_on_all_toy_facts(toy, toy_path):
    prompts = [p for p, _ in nv.toy.FACTS]
    run = nv.generate(toy, prompts, max_tokens=3, layers=None, logits=False)
    ref = nv.reference(toy_path, prompts, max_tokens=3, layers=None, logits=False)
    assert run.tokens == ref.tokens
    assert run.prompt_ids == ref.prompt_ids


def _hidden_states(path, prompt, device="cpu"):
    hf, tok = load_reference(path, "float32", device)
    with torch.no_grad():
        hs = hf(torch.tensor([tok.encode(prompt)], device=device), output_hidden_states=True).hidden_states
    return [x[0].cpu() for x in hs]


def test_block_output_through_a_trace_equals_transformers(toy, toy_path, fidelity):
    """Bounds are CPU bounds; on a GPU the ``fidelity`` fixture (conftest.py) calibrates them."""
    prompt = "The Eiffel Tower is in the city of"
    with toy.trace(prompt, temperature=0.0, max_tokens=1):
        h = torch.stack([toy.transformer.h[i].output.clone() for i in range(6)]).save()
    h = h.cpu()  # a trace's saves stay on the engine's device
    ref = fidelity.calibrated(lambda device: _hidden_states(toy_path, prompt, device))
    hs = ref.value
    for i in range(toy.n_layers - 1):  # HF's last hidden state has ln_f applied; compare the rest
        assert h[i].shape == hs[i + 1].shape
        ref.check(h[i], 1e-3, lambda r, i=i: r[i + 1], f"block {i} output")
    hf, _ = load_reference(toy_path)
    with torch.no_grad():
        last = hf.transformer.ln_f(h[-1])
    ref.check(last, 1e-3, lambda r: r[-1], "ln_f(last block output)")


def test_toy_model_is_small_and_shipped():
    import os

    size = sum(os.path.getsize(os.path.join(nv.toy.path(), f)) for f in os.listdir(nv.toy.path()))
    assert size <= 10 * 2**20
    cfg = json.load(open(os.path.join(nv.toy.path(), "config.json")))
    assert cfg["architectures"] == ["GPT2LMHeadModel"]


def test_toy_model_knows_its_facts(toy):
    prompts = [p for p, _ in nv.toy.FACTS]
    run = nv.generate(toy, prompts, max_tokens=1, layers=None, logits=False)
    tok = toy.tokenizer
    right = sum(run.tokens[i][0] == tok.encode(a)[0] for i, (_, a) in enumerate(nv.toy.FACTS))
    assert right / len(prompts) >= 0.95, f"{right}/{len(prompts)} facts right"


def test_toy_answer_becomes_top1_only_at_later_layers(toy_path):
    """Logit lens (final norm + tied unembedding) at the last prompt position, on transformers."""
    hf, tok = load_reference(toy_path)
    first = []
    for prompt, answer in nv.toy.FACTS:
        a = tok.encode(answer)[0]
        with torch.no_grad():
            hs = hf(torch.tensor([tok.encode(prompt)]), output_hidden_states=True).hidden_states[1:]
        top = [int(hf.lm_head(hf.transformer.ln_f(h[0, -1]) if j < len(hs) - 1 else h[0, -1]).argmax()) == a
               for j, h in enumerate(hs)]
        first.append(top.index(True) if True in top else len(hs))
    at_layer0 = sum(f == 0 for f in first) / len(first)
    assert at_layer0 <= 0.05, f"answer already top-1 after block 0 for {at_layer0:.0%} of facts"
    assert sorted(first)[len(first) // 2] >= 1  # median fact resolves after block 0
    assert sum(f < len(hs) for f in first) / len(first) >= 0.95  # and by the last block


def test_toy_subject_patch_moves_the_answer(toy_path):
    """Writing France's residual (block 0, subject position) into the Italy prompt makes it say Paris."""
    hf, tok = load_reference(toy_path)
    clean, corrupt = "The capital of France is", "The capital of Italy is"
    c_ids, x_ids = tok.encode(clean), tok.encode(corrupt)
    assert len(c_ids) == len(x_ids)
    subj = [i for i, (a, b) in enumerate(zip(c_ids, x_ids)) if a != b]
    assert len(subj) == 1
    saved = {}
    def first(o):
        return o[0] if isinstance(o, tuple) else o

    h0 = hf.transformer.h[0].register_forward_hook(lambda m, a, o: saved.__setitem__("x", first(o).clone()))
    with torch.no_grad():
        hf(torch.tensor([c_ids]))
    h0.remove()

    def patch(m, a, o):
        out = first(o).clone()
        out[0, subj[0]] = saved["x"][0, subj[0]]
        return (out,) + tuple(o[1:]) if isinstance(o, tuple) else out

    h1 = hf.transformer.h[0].register_forward_hook(patch)
    with torch.no_grad():
        patched = hf(torch.tensor([x_ids])).logits[0, -1]
    h1.remove()
    with torch.no_grad():
        base = hf(torch.tensor([x_ids])).logits[0, -1]
    paris, rome = tok.encode(" Paris")[0], tok.encode(" Rome")[0]
    assert int(base.argmax()) == rome
    assert int(patched.argmax()) == paris


def test_bad_inputs_give_clear_errors(tmp_path, toy):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        nv.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        nv.load(str(tmp_path / "empty"))
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match="nnvllm knows the layout of"):
        nv.load(str(bad))
    with pytest.raises(TypeError, match="checkpoint directory or a hub id"):
        nv.load(42)
    with pytest.raises(ValueError, match="layer=40 out of range for a 6-layer model"):
        nv.generate(toy, "The capital of France is", layers=[40])
    with pytest.raises(TypeError, match="prompts must be"):
        nv.generate(toy, [1, 2])
    with pytest.raises(ValueError, match="sites="):
        nv.generate(toy, "x", sites=("nope",))
    # and the engine still works afterwards
    assert nv.generate(toy, "The capital of Italy is", max_tokens=1, layers=None).text[0] == " Rome"


def test_c_level_start_up_warnings_stay_out_of_the_notebook():
    # torch's C++ "NUMA binding" warning is printed at C level, past %%capture, in every CPU load cell,
    # and vLLM's INFO lines would fill a script's output: neither may show. One fresh process: a load with the defaults (quiet),
    # then, as the control, a load with NNVLLM_VERBOSE=1 and vLLM's logger (and its handlers) back at INFO. (Two processes,
    # one per setting, cost ~50 s of CPU on the 2-core box, ~25 s each importing vLLM.)
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the C-level stderr of an in-process start is only redirected for the CPU engine")
    code = (
        "import logging, os, sys\n"
        "import nnvllm as nv\n"
        "m = nv.load(); print('LOG', 'NUMA binding' in (m.start_log or ''), flush=True); m.close()\n"
        "print('=== verbose', flush=True)\n"
        "os.environ['NNVLLM_VERBOSE'] = '1'; lg = logging.getLogger('vllm'); lg.setLevel(logging.INFO)\n"
        "for h in lg.handlers: h.setLevel(logging.INFO)\n"
        "m = nv.load(); m.close()\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "NNVLLM_VERBOSE")}
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300, env=base)
    assert p.returncode == 0, p.stdout[-2000:]
    quiet, _, loud = p.stdout.partition("=== verbose\n")
    assert loud, p.stdout[-2000:]

    def info_lines(text):
        return sum(" INFO " in ln for ln in text.splitlines())

    # vLLM's start-up INFO lines: many when asked for, none by default
    assert info_lines(loud) > 10 and info_lines(quiet) == 0, (info_lines(loud), info_lines(quiet))
    if "LOG True" not in quiet:
        pytest.skip("this machine's torch prints no NUMA warning at engine start")
    # written by C++ to fd 2 during the quiet start: kept in model.start_log, not on stderr
    assert "NUMA binding" not in quiet
