"""Build the tiny default model that ships inside the package (``tgis/embedded_model/data/``).

The server serves this model when no model is named, so the project runs and its tests pass
with nothing downloaded from a model hub. It is a real (if very small) Llama model with a real
byte-level BPE tokenizer, trained just long enough to produce English-like text.

How to run
----------
``make tiny-model`` (which runs ``.venv/bin/python scripts/build_tiny_model.py``). By default
the files are written into ``tgis/embedded_model/data/`` (the package's ``MODEL_DIR``),
replacing what is there; ``--output DIR`` writes elsewhere. ``--steps N`` changes the number
of training steps (fewer steps: faster, worse text; the shipped model uses the default).
The build takes about five minutes on two CPU cores and needs no network and no GPU.

Corpus
------
English prose that every Python installation carries: the docstrings of a fixed, sorted list
of standard-library modules (``STDLIB_MODULES``), of their public classes and functions, and
of those classes' public methods, read from the running interpreter (CPython 3.11 for the
shipped files). Each docstring is cleaned: doctest examples (``>>>`` / ``...`` lines and the
output that follows them up to the next blank line) are dropped, whitespace is collapsed to
single spaces, docstrings of fewer than ``MIN_DOC_WORDS`` words and exact duplicates are
dropped. About 4,000 documents, 1 MB of text. In the token stream every document is
``<s> text </s>``, so the model learns both how text starts and where it ends.

Tokenizer
---------
A byte-level BPE (``tokenizers`` library): ByteLevel pre-tokenizer with
``add_prefix_space=False``, the full 256-byte initial alphabet (so any UTF-8 text round-trips
exactly and ``<unk>`` is never produced), ByteLevel decoder, ``VOCAB_SIZE`` tokens in all.
Special tokens, in Llama's order: ``<unk>`` = 0, ``<s>`` (BOS) = 1, ``</s>`` (EOS) = 2,
``<pad>`` = 3. A TemplateProcessing post-processor puts BOS in front of every encoding made
with ``add_special_tokens=True``. Written as ``tokenizer.json`` plus ``tokenizer_config.json``
(``PreTrainedTokenizerFast``) and ``special_tokens_map.json`` for ``transformers``, with a
chat template in Llama 2's chat format (``chat_template.jinja``, ``CHAT_TEMPLATE``), so
``/v1/chat/completions`` serves the embedded model.

Architecture
------------
``LlamaForCausalLM``: hidden size 256, 4 layers, 4 query heads and 2 key/value heads
(grouped-query attention, head dim 64), SwiGLU MLP of 688, RMSNorm, RoPE (theta 10000),
1024 positions, input and output embeddings tied (``model.safetensors`` has no
``lm_head.weight``). 3,950,848 parameters, stored in bfloat16 in ``model.safetensors``
(config ``dtype`` and ``torch_dtype``: ``bfloat16``); the whole directory is about 8.2 MB
(the limit is 10 MB). ``generation_config.json`` carries the BOS/EOS/pad ids.

Training
--------
Next-token prediction in float32 on random windows of ``SEQ_LEN`` tokens of the concatenated
corpus, ``BATCH_SIZE`` windows a step, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),
linear warm-up then cosine decay of the learning rate, gradient clipping at 1.0.

Determinism
-----------
Same Python (docstrings), ``torch`` and ``tokenizers`` versions give the same files: module
and attribute lists are sorted, the tokenizer trainer is deterministic, all randomness comes
from ``SEED`` (``random.seed``, ``torch.manual_seed`` and a seeded ``torch.Generator`` that
picks the training windows), torch runs with ``torch.set_num_threads(2)`` and
``torch.use_deterministic_algorithms(True)``, and the step count is fixed (not time-based).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "tgis" / "embedded_model" / "data"

SEED = 1234
NUM_THREADS = 2

# Corpus.
MIN_DOC_WORDS = 8
_MODULE_NAMES = """
    abc argparse array ast asyncio asyncio.base_events asyncio.events asyncio.futures
    asyncio.locks asyncio.queues asyncio.streams asyncio.subprocess asyncio.tasks base64 bdb
    binascii bisect builtins bz2 calendar cmath cmd code codecs codeop collections
    collections.abc colorsys compileall concurrent.futures configparser contextlib contextvars
    copy copyreg csv ctypes dataclasses datetime dbm decimal difflib dis doctest email
    email.message email.parser email.policy email.utils encodings enum errno faulthandler
    filecmp fileinput fnmatch fractions ftplib functools gc getopt getpass gettext glob graphlib
    gzip hashlib heapq hmac html html.parser http http.client http.cookiejar http.cookies
    http.server imaplib importlib importlib.abc importlib.machinery importlib.metadata
    importlib.resources importlib.util inspect io ipaddress itertools json json.decoder
    json.encoder keyword linecache locale logging logging.config logging.handlers lzma mailbox
    marshal math mimetypes mmap modulefinder multiprocessing multiprocessing.connection
    multiprocessing.managers multiprocessing.pool multiprocessing.process
    multiprocessing.queues multiprocessing.shared_memory multiprocessing.synchronize netrc
    numbers opcode operator optparse os os.path pathlib pdb pickle pickletools pkgutil platform
    plistlib poplib pprint profile pstats pty py_compile pyclbr pydoc queue quopri random re
    reprlib rlcompleter runpy sched secrets select selectors shelve shlex shutil signal site
    smtplib socket socketserver sqlite3 ssl stat statistics string stringprep struct subprocess
    symtable sys sysconfig tabnanny tarfile tempfile textwrap threading time timeit token
    tokenize tomllib trace traceback tracemalloc types typing unicodedata unittest unittest.case
    unittest.loader unittest.mock unittest.result unittest.runner unittest.suite urllib
    urllib.error urllib.parse urllib.request urllib.response urllib.robotparser uuid warnings
    wave weakref wsgiref wsgiref.handlers wsgiref.headers wsgiref.simple_server wsgiref.util xml
    xml.dom xml.dom.minidom xml.etree.ElementTree xml.sax xml.sax.handler xml.sax.saxutils
    xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib zoneinfo
