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
from helpers.builders import KINDS, build_head, build_model, config_for, save_checkpoint, trunk_weights
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

    patched = (u.load_model, q.Model.sanitize, s.main, s.ResponseGenerator._tokenize)
    mtp_plugin.unpatch()
    mtp_plugin.unpatch()
    stock = (u.load_model, q.Model.sanitize, s.main, s.ResponseGenerator._tokenize)
    assert all(a is not b for a, b in zip(patched, stock, strict=True))
    assert not any(hasattr(f, "__wrapped__") for f in stock)
    mtp_plugin.patch()
    mtp_plugin.patch()
    assert [f.__wrapped__ for f in (u.load_model, s.main, s.ResponseGenerator._tokenize)] == [
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


# --- a model.safetensors.index.json that is not what it should be: loaded as stock loads it ---------------------

INDEXES = {  # id: the index's new text, or how to change its weight_map
    "weight_map-array": '{"weight_map": ["a"]}',
    "weight_map-null": '{"weight_map": null}',
    "null-entry": lambda weight_map: {**weight_map, next(iter(weight_map)): None},
    "number-entry": lambda weight_map: {**weight_map, next(iter(weight_map)): 3},
    "not-json": "{not json",
    "array": "[1, 2]",
    "directory": None,
}


def break_index(path, case):
    index = path / "model.safetensors.index.json"
    change = INDEXES[case]
    if change is None:
        index.unlink()
        index.mkdir()
    elif callable(change):
        index.write_text(json.dumps({"weight_map": change(json.loads(index.read_text())["weight_map"])}))
    else:
        index.write_text(change)
    return index


@pytest.mark.parametrize("head_file", ["mtp.safetensors", "model-00002-of-00002.safetensors"])
@pytest.mark.parametrize("case", sorted(INDEXES))
def test_broken_index_loads_as_stock_with_the_head(tmp_path, caplog, capsys, case, head_file):
    """mlx-lm never reads the index: the plugin loads what stock loads, keeps the head (found by file name, in a
    sidecar or a shard) and warns once naming the index; inspect says the same, without a traceback."""
    from mtp_plugin.commands.cli import main
    from mtp_plugin.commands.inspect import inspect_dir

    config = config_for("qwen3_5")
    model = build_model(config)
    head = build_head(model, config)
    plain = save_checkpoint(tmp_path / "plain", config, trunk_weights(model), index=True)
    path = save_checkpoint(tmp_path / "m", config, trunk_weights(model), head, head_file, index=True)
    index = break_index(path, case)
    mtp_plugin.unpatch()
    lm_load(path)  # stock mlx-lm loads it (mlx-lm < 0.32 shifts the norms of a shard holding mtp.* twice)
    mtp_plugin.patch()
    expected = logits(lm_load(plain))  # a head-less checkpoint: warns that its head was dropped
    caplog.clear()
    loaded = lm_load(path)
    np.testing.assert_array_equal(logits(loaded), expected)
    assert_head_kept(loaded, head)
    warnings = [r.getMessage() for r in caplog.records if r.name == "mtp_plugin" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(index) in warnings[0] and "repair the index or delete it" in warnings[0]
    report = inspect_dir(path)
    assert report["can_run"] and report["problems"] == [] and str(index) in report["warnings"][0]
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    assert f"warning: {index}" in capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(INDEXES))
def test_broken_index_in_mlx_vlm_as_stock(tmp_path, case):
    """mlx-vlm reads the index itself: where stock loads, the plugin loads with the head; where stock raises, the
    plugin raises stock's own error (nothing of the plugin's comes first)."""
    config = config_for("qwen3_5", vision=True)
    model = build_model(config, "mlx_vlm")
    head = build_head(model, config)
    plain = save_checkpoint(tmp_path / "plain", config, trunk_weights(model), index=True)
    path = save_checkpoint(tmp_path / "m", config, trunk_weights(model), head, "mtp.safetensors", index=True)
    break_index(path, case)

    def outcome():
        try:
            return vlm_load(path)
        except Exception as e:  # stock's own error, compared below
            return e

    mtp_plugin.unpatch()
    stock = outcome()
    mtp_plugin.patch()
    patched = outcome()
    if isinstance(stock, Exception):
        assert (type(patched), str(patched)) == (type(stock), str(stock))
    else:
        np.testing.assert_array_equal(logits(patched), logits(vlm_load(plain)))
        assert_head_kept(patched, head)


def test_other_model_types_ignore_a_broken_index(tmp_path, caplog):
    """A model type no plugin handles: its files are not even read by the plugin, whatever its index holds."""
    from mlx_lm.utils import _get_classes

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 256,
              "tie_word_embeddings": False}
    model_class, args_class = _get_classes(config)
    path = save_checkpoint(tmp_path / "llama", config, trunk_weights(model_class(args_class.from_dict(config))),
                           index=True)
    break_index(path, "weight_map-array")
    mtp_plugin.unpatch()
    expected = logits(lm_load(path))
    mtp_plugin.patch()
    caplog.clear()
    patched = lm_load(path)
    assert patched.mtp_head is None and not [r for r in caplog.records if r.name == "mtp_plugin"]
    np.testing.assert_array_equal(logits(patched), expected)
