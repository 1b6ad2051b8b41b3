"""Conversations wherever a prompt goes (nnvllm.chat): rendered as vLLM's LLM.chat renders them, every
position labelled by its part, accepted by every verb, kept by saved runs.

Two checkpoints: the toy model (its own small template: end-of-text opens each turn) and a tiny Llama
whose tokenizer carries Llama 3's chat template with its header tokens and adds a BOS to plain text
(so a rendering that let the tokenizer add special tokens would show a second BOS).
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_kwargs

import nnvllm as nv
from nnvllm import chat

TOL = 1e-3  # fp32, CPU; the fidelity fixture calibrates it on a GPU

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
SYSTEM = "Answer."
ONE = [{"role": "user", "content": "The capital of France is"}]
WITH_SYSTEM = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "The capital of Italy is"}]
MULTI = [{"role": "system", "content": "user"},  # a system prompt that reads like a role header
         {"role": "user", "content": "The capital of France is"},
         {"role": "assistant", "content": " Paris."},
         {"role": "user", "content": "The capital of Spain is "}]
CONVERSATIONS = [ONE, WITH_SYSTEM, MULTI]


@pytest.fixture(scope="session")
def llama3_path(tmp_path_factory) -> str:
    """A tiny random Llama whose tokenizer has Llama 3's chat template and header tokens and adds a BOS."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnvllm.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("llama3")
    base = tiny_checkpoint("llama", root / "base")
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.bos_token_id)])
    tok.chat_template = LLAMA3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    out = root / "chat"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["toy", "llama3"])
def engine(request, toy_path, llama3_path, tp):
    path = toy_path if request.param == "toy" else llama3_path
    model = nv.load(path, isolate=False, **engine_kwargs(tp))  # in-process: vLLM's own LLM.chat beside it
    yield request.param, path, model
    model.close()


def _vllm_chat(model, conversations, max_tokens: int, **kw):
    from vllm import SamplingParams

    return model.llm.chat(conversations, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False, **kw)


# ------------------------------------------------------------------ rendering: vLLM's LLM.chat, exactly


def test_conversations_are_the_tokens_vllms_llm_chat_runs(engine):
    kind, _, model = engine
    run = nv.generate(model, CONVERSATIONS, max_tokens=3, layers=None)
    outs = _vllm_chat(model, CONVERSATIONS, 3)
    assert run.prompt_ids == [list(o.prompt_token_ids) for o in outs]
    assert run.tokens == [list(o.outputs[0].token_ids) for o in outs]  # greedy: the same answers
    assert run.text == [o.outputs[0].text for o in outs]
    assert run.prompts == CONVERSATIONS  # as given
    if kind == "llama3":  # the template writes the BOS; the tokenizer adds no second one
        bos = model.tokenizer.bos_token_id
        assert all(ids[0] == bos and ids[1] != bos for ids in run.prompt_ids)
        assert nv.generate(model, "The capital", max_tokens=1, layers=None).prompt_ids[0][0] == bos  # plain: BOS added


def test_template_keywords_and_another_template_as_vllm_takes_them(engine):
    kind, _, model = engine
    if kind == "llama3":
        kw = {"chat_template_kwargs": {"enable_thinking": False}}
    else:
        kw = {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}"}
    run = nv.generate(model, CONVERSATIONS, max_tokens=2, layers=None, **kw)
    outs = _vllm_chat(model, CONVERSATIONS, 2, **kw)
    assert run.prompt_ids == [list(o.prompt_token_ids) for o in outs]
    plain = nv.generate(model, CONVERSATIONS, max_tokens=2, layers=None)
    assert run.prompt_ids != plain.prompt_ids  # the keywords changed the rendering
    assert run.meta["chat"] == kw
    text = run.prompt_text[0]
    assert ("<think>" in text) if kind == "llama3" else text.startswith("user: The capital of France is\nassistant:")
    # Content as OpenAI-style text parts renders as the string does.
    parts = [[{"role": "user", "content": [{"type": "text", "text": "The capital of France is"}]}]]
    assert nv.generate(model, parts, max_tokens=1, layers=None).prompt_ids == \
        [list(o.prompt_token_ids) for o in _vllm_chat(model, parts, 1)]


