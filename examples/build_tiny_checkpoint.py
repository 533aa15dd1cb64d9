"""Build a tiny Qwen3.5 checkpoint with a trained multi-token-prediction head.

The result is a test/demo model for ``mtp_plugin``: a small hybrid Qwen3.5
trunk (GatedDeltaNet linear-attention layers plus a gated full-attention
layer every ``full_attention_interval`` layers) and a one-layer MTP head wired
like Qwen3-Next / Qwen3.5 (see vLLM's ``qwen3_next_mtp.py``).  Everything is
deterministic given ``--seed`` (for a given Python stdlib and MLX build) and
runs offline on a CPU in under ten minutes:

1. training text is read from the Python standard library's own ``*.py``
   files (comments and docstrings stripped, layout normalised by
   ``ast.unparse``), with a held-out set of different files for evaluation;
2. a byte-level BPE tokenizer is trained with exactly the normaliser and
   pre-tokenizer that transformers 5 imposes on every ``qwen3_5`` checkpoint
   (NFC, the Qwen split regex, ByteLevel), so what ``mlx_lm.load`` gets is what
   was trained;
3. trunk and head are built from mlx-lm's own ``qwen3_5`` classes and trained
   jointly with AdamW on ``CE(next token) + CE(token after next)``;
4. held-out trunk loss and depth-1 greedy acceptance (how often the head's
   argmax at ``t`` equals the trunk's argmax at ``t + 1``) are measured by
   teacher forcing;
5. the weights are written in the original Hugging Face layout
   (``<out>/hf``: bf16, ``model.language_model.*`` and ``mtp.*``, zero-centred
   RMSNorm weights, conv1d as ``(channels, 1, kernel)``), converted with
   ``mlx_lm.convert`` to a 4-bit MLX model (``<out>/mlx-4bit``), which drops
   the head, and the head is restored there as a 4-bit sidecar
   ``mtp.safetensors``.

Example::

    python examples/build_tiny_checkpoint.py --out examples/tiny-qwen3_5
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import random
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# The pre-tokenizer regex of transformers' Qwen3_5Tokenizer (tokenization_qwen3_5.py).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # content is a string or, as mlx-vlm and OpenAI clients send it, a list of parts (text kept)
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# RMSNorm weights that Hugging Face stores zero-centred (effective scale 1 + w)
# and that mlx-lm's qwen3_5 ``sanitize`` shifts by +1 when loading.
TRUNK_SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
# Every RMSNorm of the MTP head is zero-centred in Hugging Face checkpoints
# (names relative to ``mtp.``; note ``pre_fc_norm_*.weight`` do not end in
# "norm.weight").
HEAD_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
)

SAMPLE_TEXT = (
    'def greet(name: str) -> str:\n    """Say hello."""\n'
    '    return f"Hello, {name}! café naïve — 日本語 ✓"\n\n\n'
    "class Point:\n\tx = 1_000  # tab-indented\r\n"
)


# --------------------------------------------------------------------------
# Data and tokenizer
# --------------------------------------------------------------------------


def strip_docs(source: str) -> str:
    """Drop comments and docstrings and normalise layout via ``ast.unparse``.

    What remains is plain, uniformly formatted code, which a model this small
    learns noticeably faster than the prose-heavy raw files.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def gather_text(seed: int, train_bytes: int, eval_bytes: int, raw: bool) -> tuple[list, list]:
    """Read standard-library ``*.py`` files into disjoint train / held-out lists.

    The top-level files of the running interpreter's stdlib are sorted by name,
    shuffled with ``seed`` and taken in that order until each byte budget is
    reached; every tenth file (in the shuffled order) is held out.  Unless
    ``raw``, comments and docstrings are stripped (:func:`strip_docs`).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    random.Random(seed).shuffle(files)
    train, held_out = [], []
    n_train = n_eval = 0
    for i, path in enumerate(files):
        if n_train >= train_bytes and n_eval >= eval_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if not raw:
            try:
                text = strip_docs(text)
            except SyntaxError:  # e.g. test fixtures with deliberate errors
                continue
        if i % 10 == 0:
            if n_eval < eval_bytes:
                held_out.append(text)
                n_eval += len(text)
        elif n_train < train_bytes:
            train.append(text)
            n_train += len(text)
    print(
        f"[data] {stdlib}: {len(train)} train files ({n_train / 1e6:.2f} MB), "
        f"{len(held_out)} held-out files ({n_eval / 1e6:.2f} MB)"
    )
    return train, held_out


def train_tokenizer(texts: list, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the Qwen3.5 normaliser and pre-tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    print(f"[tokenizer] trained byte-level BPE, vocab {tokenizer.get_vocab_size()}")
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list) -> np.ndarray:
    """Encode documents into one token stream, each followed by the EOS token."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_tokenizer(hf_tokenizer, reference: Tokenizer, samples: list) -> None:
    """Assert that a loaded tokenizer encodes like the trained one and round-trips."""
    for text in samples:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ids == expected, "loaded tokenizer does not match the trained one"
        decoded = hf_tokenizer.decode(ids)
        assert decoded == text, f"decode(encode(x)) != x: {decoded!r}"
    print(f"[tokenizer] loaded tokenizer matches and round-trips {len(samples)} samples")


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def make_text_config(vocab_size: int, eos_id: int, args: argparse.Namespace) -> dict:
    """The ``text_config`` of the checkpoint, as a real Qwen3.5 config spells it."""
    n_layers, interval = args.layers, args.full_attention_interval
    return {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": eos_id,
        "full_attention_interval": interval,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": args.linear_head_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_value_head_dim": args.linear_head_dim,
        "max_position_embeddings": 8192,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": args.heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            # (head_dim * partial_rotary_factor) / 2 frequencies, split t/h/w.
            "mrope_section": mrope_section(args.head_dim // 8),
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def mrope_section(n_freqs: int) -> list:
    """Split ``n_freqs`` rotary frequencies into three M-RoPE sections."""
    base = n_freqs // 3
    sections = [base, base, base]
    for i in range(n_freqs - 3 * base):
        sections[i] += 1
    return sections


class MTPHead(nn.Module):
    """One-layer Qwen3.5 multi-token-prediction head built from mlx-lm classes.

    For trunk position ``t`` it combines the trunk's final-normed hidden state
    ``H[t]`` with the embedding of the next token ``x[t+1]`` and predicts
    ``x[t+2]`` through a full-attention decoder layer and the tied lm_head.
    """

    def __init__(self, args: qwen3_5.TextModelArgs):
        """Create the head's modules; parameter names match ``mtp.*`` in HF."""
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # A layer index whose (idx + 1) % interval == 0 gives full attention.
        full_attention_idx = args.full_attention_interval - 1
        self.layers = [qwen3_5.DecoderLayer(args, layer_idx=full_attention_idx)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array) -> mx.array:
        """Map ``H[0:n]`` and ``embed(x[1:n+1])`` to normed states for ``x[2:n+2]``."""
        e = self.pre_fc_norm_embedding(next_embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        z = self.fc(mx.concatenate([e, h], axis=-1))
        mask = create_attention_mask(z, None)
        for layer in self.layers:
            z = layer(z, mask=mask)
        return self.norm(z)


class TrunkWithHead(nn.Module):
    """The mlx-lm Qwen3.5 model plus an MTP head sharing its tied embedding."""

    def __init__(self, config: dict):
        """Build ``qwen3_5.Model`` from ``config`` and a matching head."""
        super().__init__()
        self.trunk = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
        self.mtp = MTPHead(self.trunk.language_model.args)

    def __call__(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Return trunk logits for all positions and head logits for all but the last."""
        text_model = self.trunk.language_model.model
        embed = text_model.embed_tokens
        hidden = text_model(tokens)
        trunk_logits = embed.as_linear(hidden)
        head_hidden = self.mtp(hidden[:, :-1], embed(tokens[:, 1:]))
        return trunk_logits, embed.as_linear(head_hidden)


def losses(model: TrunkWithHead, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Mean next-token CE of the trunk and token-after-next CE of the head."""
    trunk_logits, head_logits = model(tokens[:, :-1])
    trunk_ce = nn.losses.cross_entropy(trunk_logits, tokens[:, 1:]).mean()
    head_ce = nn.losses.cross_entropy(head_logits, tokens[:, 2:]).mean()
    return trunk_ce, head_ce


def init_weights(model: nn.Module, std: float, n_layers: int, seed: int) -> None:
    """Initialise like transformers' Qwen3.5 ``_init_weights``, GPT-2 style.

    Linear, Conv1d and Embedding weights are drawn from ``N(0, std)``; the
    projections that write into the residual stream (``o_proj``, ``out_proj``,
    ``down_proj``) are further scaled by ``1 / sqrt(2 * n_layers)`` as in GPT-2,
    which measurably speeds up this short training.  RMSNorm weights stay at one
    (zero in HF's centred convention), ``dt_bias`` at one and ``A_log`` at
    mlx-lm's ``log(U(0, 16))``.
    """
    key = mx.random.key(seed)
    residual_scale = 1.0 / math.sqrt(2 * n_layers)

    def visit(name, module):
        nonlocal key
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            key, sub = mx.random.split(key)
            scale = std
            if name.rsplit(".", 1)[-1] in ("o_proj", "out_proj", "down_proj"):
                scale *= residual_scale
            module.weight = scale * mx.random.normal(module.weight.shape, key=sub)

    model.apply_to_modules(visit)


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters in ``module``."""
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def train(model: TrunkWithHead, stream: np.ndarray, args: argparse.Namespace) -> None:
    """Train trunk and head jointly with AdamW on random crops of ``stream``."""
    rng = np.random.default_rng(args.seed)
    warmup = max(1, args.steps // 10)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / warmup, args.lr, warmup),
            optim.cosine_decay(args.lr, args.steps - warmup, args.lr * 0.1),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(model, tokens):
        trunk_ce, head_ce = losses(model, tokens)
        return trunk_ce + head_ce, (trunk_ce, head_ce)

    value_and_grad = nn.value_and_grad(model, loss_fn)
    model.train()
    window = args.seq_len + 1
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        offsets = rng.integers(0, len(stream) - window, size=args.batch)
        batch = mx.array(np.stack([stream[o : o + window] for o in offsets]))
        (_, (trunk_ce, head_ce)), grads = value_and_grad(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, trunk_ce, head_ce)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            print(
                f"[train] step {step:4d}/{args.steps}  trunk CE {trunk_ce.item():.3f}"
                f"  head CE {head_ce.item():.3f}  {elapsed:6.1f}s",
                flush=True,
            )
    model.eval()
    print(f"[train] {args.steps} steps in {time.perf_counter() - start:.1f}s")


def held_out_batches(stream: np.ndarray, seq_len: int, max_windows: int) -> list:
    """Cut the held-out stream into consecutive non-overlapping windows."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    windows = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return [mx.array(np.stack(windows[i : i + 8])) for i in range(0, n, 8)]


def evaluate(trunk_fn, head_fn, batches: list) -> dict:
    """Held-out trunk CE / top-1 accuracy and depth-1 greedy acceptance.

    ``trunk_fn(tokens)`` returns ``(final-normed hidden, logits)`` and
    ``head_fn(hidden, tokens)`` returns head logits for positions ``0..T-2``.
    Acceptance is computed by teacher forcing, without a decoding loop: the
    fraction of positions ``t`` where the head's argmax at ``t`` (its guess for
    ``x[t+2]``) equals the trunk's argmax at ``t + 1`` (the trunk's own greedy
    choice for ``x[t+2]``).
    """
    ce = correct = hits = n_tokens = n_positions = 0.0
    for tokens in batches:
        hidden, logits = trunk_fn(tokens)
        head_logits = head_fn(hidden, tokens)
        logits = logits.astype(mx.float32)
        ce += nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:], reduction="sum").item()
        trunk_choice = mx.argmax(logits, axis=-1)
        correct += (trunk_choice[:, :-1] == tokens[:, 1:]).sum().item()
        n_tokens += tokens[:, 1:].size
        agree = mx.argmax(head_logits, axis=-1) == trunk_choice[:, 1:]
        hits += agree.sum().item()
        n_positions += agree.size
    return {
        "trunk_ce": ce / n_tokens,
        "trunk_top1": correct / n_tokens,
        "acceptance": hits / n_positions,
    }


def in_memory_fns(model: TrunkWithHead):
    """Trunk and head callables of the in-memory model for :func:`evaluate`."""
    text_model = model.trunk.language_model.model
    embed = text_model.embed_tokens

    def trunk_fn(tokens):
        hidden = text_model(tokens)
        return hidden, embed.as_linear(hidden)

    def head_fn(hidden, tokens):
        return embed.as_linear(model.mtp(hidden[:, :-1], embed(tokens[:, 1:])))

    return trunk_fn, head_fn


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def to_hf_weights(model: TrunkWithHead) -> dict:
    """Trunk and head weights in the original HF layout, as bf16 ``mx.array``s."""
    weights = {}
    for name, value in tree_flatten(model.trunk.parameters()):
        value = value.astype(mx.float32)
        if any(name.endswith(suffix) for suffix in TRUNK_SHIFTED_NORMS):
            value = value - 1.0
        if name.endswith("conv1d.weight"):  # MLX (C, K, 1) -> HF (C, 1, K)
            value = value.swapaxes(1, 2)
        name = name.replace("language_model.model.", "model.language_model.", 1)
        weights[name] = value.astype(mx.bfloat16)
    for name, value in tree_flatten(model.mtp.parameters()):
        value = value.astype(mx.float32)
        if name.endswith(HEAD_NORMS):
            value = value - 1.0
        weights[f"mtp.{name}"] = value.astype(mx.bfloat16)
    return weights


def save_hf(model, tokenizer, config: dict, path: Path) -> None:
    """Write config, bf16 safetensors, tokenizer and generation config."""
    path.mkdir(parents=True)
    weights = to_hf_weights(model)
    for name, value in weights.items():  # after short training, 1 + w stays near 1
        if name.startswith("mtp.") and "norm" in name:
            assert abs(value.astype(mx.float32).mean().item()) < 0.5, f"{name} is not zero-centred"
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = config["text_config"]["eos_token_id"]
    generation = {
        "bos_token_id": eos,
        "eos_token_id": [tokenizer.token_to_id("<|im_end|>"), eos],
        "pad_token_id": eos,
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(tokenizer, path)
    n_head = sum(k.startswith("mtp.") for k in weights)
    print(f"[save] {path}: {len(weights)} tensors ({n_head} under mtp.*)")


def check_hf_load(path: Path, model: TrunkWithHead, tokenizer, samples, batch):
    """Load ``path`` with ``mlx_lm.load`` and compare it with the in-memory trunk.

    Two comparisons: the checkpoint as mlx-lm runs it (bf16) against the fp32
    in-memory trunk, which differs by bf16 rounding only; and the loaded weights
    upcast to fp32 against the in-memory trunk with its weights rounded to bf16,
    which must agree to float32 precision (this pins the layout and the norm
    arithmetic exactly).
    """
    import mlx_lm

    loaded, hf_tokenizer = mlx_lm.load(str(path))
    check_tokenizer(hf_tokenizer, tokenizer, samples)
    detokenizer = hf_tokenizer.detokenizer
    detokenizer.reset()
    for token in hf_tokenizer.encode(samples[0]):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == samples[0], "mlx-lm streaming detokenizer mismatch"
    assert not any("mtp" in k for k, _ in tree_flatten(loaded.parameters()))

    reference = model.trunk(batch)
    got = loaded(batch).astype(mx.float32)
    diff = mx.abs(got - reference).max().item()
    agreement = (mx.argmax(got, -1) == mx.argmax(reference, -1)).mean().item()
    print(
        f"[check] mlx_lm.load(hf) (bf16) vs in-memory fp32 trunk: max |logit diff| "
        f"{diff:.4f} (max |logit| {mx.abs(reference).max().item():.2f}), "
        f"argmax agreement {agreement:.4f}"
    )

    def round_like_export(name, w):
        # bf16 export; shifted norms are stored as bf16(w - 1) and mlx-lm adds
        # the 1 back in bf16.
        if any(name.endswith(suffix) for suffix in TRUNK_SHIFTED_NORMS):
            return ((w - 1.0).astype(mx.bfloat16) + 1.0).astype(mx.float32)
        return w.astype(mx.bfloat16).astype(mx.float32)

    rounded = qwen3_5.Model(model.trunk.args)
    rounded.update(tree_map_with_path(round_like_export, model.trunk.parameters()))
    loaded.set_dtype(mx.float32)
    exact = mx.abs(loaded(batch) - rounded(batch)).max().item()
    print(f"[check] same with bf16-rounded weights in fp32: max |logit diff| {exact:.2e}")
    assert exact < 1e-3 and agreement > 0.95, "HF checkpoint does not reload faithfully"


def head_weights_to_mlx(hf_weights: dict) -> dict:
    """HF ``mtp.*`` tensors -> MLX head tensors (absolute RMSNorm, no prefix)."""
    out = {}
    for name, value in hf_weights.items():
        if not name.startswith("mtp."):
            continue
        name = name[len("mtp.") :]
        if name.endswith(HEAD_NORMS):
            value = (value.astype(mx.float32) + 1.0).astype(mx.bfloat16)
        out[name] = value
    return out


def convert_mlx(hf_path: Path, mlx_path: Path, text_args, q_bits: int, q_group: int):
    """Run ``mlx_lm.convert`` to 4 bits and restore the head as a sidecar."""
    from mlx_lm.convert import convert

    convert(
        hf_path=str(hf_path),
        mlx_path=str(mlx_path),
        quantize=True,
        q_bits=q_bits,
        q_group_size=q_group,
    )
    head = MTPHead(text_args)
    head.load_weights(list(head_weights_to_mlx(mx.load(str(hf_path / "model.safetensors"))).items()))
    nn.quantize(head, group_size=q_group, bits=q_bits)
    sidecar = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(
        str(mlx_path / "mtp.safetensors"),
        sidecar,
        {"format": "mlx", "mtp_norm_convention": "absolute"},
    )
    print(f"[convert] {mlx_path / 'mtp.safetensors'}: {len(sidecar)} tensors")
    for name, value in sidecar.items():
        print(f"    {name:48s} {str(value.dtype):16s} {tuple(value.shape)}")


def check_mlx(mlx_path: Path, text_args, batches: list) -> dict:
    """Evaluate the 4-bit trunk plus the reloaded 4-bit sidecar head.

    Quantized matmuls are slow on MLX's CPU backend, so callers pass few batches.
    """
    import mlx_lm

    trunk, _ = mlx_lm.load(str(mlx_path))
    config = json.loads((mlx_path / "config.json").read_text())["quantization"]
    head = MTPHead(text_args)
    nn.quantize(head, group_size=config["group_size"], bits=config["bits"])
    sidecar = mx.load(str(mlx_path / "mtp.safetensors"))
    head.load_weights([(k[len("mtp.") :], v) for k, v in sidecar.items()])
    head.eval()
    text_model = trunk.language_model.model
    embed = text_model.embed_tokens

    def trunk_fn(tokens):
        hidden = text_model(tokens)
        return hidden, embed.as_linear(hidden)

    def head_fn(hidden, tokens):
        return embed.as_linear(head(hidden[:, :-1], embed(tokens[:, 1:])))

    return evaluate(trunk_fn, head_fn, batches)


def directory_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=220, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed for everything")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--full-attention-interval", type=int, default=3)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--linear-key-heads", type=int, default=2)
    parser.add_argument("--linear-value-heads", type=int, default=4)
    parser.add_argument("--linear-head-dim", type=int, default=32)
    parser.add_argument("--train-mb", type=float, default=2.0)
    parser.add_argument("--raw-text", action="store_true", help="keep comments and docstrings")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=25)
    return parser.parse_args()


def main() -> None:
    """Build, train, check and export the tiny checkpoint atomically."""
    args = parse_args()
    t0 = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)

    train_texts, eval_texts = gather_text(args.seed, int(args.train_mb * 1e6), 300_000, raw=args.raw_text)
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_stream = encode_documents(tokenizer, train_texts)
    eval_stream = encode_documents(tokenizer, eval_texts)
    print(f"[data] {len(train_stream)} train tokens, {len(eval_stream)} held-out tokens")
    samples = [SAMPLE_TEXT, eval_texts[0][:2000], train_texts[0][:2000]]

    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    text_config = make_text_config(tokenizer.get_vocab_size(), eos_id, args)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": True,
        "transformers_version": "5.0.0",
    }
    # mlx-lm's ModelArgs rewrite rope_parameters in place ("rope_type" ->
    # "type"), so the model gets a copy and config.json keeps the HF spelling.
    model = TrunkWithHead(copy.deepcopy(config))
    init_weights(model, text_config["initializer_range"], args.layers, args.seed)
    mx.eval(model.parameters())
    n_trunk = count_parameters(model.trunk)
    n_head = count_parameters(model.mtp)
    print(f"[model] trunk {n_trunk:,} parameters, MTP head {n_head:,} (embedding shared)")

    train(model, train_stream, args)
    batches = held_out_batches(eval_stream, args.seq_len, args.eval_windows)
    metrics = evaluate(*in_memory_fns(model), batches)
    print(
        f"[eval] held-out trunk CE {metrics['trunk_ce']:.4f} "
        f"(ppl {math.exp(metrics['trunk_ce']):.1f}), top-1 {metrics['trunk_top1']:.4f}"
    )
    print(f"[eval] depth-1 greedy acceptance (fp32, in memory) {metrics['acceptance']:.4f}")

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is meant to be shared
    try:
        save_hf(model, tokenizer, config, tmp / "hf")
        check_hf_load(tmp / "hf", model, tokenizer, samples, batches[0])
        text_args = model.trunk.language_model.args
        convert_mlx(tmp / "hf", tmp / "mlx-4bit", text_args, q_bits=4, q_group=64)
        q_metrics = check_mlx(tmp / "mlx-4bit", text_args, batches[:1])
        print(
            f"[eval] 4-bit trunk + sidecar head (first {batches[0].size} held-out "
            f"tokens): CE {q_metrics['trunk_ce']:.4f}, acceptance {q_metrics['acceptance']:.4f}"
        )
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for sub in ("hf", "mlx-4bit"):
        print(f"[done] {out / sub}: {directory_bytes(out / sub):,} bytes")
    print(f"[done] total {directory_bytes(out):,} bytes, {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
