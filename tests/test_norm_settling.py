"""Norm conventions the files leave open are settled per tensor on a prompt's own tokens (issue 25, item 4).

Two heads of the bundled trained checkpoint whose files do not tell their norms' conventions (``norm_cases``): one
zero-centred pre-fc norm beside absolute ones, and the Hugging Face original's head in an MLX sidecar. Once a prompt
long enough has been seen, each reads every norm as its twin with declared conventions does, so it drafts exactly as
well, whichever runtime path fed the head the prompt (single-stream ``generate_step``, the mlx-lm server's batched
prompt pass); output never changes; ``verify --write`` records the true readings, also where metadata declares a
wrong one.
"""

import importlib
import shutil

import mlx.core as mx
import pytest
from helpers.norm_cases import code_prompt, hf_sidecar, mixed_sidecar
from mlx_lm import load
from mtp_plugin.adapters.mlx_lm_server import MTPRequest
from test_batching import drain, insert, mtp_generator, stock_tokens

from mtp_plugin.commands.verify import verify
from mtp_plugin.head import norm_settling

BUILDERS = {"mixed": mixed_sidecar, "hf": hf_sidecar}
PROMPT = code_prompt("textwrap", 3000, 400)  # 129 tokens: 127 scored positions
SHORT = code_prompt("textwrap", 3000, 60)  # 23 tokens: under norm_settling.MIN_POSITIONS scored positions
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per case: (open model directory, declared twin's directory, true convention per norm)."""
    root = tmp_path_factory.mktemp("norm-cases")
    out = {}
    for name, build in BUILDERS.items():
        path, truth = build(root / name)
        out[name] = (path, build(root / f"{name}-declared", declared=True)[0], truth)
    return out


def generate_step(*args, **kwargs):
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def decode(model, tokenizer, text, **options):
    """Greedy tokens of ``text`` (depth 2 unless ``options`` say otherwise) and the generation's MTP counters."""
    options = {"mtp_depth": 2, **options}
    tokens = [t for t, _ in generate_step(mx.array(tokenizer.encode(text)), model, max_tokens=MAX_TOKENS, **options)]
    return tokens, model.mtp_head.stats


def conventions(model):
    return {n: d.convention for n, d in model.mtp_head.norms.items()}


# Depth-2 acceptance on PROMPT with MAX_TOKENS tokens (4-bit trunk, CPU) that the declared twin reaches and the open
# head must reach once settled. Measured, declared twin = settled open head: mixed 0.412 (mlx-lm 0.32) / 0.205
# (mlx-lm 0.31), hf 0.316 (both). Before settling was per tensor (all open norms decided together on 64
# pseudo-random tokens) the open heads reached 0.034 and 0.275 (mlx-lm 0.32).
ACCEPTANCE = {"mixed": 0.20, "hf": 0.30}


@pytest.mark.parametrize("case", sorted(BUILDERS))
def test_open_norms_settle_per_tensor_at_the_first_prompt(cases, case):
    path, declared_path, truth = cases[case]
    model, tokenizer = load(str(path))
    summary = model.mtp_head.summary()
    tokens, stats = decode(model, tokenizer, PROMPT)
    declared, _ = load(str(declared_path))
    _, reference = decode(declared, tokenizer, PROMPT)
    assert stats.acceptance >= ACCEPTANCE[case] and reference.acceptance >= ACCEPTANCE[case]
    assert abs(stats.acceptance - reference.acceptance) <= 0.02, (stats.acceptance, reference.acceptance)
    assert conventions(model) == truth and conventions(declared) == truth
    assert all(d.settled for d in model.mtp_head.norms.values())
    assert model.mtp_head.module.open_norms is None
    assert declared.mtp_head.module.open_norms is None  # its files decide every norm: nothing to settle
    assert "read as stored until a prompt settles them" in summary
    assert tokens == decode(model, tokenizer, PROMPT, enable_mtp=False)[0]


def test_a_short_prompt_leaves_norms_open_for_a_longer_one(cases):
    path, _, truth = cases["hf"]
    model, tokenizer = load(str(path))
    assert len(tokenizer.encode(SHORT)) - 2 < norm_settling.MIN_POSITIONS
    short, _ = decode(model, tokenizer, SHORT)
    assert model.mtp_head.module.open_norms is not None
    assert not any(model.mtp_head.norms[n].settled for n in model.mtp_head.module.open_norms.names)
    assert short == decode(model, tokenizer, SHORT, enable_mtp=False)[0]
    decode(model, tokenizer, PROMPT)
    assert conventions(model) == truth


def test_the_server_batch_settles_at_its_prompt(cases):
    """mlx-lm's server batch: the first row whose prompt carries enough evidence settles the head; every row decodes
    what stock mlx-lm decodes."""
    path, _, truth = cases["hf"]
    model, tokenizer = load(str(path))
    prompts = [tokenizer.encode(SHORT), tokenizer.encode(PROMPT)]
    generator = mtp_generator(model)
    uids = insert(generator, prompts, [MAX_TOKENS] * 2, [MTPRequest(True, 2)] * 2)
    results = {}
    drain(generator, results)
    assert conventions(model) == truth
    assert [results[uid] for uid in uids] == stock_tokens(model, prompts, [MAX_TOKENS] * 2)


@pytest.mark.parametrize("declared", [False, "absolute"], ids=["open", "declared-absolute"])
def test_verify_write_records_each_norms_reading(tmp_path, declared):
    """``verify --write`` records the true reading of every norm: open ones settled on its text, and (per-tensor
    readings in its sweep) one that metadata declares wrongly."""
    path, truth = mixed_sidecar(tmp_path / "mixed", declared=declared)
    head_file = (path / "mtp.safetensors").read_bytes()
    result = verify(path, PROMPT, write=True)
    assert result["best"]["norms"] in ("decided", "per_tensor")
    model, _ = load(str(path))
    assert conventions(model) == truth
    assert all(d.evidence == "declared in metadata" for d in model.mtp_head.norms.values())
    assert (path / "mtp.safetensors").read_bytes() == head_file  # only config.json is replaced (atomically)
    shutil.rmtree(path)
