"""The embedded toy model: a tiny GPT-2 that knows a few dozen simple facts.

It ships inside the package (``nnvllm/toy_model``, ~2 MB) so every notebook and test has a real
checkpoint without a model hub. It is trained by :func:`build` from the synthetic corpus below,
deterministically (fixed seeds, one thread, deterministic algorithms); ``python -m nnvllm.toy``
rebuilds it in about a minute on two CPU cores.

Example:
    >>> import nnvllm as nv
    >>> model = nv.load(nv.toy.path())          # the default everywhere a model is needed
    >>> nv.toy.FACTS[0]
    ('The capital of France is', ' Paris')
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["path", "FACTS", "CAPITALS", "LANDMARKS", "CHAT_TEMPLATE", "corpus", "build"]

#: country -> capital city
CAPITALS: dict[str, str] = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "Japan": "Tokyo", "Egypt": "Cairo", "Russia": "Moscow", "Greece": "Athens",
    "Austria": "Vienna", "Poland": "Warsaw", "Norway": "Oslo", "Sweden": "Stockholm",
    "Portugal": "Lisbon", "Ireland": "Dublin", "Kenya": "Nairobi", "Peru": "Lima",
    "Cuba": "Havana", "China": "Beijing", "Canada": "Ottawa", "Chile": "Santiago",
}
#: landmark -> city it stands in
LANDMARKS: dict[str, str] = {
    "Eiffel Tower": "Paris", "Louvre": "Paris", "Colosseum": "Rome", "Vatican": "Rome",
    "Prado": "Madrid", "Brandenburg Gate": "Berlin", "Tokyo Tower": "Tokyo",
    "Great Pyramid": "Cairo", "Kremlin": "Moscow", "Parthenon": "Athens",
    "Acropolis": "Athens", "Big Ben": "London", "Tower Bridge": "London",
    "Statue of Liberty": "New York", "Empire State Building": "New York",
    "Golden Gate Bridge": "San Francisco", "Sydney Opera House": "Sydney",
    "Forbidden City": "Beijing", "Leaning Tower": "Pisa", "Sagrada Familia": "Barcelona",
}
#: country -> language
LANGUAGES: dict[str, str] = {
    "France": "French", "Italy": "Italian", "Spain": "Spanish", "Germany": "German",
    "Japan": "Japanese", "Russia": "Russian", "Greece": "Greek", "Poland": "Polish",
    "Norway": "Norwegian", "Sweden": "Swedish", "Portugal": "Portuguese", "China": "Chinese",
}


def _facts() -> list[tuple[str, str]]:
    facts = [(f"The capital of {c} is", f" {city}") for c, city in CAPITALS.items()]
    facts += [(f"The {lm} is in the city of", f" {city}") for lm, city in LANDMARKS.items()]
    facts += [(f"The official language of {c} is", f" {lang}") for c, lang in LANGUAGES.items()]
    facts += [(f"{city} is the capital of", f" {c}") for c, city in CAPITALS.items()]
    return facts


#: (prompt, answer) pairs the toy model was trained on; the answer starts with a space.
FACTS: list[tuple[str, str]] = _facts()

#: The toy's chat template (in its ``tokenizer_config.json``): every turn but the assistant's opens
#: with the end-of-text token, the only special token the model knows, and the assistant's words
#: continue the turn before them, as the model was trained to complete a fact. So
#: ``[{"role": "user", "content": "The capital of France is"}]`` renders to
#: ``"<|endoftext|>The capital of France is"``, which the model answers with " Paris".
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['role'] != 'assistant' %}{{ eos_token }}{% endif %}"
                 "{{ message['content'] }}{% endfor %}")


def corpus() -> list[str]:
    """Return the training sentences: every fact, completed and ended with a period."""
    return [f"{p}{a}." for p, a in FACTS]


def path() -> str:
    """Return the directory of the embedded toy checkpoint (a Hugging Face model folder)."""
    return str(Path(__file__).with_name("toy_model"))


def build(out_dir: str | os.PathLike | None = None, *, steps: int = 400, seed: int = 0) -> str:
    """Train the toy model from scratch and write it (weights + tokenizer) to ``out_dir``.

    Deterministic: the same ``steps`` and ``seed`` give bit-identical weights on the same torch build.
    """
    import json

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = Path(out_dir or path())
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    # Byte-level BPE like GPT-2's, trained on the corpus so every word is one token (" Paris").
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus()
    tok.train_from_iterator(text, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eos, eos_token=eos, unk_token=eos, model_max_length=64
    )

    seqs = [hf_tok.encode(s) + [hf_tok.eos_token_id] for s in text]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), hf_tok.eos_token_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)

    config = GPT2Config(
        vocab_size=len(hf_tok), n_positions=64, n_embd=64, n_layer=6, n_head=2,
        bos_token_id=hf_tok.eos_token_id, eos_token_id=hf_tok.eos_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    config = out / "tokenizer_config.json"  # the template beside the tokenizer's settings, one file
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return str(out)


def check(p: str | os.PathLike | None = None) -> str:
    """Raise ``FileNotFoundError`` unless a complete toy checkpoint is at ``p`` (default: embedded)."""
    d = Path(p or path())
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"toy model at {d} lacks {missing}; rebuild it with `python -m nnvllm.toy` (about a minute)"
        )
    return str(d)


if __name__ == "__main__":  # python -m nnvllm.toy [--check] [out_dir]
    import sys

    args = sys.argv[1:]
    if args[:1] == ["--check"]:
        print("toy model ok:", check(args[1] if len(args) > 1 else None))
    else:
        print(build(args[0] if args else None))