def test_no_template_is_an_error_that_names_the_fix(engine):
    _, _, model = engine
    tok = model.tokenizer
    own = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(ValueError, match=r"has no chat template.*chat_template="):
            nv.generate(model, ONE, max_tokens=1, layers=None)
        with pytest.raises(ValueError, match="has no chat template"):
            nv.logit_lens(model, ONE, max_tokens=1)
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        run = nv.generate(model, ONE, max_tokens=1, layers=None, chat_template=template)  # the fix works
        assert run.prompt_text == ["The capital of France is"]
    finally:
        tok.chat_template = own
    assert nv.generate(model, "The capital of France is", max_tokens=1, layers=None).text  # plain text needs none


def test_tool_calls_and_tools_render_as_vllm_renders_them(engine):
    kind, _, model = engine
    if kind != "toy":
        pytest.skip("one engine shows it; the rendering is the client's, the same for every model")
    template = ("{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m['content'] }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
                "\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "The capital of France is"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "capital", "arguments": '{"country": "France"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": " Paris"}]
    run = nv.generate(model, [conv], max_tokens=1, layers=None, chat_template=template,
                      chat_template_kwargs={"tools": tools})
    out = _vllm_chat(model, [conv], 1, chat_template=template, tools=tools)[0]
    assert run.prompt_ids[0] == list(out.prompt_token_ids)
    assert run.prompt_text[0].startswith("capital;The capital of France is") and ' Paris' in run.prompt_text[0]
    assert 'capital({"country": "France"})' in run.prompt_text[0]  # the arguments as a dict, as vLLM parses them
    assert "tool" in run.roles[0]  # the tool's answer is labelled by its role


# ------------------------------------------------------------------ roles: every position, the right spans


