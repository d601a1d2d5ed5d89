"""Pretraining data that needs no download: the running interpreter's standard library.

Documents are the ``.py`` files (sources with their docstrings) under one or more roots,
by default ``sysconfig.get_paths()["stdlib"]`` without ``site-packages``; one document per
file, in sorted relative-path order. The held-out split is by a hash of each file's
relative path, so it does not depend on the file order or on the other files present.

A byte-level BPE tokenizer (``tokenizers``) is trained on the training split only and
cached, with the encoded corpus, under a cache directory (default
``~/.cache/flamia_serve``), keyed by the corpus content, the split and the vocabulary size.

Packing (``pack_documents``): documents (each ending in ``<|endoftext|>``) are laid end to
end into microbatches of exactly ``seq_len`` tokens; the last document of a microbatch is
cut to fill it (DESIGN §7), and the rest of that document starts the next microbatch as a
new document (positions from 0), so no token is dropped. Each microbatch carries
``cu_seqlens`` (int32, one entry per document start plus the end) and ``position_ids``
that restart at 0 at every document start — what transformers' packed path and the
FLAMIA attention read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"
IGNORE_INDEX = -100
DEFAULT_CACHE = Path("~/.cache/flamia_serve")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class SourceFile:
    """One document: ``root / rel`` (``rel`` a POSIX relative path, the split key)."""

    root: Path
    rel: str

    @property
    def path(self) -> Path:
        return self.root / self.rel


def list_source_files(roots: Sequence[str | os.PathLike], *, suffix: str = ".py",
                      max_files: int | None = None) -> list[SourceFile]:
    """Files ending in ``suffix`` under ``roots``, sorted by (root order, relative path).

    ``site-packages``, ``dist-packages`` and ``__pycache__`` are skipped. ``max_files``
    keeps the first files of that order (tests use a few).
    """
    if not roots:
        raise ValueError("roots: give at least one source directory")
    if max_files is not None and max_files < 2:
        raise ValueError(f"max_files: need at least 2 (one train, one held-out), got {max_files}")
    out: list[SourceFile] = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"roots: {str(root)!r} is not a directory")
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
            for name in filenames:
                if name.endswith(suffix):
                    found.append(Path(dirpath, name).relative_to(root).as_posix())
        out.extend(SourceFile(root, rel) for rel in sorted(found))
    if max_files is not None:
        out = out[:max_files]
    if len(out) < 2:
        raise ValueError(f"roots: found {len(out)} '{suffix}' file(s); need at least 2")
    return out


def heldout_fraction(rel: str) -> float:
    """Position of a relative path in [0, 1) by its SHA-256 (the split key)."""
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(files: Sequence[SourceFile], eval_fraction: float
                ) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held-out): a file is held out when ``heldout_fraction(rel) < eval_fraction``.

    Both sides keep the input order. When the hash puts no file on one side (tiny corpora),
    the file with the smallest (largest) hash moves over, so both sides are non-empty.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction: must be in (0, 1), got {eval_fraction}")
    if len(files) < 2:
        raise ValueError(f"files: need at least 2, got {len(files)}")
    keys = [heldout_fraction(f.rel) for f in files]
    held = [k < eval_fraction for k in keys]
    if not any(held):
        held[min(range(len(files)), key=keys.__getitem__)] = True
    if all(held):
        held[max(range(len(files)), key=keys.__getitem__)] = False
    train = [f for f, h in zip(files, held, strict=True) if not h]
    heldout = [f for f, h in zip(files, held, strict=True) if h]
    return train, heldout


def read_text(file: SourceFile) -> str:
    """A file's text (UTF-8; undecodable bytes, which some stdlib tests hold, replaced)."""
    return file.path.read_bytes().decode("utf-8", errors="replace")


