"""Train a small Llama-family model and its sentencepiece tokenizer from plain text.

The result is a Hugging Face style directory (config.json, model.safetensors, tokenizer.model,
tokenizer_config.json, generation_config.json) that `lmserve.model.loader.load_model` and
`transformers` both load. Meant for small corpora on CPU: test models, demos, experiments.

Pipeline: text -> paragraphs (documents) -> BPE tokenizer with byte fallback -> bos + tokens + eos
-> windows of at most `context + 1` tokens -> right-padded batches (targets -100 on padding,
mask = causal AND key-valid) -> AdamW with warm-up and cosine decay -> save.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.sdpa import AttentionMetadata
from ..config import ModelConfig
from ..llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"

# Role-prefixed turns separated by blank lines; the prompt ends where the assistant speaks.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class TrainingDivergedError(RuntimeError):
    """A gradient became NaN or infinite; the message names the step."""


@dataclass(frozen=True)
class TrainResult:
    path: Path
    final_loss: float  # mean loss over every target token of the corpus after training
    steps: int
    losses: tuple[float, ...]  # training-batch loss of each step
    config: ModelConfig
    seconds: float


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # [B, L] padded with PAD_ID
    targets: Tensor  # [B, L] next token, IGNORE_INDEX on padding
    positions: Tensor  # [B, L]
    q_lens: Tensor  # [B] real tokens per row

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.targets, self.positions, self.q_lens)))


# ---- text -> documents -> tokens ------------------------------------------------------

def read_texts(texts_or_files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Strings are text; paths are files, or directories whose *.txt files are read (sorted)."""
    items = [texts_or_files] if isinstance(texts_or_files, (str, os.PathLike)) else list(texts_or_files)
    texts: list[str] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            continue
        path = Path(item)
        if path.is_dir():
            files = sorted(path.rglob("*.txt"))
            if not files:
                raise ValueError(f"directory {path} holds no .txt files")
            texts.extend(f.read_text(encoding="utf-8") for f in files)
        elif path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
    return texts


def split_documents(texts: Iterable[str]) -> list[str]:
    """Paragraphs (separated by blank lines), stripped, empty ones dropped: one document each."""
    docs = []
    for text in texts:
        docs.extend(p.strip() for p in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")))
    return [d for d in docs if d]


def train_tokenizer(docs: Sequence[str], vocab_size: int, character_coverage: float = 0.9995) -> bytes:
    """A BPE sentencepiece model (serialized) with byte fallback and fixed special ids.

    Identity normalization and kept whitespace make decode(encode(text)) == text. The
    vocabulary may come out smaller than asked when the corpus is tiny.
    """
    import sentencepiece as spm

    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(docs), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=character_coverage, hard_vocab_limit=False,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            unk_piece=UNK_TOKEN, bos_piece=BOS_TOKEN, eos_piece=EOS_TOKEN, pad_piece=PAD_TOKEN,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            max_sentence_length=1 << 20, num_threads=1, minloglevel=2,
        )
    except RuntimeError as e:  # e.g. a vocabulary too small for the characters and the 256 byte pieces
        raise ValueError(f"tokenizer training failed: {str(e).split('] ')[-1]}") from e
    return buf.getvalue()


def encode_documents(sp, docs: Sequence[str]) -> list[list[int]]:
    """bos + tokens + eos per document."""
    return [[BOS_ID, *sp.encode(d), EOS_ID] for d in docs]


def make_sequences(token_docs: Sequence[Sequence[int]], context: int) -> list[list[int]]:
    """Windows of at most context + 1 tokens; consecutive windows share one token so every target is seen."""
    seqs = []
    for toks in token_docs:
        for start in range(0, max(1, len(toks) - 1), context):
            seqs.append(list(toks[start:start + context + 1]))
    return seqs


