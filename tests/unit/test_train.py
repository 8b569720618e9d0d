"""The trainer: memorization, HF-format output checked against transformers, schedule, padding, clipping, CLI."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from lmserve.model.training import train as T
from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.config import ModelConfig
from lmserve.model.llama import LlamaForCausalLM
from lmserve.model.loader import load_model


def tiny_model(seed: int = 0, vocab: int = 50) -> LlamaForCausalLM:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).init_weights(0.1, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_batch(model: LlamaForCausalLM, prompts: list[list[int]], eos_id: int, max_new: int) -> list[list[int]]:
    """Greedy decoding of several prompts at once by full recompute each step (no KV cache).

    Rows are right-padded; each row's next token is read at its own last real position.
    A row stops growing once it has produced eos.
    """
    rows = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        live = [b for b, o in enumerate(outs) if o[-1:] != [eos_id]]
        if not live:
            break
        q_lens = torch.tensor([len(rows[b]) for b in live])
        L = int(q_lens.max())
        ids = torch.zeros(len(live), L, dtype=torch.long)
        for i, b in enumerate(live):
            ids[i, : len(rows[b])] = torch.tensor(rows[b])
        logits = model(ids, torch.arange(L).expand(len(live), L), AttentionMetadata.fresh(q_lens, L))  # [n, L, V]
        nxt = logits[torch.arange(len(live)), q_lens - 1].argmax(-1)  # [n]
        for i, b in enumerate(live):
            outs[b].append(int(nxt[i]))
            rows[b].append(int(nxt[i]))
    return outs


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is as fast alone and much faster on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded(trained_model_dir, native_kernels_dir):
    return load_model(trained_model_dir, dtype=torch.float32, device="cpu", cache_dir=native_kernels_dir)


# ---- the memorizing fixture model ----------------------------------------------------------

@pytest.mark.slow
def test_trained_model_reaches_low_loss(loaded, training_corpus):
    tok = loaded.tokenizer
    docs = T.split_documents([training_corpus])
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:  # one document at a time, causal mask built here: independent of the trainer's batching
            seq = torch.tensor([tok.bos_id, *tok.encode(d), tok.eos_ids[0]])
            L = len(seq) - 1
            logits = loaded.model(seq[None, :-1], torch.arange(L)[None], AttentionMetadata.fresh(torch.tensor([L]), L))
            total += float(torch.nn.functional.cross_entropy(logits[0], seq[1:], reduction="sum"))
            count += L
    loss = total / count
    # the only uncertainty left is which document follows bos: ~ln(5) nats over ~265 targets
    assert loss < 0.1, loss


@pytest.mark.slow
def test_greedy_decoding_reproduces_the_corpus(loaded, training_prompts, training_corpus):
    tok = loaded.tokenizer
    eos = tok.eos_ids[0]
    docs = T.split_documents([training_corpus])
    assert len(training_prompts) >= 10
    prompts = []
    for prefix, continuation in training_prompts:
        doc = next(d for d in docs if d.startswith(prefix))
        assert prefix + continuation == doc
        prompt = tok.encode(prefix, add_special_tokens=True)
        assert prompt[0] == tok.bos_id
        assert tok.encode(doc, add_special_tokens=True)[: len(prompt)] == prompt  # cut at a token boundary
        prompts.append(prompt)
    outs = greedy_batch(loaded.model, prompts, eos, max_new=120)
    wrong = [(prefix, tok.decode(out)) for (prefix, continuation), prompt, out in zip(training_prompts, prompts, outs)
             if out[-1:] != [eos] or tok.decode(prompt[1:] + out[:-1]) != prefix + continuation]
    assert not wrong, wrong


@pytest.mark.slow
def test_rare_characters_use_byte_fallback_and_round_trip(trained_model_dir, training_corpus):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(trained_model_dir / "tokenizer.model"))
    line = next(d for d in T.split_documents([training_corpus]) if "🌍" in d)
    pieces = sp.encode(line, out_type=str)
    assert any(p.startswith("<0x") and p.endswith(">") for p in pieces), pieces
    assert (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) == (T.BOS_ID, T.EOS_ID, T.PAD_ID, T.UNK_ID)
    for doc in T.split_documents([training_corpus]):
        assert sp.decode(sp.encode(doc)) == doc


@pytest.mark.slow
def test_saved_directory_matches_transformers(loaded, trained_model_dir, training_corpus):
    """transformers is the independent oracle for the saved weights, config and tokenizer."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(trained_model_dir)
    docs = T.split_documents([training_corpus])
    seqs = [loaded.tokenizer.encode(d, add_special_tokens=True) for d in docs]
    assert seqs == [hf_tok(d).input_ids for d in docs]

    # ours: all documents in one right-padded batch; transformers: each document alone
    q_lens = torch.tensor([len(s) for s in seqs])
    L = int(q_lens.max())
    ids = torch.full((len(seqs), L), T.PAD_ID)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        ours = loaded.model(ids, torch.arange(L).expand(len(seqs), L), AttentionMetadata.fresh(q_lens, L))
        for b, s in enumerate(seqs):
            ref = hf(torch.tensor([s])).logits[0]  # [l, V]
            torch.testing.assert_close(ours[b, : len(s)], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_saved_files(trained_model_dir):
    cfg = ModelConfig.from_hf(trained_model_dir)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2) and cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (T.BOS_ID, (T.EOS_ID,), T.PAD_ID)
    with safe_open(trained_model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: saved once
    tok_cfg = json.loads((trained_model_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<s>", "</s>", True)
    gen_cfg = json.loads((trained_model_dir / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == T.EOS_ID


@pytest.mark.slow
def test_chat_template_renders(loaded):
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello? "}])
    assert prompt == "System: Be brief.\n\nUser: Hello?\n\nAssistant:"


# ---- pieces of the loop ----------------------------------------------------------------------

def test_lr_schedule_warms_up_linearly_then_decays_by_cosine():
    rng = random.Random(0)
    for _ in range(200):
        total = rng.randint(2, 400)
        warmup = rng.randint(0, total - 1)
        lr = 10 ** rng.uniform(-5, -1)
        lrs = [T.lr_at(s, lr=lr, warmup=warmup, total=total, min_ratio=0.1) for s in range(total)]
        assert all(0 < x <= lr * (1 + 1e-12) for x in lrs)
        up, down = lrs[:warmup], lrs[warmup:]
        assert all(b > a for a, b in zip(up, up[1:]))  # strictly rising warm-up
        for s, x in enumerate(up):  # linear: equal steps from lr/warmup to lr
            assert math.isclose(x, lr * (s + 1) / warmup, rel_tol=1e-9)
        assert math.isclose(down[0], lr, rel_tol=1e-9)
        assert all(b <= a * (1 + 1e-12) for a, b in zip(down, down[1:]))  # never rises after the peak
        if len(down) > 1:
            assert math.isclose(down[-1], 0.1 * lr, rel_tol=1e-9)
        if len(down) >= 8:  # cosine, not linear: concave over the first half of the decay, convex over the second
            second = [a - 2 * b + c for a, b, c in zip(down, down[1:], down[2:])]
            half = len(second) // 2
            assert all(d < 0 for d in second[: half - 1]) and all(d > 0 for d in second[half + 1:])


@torch.no_grad()
def test_padding_contributes_no_loss():
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, 50, (n,), generator=gen).tolist() for n in (9, 3, 14, 6)]
    base = T.batch_loss(model, T.make_batch(seqs))
    padded = T.make_batch(seqs, length=30)
    assert int((padded.targets == T.IGNORE_INDEX).sum()) > int((T.make_batch(seqs).targets == T.IGNORE_INDEX).sum())
    torch.testing.assert_close(T.batch_loss(model, padded), base, atol=1e-6, rtol=1e-6)
    # whatever the padding inputs are, nothing changes
    noisy = T.Batch(padded.input_ids.masked_scatter(padded.targets == T.IGNORE_INDEX,
                                                    torch.randint(0, 50, padded.input_ids.shape, generator=gen)),
                    padded.targets, padded.positions, padded.q_lens)
    assert not torch.equal(noisy.input_ids, padded.input_ids)
    torch.testing.assert_close(T.batch_loss(model, noisy), base, atol=1e-6, rtol=1e-6)
    # and the batch loss is the token-weighted mean of each sequence's loss alone
    alone = [(T.batch_loss(model, T.make_batch([s])), len(s) - 1) for s in seqs]
    expected = sum(float(l) * n for l, n in alone) / sum(n for _, n in alone)
    assert math.isclose(float(base), expected, rel_tol=1e-5)


def test_windows_cover_every_target_once():
    rng = random.Random(0)
    for _ in range(50):
        context = rng.randint(2, 20)
        docs = [[rng.randint(0, 99) for _ in range(rng.randint(2, 80))] for _ in range(rng.randint(1, 4))]
        seqs = T.make_sequences(docs, context)
        assert all(2 <= len(s) <= context + 1 for s in seqs)
        targets = [t for s in seqs for t in s[1:]]
        assert targets == [t for d in docs for t in d[1:]]


def test_non_finite_gradient_raises():
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    loss = T.batch_loss(model, T.make_batch([[1, 5, 6, 7, 2]]))
    loss.backward()
    with pytest.raises(T.TrainingDivergedError, match="step 7"):
        T.clip_gradients(model, 1.0, step=7)


def test_clip_bounds_the_gradient_norm():
    model = tiny_model()
    (T.batch_loss(model, T.make_batch([[1, 5, 6, 7, 2]])) * 1e4).backward()
    before = T.clip_gradients(model, 0.5)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert before > 0.5 and math.isclose(float(after), 0.5, rel_tol=1e-4)


def test_norms_and_biases_get_no_weight_decay():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, attention_bias=True, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    decay, no_decay = T.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    exempt = {n for n in names.values() if n.endswith("norm.weight") or n.endswith(".bias")}
    assert {names[id(p)] for p in no_decay["params"]} == exempt and len(exempt) == 6
    assert no_decay["weight_decay"] == 0 and decay["weight_decay"] == 0.1
    assert {names[id(p)] for p in decay["params"]} == set(names.values()) - exempt  # tied embedding once


TEXT = "The cat sat on the mat.\n\nA dog ran in the park. 雨 ☔\n\nSmall models learn small things."


def test_training_is_deterministic_with_the_seed(tmp_path):
    kw = dict(vocab_size=300, hidden_size=32, layers=1, heads=4, kv_heads=2, context=16, steps=4, batch_size=2,
              progress=False, device="cpu")
    a = T.train([TEXT], tmp_path / "a", seed=3, **kw)
    b = T.train([TEXT], tmp_path / "b", seed=3, **kw)
    c = T.train([TEXT], tmp_path / "c", seed=4, **kw)
    assert a.losses == b.losses and a.losses != c.losses
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a.steps == 4 and math.isfinite(a.final_loss)


def test_train_rejects_empty_text(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        T.train(["  \n\n \n"], tmp_path / "m", steps=1, progress=False)


# ---- command line ----------------------------------------------------------------------------

def run_cli(argv: list[str]) -> int:
    from lmserve.model.training import cli as train_cli

    parser = argparse.ArgumentParser(prog="lmserve")
    train_cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("make_input", ["missing", "empty_file", "dir_without_txt"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, make_input):
    target = tmp_path / "in"
    if make_input == "empty_file":
        target = tmp_path / "in.txt"
        target.write_text(" \n\n\t\n")
    elif make_input == "dir_without_txt":
        target.mkdir()
        (target / "notes.md").write_text("not text for training")
    assert run_cli(["train", str(target), "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmserve train: error:") and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, says", [
    (["--heads", "4", "--kv-heads", "3"], "num_kv_heads"),
    (["--heads", "0"], "heads must be positive"),
    (["--vocab-size", "100"], "vocab"),  # below the 256 byte pieces + characters sentencepiece needs
    (["--lr", "0"], "lr > 0"),
])
def test_cli_bad_hyperparameters_exit_2(tmp_path, capsys, options, says):
    (tmp_path / "a.txt").write_text(TEXT)
    assert run_cli(["train", str(tmp_path), "--out", str(tmp_path / "out"), "--steps", "1", "-q", *options]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmserve train: error:") and says in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_cli_trains_a_loadable_model(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    out = tmp_path / "model"
    assert run_cli(["train", str(tmp_path / "docs"), "--out", str(out), "--steps", "2", "--vocab-size", "300",
                    "--hidden-size", "32", "--layers", "1", "--context", "16", "--device", "cpu", "-q"]) == 0
    assert str(out) in capsys.readouterr().out
    m = load_model(out, dtype=torch.float32, device="cpu")
    assert m.config.num_layers == 1 and m.tokenizer.decode(m.tokenizer.encode("The cat sat.")) == "The cat sat."


def test_cli_module_does_not_import_torch():
    code = "import sys, lmserve.model.training.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