def corpus_key(files: Sequence[SourceFile], texts: Sequence[str]) -> str:
    """SHA-256 over relative paths and contents: the cache key of a corpus."""
    h = hashlib.sha256()
    for f, t in zip(files, texts, strict=True):
        h.update(f.rel.encode())
        h.update(b"\0")
        h.update(t.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()


def train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: str | os.PathLike,
                    key: str):
    """Byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` is id 0), cached.

    ``key`` names the corpus (``corpus_key``); the tokenizer is read from
    ``cache_dir/bpe-<vocab>-<key[:16]>.json`` when present, else trained and written there.
    Returns a ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"vocab_size: byte-level BPE needs >= 300 (256 bytes + merges), "
                         f"got {vocab_size}")
    cache = Path(cache_dir).expanduser()
    path = cache / f"bpe-{vocab_size}-{key[:16]}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok


def encode_documents(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text followed by ``<|endoftext|>`` (int32 arrays, one per text).
    An ``<|endoftext|>`` written in a text (tokenizer sources hold it) is encoded as text:
    the end-of-document id appears only at the end."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer: has no {EOS!r} token")
    split = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = split
    return [np.asarray([*e.ids, eos], dtype=np.int32) for e in encoded]


@dataclass
class Corpus:
    """Tokenized train / held-out documents and where they came from."""

    train_docs: list[np.ndarray]
    eval_docs: list[np.ndarray]
    tokenizer: object  # tokenizers.Tokenizer
    vocab_size: int
    info: dict


def _save_docs(path: Path, docs: Sequence[np.ndarray]) -> None:
    lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
    flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, tokens=flat, lengths=lengths)
    os.replace(tmp, path)


def _load_docs(path: Path) -> list[np.ndarray]:
    with np.load(path) as z:
        flat, lengths = z["tokens"], z["lengths"]
    return list(np.split(flat, np.cumsum(lengths)[:-1])) if len(lengths) else []


def load_corpus(roots: Sequence[str | os.PathLike] | None = None, *, vocab_size: int = 8192,
                eval_fraction: float = 0.05, cache_dir: str | os.PathLike | None = None,
                max_files: int | None = None) -> Corpus:
    """Read, split, tokenize (training a cached BPE tokenizer) the source files under ``roots``.

    ``roots`` defaults to the standard library. The encoded documents are cached beside
    the tokenizer, so a second call (another attention choice) reads them back.
    """
    roots = [stdlib_root()] if not roots else [Path(r) for r in roots]
    files = list_source_files(roots, max_files=max_files)
    train_files, eval_files = split_files(files, eval_fraction)
    train_texts = [read_text(f) for f in train_files]
    eval_texts = [read_text(f) for f in eval_files]
    key = corpus_key(train_files + eval_files, train_texts + eval_texts)
    # The cache holds a tokenizer trained on the training side and documents cut at
    # n_train: key it by the split too (two splits can list the files in the same order).
    split_key = hashlib.sha256(f"{key}:n_train={len(train_files)}".encode()).hexdigest()
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE).expanduser()
    tokenizer = train_tokenizer(train_texts, vocab_size, cache, split_key)
    tok_json = tokenizer.to_str()
    tok_sha = hashlib.sha256(tok_json.encode()).hexdigest()
    docs_path = cache / f"docs-{vocab_size}-{split_key[:16]}-{tok_sha[:16]}.npz"
    meta_path = docs_path.with_suffix(".json")
    if docs_path.is_file() and meta_path.is_file():
        docs = _load_docs(docs_path)
        n_train = json.loads(meta_path.read_text())["n_train"]
    else:
        docs = encode_documents(tokenizer, train_texts + eval_texts)
        n_train = len(train_texts)
        cache.mkdir(parents=True, exist_ok=True)
        _save_docs(docs_path, docs)
        meta_path.write_text(json.dumps({"n_train": n_train}))
    train_docs, eval_docs = docs[:n_train], docs[n_train:]
    info = {
        "roots": [str(r) for r in roots],
        "files_train": len(train_files),
        "files_eval": len(eval_files),
        "tokens_train": int(sum(len(d) for d in train_docs)),
        "tokens_eval": int(sum(len(d) for d in eval_docs)),
        "bytes": int(sum(len(t.encode("utf-8", errors="replace"))
                         for t in train_texts + eval_texts)),
        "eval_fraction": eval_fraction,
        "corpus_sha256": key,
        "tokenizer_sha256": tok_sha,
        "vocab_size": tokenizer.get_vocab_size(),
    }
    return Corpus(train_docs, eval_docs, tokenizer, tokenizer.get_vocab_size(), info)


@dataclass
class PackedBatch:
    """One packed microbatch of ``T`` tokens.

    ``input_ids`` / ``position_ids``: ``[T]`` int64; ``cu_seqlens``: ``[n_docs + 1]`` int32
    (document starts, then ``T``); ``max_seqlen``: the longest document piece.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    def labels(self) -> torch.Tensor:
        """Next-token targets aligned with ``input_ids``, as transformers' causal-LM loss
        expects (it shifts by one): ``IGNORE_INDEX`` at every document start, so no token
        is trained to predict the first token of the next document. ``[T]`` int64."""
        # torch.where, not masked assignment: no host sync on a GPU
        return torch.where(self.position_ids == 0, IGNORE_INDEX, self.input_ids)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> PackedBatch:
        """The same batch on ``device`` (``max_seqlen`` stays a host int)."""
        return PackedBatch(*(t.to(device, non_blocking=non_blocking)
                             for t in (self.input_ids, self.position_ids, self.cu_seqlens)),
                           self.max_seqlen)

    def pin_memory(self) -> PackedBatch:
        """The same batch in page-locked host memory (for copies that do not block)."""
        return PackedBatch(self.input_ids.pin_memory(), self.position_ids.pin_memory(),
                           self.cu_seqlens.pin_memory(), self.max_seqlen)