"""
STDLIB_MODULES: tuple[str, ...] = tuple(sorted(_MODULE_NAMES.split()))

# Tokenizer.
VOCAB_SIZE = 4096
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3
# The chat template (chat_template.jinja, which transformers and the router read), in Llama
# 2's chat format, since the tokenizer has Llama's special tokens and no chat tokens: a user
# turn (or any role but assistant) is "<s>[INST] text [/INST]", an assistant turn
# " text </s>"; a leading system message goes inside the first turn between <<SYS>> lines
# (in a turn of its own when no user turn comes first).
# Any order of roles is taken (tool answers, several user turns); the model was not trained
# on chats, so its replies are its usual English-like prose.
CHAT_TEMPLATE = r"""{#- The embedded demo model's chat template: Llama 2's chat format. -#}
{%- if messages[0]['role'] == 'system' -%}
    {%- set system = '<<SYS>>\n' + messages[0]['content'] | trim + '\n<</SYS>>\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if not turns or turns[0]['role'] == 'assistant' -%}
    {{- bos_token + ('[INST] ' + system + '[/INST]' if system else '') -}}
{%- endif -%}
{%- for message in turns -%}
    {%- set text = message['content'] | trim -%}
    {%- if message['role'] == 'assistant' -%}
        {{- ' ' + text + ' ' + eos_token -}}
    {%- else -%}
        {{- bos_token + '[INST] ' + (system if loop.first else '') + text + ' [/INST]' -}}
    {%- endif -%}
{%- endfor -%}
"""

# Model.
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 688
ROPE_THETA = 10000.0
MAX_POSITIONS = 1024
STORAGE_DTYPE = torch.bfloat16

# Training.
SEQ_LEN = 128
BATCH_SIZE = 16
DEFAULT_STEPS = 700
PEAK_LR = 2e-3
MIN_LR_RATIO = 0.1
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0

SAMPLE_PROMPTS = ("Return the number of", "The default value is", "This module provides")


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def clean_docstring(doc: str) -> str:
    """Drop doctest examples (and their output) from ``doc`` and collapse its whitespace."""
    kept: list[str] = []
    in_example = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>") or (in_example and stripped.startswith("...")):
            in_example = True
            continue
        if in_example:
            if stripped:
                continue  # expected output of the example
            in_example = False
        kept.append(stripped)
    return " ".join(" ".join(kept).split())


def iter_documented_objects(module: object) -> Iterator[object]:
    """Yield ``module``, its public classes and routines, and those classes' public methods."""
    yield module
    namespace = vars(module)
    for name in sorted(namespace):
        obj = namespace[name]
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        yield obj
        if inspect.isclass(obj):
            members = vars(obj)
            for member in sorted(members):
                if member == "__init__" or not member.startswith("_"):
                    yield members[member]


def collect_corpus(modules: Iterable[str] = STDLIB_MODULES) -> list[str]:
    """Return the cleaned, de-duplicated docstrings of ``modules``, in a deterministic order."""
    documents: list[str] = []
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules (typing.io, ...) warn on access
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # e.g. a Python built without sqlite3 or ssl
                continue
            for obj in iter_documented_objects(module):
                raw = getattr(obj, "__doc__", None)
                if not isinstance(raw, str):
                    continue
                text = clean_docstring(raw)
                if len(text.split()) >= MIN_DOC_WORDS and text not in seen:
                    seen.add(text)
                    documents.append(text)
    return documents


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(documents: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on ``documents``; encodings start with BOS."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def encode_corpus(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """Return the whole corpus as one id stream: ``<s> doc </s> <s> doc </s> ...``."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=True):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def save_tokenizer(tokenizer: Tokenizer, output: Path) -> None:
    """Write ``tokenizer.json`` and the ``transformers`` side files into ``output``."""
    tokenizer.save(str(output / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
    }
    write_json(output / "tokenizer_config.json", config)
    write_json(output / "special_tokens_map.json", special)
    (output / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------------------------


def make_config(tokenizer: Tokenizer) -> LlamaConfig:
    """Return the Llama config of the tiny model, with the tokenizer's special ids."""
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )


def learning_rate(step: int, total_steps: int) -> float:
    """Linear warm-up to ``PEAK_LR``, then cosine decay to ``MIN_LR_RATIO * PEAK_LR``."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return PEAK_LR * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine)


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(data: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Return ``BATCH_SIZE`` random windows of ``SEQ_LEN`` tokens from ``data``."""
    starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
    return torch.stack([data[start : start + SEQ_LEN] for start in starts.tolist()])


def train(model: LlamaForCausalLM, data: torch.Tensor, steps: int) -> float:
    """Train ``model`` on ``data`` for ``steps`` steps; return the mean loss of the last 20."""
    generator = torch.Generator().manual_seed(SEED)
    optimizer = make_optimizer(model)
    model.train()
    recent: list[float] = []
    started = time.monotonic()
    for step in range(steps):
        lr = learning_rate(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(data, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = [*recent[-19:], loss.item()]
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.monotonic() - started
            print(
                f"step {step + 1:4d}/{steps}  loss {loss.item():.3f}  lr {lr:.2e}  {elapsed:6.1f}s",
                flush=True,
            )
    model.eval()
    return sum(recent) / len(recent)


@torch.no_grad()
def greedy_sample(model: LlamaForCausalLM, tokenizer: Tokenizer, prompt: str, tokens: int) -> str:
    """Return the greedy continuation (``tokens`` new tokens at most) of ``prompt``."""
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    eos_id = tokenizer.token_to_id(EOS)
    out = model.generate(
        ids, max_new_tokens=tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write_json(path: Path, obj: dict[str, object]) -> None:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_model(model: LlamaForCausalLM, output: Path) -> None:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors``."""
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.to(STORAGE_DTYPE).save_pretrained(output, safe_serialization=True)
    add_legacy_config_keys(output / "config.json")


def add_legacy_config_keys(path: Path) -> None:
    """Also state RoPE theta and dtype under their transformers 4 names in ``config.json``.

    transformers 5 writes ``rope_parameters`` and ``dtype``; readers of the older format (and
    simple loaders) look for top-level ``rope_theta`` and ``torch_dtype``. Both load the same.
    """
    config = json.loads(path.read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", ROPE_THETA)
    config["torch_dtype"] = config["dtype"]
    write_json(path, config)


def directory_size(path: Path) -> int:
    """Return the total size in bytes of the files directly in ``path``."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="directory to write into"
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    return parser.parse_args(argv)


def seed_everything() -> None:
    """Fix every source of randomness and the thread count."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)


def main(argv: list[str] | None = None) -> int:
    """Build the corpus, tokenizer and model, train, and write everything to ``--output``."""
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed_everything()
    started = time.monotonic()

    documents = collect_corpus()
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)):,} characters")
    tokenizer = train_tokenizer(documents)
    data = encode_corpus(tokenizer, documents)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens; corpus: {len(data):,} tokens")

    model = LlamaForCausalLM(make_config(tokenizer))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters; training {args.steps} steps")
    final_loss = train(model, data, args.steps)
    print(f"final loss (mean of last 20 steps): {final_loss:.3f}")

    for prompt in SAMPLE_PROMPTS:
        print(f"sample: {prompt!r} -> {greedy_sample(model, tokenizer, prompt, 24)!r}")

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, output)
    save_model(model, output)
    size = directory_size(output)
    print(f"wrote {output} ({size / 1e6:.2f} MB) in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
