"""Conversations as prompts: render them as vLLM's ``LLM.chat`` does, and label every token by its part.

A prompt may be a conversation, a list of ``{"role", "content"}`` messages, wherever nnvllm takes
a prompt. :func:`render` turns one into the text and token ids the engine reads, the way vLLM's
``LLM.chat`` does: the checkpoint's chat template (or ``chat_template=``) applied by the tokenizer's
``apply_chat_template`` with ``add_generation_prompt=True`` and the template keywords
(``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), then tokenized with
``add_special_tokens=False`` (the template writes its own BOS). The engine gets those ids, so what
it runs and what the labels describe are the same tokens.

Each token gets a label (:data:`ROLES`): the role of the message whose words it carries
(``"system"``, ``"user"``, ``"assistant"``, or a template's own roles such as ``"tool"``), or
``"template"`` for what the template adds around them (role headers, special tokens, the generation
prompt). Labels come from character spans of the rendered text mapped to tokens through the
tokenizer's offsets: the conversation is rendered a second time with every message's text replaced
by a marker, and the text between the template's pieces is the messages'. A token holding any of a
message's characters carries that message's role.

Pure: the tokenizer is the one object used (no vLLM, no transformers import).

Example:
    >>> r = render(model.tokenizer, [{"role": "user", "content": "The capital of France is"}])  # doctest: +SKIP
    >>> list(zip(r.roles, r.ids))[:2]                                                        # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _validate

__all__ = ["ROLES", "TEMPLATE", "Rendered", "is_conversation", "plain_roles", "render", "render_prompts",
           "select_positions"]

TEMPLATE = "template"
#: The labels of :attr:`nnvllm.Run.roles`: a message's role for its words, ``"template"`` for the rest;
#: generated tokens are ``"assistant"``. A template's other roles (``"tool"``) label as themselves.
ROLES = ("system", "user", "assistant", TEMPLATE)

# Keywords vLLM's LLM.chat sets itself (a value in chat_template_kwargs would be overridden there).
_FIXED = ("add_generation_prompt", "continue_final_message", "tokenize", "chat_template", "conversation",
          "messages", "return_dict")
# Markers standing in for the messages' text when the template's own pieces are located: private-use
# characters that neither a template nor a tokenizer treats specially.
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class Rendered:
    """One prompt as the engine reads it.

    Attributes:
        text: the rendered text (a conversation through its chat template; a plain prompt as given).
        ids: its token ids.
        roles: one label per token (:data:`ROLES`).
    """

    text: str
    ids: list[int]
    roles: list[str]


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is one conversation: a non-empty list of dicts (messages), not a list of prompts."""
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and len(value) > 0
            and all(isinstance(m, Mapping) for m in value))


def _options(chat_template: Any, chat_template_kwargs: Any) -> tuple[str | None, dict]:
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template={_validate._show(chat_template)}: expected None (the checkpoint's own "
                        "template), a Jinja template string, the name of one of the tokenizer's templates, or "
                        "the path of a template file")
    if chat_template_kwargs is None:
        return chat_template, {}
    if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError(f"chat_template_kwargs={_validate._show(chat_template_kwargs)}: expected a dict of the "
                        "template's keywords, e.g. {'enable_thinking': False}")
    fixed = sorted(set(chat_template_kwargs) & set(_FIXED))
    if fixed:
        raise ValueError(f"chat_template_kwargs sets {fixed}: nnvllm renders a conversation as vLLM's LLM.chat "
                         "does (generation prompt added, text not tokenized by the template); pass only the "
                         "template's own keywords, such as {'enable_thinking': False}")
    return chat_template, dict(chat_template_kwargs)