def _make_batch(pieces: list[np.ndarray]) -> PackedBatch:
    lengths = [len(p) for p in pieces]
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    ids = np.concatenate(pieces).astype(np.int64)
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(pos),
                       torch.from_numpy(cu.astype(np.int32)), max(lengths))


def pack_documents(docs: Sequence[np.ndarray], seq_len: int, *,
                   drop_last: bool = True) -> Iterator[PackedBatch]:
    """Lay ``docs`` end to end into ``PackedBatch``es of exactly ``seq_len`` tokens.

    The document that crosses a microbatch end is cut there; its remainder opens the next
    microbatch as a new document (positions from 0). Empty documents are skipped. The
    final partial microbatch is yielded (shorter) unless ``drop_last``. ``docs`` are not
    modified.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    pieces: list[np.ndarray] = []
    filled = 0
    for doc in docs:
        doc = np.asarray(doc)
        if doc.ndim != 1:
            raise ValueError(f"docs: each document must be 1-D token ids, got shape {doc.shape}")
        start = 0
        while start < len(doc):
            take = min(len(doc) - start, seq_len - filled)
            pieces.append(doc[start:start + take])
            filled += take
            start += take
            if filled == seq_len:
                yield _make_batch(pieces)
                pieces, filled = [], 0
    if pieces and not drop_last:
        yield _make_batch(pieces)


def train_batches(docs: Sequence[np.ndarray], seq_len: int, seed: int) -> Iterator[PackedBatch]:
    """Endless training microbatches: each epoch packs the documents in an order drawn
    from ``(seed, epoch)``, so every run with the same seed sees the same microbatches."""
    if not docs:
        raise ValueError("docs: no training documents")
    if sum(len(d) for d in docs) < seq_len:
        raise ValueError(f"docs: {sum(len(d) for d in docs)} training tokens do not fill one "
                         f"microbatch of seq_len={seq_len}")
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(docs))
        yield from pack_documents([docs[i] for i in order], seq_len, drop_last=True)
        epoch += 1


def eval_batches(docs: Sequence[np.ndarray], seq_len: int, max_batches: int) -> list[PackedBatch]:
    """The fixed held-out set: the first ``max_batches`` microbatches of the held-out
    documents in file order (the last one may be shorter than ``seq_len``)."""
    if max_batches < 1:
        raise ValueError(f"max_batches: must be >= 1, got {max_batches}")
    out = []
    for batch in pack_documents(docs, seq_len, drop_last=False):
        out.append(batch)
        if len(out) == max_batches:
            break
    if not out:
        raise ValueError("docs: no held-out tokens")
    return out