def test_roles_on_a_hand_checked_toy_conversation(toy_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_path)
    r = chat.render(tok, WITH_SYSTEM)
    assert r.text == "<|endoftext|>Answer.<|endoftext|>The capital of Italy is"
    assert [tok.decode([t]) for t in r.ids] == ["<|endoftext|>", "A", "n", "s", "wer", ".", "<|endoftext|>",
                                                "The", " capital", " of", " Italy", " is"]
    assert r.roles == ["template"] + ["system"] * 5 + ["template"] + ["user"] * 5
    # The same ids as transformers' apply_chat_template with the generation prompt.
    assert r.ids == tok.apply_chat_template(WITH_SYSTEM, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_roles_on_a_hand_checked_llama3_conversation(llama3_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama3_path)
    r = chat.render(tok, MULTI)
    pieces = [tok.decode([t]) for t in r.ids]
    by_role = {role: "".join(p for p, x in zip(pieces, r.roles) if x == role) for role in set(r.roles)}
    # Each message's words, trimmed as the template trims them; the rest is the template's.
    assert by_role["system"] == "user" and by_role["assistant"] == "Paris."
    assert by_role["user"] == "The capital of France is" + "The capital of Spain is"
    assert "".join(pieces) == r.text and set(by_role) == {"system", "user", "assistant", "template"}
    assert r.roles[:2] == ["template", "template"] and r.roles[-1] == "template"  # BOS, header; generation prompt
    head = r.roles.index("system")
    assert pieces[head - 3:head] == ["<|end_header_id|>", "\n", "\n"]  # the header's "system" is template
    assert r.ids == tok.apply_chat_template(MULTI, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_roles_cover_every_position_and_survive_save_and_load(engine, tmp_path):
    _, _, model = engine
    run = nv.generate(model, [MULTI, "The capital of France is"], max_tokens=4, ignore_eos=True, layers=[0])
    for i in range(len(run)):
        assert len(run.roles[i]) == run.positions(i) == len(run.sequence(i)) == run.resid[i].shape[1]
        p = len(run.prompt_ids[i])
        assert run.roles[i][p:] == ["assistant"] * 3  # the fed-back generated tokens
    assert {"system", "user", "assistant", "template"} <= set(run.roles[0][: len(run.prompt_ids[0])])
    special = set(model.tokenizer.all_special_ids)
    assert run.roles[1][: len(run.prompt_ids[1])] == ["template" if t in special else "user" for t in run.prompt_ids[1]]
    assert run.prompt_text[1] == "The capital of France is" and run.prompt_text[0] != ""
    frame = run.to_frame(by="position")
    assert list(frame["role"]) == run.roles[0] + run.roles[1]
    assert frame["generated"].sum() == 6
    run.save(tmp_path / "run.safetensors")
    back = nv.Run.load(tmp_path / "run.safetensors")
    assert back.prompts == run.prompts and back.roles == run.roles and back.prompt_text == run.prompt_text


def test_datasets_keep_conversations_and_their_roles(engine, tmp_path):
    _, _, model = engine
    prompts = [MULTI, "The capital of France is", ONE]
    run = nv.generate(model, prompts, max_tokens=2, layers=[0], ignore_eos=True)
    ds = nv.collect(model, prompts, tmp_path / "ds", max_tokens=2, layers=[0], ignore_eos=True, batch_size=2,
                    progress=False)
    for i in range(len(prompts)):
        rec = ds[i]
        assert rec.prompt == prompts[i] and rec.prompt_ids == run.prompt_ids[i]
        assert rec.roles == run.roles[i] and rec.prompt_text == run.prompt_text[i]
        assert len(rec.roles) == rec.ids.shape[0] == rec.resid.shape[1]
    written = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "ds").glob("shard-*")}
    again = nv.collect(model, prompts, tmp_path / "ds", max_tokens=2, layers=[0], ignore_eos=True, progress=False)
    assert len(again) == 3  # the same conversations are the same dataset: nothing collected again
    assert {f.name: f.stat().st_mtime_ns for f in (tmp_path / "ds").glob("shard-*")} == written
    with pytest.raises(ValueError, match="other settings"):  # another template is another dataset
        nv.collect(model, prompts, tmp_path / "ds", max_tokens=2, layers=[0], ignore_eos=True, progress=False,
                   chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


# ------------------------------------------------------------------ every verb takes a conversation


def test_conversations_match_transformers_rendering_and_capture(engine, fidelity):
    kind, path, model = engine
    convs = [MULTI, WITH_SYSTEM]
    run = nv.generate(model, convs, max_tokens=3, ignore_eos=True)
    hf = fidelity.reference(path, convs, max_tokens=3, ignore_eos=True)
    ref = hf.value
    assert run.prompt_ids == ref.prompt_ids and run.tokens == ref.tokens
    assert run.roles == ref.roles and run.prompt_text == ref.prompt_text and ref.prompts == convs
    for i in range(len(convs)):
        hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} resid[{i}]")
        hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"{kind} logits[{i}]")


def test_logit_lens_stream_and_steering_take_a_conversation(engine):
    _, _, model = engine
    lens = nv.logit_lens(model, ONE, max_tokens=2)
    run = nv.generate(model, [ONE], max_tokens=2)
    assert lens.roles == run.roles[0] and lens.labels[0] == model.tokenizer.decode([run.prompt_ids[0][0]])
    content = lens.select("content")
    keep = [p for p, r in enumerate(run.roles[0]) if r != "template"]
    assert content.positions == keep and "template" not in content.roles
    assert torch.equal(content.top_ids, lens.top_ids[:, keep])
    assert lens.select("user").positions == [p for p, r in enumerate(run.roles[0]) if r == "user"]
    frame = content.to_frame()
    assert set(frame["pos"]) == set(keep) and "template" not in set(frame["role"])
    with pytest.raises(ValueError, match="selects no position"):
        lens.select("system")

    stream = nv.stream(model, ONE, max_tokens=2)
    for _ in stream:
        pass
    assert stream.run.prompt_ids == run.prompt_ids and stream.run.roles == run.roles

    # A conversation's last token is its generation prompt's: the same vector as from its rendered ids.
    v = nv.steering_vector(model, [WITH_SYSTEM], [ONE], layer=1)
    both = nv.generate(model, [WITH_SYSTEM, ONE], max_tokens=1, layers=[1])
    want = both.resid[0][0, len(both.prompt_ids[0]) - 1] - both.resid[1][0, len(both.prompt_ids[1]) - 1]
    assert torch.allclose(v, want.float(), atol=1e-6)


