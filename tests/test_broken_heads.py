"""A broken or odd head never changes output: the loader and ``inspect`` run one validation (each problem
named by file and tensor or key), a non-finite draft is a rejected draft that parks the head, and head
files that cannot be read are reported as what they are."""

import importlib
import json
import logging
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mtp_plugin.adapters.patching import release

from mtp_plugin.commands.inspect import inspect_dir
from mtp_plugin.commands.verify import verify

PROMPT = mx.array([3, 17, 42, 99, 7, 128, 5, 64])


@pytest.fixture(scope="module")
def tiny():
    config = config_for("qwen3_5")
    model = build_model(config)
    return config, model, trunk_weights(model), build_head(model, config), build_head(model, config, {
        "bits": 4, "group_size": 32})


def lm_load(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def vlm_load(path):
    from mlx_vlm.utils import load_model

    return load_model(path)


def poisoned(head, name, value):
    """``head`` with the first entry of ``name`` set to ``value`` (NaN or Inf)."""
    tensor = np.array(head[name].astype(mx.float32))
    tensor.flat[0] = value
    return {**head, name: mx.array(tensor).astype(head[name].dtype)}


def refused(path, caplog, expected, runtime="mlx_lm"):
    """The loader ignores the head with one warning and inspect says it cannot run, both naming ``expected``."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        model = (lm_load if runtime == "mlx_lm" else vlm_load)(path)
    assert model.mtp_head is None
    warnings = [r.getMessage() for r in caplog.records if "MTP head ignored" in r.getMessage()]
    assert len(warnings) == 1 and all(e in warnings[0] for e in expected), warnings
    report = inspect_dir(path)
    assert not report["can_run"]
    assert any(all(e in p for e in expected) for p in report["problems"]), report["problems"]
    return warnings[0]


# --- non-finite weights: refused at load, named by tensor -----------------------------------------------

@pytest.mark.parametrize("name,value,quantized", [
    ("fc.weight", np.nan, False),
    ("norm.weight", np.inf, False),
    ("layers.0.mlp.down_proj.weight", -np.inf, False),
    ("fc.scales", np.nan, True),
    ("layers.0.self_attn.q_proj.biases", np.inf, True),
])
def test_nonfinite_head_weights_refused_by_name(tmp_path, tiny, caplog, name, value, quantized):
    config, _, weights, head, qhead = tiny
    path = save_checkpoint(tmp_path / "m", config, weights, poisoned(qhead if quantized else head, name, value),
                           "mtp.safetensors")
    refused(path, caplog, [str(path / "mtp.safetensors"), f"mtp.{name}", "non-finite"])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
def test_nonfinite_half_precision_head_refused(tmp_path, tiny, caplog, dtype):
    config, _, weights, head, _ = tiny
    half = {k: v.astype(dtype) for k, v in head.items()}
    path = save_checkpoint(tmp_path / "m", config, weights, poisoned(half, "fc.weight", np.nan), "mtp.safetensors")
    refused(path, caplog, [str(path / "mtp.safetensors"), "mtp.fc.weight", "non-finite"])


def test_finite_weights_whose_sum_overflows_load(tmp_path, tiny):
    """The check reads each tensor's sum; a sum that overflows (finite entries near the dtype's maximum) sends the
    tensor to the entry-by-entry check, which finds nothing wrong."""
    config, _, weights, head, _ = tiny
    big = mx.full(head["fc.weight"].shape, 3e38, dtype=mx.float32).astype(head["fc.weight"].dtype)
    assert not mx.isfinite(big.sum()).item() and mx.isfinite(big).all().item()
    path = save_checkpoint(tmp_path / "m", config, weights, {**head, "fc.weight": big}, "mtp.safetensors")
    assert lm_load(path).mtp_head is not None


def test_nonfinite_head_refused_by_mlx_vlm(tmp_path, tiny, caplog):
    _, _, _, _, _ = tiny
    config = config_for("qwen3_5", vision=True)
    model = build_model(config, "mlx_vlm")
    head = poisoned(build_head(model, config), "fc.weight", np.nan)
    path = save_checkpoint(tmp_path / "m", config, trunk_weights(model), head, "mtp.safetensors")
    refused(path, caplog, ["mtp.fc.weight", "non-finite"], runtime="mlx_vlm")


# --- non-finite head output at decode time: rejected, warned once, parked --------------------------------

@pytest.fixture
def nan_head_model(tmp_path, tiny):
    """A loaded model whose head turned non-finite after loading (e.g. an activation overflow)."""
    config, _, weights, head, _ = tiny
    model = lm_load(save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors"))
    module = model.mtp_head.module
    module.update({"fc": {"weight": mx.full(module.fc.weight.shape, mx.nan, dtype=module.fc.weight.dtype)}})
    return model


@pytest.mark.parametrize("temp,top_k,depth", [(1.0, 3, 2), (0.8, 2, 1), (1.0, 4, 3)])
def test_nonfinite_drafts_never_reach_sampled_output(nan_head_model, caplog, temp, top_k, depth):
    """Every sampled token lies inside the trunk's own top-k (a NaN residual would draw garbage), the
    generation runs its full length, and the head is parked after its first cycle with one warning."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    mx.random.seed(7)
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        out = list(generate_step(PROMPT, nan_head_model, max_tokens=24, sampler=make_sampler(temp=temp, top_k=top_k),
                                 mtp_depth=depth))
        again = list(generate_step(PROMPT, nan_head_model, max_tokens=8, sampler=make_sampler(temp=temp, top_k=top_k),
                                   mtp_depth=depth))
    assert len(out) == 24 and len(again) == 8
    for token, logprobs in out + again:
        assert np.isfinite(np.array(logprobs)).all()
        assert token in np.argsort(-np.array(logprobs))[:top_k]
    loaded = nan_head_model.mtp_head
    assert loaded.stats.cycles == 0 or loaded.stats.accepted == 0
    assert "not finite" in loaded.health.parked and "parked" in loaded.summary()
    assert len([r for r in caplog.records if "parked" in r.getMessage()]) == 1


