"""Loading checkpoints that carry an MTP head: trunk logits identical to the head-less twin, head kept.

Runs against whichever mlx-lm / mlx-vlm the environment has; the nox matrix runs it on a buggy and a
current release of each.
"""

import importlib
import json
from importlib import metadata

import mlx.core as mx
import numpy as np
import pytest
from builders import KINDS, build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx.utils import tree_flatten

import mtp_plugin

TOKENS = mx.array([[3, 17, 42, 99, 7, 128, 5, 64, 200, 11]])
FORMS = {  # id: (head file, prefix, extra config, indexed shards)
    "shard-mtp": ("model.safetensors", "mtp.", {}, False),
    "shard-language_model": ("model.safetensors", "language_model.mtp.", {}, False),
    "shard-model": ("model.safetensors", "model.mtp.", {}, False),
    "indexed-shard": ("model-00002-of-00002.safetensors", "mtp.", {}, True),
    "unindexed-extra-file": ("extra.safetensors", "mtp.", {}, True),
    "sidecar": ("mtp.safetensors", "mtp.", {}, False),
    "sidecar-dir-bare": ("mtp/weights.safetensors", "", {}, False),
    "model-mtp": ("model-mtp.safetensors", "mtp.", {}, False),
    "model-mtp-bare": ("model-mtp.safetensors", "", {}, False),  # mlx-lm's model*.safetensors glob reads it
    "sidecar-bare": ("mtp.safetensors", "", {}, False),  # mlx-vlm's *.safetensors glob reads it
    "sidecar-bare-indexed": ("mtp.safetensors", "", {}, True),  # listed in the index
    "config-named": ("heads/draft.safetensors", "mtp.", {"mtp_sidecar": "heads/draft.safetensors"}, False),
}


def release(name):
    return tuple(int(p) for p in metadata.version(name).split(".")[:3])


def lm_load(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def vlm_load(path):
    from mlx_vlm.utils import load_model

    return load_model(path)


def logits(model):
    out = model(TOKENS)
    return np.array(getattr(out, "logits", out).astype(mx.float32))


def make_pair(tmp_path, kind, form, runtime="mlx_lm", head_quant=None):
    head_file, prefix, extra, index = FORMS[form]
    config = {**config_for(kind, vision=runtime == "mlx_vlm"), **extra}
    model = build_model(config, runtime)
    trunk = trunk_weights(model)
    head = build_head(model, config, head_quant)
    plain = save_checkpoint(tmp_path / "plain", config, trunk, index=index)
    with_head = save_checkpoint(tmp_path / "head", config, trunk, head, head_file, prefix, index=index)
    if form.endswith("-indexed"):  # the index lists the head file too
        index_file = with_head / "model.safetensors.index.json"
        listing = json.loads(index_file.read_text())
        listing["weight_map"].update({prefix + k: head_file for k in head})
        index_file.write_text(json.dumps(listing))
    return plain, with_head, head


def assert_head_kept(model, head):
    loaded = model.mtp_head
    assert loaded is not None
    got = dict(tree_flatten(loaded.module.parameters()))
    assert sorted(got) == sorted(head)
    for name, value in head.items():
        assert mx.array_equal(got[name], value), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_mlx_lm_loads_every_head_form(tmp_path, kind, form):
    plain, with_head, head = make_pair(tmp_path, kind, form)
    expected = logits(lm_load(plain))
    model = lm_load(with_head)
    np.testing.assert_array_equal(logits(model), expected)
    assert_head_kept(model, head)


@pytest.mark.parametrize("kind", KINDS)
def test_mlx_lm_quantized_head_differs_from_trunk(tmp_path, kind):
    plain, with_head, head = make_pair(tmp_path, kind, "sidecar", head_quant={"bits": 8, "group_size": 32})
    model = lm_load(with_head)
    np.testing.assert_array_equal(logits(model), logits(lm_load(plain)))
    assert_head_kept(model, head)
    assert set(model.mtp_head.quantization.values()) == {"int8/g32"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["shard-mtp", "sidecar", "sidecar-dir-bare", "shard-language_model", "sidecar-bare",
                                  "model-mtp-bare"])
def test_mlx_vlm_loads_every_head_form(tmp_path, kind, form):
    plain, with_head, head = make_pair(tmp_path, kind, form, runtime="mlx_vlm")
    model = vlm_load(with_head)
    np.testing.assert_array_equal(logits(model), logits(vlm_load(plain)))
    assert_head_kept(model, head)


def test_stock_mlx_lm_behaviour_is_what_we_fix(tmp_path):
    """Without the plugin, a buggy mlx-lm shifts norms twice; a current one loads but drops the head."""
    plain, with_head, _ = make_pair(tmp_path, "qwen3_5", "shard-mtp")
    mtp_plugin.unpatch()
    stock = lm_load(with_head)
    assert not hasattr(stock, "mtp_head")
    same = np.array_equal(logits(stock), logits(lm_load(plain)))
    assert same == (release("mlx-lm") >= (0, 32, 0))


def test_stock_qwen3_next_rejects_head_tensors(tmp_path):
    _, with_head, _ = make_pair(tmp_path, "qwen3_next", "shard-mtp")
    mtp_plugin.unpatch()
    with pytest.raises(ValueError, match="parameters not in model"):
        lm_load(with_head)


def test_stock_mlx_vlm_behaviour_is_what_we_fix(tmp_path):
    plain, with_head, _ = make_pair(tmp_path, "qwen3_5", "shard-mtp", runtime="mlx_vlm")
    mtp_plugin.unpatch()
    same = np.array_equal(logits(vlm_load(with_head)), logits(vlm_load(plain)))
    assert same == (release("mlx-vlm") >= (0, 6, 9))


def test_unpatch_restores_stock_functions():
    import mlx_lm.models.qwen3_5 as q
    import mlx_lm.server as s
    import mlx_lm.utils as u

    patched = (u.load_model, q.Model.sanitize, s.main, s.ResponseGenerator._is_batchable)
    mtp_plugin.unpatch()
    mtp_plugin.unpatch()
    stock = (u.load_model, q.Model.sanitize, s.main, s.ResponseGenerator._is_batchable)
    assert all(a is not b for a, b in zip(patched, stock, strict=True))
    assert not any(hasattr(f, "__wrapped__") for f in stock)
    mtp_plugin.patch()
    mtp_plugin.patch()
    assert [f.__wrapped__ for f in (u.load_model, s.main, s.ResponseGenerator._is_batchable)] == [
        stock[0], stock[2], stock[3]]
    assert not hasattr(u.load_model.__wrapped__, "__wrapped__")


def test_other_model_types_untouched(tmp_path):
    """A model type no plugin handles loads through the wrapped loader exactly as stock, with no head."""
    from mlx_lm.utils import _get_classes

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 256,
              "tie_word_embeddings": False}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    weights = trunk_weights(model_class(args_class.from_dict(config)))
    path = save_checkpoint(tmp_path / "llama", config, weights, {"fc.weight": mx.zeros((2, 2))}, "mtp.safetensors")
    patched = lm_load(path)
    assert patched.mtp_head is None
    generated = [t for t, _ in importlib.import_module("mlx_lm.generate").generate_step(TOKENS[0], patched,
                                                                                         max_tokens=12)]
    mtp_plugin.unpatch()
    stock = lm_load(path)
    np.testing.assert_array_equal(logits(patched), logits(stock))
    stock_generate_step = importlib.import_module("mlx_lm.generate").generate_step
    assert generated == [t for t, _ in stock_generate_step(TOKENS[0], stock, max_tokens=12)]
