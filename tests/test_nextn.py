"""The next-n family (DeepSeek-V3, GLM-4 MoE, GLM-4.7-Flash) through the hookspecs: clean loading, lossless decoding.

Tiny random float32 checkpoints of each model type mlx-lm implements, the head stored as the extra decoder layer
the original checkpoints carry (in an MLX conversion's shard, or in the Hugging Face layout with per-expert
tensors and MLA's ``kv_b_proj``), or as the plugin's own sidecar.
"""

import importlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import save_checkpoint
from helpers.console_runs import HF
from helpers.nextn_builders import KINDS, LAYERS, distilled, save_hf, save_mlx
from mlx.utils import tree_flatten
from mtp_plugin.adapters.mlx_lm_server import MTPRequest
from test_batching import drain, insert, mtp_generator, stock_tokens

import mtp_plugin

TOKENS = mx.array([[3, 17, 42, 99, 7, 128, 5, 64, 200, 11]])
PROMPT = [3, 17, 42, 99, 7, 128, 5, 64]


def logits(model):
    return np.array(model(TOKENS))


def load_model(path):
    """mlx-lm's ``load_model`` as patched now (looked up at call time)."""
    return importlib.import_module("mlx_lm.utils").load_model(path)


def generate_step(*args, **kwargs):
    """mlx-lm's generate_step as patched now (looked up at call time)."""
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def tokens(model, prompt, **kwargs):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=20, **kwargs)]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    """``(kind, head-less twin, checkpoint with the head as layer N in its shard, head weights)``."""
    return request.param, *save_mlx(tmp_path_factory.mktemp(request.param), request.param, "layer")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint[2])[0]


def assert_head_is(model, head):
    got = dict(tree_flatten(model.mtp_head.module.parameters()))
    assert sorted(got) == sorted(head)
    for name, value in head.items():
        assert mx.array_equal(got[name], value), name


def test_layer_in_the_shard_loads_cleanly(checkpoint, model):
    kind, plain, _, head = checkpoint
    np.testing.assert_array_equal(logits(model), logits(load_model(plain)[0]))
    assert_head_is(model, head)
    assert model.mtp_head.location.naming == [f"model.layers.{LAYERS}.*"]


@pytest.mark.parametrize("kind", KINDS)
def test_sidecar_loads_cleanly(tmp_path, kind):
    plain, with_head, head = save_mlx(tmp_path, kind, "sidecar")
    model = load_model(with_head)[0]
    np.testing.assert_array_equal(logits(model), logits(load_model(plain)[0]))
    assert_head_is(model, head)


@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_layout_loads_cleanly(tmp_path, kind):
    """Per-expert tensors and MLA's ``kv_b_proj`` in the head too: the family's sanitize is mlx-lm's own."""
    path, head = save_hf(tmp_path / "hf", kind)
    plain = save_mlx(tmp_path / "mlx", kind, "sidecar")[0]
    model = load_model(path)[0]
    np.testing.assert_array_equal(logits(model), logits(load_model(plain)[0]))
    assert_head_is(model, head)


def test_stock_mlx_lm_loses_the_head(checkpoint):
    """What the family fixes: stock mlx-lm drops the layer (GLM-4) or refuses the checkpoint (DeepSeek-V3 of any
    depth but 61 layers, whose own sanitize drops only ``model.layers.61``)."""
    kind, plain, with_head, _ = checkpoint
    mtp_plugin.unpatch()
    if kind == "deepseek_v3":
        with pytest.raises(ValueError, match="parameters not in model"):
            load_model(with_head)
        return
    stock = load_model(with_head)[0]
    assert not hasattr(stock, "mtp_head")
    np.testing.assert_array_equal(logits(stock), logits(load_model(plain)[0]))


@pytest.mark.parametrize("depth", [1, 2, 3, 8, 0])
def test_greedy_identical_to_plain(model, depth):
    plain = tokens(model, PROMPT, enable_mtp=False)
    assert tokens(model, PROMPT, mtp_depth=depth) == plain
    stats = model.mtp_head.stats
    assert stats.cycles > 0 and stats.drafted > 0