def test_nonfinite_drafts_greedy_output_is_the_trunks(nan_head_model):
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    plain = [t for t, _ in generate_step(PROMPT, nan_head_model, max_tokens=20, enable_mtp=False)]
    mtp = [t for t, _ in generate_step(PROMPT, nan_head_model, max_tokens=20, mtp_depth=3)]
    assert mtp == plain
    assert nan_head_model.mtp_head.health.parked


def test_nonfinite_drafts_parked_in_mlx_vlm(tmp_path):
    """mlx-vlm decodes text prompts through the same loop: greedy output stays its own, the head is parked."""
    config = config_for("qwen3_5", vision=True)
    built = build_model(config, "mlx_vlm")
    model = vlm_load(save_checkpoint(tmp_path / "m", config, trunk_weights(built), build_head(built, config),
                                     "mtp.safetensors"))
    module = model.mtp_head.module
    module.update({"norm": {"weight": mx.full(module.norm.weight.shape, mx.inf, dtype=module.norm.weight.dtype)}})
    generate_step = importlib.import_module("mlx_vlm.generate").generate_step

    def run(**kwargs):
        return [t for t, _ in generate_step(PROMPT[None], model, None, None, max_tokens=16, temperature=0.0, **kwargs)]

    assert run(mtp_depth=2) == run(enable_mtp=False)
    assert "not finite" in model.mtp_head.health.parked


def test_nonfinite_check_inside_acceptance():
    """The acceptance functions never let a non-finite q through: the draft is rejected and the token
    drawn in its place comes from p alone (here p puts all its mass on token 2)."""
    from mtp_plugin.decoding.acceptance import NONFINITE, accept_sampled, reject_nonfinite

    p = mx.array([[0.0, 0.0, 1.0, 0.0]] * 3)
    q = mx.full((2, 4), mx.nan)
    for _ in range(20):
        accepted, block = accept_sampled(p, q, mx.array([2, 2]), mx.array(False))
        assert accepted.item() == 0 and block[0].item() == 2
        assert reject_nonfinite(accepted, mx.array(False)).item() == NONFINITE


# --- one validation for inspect and the loader ----------------------------------------------------------

def _drop(head, name):
    return {k: v for k, v in head.items() if k != name}


def _narrow(head, name):
    return {**head, name: head[name][..., : head[name].shape[-1] - 1]}


def _without(head, part):
    return {k: v for k, v in head.items() if part not in k}


def _fewer_outputs(head, name):
    return {**head, name: head[name][:-8]}


def _second_layer(head):
    return {**head, **{k.replace("layers.0.", "layers.1.", 1): v for k, v in head.items() if k.startswith("layers.0.")}}