def make_batch(seqs: Sequence[Sequence[int]], length: int | None = None) -> Batch:
    """Right-pad sequences to `length` (default: the longest) input tokens, shifting targets by one."""
    q_lens = [len(s) - 1 for s in seqs]
    L = max(q_lens) if length is None else length
    if min(q_lens) < 1 or max(q_lens) > L:
        raise ValueError(f"sequence lengths {q_lens} do not fit a batch of {L} tokens")
    input_ids = torch.full((len(seqs), L), PAD_ID, dtype=torch.long)  # [B, L]
    targets = torch.full((len(seqs), L), IGNORE_INDEX, dtype=torch.long)  # [B, L]
    for b, s in enumerate(seqs):
        t = torch.tensor(s, dtype=torch.long)
        input_ids[b, : len(s) - 1] = t[:-1]
        targets[b, : len(s) - 1] = t[1:]
    positions = torch.arange(L).expand(len(seqs), L)  # [B, L]
    return Batch(input_ids, targets, positions, torch.tensor(q_lens, dtype=torch.long))


def batch_loss(model: LlamaForCausalLM, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy over the real (non-padding) targets."""
    meta = AttentionMetadata.fresh(batch.q_lens, batch.input_ids.shape[1])
    logits = model(batch.input_ids, batch.positions, meta)  # [B, L, V]
    return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def corpus_loss(model: LlamaForCausalLM, seqs: Sequence[Sequence[int]], batch_size: int) -> float:
    """Token-weighted mean loss over every sequence."""
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        batch = make_batch(seqs[i:i + batch_size]).to(next(model.parameters()).device)
        n = int(batch.q_lens.sum())
        total += float(batch_loss(model, batch)) * n
        count += n
    return total / count


# ---- optimisation ----------------------------------------------------------------------

def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Learning rate of 0-based update `step`: linear warm-up to `lr`, then cosine down to lr * min_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    low = lr * min_ratio
    return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embeddings); none on norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def clip_gradients(model: torch.nn.Module, max_norm: float, step: int = 0) -> float:
    """Clip the global gradient norm; a NaN/inf gradient raises TrainingDivergedError."""
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True)
    except RuntimeError as e:
        raise TrainingDivergedError(f"non-finite gradient norm at step {step}; lower the learning rate") from e
    return float(norm)


def default_intermediate(hidden_size: int) -> int:
    """SwiGLU width ~ 8/3 of the hidden size, rounded up to a multiple of 32."""
    return -(-(8 * hidden_size // 3) // 32) * 32


def batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless stream of index batches drawn from successive seeded shuffles of range(n)."""
    batch_size = min(batch_size, n)
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            pending.extend(torch.randperm(n, generator=generator).tolist())
        yield pending[:batch_size]
        pending = pending[batch_size:]


# ---- saving ------------------------------------------------------------------------------

def save_pretrained(model: LlamaForCausalLM, sp_model: bytes, out_dir: str | os.PathLike) -> Path:
    """Write a Hugging Face style directory that load_model and transformers read."""
    from safetensors.torch import save_file

    cfg = model.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().cpu().contiguous() for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one copy: the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    (out / "tokenizer.model").write_bytes(sp_model)
    tok_cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


# ---- the loop ----------------------------------------------------------------------------

def _check_settings(sizes: dict[str, int], context: int, lr: float, warmup: int | None) -> None:
    """ValueError naming the first setting no model can be trained with (every one of `sizes` must be
    positive, the hidden size a multiple of the heads)."""
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if context < 2 or not lr > 0 or (warmup is not None and warmup < 0):
        raise ValueError(f"need context >= 2, lr > 0 and warmup >= 0 (got {context}, {lr}, {warmup})")
    if sizes["hidden_size"] % sizes["heads"]:
        raise ValueError(f"hidden_size={sizes['hidden_size']} is not a multiple of heads={sizes['heads']}")


def _documents(texts_or_files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The training text's documents (read_texts, split_documents); ValueError when there are none."""
    docs = split_documents(read_texts(texts_or_files))
    if not docs:
        raise ValueError("the training text is empty")
    return docs


def _model_config(vocab_size: int, name: str, *, hidden_size: int, layers: int, heads: int, kv_heads: int,
                  intermediate_size: int | None, tie_embeddings: bool, context: int) -> ModelConfig:
    """The shape of the model to train, with this module's special token ids."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden_size // heads,
        intermediate_size=intermediate_size or default_intermediate(hidden_size),
        tie_word_embeddings=tie_embeddings, max_position_embeddings=context,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID, name=name,
    )


def _initial_model(cfg: ModelConfig, generator: torch.Generator, device: str | torch.device | None) -> LlamaForCausalLM:
    """A model of `cfg` with seeded random weights, in training mode on `device` (None: cuda when available)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return LlamaForCausalLM(cfg).init_weights(0.02, generator=generator).to(device).train()


def optimise(model: LlamaForCausalLM, seqs: Sequence[Sequence[int]], generator: torch.Generator, *, steps: int,
             batch_size: int, lr: float, warmup: int | None, weight_decay: float, grad_clip: float, progress: bool,
             log_every: int | None) -> list[float]:
    """`steps` AdamW updates, each on a batch drawn from seeded shuffles of `seqs`, the learning rate
    warmed up and decayed (lr_at); each step's training-batch loss. `warmup` and `log_every` default
    to a tenth of `steps`."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    warmup = max(1, steps // 10) if warmup is None else warmup
    log_every = max(1, steps // 10) if log_every is None else log_every
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    stream = batches(len(seqs), batch_size, generator)
    losses: list[float] = []
    with logging_redirect_tqdm(), tqdm(range(steps), desc="train", unit="step", disable=not progress) as bar:
        for step in bar:
            step_lr = lr_at(step, lr=lr, warmup=warmup, total=steps)
            for group in opt.param_groups:
                group["lr"] = step_lr
            loss = batch_loss(model, make_batch([seqs[i] for i in next(stream)]).to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clip_gradients(model, grad_clip, step)
            opt.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{step_lr:.2e}")
            if (step + 1) % log_every == 0 or step + 1 == steps:
                logger.info("step %d/%d loss %.4f lr %.2e", step + 1, steps, losses[-1], step_lr)
    return losses


def train(
    texts_or_files: str | os.PathLike | Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    context: int = 256,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 3e-3,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    tie_embeddings: bool = True,
    character_coverage: float = 0.9995,
    seed: int = 0,
    device: str | torch.device | None = None,
    progress: bool = True,
    log_every: int | None = None,
) -> TrainResult:
    """Train tokenizer and model on the given text and save them to `out_dir`.

    `texts_or_files`: text strings, or paths to .txt files / directories of them. Each
    paragraph is one document. `warmup` defaults to a tenth of `steps`, `log_every` to a
    tenth, `intermediate_size` to ~8/3 of `hidden_size`, `device` to cuda when available.
    Weights are trained and saved in float32. Raises ValueError on empty text or
    an inconsistent shape, TrainingDivergedError if a gradient becomes non-finite.
    """
    import sentencepiece as spm

    _check_settings(dict(vocab_size=vocab_size, hidden_size=hidden_size, layers=layers, heads=heads, kv_heads=kv_heads,
                         steps=steps, batch_size=batch_size), context, lr, warmup)
    docs = _documents(texts_or_files)
    started = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    sp_model = train_tokenizer(docs, vocab_size, character_coverage)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    seqs = make_sequences(encode_documents(sp, docs), context)
    cfg = _model_config(sp.get_piece_size(), Path(out_dir).name, hidden_size=hidden_size, layers=layers, heads=heads,
                        kv_heads=kv_heads, intermediate_size=intermediate_size, tie_embeddings=tie_embeddings,
                        context=context)
    model = _initial_model(cfg, gen, device)
    logger.info("%d documents, %d sequences, %d tokens, vocab %d, %.2fM parameters", len(docs), len(seqs),
                sum(len(s) - 1 for s in seqs), cfg.vocab_size, sum(p.numel() for p in model.parameters()) / 1e6)

    losses = optimise(model, seqs, gen, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                      weight_decay=weight_decay, grad_clip=grad_clip, progress=progress, log_every=log_every)
    model.eval()
    final = corpus_loss(model, seqs, batch_size)
    path = save_pretrained(model, sp_model, out_dir)
    seconds = time.perf_counter() - started
    logger.info("corpus loss %.4f after %d steps (%.1fs); saved to %s", final, steps, seconds, path)
    return TrainResult(path=path, final_loss=final, steps=steps, losses=tuple(losses), config=cfg, seconds=seconds)