@pytest.mark.parametrize("depths", [(1, 2, 3), (0, 8, None)])
def test_greedy_identical_in_one_batch(model, depths):
    """Rows of the server's ``BatchGenerator`` decoding with batched MTP cycles (KV caches trimmed per row, MLA's
    latent cache included) give each row what stock mlx-lm gives it."""
    prompts, max_tokens = [PROMPT, [5, 9], [200, 3, 3, 3, 17, 42]], [20, 16, 24]
    expected = stock_tokens(model, prompts, max_tokens)
    generator = mtp_generator(model)
    options = [MTPRequest(enabled=d != 0, depth=d or None) for d in depths]
    uids = insert(generator, prompts, max_tokens, options)
    results = {}
    drain(generator, results)
    assert [results[uid] for uid in uids] == expected
    assert model.mtp_state.batching.drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_extract_graft_inspect(tmp_path, kind, capsys):
    """The head taken out of a Hugging Face layout checkpoint (quantized as mlx-lm would: DeepSeek's router stays
    float) and grafted onto the MLX conversion's head-less twin decodes as plain decoding does."""
    from mtp_plugin.commands.cli import main

    hf, _ = save_hf(tmp_path / "hf", kind)
    plain = save_mlx(tmp_path / "mlx", kind, "sidecar")[0]
    head, grafted = tmp_path / "head.safetensors", tmp_path / "grafted"
    assert main(["extract", "--hf", str(hf), "--out", str(head)]) == 0
    assert main(["graft", "--recipient", str(plain), "--donor", str(head), "--out", str(grafted)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(grafted), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["can_run"] and report["model_type"] == kind
    model = load_model(grafted)[0]
    assert model.mtp_head.quantization["layers.0.self_attn.o_proj"].startswith("int")
    assert "layers.0.mlp.gate" not in model.mtp_head.quantization  # no linear module: kept float, as mlx-lm does
    assert tokens(model, PROMPT, mtp_depth=2) == tokens(model, PROMPT, enable_mtp=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DeepSeek-V3 checkpoint (MLA, dense layers) whose head drafts what its trunk decodes (``distilled``)."""
    config, trunk, head = distilled("deepseek_v3")
    path = save_checkpoint(tmp_path_factory.mktemp("trained"), config, trunk, head, "mtp.safetensors", "mtp.")
    return load_model(path)[0]


def acceptance(model, depth):
    drafted = accepted = 0
    for prompt in ([3, 17, 42, 99, 7], [100, 5, 77, 150], [9, 9, 200, 31, 64, 2, 250]):
        plain = tokens(model, prompt, enable_mtp=False)
        assert tokens(model, prompt, mtp_depth=depth) == plain
        drafted, accepted = drafted + model.mtp_head.stats.drafted, accepted + model.mtp_head.stats.accepted
    return accepted / drafted


def test_trained_head_is_accepted_through_the_family_wiring(trained):
    """Acceptance of a trained next-n head through the decoding loop: high with the family's wiring (the embedding
    first, the trunk's final-normed hidden state), near zero with the halves swapped."""
    from mtp_plugin.head.conventions import Contract

    assert acceptance(trained, 1) > 0.4 and acceptance(trained, 3) > 0.2
    head = trained.mtp_head.module
    wired = head.contract
    head.contract = Contract(concat_order="hidden_first")
    try:
        assert acceptance(trained, 1) < 0.2
    finally:
        head.contract = wired


@pytest.mark.parametrize("kind", KINDS)
def test_mlx_lm_convert_then_graft(tmp_path, kind):
    """``mlx_lm.convert`` (4-bit) of the Hugging Face layout drops the head, as every MLX conversion does; grafted
    back from the original as a sidecar, it decodes as plain decoding does on the quantized trunk."""
    from mlx_lm import convert

    from mtp_plugin.commands.cli import main

    hf, _ = save_hf(tmp_path / "hf", kind)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF / name, hf / name)
    convert(str(hf), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=64)
    assert load_model(tmp_path / "q4")[0].mtp_head is None
    assert main(["graft", "--recipient", str(tmp_path / "q4"), "--donor", str(hf), "--out", str(tmp_path / "mtp")]) == 0
    model = load_model(tmp_path / "mtp")[0]
    assert model.mtp_head is not None
    assert tokens(model, PROMPT, mtp_depth=2) == tokens(model, PROMPT, enable_mtp=False)


def test_verify_tune_bench(tmp_path, monkeypatch, capsys):
    """The measuring commands on a next-n checkpoint (with the bundled tokenizer, whose vocabulary it shares): the
    wiring sweep runs (a random head is reported unusable: exit 1), tune recommends, bench reports; another
    runtime that cannot run this head is reported by bench, never raised."""
    from mtp_plugin.commands.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, model_dir, _ = save_mlx(tmp_path, "glm4_moe_lite", "layer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF / name, model_dir / name)
    quick = ["--depths", "2", "--max-tokens", "6", "--repeats", "1"]
    assert main(["verify", str(model_dir), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["candidates"]
    assert main(["tune", str(model_dir), *quick]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert main(["bench", str(model_dir), *quick, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["candidates"]] == ["plain", "depth 1", "depth 2", "adaptive"]
    assert all(isinstance(r, str) or r["candidates"] for r in report["references"])


@pytest.mark.parametrize("stored,layers,canonical", [
    ("model.layers.2.eh_proj.weight", 2, "fc.weight"),
    ("language_model.model.layers.2.enorm.weight", 2, "pre_fc_norm_embedding.weight"),
    ("model.language_model.layers.2.self_attn.o_proj.scales", 2, "layers.0.self_attn.o_proj.scales"),
    ("model.layers.2.shared_head.norm.weight", 2, "norm.weight"),
    ("model.layers.2.shared_head.head.weight", 2, "shared_head.head.weight"),  # claimed, then dropped
    ("mtp.layers.0.mlp.switch_mlp.up_proj.weight", 2, "layers.0.mlp.switch_mlp.up_proj.weight"),
    ("model.layers.1.eh_proj.weight", 2, None),  # a trunk layer
    ("model.layers.2.eh_proj.weight", 5, None),  # a trunk layer of a deeper model
])
def test_head_names(stored, layers, canonical):
    """The layer index form with the prefixes a VLM conversion adds, and the plugin's own sidecar names."""
    from mtp_plugin.plugins import hook

    config = {"model_type": "deepseek_v3", "num_hidden_layers": layers}
    assert hook().mtp_head_name(name=stored, model_type="deepseek_v3", sidecar=False, config=config) == canonical


@pytest.mark.parametrize("kind", KINDS)
def test_head_missing_an_expert_is_refused_cleanly(tmp_path, kind, caplog, capsys):
    """A Hugging Face layout head layer without one of its experts: mlx-lm's own sanitize cannot stack it. The head
    is refused with the tensor named, the trunk loads as without it, and ``inspect`` says why."""
    from mtp_plugin.commands.cli import main

    path, _ = save_hf(tmp_path / "hf", kind)
    plain = save_mlx(tmp_path / "mlx", kind, "sidecar")[0]
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items()
               if f"layers.{LAYERS}.mlp.experts.3." not in k}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    model = load_model(path)[0]
    assert model.mtp_head is None
    assert "layers.0.mlp.experts.3." in caplog.text and "MTP head ignored" in caplog.text
    np.testing.assert_array_equal(logits(model), logits(load_model(plain)[0]))
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["can_run"] and "experts.3." in report["problems"][0]


def test_inspect_names_the_declaring_key(tmp_path, capsys):
    from mtp_plugin.commands.cli import main

    plain = save_mlx(tmp_path, "glm4_moe", "sidecar")[0]
    assert main(["inspect", str(plain), "--json"]) == 1
    assert "declares num_nextn_predict_layers=1 but no head" in json.loads(capsys.readouterr().out)["problems"][0]


@pytest.mark.parametrize("case", ["missing-shared-expert", "o_proj-outputs"])
@pytest.mark.parametrize("kind", KINDS)
def test_inspect_and_loader_agree_on_the_layers_structure(tmp_path, kind, case, caplog, capsys):
    """The one validation needs nothing from this family but its head module: an MLP tensor missing or an output
    width wrong is refused by the loader and by inspect alike, naming the tensor."""
    from mtp_plugin.commands.cli import main

    _, path, head = save_mlx(tmp_path, kind, "sidecar")
    name = "layers.0.mlp.shared_experts.down_proj.weight" if case.startswith("missing") else \
        "layers.0.self_attn.o_proj.weight"
    changed = {k: v for k, v in head.items() if k != name} if case.startswith("missing") else \
        {**head, name: head[name][:-8]}
    mx.save_safetensors(str(path / "mtp.safetensors"), {f"mtp.{k}": v for k, v in changed.items()},
                        metadata={"format": "mlx"})
    caplog.clear()
    model = load_model(path)[0]
    assert model.mtp_head is None and name in caplog.text and "MTP head ignored" in caplog.text
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["can_run"] and any(name in p for p in report["problems"]), report["problems"]