BROKEN = {  # id: (quantized head?, change, words the problem must contain)
    "norm-shape": (False, lambda h: {**h, "pre_fc_norm_hidden.weight": h["pre_fc_norm_hidden.weight"][:32]},
                   ["mtp.pre_fc_norm_hidden.weight", "(32,)"]),
    "final-norm-shape": (False, lambda h: {**h, "norm.weight": mx.ones((48,))}, ["mtp.norm.weight", "(48,)"]),
    "fc-shape": (False, lambda h: {**h, "fc.weight": h["fc.weight"][:, :64]}, ["mtp.fc.weight", "64 inputs"]),
    "fc-outputs": (False, lambda h: {**h, "fc.weight": h["fc.weight"][:32]}, ["mtp.fc.weight", "32 outputs"]),
    "missing-scales": (True, lambda h: _drop(_drop(h, "fc.scales"), "fc.biases"), ["mtp.fc.weight", "scales"]),
    "missing-mlp-scales": (True, lambda h: _drop(h, "layers.0.mlp.up_proj.scales"),
                           ["mtp.layers.0.mlp.up_proj.weight", "scales"]),
    "packed-width": (True, lambda h: _narrow(h, "fc.weight"), ["mtp.fc.weight", "fit no quantization"]),
    # what only loading used to find (inspect said can_run: yes, graft and extract wrote the head)
    "missing-gate_proj": (False, lambda h: _without(h, "mlp.gate_proj."), ["layers.0.mlp.gate_proj.weight", "missing"]),
    "missing-up_proj": (False, lambda h: _without(h, "mlp.up_proj."), ["layers.0.mlp.up_proj.weight", "missing"]),
    "missing-down_proj": (True, lambda h: _without(h, "mlp.down_proj."), ["layers.0.mlp.down_proj.weight", "missing"]),
    "missing-mlp": (False, lambda h: _without(h, ".mlp."), ["3 of the", "layers.0.mlp.gate_proj.weight", "missing"]),
    "q_proj-outputs": (False, lambda h: _fewer_outputs(h, "layers.0.self_attn.q_proj.weight"),
                       ["mtp.layers.0.self_attn.q_proj.weight", "120 outputs, expected 128"]),
    "o_proj-outputs": (False, lambda h: _fewer_outputs(h, "layers.0.self_attn.o_proj.weight"),
                       ["mtp.layers.0.self_attn.o_proj.weight", "56 outputs, expected 64"]),
    "gate_proj-outputs": (True, lambda h: _fewer_outputs(h, "layers.0.mlp.gate_proj.weight"),
                          ["mtp.layers.0.mlp.gate_proj.weight", "outputs"]),
    "norm-2d": (False, lambda h: {**h, "layers.0.input_layernorm.weight": h["layers.0.input_layernorm.weight"][None]},
                ["mtp.layers.0.input_layernorm.weight", "shape (1, 64)", "(64,)"]),
    "unknown-tensor": (False, lambda h: {**h, "layers.0.self_attn.gate.weight": mx.ones((4, 64))},
                       ["mtp.layers.0.self_attn.gate.weight", "not a parameter of the head"]),
    "two-layers": (False, _second_layer, ["layers.1.*", "beyond the 1 of the head module"]),
    "integer-norm": (False, lambda h: {**h, "norm.weight": mx.ones((64,), dtype=mx.int32)},
                     ["mtp.norm.weight", "stored as int32, not a floating-point type"]),
    "integer-fc": (False, lambda h: {**h, "fc.weight": h["fc.weight"].astype(mx.int8)},
                   ["mtp.fc.weight", "stored as int8, not a floating-point type"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_inspect_and_loader_agree_on_broken_tensors(tmp_path, tiny, caplog, capsys, case):
    config, _, weights, head, qhead = tiny
    quantized, change, words = BROKEN[case]
    path = save_checkpoint(tmp_path / "m", config, weights, change(qhead if quantized else head), "mtp.safetensors")
    message = refused(path, caplog, [str(path / "mtp.safetensors"), *words])
    assert case != "two-layers" or "config.json declares mtp_num_hidden_layers=1" in message
    from mtp_plugin.commands.cli import main

    assert main(["inspect", str(path)]) == 1 and "can_run:            NO" in capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_graft_and_extract_refuse_heads_that_would_not_load(tmp_path, tiny, capsys, case):
    """graft (a head file as donor) and extract (a checkpoint carrying the head) run the loader's validation: exit 1,
    the message names the file and the tensor, and nothing is written."""
    from mtp_plugin.commands.cli import main

    config, _, weights, head, qhead = tiny
    quantized, change, words = BROKEN[case]
    broken = change(qhead if quantized else head)
    recipient = save_checkpoint(tmp_path / "recipient", config, weights)
    donor = save_checkpoint(tmp_path / "donor", config, weights, broken, "mtp.safetensors")
    for argv in (["graft", "--recipient", recipient, "--donor", donor / "mtp.safetensors", "--out", tmp_path / "out"],
                 ["extract", "--hf", donor, "--out", tmp_path / "head.safetensors", "--bits", "16"]):
        assert main([str(a) for a in argv]) == 1, argv[0]
        err = capsys.readouterr().err
        assert all(w in err for w in [str(donor / "mtp.safetensors"), *words]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["donor", "recipient"]


METADATA = {  # id: (where, key, value, words)
    "contract-garbage": ("file", "mtp_contract", "{not json", ["mtp_contract", "mtp.safetensors"]),
    "contract-unknown-field": ("file", "mtp_contract", '{"wiring": "x"}', ["mtp_contract", "mtp.safetensors"]),
    "contract-bad-value": ("config", "mtp_contract", '{"hidden": "middle"}', ["mtp_contract", "config.json"]),
    "layers-word": ("config", "mtp_num_hidden_layers", "one", ["mtp_num_hidden_layers", "config.json", "'one'"]),
    "norm-convention-word": ("file", "mtp_norm_convention", "centred", ["mtp_norm_convention", "mtp.safetensors"]),
    "norm-convention-json": ("config", "mtp_norm_convention", '{"norm.weight": ', ["mtp_norm_convention",
                                                                                  "config.json"]),
}


@pytest.mark.parametrize("case", sorted(METADATA))
def test_bad_metadata_named_by_file_and_key(tmp_path, tiny, caplog, case):
    config, _, weights, head, _ = tiny
    where, key, value, words = METADATA[case]
    config = json.loads(json.dumps(config))
    if where == "config":
        (config["text_config"] if key == "mtp_num_hidden_layers" else config)[key] = value
    path = save_checkpoint(tmp_path / "m", config, weights)
    metadata = {"format": "mlx", key: value} if where == "file" else {"format": "mlx"}
    mx.save_safetensors(str(path / "mtp.safetensors"), {f"mtp.{k}": v for k, v in head.items()}, metadata=metadata)
    message = refused(path, caplog, words)
    assert repr(value) in message


# --- where the head file is, and what is wrong with it -----------------------------------------------------

def test_sidecar_kept_elsewhere_serves_through_a_link_not_an_absolute_name(tmp_path, tiny):
    config, _, weights, head, _ = tiny
    elsewhere = tmp_path / "heads" / "draft.safetensors"
    elsewhere.parent.mkdir()
    mx.save_safetensors(str(elsewhere), {f"mtp.{k}": v for k, v in head.items()})
    path = save_checkpoint(tmp_path / "m", {**config, "mtp_sidecar": str(elsewhere)}, weights)
    assert lm_load(path).mtp_head is None  # a name outside the directory is never opened
    report = inspect_dir(path)
    assert not report["can_run"] and any(f"'{elsewhere}'" in p and "link" in p for p in report["problems"]), report
    (path / "draft.safetensors").symlink_to(elsewhere)
    (path / "config.json").write_text(json.dumps({**config, "mtp_sidecar": "draft.safetensors"}))
    model = lm_load(path)
    assert "draft.safetensors" in model.mtp_head.summary()
    report = inspect_dir(path)
    assert report["can_run"] and report["files"] == {"draft.safetensors": len(head)}
    from mtp_plugin.adapters.mlx_lm_decoding import announce

    announce(model.mtp_head, 2)  # what mlx_lm.generate --verbose prints first


@pytest.mark.parametrize("kind", ["dangling-link", "directory", "named-absent", "unreadable"])
def test_unusable_sidecar_says_what_is_wrong(tmp_path, tiny, caplog, kind):
    config, _, weights, head, _ = tiny
    config = {**config, "mtp_sidecar": "head.safetensors"} if kind == "named-absent" else config
    path = save_checkpoint(tmp_path / "m", config, weights)
    sidecar = path / "mtp.safetensors"
    if kind == "dangling-link":
        os.symlink(tmp_path / "gone.safetensors", sidecar)
        words = ["dangling symbolic link", "gone.safetensors"]
    elif kind == "directory":
        sidecar.mkdir()
        words = ["a directory"]
    elif kind == "named-absent":
        words = ["head.safetensors", "named in config.json but absent"]
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads every file")
        mx.save_safetensors(str(sidecar), {f"mtp.{k}": v for k, v in head.items()})
        sidecar.chmod(0)
        words = ["permission denied"]
    message = refused(path, caplog, words)
    assert "converter dropped it" not in message
    problems = inspect_dir(path)["problems"]
    assert all("converter dropped it" not in p and "None" not in p for p in problems), problems
    assert len(problems) == 1  # what is wrong with the file, and nothing read from a head that is not there
    if kind == "directory":
        shutil.rmtree(sidecar)
        assert lm_load(path).mtp_head is None and "converter dropped it" in inspect_dir(path)["problems"][0]


def test_broken_index_and_broken_head_warn_once(tmp_path, tiny, caplog):
    """A head refused beside an index that cannot be used: one warning, naming both files."""
    config, _, weights, head, _ = tiny
    path = save_checkpoint(tmp_path / "m", config, weights, _without(head, "mlp.up_proj."), "mtp.safetensors",
                           index=True)
    (path / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    message = refused(path, caplog, [str(path / "mtp.safetensors"), "layers.0.mlp.up_proj.weight"])
    assert str(path / "model.safetensors.index.json") in message
    assert len([r for r in caplog.records if r.name == "mtp_plugin"]) == 1


def test_graft_into_a_broken_index(tmp_path, tiny, capsys):
    """The omlx layout lists its head file in the recipient's index: an index that cannot be read is refused (exit 1,
    named, with the fix); the default layout never touches the index and grafts."""
    from mtp_plugin.commands.cli import main

    config, _, weights, head, _ = tiny
    recipient = save_checkpoint(tmp_path / "recipient", config, weights, index=True)
    index = recipient / "model.safetensors.index.json"
    index.write_text('{"weight_map": ["a"]}')
    donor = save_checkpoint(tmp_path / "donor", config, weights, head, "mtp.safetensors")
    graft = ["graft", "--recipient", str(recipient), "--donor", str(donor), "--out"]
    assert main([*graft, str(tmp_path / "omlx"), "--layout", "omlx"]) == 1
    err = capsys.readouterr().err
    assert str(index) in err and "weight_map is an array" in err and "--layout mlx-lm" in err
    assert not (tmp_path / "omlx").exists()
    assert main([*graft, str(tmp_path / "grafted")]) == 0
    assert lm_load(tmp_path / "grafted").mtp_head is not None


def test_valid_heads_still_load(tmp_path, tiny):
    """The validation refuses nothing that fits: float and quantized heads load and inspect says can run."""
    config, _, weights, head, qhead = tiny
    for name, h in (("float", head), ("quantized", qhead)):
        path = save_checkpoint(tmp_path / name, config, weights, h, "mtp.safetensors")
        model = lm_load(path)
        assert model.mtp_head is not None and inspect_dir(path)["can_run"]
        got = dict(tree_flatten(model.mtp_head.module.parameters()))
        assert sorted(got) == sorted(h)


# --- the same head under two prefixes ---------------------------------------------------------------------

def _with_second_copy(tmp_path, tiny, same_file, equal):
    """A sidecar ``mtp.*`` head plus a second copy as ``language_model.mtp.*`` in the shard (or in the sidecar)."""
    config, model, weights, head, _ = tiny
    other = head if equal else build_head(model, config)
    path = save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors")
    target = path / ("mtp.safetensors" if same_file else "model.safetensors")
    tensors = dict(mx.load(str(target)))
    tensors.update({f"language_model.mtp.{k}": v for k, v in other.items()})
    mx.save_safetensors(str(target), tensors, metadata={"format": "mlx"})
    return path, head


@pytest.mark.parametrize("same_file", [False, True], ids=["two-files", "one-file"])
@pytest.mark.parametrize("runtime", ["mlx_lm", "mlx_vlm"])
def test_identical_copies_load_once(tmp_path, tiny, same_file, runtime):
    if runtime == "mlx_vlm":
        config = config_for("qwen3_5", vision=True)
        model = build_model(config, "mlx_vlm")
        tiny = (config, model, trunk_weights(model), build_head(model, config), None)
    path, head = _with_second_copy(tmp_path, tiny, same_file, equal=True)
    model = (lm_load if runtime == "mlx_lm" else vlm_load)(path)
    assert model.mtp_head is not None
    got = dict(tree_flatten(model.mtp_head.module.parameters()))
    assert all(mx.array_equal(got[k], v) for k, v in head.items())
    assert inspect_dir(path)["can_run"]


@pytest.mark.parametrize("same_file", [False, True], ids=["two-files", "one-file"])
def test_differing_copies_refused_naming_both(tmp_path, tiny, caplog, same_file):
    path, _ = _with_second_copy(tmp_path, tiny, same_file, equal=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        assert lm_load(path).mtp_head is None
    message = next(r.getMessage() for r in caplog.records if "MTP head ignored" in r.getMessage())
    second = "mtp.safetensors" if same_file else "model.safetensors"
    assert "different values" in message and str(path / "mtp.safetensors") in message
    assert str(path / second) in message and "language_model.mtp." in message
    from mtp_plugin.commands.cli import main

    assert main(["inspect", str(path)]) == 1


# --- a head that accepts nothing over its first cycles -----------------------------------------------------

@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_head_accepting_nothing_is_parked(tmp_path, tiny, caplog, monkeypatch, sampled):
    """The tests' random heads accept nothing: over the first 64 draft tokens the head is parked (one
    warning), the rest of the generation and later ones decode plain, and greedy output stays the trunk's."""
    import mtp_plugin.head.health

    monkeypatch.setattr(mtp_plugin.head.health, "PROBE_DRAFTS", 64)
    config, _, weights, head, _ = tiny
    model = lm_load(save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors"))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    options = {"sampler": make_sampler(temp=1.0, top_k=3)} if sampled else {}
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        mtp = [t for t, _ in generate_step(PROMPT, model, max_tokens=80, mtp_depth=4, **options)]
        stats = model.mtp_head.stats
        later = [t for t, _ in generate_step(PROMPT, model, max_tokens=8, mtp_depth=4, **options)]
    health = model.mtp_head.health
    assert model.mtp_head.stats.drafted == 0
    assert len(mtp) == 80 and len(later) == 8
    assert health.drafted == 64 and health.accepted <= 1 and "of its first 64 draft tokens" in health.parked
    assert stats.drafted == 64 and stats.plain > 0
    assert len([r for r in caplog.records if "parked" in r.getMessage()]) == 1
    if not sampled:
        assert mtp == [t for t, _ in generate_step(PROMPT, model, max_tokens=80, enable_mtp=False)]


def _untrained_head_on_the_trained_trunk(path):
    """The bundled trained checkpoint (Hugging Face layout) with a head whose every tensor is zero (zero-centred
    norms: scale 1): its drafts carry no information about the text, on any runtime version."""
    shutil.copytree(TINY / "hf", path)
    weights = dict(mx.load(str(TINY / "hf" / "model.safetensors")))
    for name, value in weights.items():
        if name.startswith("mtp."):
            weights[name] = mx.zeros_like(value)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path


def test_sampled_generation_parks_drafts_that_cannot_pay(tmp_path):
    """A sampled generation with the automatic depth: an untrained head on the trained trunk soon decodes plain, and
    a seed fixes the tokens (the same twice, the same as with the trained head at the automatic depth and at depth 2:
    they do not depend on the drafts). The trained head's acceptance is read at depth 2 (the automatic depth decides
    by the clock, and may draft from the context or step plain). At temperature 0.3 the untrained head's drafts are
    accepted about 4 % of the time, which pays on no machine; at 0.8 the trunk's flat distribution accepts about 16 %,
    which a machine with cheap verify passes may rightly draft for."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    tokens, stats = [], []
    for path in (_untrained_head_on_the_trained_trunk(tmp_path / "random-head"), TINY / "hf"):
        model = lm_load(path)
        prompt = mx.array(load_tokenizer(path).encode("def read_config(path):\n    with open(path) as f:\n"))
        for options in ({}, {}, {"mtp_depth": 2, "mtp_lookup": False}):
            mx.random.seed(11)
            tokens.append([t for t, _ in generate_step(prompt, model, max_tokens=72, sampler=make_sampler(0.3),
                                                       **options)])
            stats.append(model.mtp_head.stats)
    random_automatic, random_depth2, trained_depth2 = stats[1], stats[2], stats[5]
    assert random_automatic.plain > random_automatic.cycles, random_automatic
    assert all(t == tokens[0] for t in tokens)
    assert trained_depth2.accepted / trained_depth2.cycles > random_depth2.accepted / random_depth2.cycles


@pytest.mark.skipif(release("mlx-vlm") < (0, 7), reason="mlx-vlm 0.6 loads no Qwen3.5 checkpoint without vision")
def test_sampled_generation_parks_drafts_that_cannot_pay_in_mlx_vlm(tmp_path):
    """The same in mlx-vlm, with a seeded request (mlx-vlm's position-keyed sampler)."""
    generate_step = importlib.import_module("mlx_vlm.generate").generate_step
    model = vlm_load(_untrained_head_on_the_trained_trunk(tmp_path / "random-head"))
    prompt = mx.array([load_tokenizer(TINY / "hf").encode("def read_config(path):\n    with open(path) as f:\n")])
    runs = [[t for t, _ in generate_step(prompt, model, None, None, max_tokens=72, temperature=0.3, seed=3)]
            for _ in range(2)]
    assert runs[0] == runs[1] and model.mtp_head.stats.plain > 0, model.mtp_head.stats


# --- norm conventions from the evidence a file carries --------------------------------------------------

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
SMALL = {"pre_fc_norm_embedding.weight": 0.3, "pre_fc_norm_hidden.weight": 0.5, "norm.weight": 0.4}


def _small_absolute_norms(path):
    """The bundled 4-bit checkpoint with its sidecar rewritten as an MLX writer without norm metadata would:
    absolute pre-fc norms scaled down to means of 0.3-0.5 (fc's input columns scaled up to match, so the head
    computes the same drafts) and the final norm scaled by 0.4 (the same greedy drafts)."""
    shutil.copytree(TINY / "mlx-4bit", path, ignore=shutil.ignore_patterns("mtp.safetensors"))
    head = dict(mx.load(str(TINY / "mlx-4bit" / "mtp.safetensors")))
    fc = mx.dequantize(head.pop("mtp.fc.weight"), head.pop("mtp.fc.scales"), head.pop("mtp.fc.biases"),
                       group_size=64, bits=4).astype(mx.float32)
    hidden = fc.shape[0]
    columns = mx.concatenate([mx.full((hidden,), 1 / SMALL["pre_fc_norm_embedding.weight"]),
                              mx.full((hidden,), 1 / SMALL["pre_fc_norm_hidden.weight"])])
    head["mtp.fc.weight"] = fc * columns
    for name, scale in SMALL.items():
        head[f"mtp.{name}"] = (head[f"mtp.{name}"].astype(mx.float32) * scale).astype(head[f"mtp.{name}"].dtype)
    mx.save_safetensors(str(path / "mtp.safetensors"), head, metadata={"format": "mlx"})
    return path


def _agreement(model, text):
    """Depth-1 greedy agreement of the loaded head with the trunk on ``text`` (as ``verify`` measures it)."""
    from mtp_plugin.plugins import hook

    head = model.mtp_head.module
    trunk = hook().mtp_trunk(model=model, contract=head.contract)
    tokens = mx.array(text)[None]
    hidden = trunk.hidden(tokens, None)
    target = mx.argmax(trunk.trunk_logits(hidden), axis=-1)[0, 1:]
    draft = mx.argmax(trunk.logits(head(hidden[:, :-1], trunk.embed(tokens[:, 1:]))), axis=-1)[0]
    return (draft == target).mean().item()


def test_small_absolute_norms_in_an_mlx_sidecar_stay_absolute(tmp_path):
    from mlx_lm import load

    from mtp_plugin.commands.cli import SAMPLE_SOURCE

    reference, tokenizer = load(str(TINY / "mlx-4bit"))
    source = SAMPLE_SOURCE.read_text()[:700]
    text = tokenizer.encode(source)
    model, _ = load(str(_small_absolute_norms(tmp_path / "small")))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    list(generate_step(mx.array(text), model, max_tokens=1, mtp_depth=1))  # the first prompt settles open norms
    for name in SMALL:
        decision = model.mtp_head.norms[name]
        assert decision.convention == "absolute" and "settled by the head's own predictions" in decision.evidence
    assert _agreement(model, text) > _agreement(reference, text) - 0.05
    current = verify(tmp_path / "small", source)["current"]  # verify's "decided" reading is the loader's, settled
    assert current["norms"] == "decided" and current["acceptance"] == pytest.approx(_agreement(model, text))
    report = inspect_dir(tmp_path / "small")
    assert report["can_run"] and "settles it" in report["norm_convention"]["pre_fc_norm_embedding.weight"]["evidence"]


def test_all_positive_zero_centred_norm_in_an_hf_original(tmp_path):
    """An HF original stores trunk and head zero-centred; a head norm positive everywhere is still read so."""
    path = tmp_path / "hf"
    shutil.copytree(TINY / "hf", path)
    tensors = dict(mx.load(str(path / "model.safetensors")))
    for name in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_norm.weight"):
        tensors[name] = mx.abs(tensors[name]) + 0.05
        assert (tensors[name] > 0).all().item()
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
    report = inspect_dir(path)
    for name in ("norm.weight", "pre_fc_norm_hidden.weight", "layers.0.self_attn.q_norm.weight"):
        assert report["norm_convention"][name]["convention"] == "zero_centred", report["norm_convention"][name]
    model = lm_load(path)
    assert model.mtp_head.norms["norm.weight"].convention == "zero_centred"


def test_pytorch_written_sidecar_is_zero_centred(tmp_path, tiny):
    """A head-only file written by PyTorch (format 'pt') keeps the original's zero-centred convention."""
    config, _, weights, head, _ = tiny
    path = save_checkpoint(tmp_path / "m", config, weights)
    stored = {f"mtp.{k}": (v * 0.1 + 0.02 if k.endswith("norm.weight") else v) for k, v in head.items()}
    mx.save_safetensors(str(path / "mtp.safetensors"), stored, metadata={"format": "pt"})
    model = lm_load(path)
    assert {d.convention for d in model.mtp_head.norms.values()} == {"zero_centred"}
    got = dict(tree_flatten(model.mtp_head.module.parameters()))
    np.testing.assert_allclose(np.array(got["norm.weight"]), np.array(head["norm.weight"] * 0.1 + 1.02), atol=1e-6)


# --- random initialisation: flagged by inspect, warned at load ------------------------------------------

def _mlx_default_init(model, config):
    """MLX's own nn.Linear init (uniform ±1/sqrt(in)), norms moved."""
    from mtp_plugin.plugins import hook

    head = hook().mtp_build_head(model=model, config=config)
    weights = dict(tree_flatten(head.parameters()))
    return {k: (mx.random.uniform(0.8, 1.2, v.shape) if v.ndim == 1 else v) for k, v in weights.items()}


def _gpt2_init(model, config):
    """GPT-2 style: N(0, 0.02), residual projections (o_proj, down_proj) scaled by 1/sqrt(2 * layers); norms moved."""
    head = _mlx_default_init(model, config)
    scale = {"o_proj": (2 * 4) ** -0.5, "down_proj": (2 * 4) ** -0.5}
    return {k: v if v.ndim == 1 else 0.02 * scale.get(k.split(".")[-2], 1.0) * mx.random.normal(v.shape)
            for k, v in head.items()}


def _xavier_uniform(model, config):
    """Xavier/Glorot uniform (bound sqrt(6 / (in + out))), norms moved."""
    head = _mlx_default_init(model, config)
    return {k: v if v.ndim == 1 else mx.random.uniform(-1, 1, v.shape) * (6 / sum(v.shape)) ** 0.5
            for k, v in head.items()}


@pytest.mark.parametrize("init,quantize", [(_mlx_default_init, None), (_gpt2_init, None), (_xavier_uniform, None),
                                           (_mlx_default_init, {"bits": 8, "group_size": 32})],
                         ids=["mlx-uniform", "gpt2-scaled", "xavier-uniform", "mlx-uniform-int8"])
def test_random_init_flagged_and_warned_at_load(tmp_path, tiny, caplog, init, quantize):
    config, model, weights, _, _ = tiny
    head = init(model, config)
    if quantize:
        import mlx.nn as nn

        from mtp_plugin.plugins import hook

        module = hook().mtp_build_head(model=model, config=config)
        module.load_weights(list(head.items()))
        nn.quantize(module, **quantize)
        head = dict(tree_flatten(module.parameters()))
    path = save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors")
    report = inspect_dir(path)
    assert report["head_trained"] is False and not report["can_run"], report["projection_kurtosis"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        loaded = lm_load(path)
    assert loaded.mtp_head is not None  # it loads (output is never wrong), and is parked if it accepts nothing
    assert any("looks like random initialisation" in r.getMessage() for r in caplog.records)


def test_trained_heads_are_not_flagged(caplog):
    """The bundled trained head (4-bit sidecar and HF original) loads without the random-init warning."""
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        for d in ("mlx-4bit", "hf"):
            assert inspect_dir(TINY / d)["head_trained"] is True
            assert lm_load(TINY / d).mtp_head is not None
    assert not any("random initialisation" in r.getMessage() for r in caplog.records)