def test_patch_takes_conversations_and_sweeps_the_users_words(engine):
    kind, _, model = engine
    if kind != "toy":
        pytest.skip("the toy model knows the answers patching measures; the random Llama does not")
    clean = [{"role": "user", "content": "The capital of France is"}]
    corrupt = [{"role": "user", "content": "The capital of Italy is"}]
    res = nv.patch(model, clean=clean, corrupt=corrupt, answer=" Paris", wrong=" Rome", layers=[0, 3],
                   positions="content", progress=False)
    assert res.positions == [1, 2, 3, 4, 5] and res.roles == ["user"] * 5  # position 0: the template's token
    assert res.labels[3] == " France"
    assert float(res.effect[0, 3]) > 0.9  # the country's position carries the answer at layer 0
    assert list(res.to_frame()["role"]) == ["user"] * 10
    # The same sweep over the rendered text as a plain prompt: the same tokens, the same effects.
    text = nv.patch(model, clean="<|endoftext|>The capital of France is", corrupt="<|endoftext|>The capital of Italy is",
                    answer=" Paris", wrong=" Rome", layers=[0, 3], positions=[1, 2, 3, 4, 5], progress=False)
    assert torch.allclose(res.effect, text.effect, atol=1e-5)
    users = nv.patch(model, clean=clean, corrupt=corrupt, answer=" Paris", wrong=" Rome", layers=[0],
                     positions="user", progress=False)
    assert users.positions == res.positions


def test_an_isolated_engine_runs_conversations(toy_path, tp):
    """The GPU default: the client renders, the ids cross to the engine's process (JSON for generate,
    torch's format for a stream) and the roles come back with the run."""
    if tp > 1:
        pytest.skip("the transport is the same at TP=2; a third TP=2 engine costs the CPU box ~100 s")
    model = nv.load(toy_path, isolate=True, **engine_kwargs(tp))
    try:
        run = nv.generate(model, [WITH_SYSTEM, "The capital of Italy is"], max_tokens=2, ignore_eos=True)
        r = chat.render(model.tokenizer, WITH_SYSTEM)
        assert run.prompt_ids[0] == r.ids and run.roles[0] == r.roles + ["assistant"]
        assert run.prompt_text == [r.text, "The capital of Italy is"] and run.text[1] == " Rome."
        stream = nv.stream(model, WITH_SYSTEM, max_tokens=2, ignore_eos=True)
        for _ in stream:
            pass
        assert stream.run.prompt_ids[0] == r.ids and stream.run.roles[0] == run.roles[0]
    finally:
        model.close()


# ------------------------------------------------------------------ input checks, on the client