def _template(tokenizer, chat_template: str | None, tools=None) -> str:
    """The Jinja source to render with, chosen as vLLM chooses it (``tokenizer.get_chat_template``):
    the given one (a template, or the name of one of the tokenizer's), else the checkpoint's (its
    ``tool_use`` one when there are ``tools``). A template file's path is read."""
    if chat_template is not None and "{" not in chat_template and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    own = getattr(tokenizer, "chat_template", None)
    if chat_template is None and not own:
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise ValueError(
            f"{name!s} has no chat template, so a conversation cannot be rendered. Pass one: "
            "chat_template=\"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}\" (a Jinja template, as vLLM's "
            "LLM.chat takes), or give a plain str prompt")
    try:
        return tokenizer.get_chat_template(chat_template, tools=tools)
    except (ValueError, KeyError, TypeError, AttributeError):  # a tokenizer without the method, or no such name
        return chat_template if chat_template is not None else own if isinstance(own, str) else own["default"]


def _content_is_parts(template: str) -> bool:
    """Whether the template loops over a message's content (OpenAI-style parts) rather than printing
    a string: vLLM's ``"auto"`` content format, read from the template's syntax tree the same way."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes

        class _Generation(jinja2.ext.Extension):  # transformers' {% generation %} tag
            tags = frozenset({"generation"})

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body).set_lineno(lineno)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                                 extensions=[_Generation, jinja2.ext.loopcontrols])
        tree = env.parse(template)
    except Exception:  # noqa: BLE001  an unparsable template: vLLM's default, strings
        return False

    def access(node, var: str, key: str | None = None) -> bool:
        if isinstance(node, (nodes.Filter, nodes.Test)):
            return node.node is not None and access(node.node, var, key)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return access(node.node, var, key)
        if key is None:
            return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var
        if isinstance(node, nodes.Getitem):
            return access(node.node, var) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        if isinstance(node, nodes.Getattr):
            return access(node.node, var) and node.attr == key
        return False

    lists, queue = {"messages"}, ["messages"]
    while queue:  # {% set loop_messages = messages[1:] %} and the like
        var = queue.pop()
        for a in tree.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and access(a.node, var) and a.target.name not in lists:
                lists.add(a.target.name)
                queue.append(a.target.name)
    loops = list(tree.find_all(nodes.For))
    items = {f.target.name for f in loops if isinstance(f.target, nodes.Name) and any(access(f.iter, v) for v in lists)}
    in_macros = {id(f) for m in tree.find_all(nodes.Macro) for f in m.find_all(nodes.For)}
    return any(any(access(f.iter, v, "content") for v in items)
               or (id(f) not in in_macros and isinstance(f.iter, nodes.Name) and f.iter.name == "content")
               for f in loops)


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [p if isinstance(p, str) else p["text"] for p in content]


def _conversation(messages: list[dict], parts: bool, template: str, texts=None) -> list[dict]:
    """The messages as vLLM hands them to the template (``parse_chat_messages``): text content as one
    string (parts joined by newlines) or as ``[{"type": "text", "text": ...}]`` parts, the fields it
    keeps (tool calls with their arguments as dicts), and ``developer`` turned into ``system`` where
    the template has no such role. ``texts``: replacement text per part (the markers)."""
    out, k = [], 0
    for m in messages:
        pieces = _texts(m.get("content"))
        if texts is not None:
            pieces = [texts[k + j] for j in range(len(pieces))]
        k += len(_texts(m.get("content")))
        msg: dict[str, Any] = {"role": m["role"],
                               "content": [{"type": "text", "text": t} for t in pieces] if parts else "\n".join(pieces)}
        if m["role"] == "assistant":
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
            if m.get("reasoning") is not None:
                msg["reasoning"] = m["reasoning"]
            if m.get("reasoning") is not None:
                msg["reasoning_content"] = m["reasoning"]
        if m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if any(m["role"] == "developer" for m in out) and "'developer'" not in template and '"developer"' not in template:
        out = [dict(m, role="system") if m["role"] == "developer" else m for m in out]
        system = [m for m in out if m["role"] == "system"]
        if len(system) > 1 or (system and out[0]["role"] != "system"):  # one system message, first
            joined = "\n\n".join(t for m in system for t in ([m["content"]] if isinstance(m["content"], str)
                                                             else [p["text"] for p in m["content"]]) if t)
            out = [{"role": "system", "content": joined}] + [m for m in out if m["role"] != "system"]
    return out


def _tool_call(call: Any) -> Any:
    """A tool call as templates take it: the function's ``arguments`` as a dict (vLLM parses a JSON
    string, and takes anything else for an empty one)."""
    import json

    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    return {**call, "function": {**call["function"], "arguments": args if isinstance(args, dict) else {}}}


def _apply(tokenizer, conversation: list[dict], template: str, kwargs: dict) -> str:
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, continue_final_message=False, **kwargs)
    except Exception as e:  # noqa: BLE001  the template refused it (roles out of order, a missing keyword)
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    if not isinstance(text, str):
        raise TypeError(f"the chat template rendered {type(text).__name__}, expected text")
    return text


def render(tokenizer, messages, *, chat_template: str | None = None,
           chat_template_kwargs: dict | None = None) -> Rendered:
    """Render one conversation as vLLM's ``LLM.chat`` does, with a role label per token.

    Args:
        tokenizer: the model's tokenizer (``model.tokenizer``; an HF tokenizer).
        messages: a list of ``{"role": ..., "content": ...}`` dicts; content is a str or a list of
            text parts (``{"type": "text", "text": ...}``).
        chat_template: None (the checkpoint's), a Jinja template string, a named template of the
            tokenizer, or a template file's path.
        chat_template_kwargs: the template's keywords, e.g. ``{"enable_thinking": False}`` (and
            ``tools``, as vLLM's ``LLM.chat`` takes them there).

    Returns:
        A :class:`Rendered`: the text, its token ids (no special tokens added beyond the
        template's), and one label per token.

    Raises:
        ValueError: the model has no chat template and none was given (the message shows one), or
            the template refused the conversation.
    """
    messages = _validate.conversation(messages)
    chat_template, kwargs = _options(chat_template, chat_template_kwargs)
    template = _template(tokenizer, chat_template, kwargs.get("tools"))
    parts = _content_is_parts(template)
    text = _apply(tokenizer, _conversation(messages, parts, template), template, kwargs)
    ids, offsets = _tokenize(tokenizer, text)
    slots = [(m["role"], t) for m in messages for t in _texts(m.get("content"))]
    roles_of_slots = [r if r != "developer" or "developer" in template else "system" for r, _ in slots]
    spans = _spans(tokenizer, messages, parts, template, kwargs, text, [t for _, t in slots])
    labelled = [(a, b, roles_of_slots[k]) for k, (a, b) in enumerate(spans) if b > a]
    return Rendered(text=text, ids=ids, roles=_token_roles(offsets, labelled))


def _tokenize(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids as vLLM tokenizes a rendered conversation (no special tokens added), and each token's
    character span (the tokenizer's offsets; for a tokenizer without them, from decoding prefixes)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    offsets, end = [], 0
    for j in range(len(ids)):
        n = len(tokenizer.decode(ids[: j + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        offsets.append((min(end, n), n))
        end = n
    return ids, offsets


def _spans(tokenizer, messages, parts, template, kwargs, text: str, pieces: list[str]) -> list[tuple[int, int]]:
    """Where each text part of the conversation lies in ``text``: the template rendered with markers
    in their place gives its own pieces, located in order in the real rendering; a template whose
    pieces change with the content falls back to finding each part after the previous one."""
    marked = _apply(tokenizer, _conversation(messages, parts, template, [_MARK.format(k) for k in range(len(pieces))]),
                    template, kwargs)
    found = [int(m.group(1)) for m in _MARKS.finditer(marked)]
    if found == list(range(len(pieces))):
        skeleton = _MARKS.split(marked)[::2]  # the template's pieces around the markers
        spans = _walk(text, skeleton, pieces)
        if spans is not None:
            return spans
    spans, pos = [], 0
    for p in pieces:
        for v in _variants(p):
            at = text.find(v, pos) if v else -1
            if at >= 0:
                spans.append((at, at + len(v)))
                pos = at + len(v)
                break
        else:
            spans.append((pos, pos))
    return spans


def _variants(piece: str) -> list[str]:
    # Templates often trim a message (Llama 3: content | trim).
    return list(dict.fromkeys([piece, piece.strip(), piece.lstrip(), piece.rstrip()]))


def _walk(text: str, skeleton: list[str], pieces: list[str]) -> list[tuple[int, int]] | None:
    if not text.startswith(skeleton[0]):
        return None
    pos, spans = len(skeleton[0]), []
    for k, p in enumerate(pieces):
        after = skeleton[k + 1]
        last = k == len(pieces) - 1
        end = next((pos + len(v) for v in _variants(p) if text.startswith(v, pos)
                    and (text[pos + len(v):] == after if last else text.startswith(after, pos + len(v)))), None)
        if end is None:  # the template changed the text: it runs to the template's next piece
            end = (len(text) - len(after) if text.endswith(after) and len(text) - len(after) >= pos else -1) if last \
                else (text.find(after, pos) if after else pos)
            if end < 0:
                return None
        spans.append((pos, end))
        pos = end + len(after)
    return spans if pos == len(text) else None


def _token_roles(offsets: list[tuple[int, int]], spans: list[tuple[int, int, str]]) -> list[str]:
    """One label per token: the role of the message characters it holds (the most of them), else template."""
    out = []
    spans = sorted(spans)
    k = 0
    for a, b in offsets:
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        got: Counter = Counter()
        j = k
        while j < len(spans) and spans[j][0] < b:
            got[spans[j][2]] += min(b, spans[j][1]) - max(a, spans[j][0])
            j += 1
        out.append(got.most_common(1)[0][0] if b > a and got else TEMPLATE)
    return out


def plain_roles(tokenizer, ids: Sequence[int]) -> list[str]:
    """Labels of a plain (str) prompt's tokens: ``"user"``, and ``"template"`` for the special tokens
    the tokenizer adds (a BOS)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) if tokenizer is not None else set()
    return [TEMPLATE if t in special else "user" for t in ids]


def render_prompts(tokenizer, prompts: list, *, chat_template: str | None = None,
                   chat_template_kwargs: dict | None = None) -> list[Rendered | None]:
    """:func:`render` for each conversation among checked ``prompts`` (:func:`nnvllm._validate.prompts`);
    None for a plain str prompt (the engine tokenizes it as vLLM's ``LLM.generate`` does)."""
    chat = [is_conversation(p) for p in prompts]
    if not any(chat):
        if chat_template is not None or chat_template_kwargs:
            raise ValueError("chat_template and chat_template_kwargs render conversations, and these prompts are "
                             "plain text; pass a conversation, e.g. [{'role': 'user', 'content': 'The capital of "
                             "France is'}], or leave the template options out")
        return [None] * len(prompts)
    if tokenizer is None:
        raise ValueError("rendering a conversation needs the model's tokenizer, and this model has none "
                         "(model.tokenizer is None); load it with nv.load(path), or pass plain str prompts")
    _options(chat_template, chat_template_kwargs)  # checked once, before any rendering
    return [render(tokenizer, p, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            if c else None for p, c in zip(prompts, chat)]


def select_positions(roles: Sequence[str], which: Any, name: str = "positions") -> list[int] | None:
    """Positions whose label matches ``which``: ``"content"`` (every label but ``"template"``), a role
    (``"user"``, ``"system"``, ``"assistant"``, ``"template"``) or a list of roles. None for ``"all"``
    or for a value that is not a role selection (ints, lists of ints: the caller's own)."""
    if isinstance(which, str):
        if which == "all":
            return None
        wanted = {which}
    elif isinstance(which, (list, tuple)) and which and all(isinstance(w, str) for w in which):
        wanted = set(which)
    else:
        return None
    known = set(ROLES) | set(roles) | {"content"}
    bad = sorted(wanted - known)
    if bad:
        raise ValueError(f"{name}={which!r}: {bad} is not a role of these positions; expected 'all', 'content' "
                         f"(every position but the template's), or roles among {sorted(set(roles) | set(ROLES))}")
    out = [p for p, r in enumerate(roles) if r in wanted or ("content" in wanted and r != TEMPLATE)]
    if not out:
        raise ValueError(f"{name}={which!r} selects no position: the labels here are {sorted(set(roles))}")
    return out