def test_bad_conversations_are_refused_before_the_engine_runs(engine):
    _, _, model = engine
    cases = [
        ([{"role": "user"}], ValueError, r"prompts\[0\] has no 'content'"),
        ([{"role": 3, "content": "x"}], TypeError, "role=3"),
        ([{"content": "x"}], ValueError, "every message needs a role"),
        ([{"role": "user", "content": 5}], TypeError, r"\['content'\] is 5"),
        ([{"role": "user", "content": "x"}, "The capital"], TypeError, "put the messages of one conversation"),
    ]
    for prompts, exc, match in cases:
        with pytest.raises(exc, match=match):
            nv.generate(model, prompts, max_tokens=1)
    with pytest.raises(ValueError, match="chat_template and chat_template_kwargs render conversations"):
        nv.generate(model, "The capital of France is", chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        nv.generate(model, ONE, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(TypeError, match="chat_template_kwargs="):
        nv.generate(model, ONE, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ValueError, match="not a role of these positions"):
        nv.patch(model, clean=ONE, corrupt=ONE, answer=" Paris", wrong=" Rome", positions="tool")


# ------------------------------------------------------------------ pure: the rendering's own rules


def test_content_parts_templates_and_developer_messages_render_as_vllm_would(toy_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_path)
    loops = "{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}{{ c['text'] }}|{% endfor %}{% endfor %}"
    assert chat._content_is_parts(loops) and not chat._content_is_parts(LLAMA3)
    assert not chat._content_is_parts(tok.chat_template)
    r = chat.render(tok, [{"role": "user", "content": [{"type": "text", "text": "The capital"}, "of France is"]}],
                    chat_template=loops)
    assert r.text == "[user]The capital|of France is|"
    assert "".join(tok.decode([t]) for t, x in zip(r.ids, r.roles) if x == "user") == "The capitalof France is"
    # A template without a developer role gets it as the system message, as vLLM converts it.
    r = chat.render(tok, [{"role": "developer", "content": "Answer."}, {"role": "user", "content": "The capital"}],
                    chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert r.text == "<system>Answer.<user>The capital" and "system" in r.roles
    assert chat.select_positions(r.roles, "content") == [p for p, x in enumerate(r.roles) if x != "template"]
    assert chat.select_positions(r.roles, "all") is None and chat.select_positions(r.roles, [0, 1]) is None


def test_a_lens_selected_by_role_keeps_its_positions_and_a_patch_result_its_roles():
    from nnvllm.lens import Lens, Norm, Unembed, lens_topk
    from nnvllm.patching import PatchResult

    g = torch.Generator().manual_seed(0)
    u = Unembed(Norm("layernorm", torch.ones(8), torch.zeros(8)), torch.randn(20, 8, generator=g))
    resid = torch.randn(3, 7, 8, generator=g)
    ids, probs = lens_topk(resid, u, k=3)
    roles = ["template", "user", "user", "template", "user", "assistant", "assistant"]
    lens = Lens(top_ids=ids, top_probs=probs, layers=[0, 1, 2], labels=list("abcdefg"), prompt_len=5, resid=resid,
                unembed=u, roles=roles)
    user = lens.select("user")
    assert user.positions == [1, 2, 4] and user.labels == ["b", "c", "e"] and user.prompt_len == 3
    assert torch.equal(user.top_probs, probs[:, [1, 2, 4]])
    assert torch.allclose(user.prob_of(5), lens.prob_of(5)[:, [1, 2, 4]])
    assert list(user.to_frame()["pos"].unique()) == [1, 2, 4]
    assert lens.select(["user", "assistant"]).positions == lens.select("content").positions == [1, 2, 4, 5, 6]
    assert lens.select([6, 0]).roles == ["assistant", "template"]
    with pytest.raises(ValueError, match="not a role of these positions"):
        lens.select("tool")
    with pytest.raises(ValueError, match="1 roles"):
        Lens(top_ids=ids, top_probs=probs, layers=[0, 1, 2], labels=list("abcdefg"), prompt_len=5, resid=resid,
             unembed=u, roles=["user"])
    with pytest.raises(ValueError, match="2 positions but 1 roles"):
        PatchResult(effect=torch.zeros(1, 2), patched_diff=torch.zeros(1, 2), clean_diff=1.0, corrupt_diff=0.0,
                    layers=[0], positions=[1, 2], labels=["a", "b"], site="resid", answer="x", wrong="y", roles=["user"])
