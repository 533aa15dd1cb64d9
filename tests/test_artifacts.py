"""graft, extract and verify on the bundled tiny checkpoint: layouts, refusals, sizes, wiring sweep."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx_lm import load

import mtp_plugin
from mtp_plugin.commands.cli import SAMPLE_SOURCE, main, write_advice
from mtp_plugin.commands.extract import extract
from mtp_plugin.commands.graft import GraftRefused, graft
from mtp_plugin.commands.inspect import inspect_dir
from mtp_plugin.commands.verify import verify
from mtp_plugin.head.conventions import is_norm
from mtp_plugin.loading.checkpoint import read_config

ROOT = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
HF, MLX4 = ROOT / "hf", ROOT / "mlx-4bit"
TEXT = SAMPLE_SOURCE.read_text()[:1200]  # within the tiny model's 128-token training windows x3
LAYOUT_FILES = {"mlx-lm": ("mtp.safetensors", "mtp."), "mtplx": ("mtp.safetensors", "mtp."),
                "omlx": ("model-mtp.safetensors", "language_model.mtp."),
                "mlx-serve": ("mtp/weights.safetensors", "mtp.")}


@pytest.fixture(scope="module")
def recipient(tmp_path_factory):
    """The 4-bit conversion without its head: what most conversions ship."""
    path = tmp_path_factory.mktemp("recipient") / "tiny-4bit"
    shutil.copytree(MLX4, path, ignore=shutil.ignore_patterns("mtp.safetensors"))
    return path


@pytest.fixture(scope="module")
def reference_acceptance():
    return verify(MLX4, TEXT)["current"]["acceptance"]


def names_in(path):
    return set(mx.load(str(path)))


@pytest.mark.parametrize("layout", sorted(LAYOUT_FILES))
def test_graft_from_hf_original(tmp_path, recipient, reference_acceptance, layout):
    out = tmp_path / "grafted"
    summary = graft(recipient, HF, out, layout)
    head_file, prefix = LAYOUT_FILES[layout]
    assert summary["head_file"] == head_file
    names = names_in(out / head_file)
    assert names and all(n.startswith(prefix) for n in names)
    model, _ = load(str(out))
    assert model.mtp_head is not None
    acceptance = verify(out, TEXT)["current"]["acceptance"]
    assert abs(acceptance - reference_acceptance) < 0.05, (acceptance, reference_acceptance)
    # recipient files are hard links; the output costs only the head's bytes
    new_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.stat().st_nlink == 1)
    index_bytes = sum(p.stat().st_size for p in out.glob("*.index.json") if p.stat().st_nlink == 1)
    assert new_bytes - index_bytes == (out / head_file).stat().st_size
    assert all(p.stat().st_nlink >= 2 for p in recipient.rglob("*") if p.is_file())


def test_default_layout_loads_in_stock_mlx_lm(tmp_path, recipient):
    out = tmp_path / "grafted"
    graft(recipient, HF, out)
    tokens = mx.array([[5, 6, 7, 8, 9]])
    mtp_plugin.unpatch()
    stock_out, _ = load(str(out))
    stock_recipient, _ = load(str(recipient))
    assert mx.array_equal(stock_out(tokens), stock_recipient(tokens))


def test_graft_never_writes_inputs_and_is_atomic(tmp_path, recipient):
    before = {p: p.stat().st_mtime_ns for p in list(recipient.rglob("*")) + list(HF.rglob("*"))}
    out = tmp_path / "grafted"
    graft(recipient, HF, out)
    with pytest.raises(Exception, match="already exists"):
        graft(recipient, HF, out)
    with pytest.raises(ValueError, match="unknown layout"):
        graft(recipient, HF, tmp_path / "other", "nope")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.*"))
    assert {p: p.stat().st_mtime_ns for p in before} == before


def donor_with(tmp_path, change):
    donor = tmp_path / "donor"
    shutil.copytree(MLX4, donor)
    config = read_config(donor)
    change(config)
    (donor / "config.json").write_text(json.dumps(config))
    return donor


@pytest.mark.parametrize("field,change", [
    ("hidden_size", lambda c: c["text_config"].update(hidden_size=c["text_config"]["hidden_size"] * 2)),
    ("vocab_size", lambda c: c["text_config"].update(vocab_size=c["text_config"]["vocab_size"] + 64)),
    ("base quantization", lambda c: c["quantization"].update(bits=8)),
])
def test_graft_refuses_mismatch_unless_forced(tmp_path, recipient, field, change):
    donor = donor_with(tmp_path, change)
    with pytest.raises(GraftRefused, match=field):
        graft(recipient, donor, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    summary = graft(recipient, donor, tmp_path / "forced", force=True)
    assert any(field in line for line in summary["overridden"])


def test_a_donor_of_another_size_is_refused_in_one_line(tmp_path, recipient, capsys):
    """The cause (the sizes) leads, in one line without advice to re-extract; ``--verbose`` lists the tensors."""
    model_config = config_for("qwen3_5")  # hidden size 64: the bundled model's is 128
    model = build_model(model_config)
    donor = save_checkpoint(tmp_path / "donor64", model_config, trunk_weights(model), build_head(model, model_config))
    argv = ["graft", "--recipient", str(recipient), "--donor", str(donor), "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mtp-plugin: the donor's head ({donor}) is for a model of "
                                                   "another size (hidden_size: recipient 128 vs donor 64;"), lines
    assert "re-extract" not in lines[0] and "--verbose lists the 15 tensors" in lines[0]
    assert main([*argv, "--verbose"]) == 1
    listed = capsys.readouterr().err.splitlines()[1:]
    assert len(listed) == 15 and all("mtp." in line for line in listed)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bits,told", [(4, False), (8, True), (16, True)])
def test_a_quantized_donor_head_is_kept_and_said_so(tmp_path, recipient, capsys, bits, told):
    """The bundled conversion's head is int4/g64: ``--bits`` other than that keeps it, with a line saying so."""
    out = tmp_path / "out"
    assert main(["graft", "--recipient", str(recipient), "--donor", str(MLX4), "--out", str(out),
                 "--bits", str(bits)]) == 0
    err = capsys.readouterr().err
    assert ("already quantized (int4/g64): kept as it is, not --bits" in err) is told, err
    assert mx.load(str(out / "mtp.safetensors"))["mtp.fc.weight"].dtype == mx.uint32  # still int4


def test_extract_quantizes_with_mlx(tmp_path):
    for bits in (4, 8, 16):
        out = tmp_path / f"head-{bits}.safetensors"
        summary = extract(HF, out, bits=bits, group_size=32)
        labels = set(summary["quantization"].values())
        assert labels == ({"bf16"} if bits == 16 else {f"int{bits}/g32"})
        assert all(n.startswith("mtp.") for n in names_in(out))
        assert summary["norms_folded"]  # the HF original stores zero-centred norms


def head_file_variant(tmp_path, change):
    """An extracted head file, changed by ``change(tensors) -> (tensors, metadata updates)``."""
    path = tmp_path / "head.safetensors"
    extract(HF, path, bits=16)
    tensors, metadata = mx.load(str(path), return_metadata=True)
    tensors, updates = change(tensors)
    mx.save_safetensors(str(path), tensors, metadata={**metadata, **updates})
    return path


def swap_concat(tensors):
    fc = tensors["mtp.fc.weight"]
    half = fc.shape[1] // 2
    return {**tensors, "mtp.fc.weight": mx.concatenate([fc[:, half:], fc[:, :half]], axis=1)}, {}


def unshift_norms(tensors):
    """Zero-centred norms stored as if absolute (metadata says absolute)."""
    return {k: (v.astype(mx.float32) - 1).astype(v.dtype) if is_norm(k, v.shape) else v
            for k, v in tensors.items()}, {"mtp_norm_convention": "absolute"}


@pytest.mark.parametrize("change,expected", [(swap_concat, ("decided", "hidden_first")),
                                             (unshift_norms, ("all_zero_centred", "embedding_first"))])
def test_verify_detects_and_fixes_wrong_wiring(tmp_path, recipient, reference_acceptance, change, expected):
    out = tmp_path / "grafted"
    graft(recipient, head_file_variant(tmp_path, change), out, force=True)
    broken = verify(out, TEXT, write=True)
    assert broken["current"]["acceptance"] < broken["best"]["acceptance"] - 0.1
    assert (broken["best"]["norms"], broken["best"]["concat_order"]) == expected
    fixed = verify(out, TEXT)
    assert fixed["current"] == fixed["best"]
    assert fixed["current"]["acceptance"] > reference_acceptance - 0.1


def test_random_init_head_flagged_by_inspect_and_verify(tmp_path, recipient, capsys):
    def randomize(tensors):
        return {k: mx.zeros_like(v) if is_norm(k, v.shape) else 0.02 * mx.random.normal(v.shape)
                for k, v in tensors.items()}, {"mtp_norm_convention": "zero_centred"}

    out = tmp_path / "grafted"
    graft(recipient, head_file_variant(tmp_path, randomize), out, force=True)
    report = inspect_dir(out)
    assert report["head_trained"] is False and not report["can_run"]
    prompt = tmp_path / "prompt.py"
    prompt.write_text(TEXT)
    capsys.readouterr()
    assert main(["verify", str(out), "--json", "--prompt-file", str(prompt)]) == 1  # exit 1 says why: stderr, JSON
    captured = capsys.readouterr()
    assert "mtp-plugin: verify: head looks like random initialisation" in captured.err
    assert any("random initialisation" in p for p in json.loads(captured.out)["problems"])


def test_verify_says_why_it_exits_1(tmp_path, monkeypatch, capsys):
    """A head whose best wiring accepts under the threshold (raised here above any acceptance) exits 1 with the
    reason on stderr, not just the table."""
    import mtp_plugin.commands.cli
    import mtp_plugin.commands.verify

    for module in (mtp_plugin.commands.cli, mtp_plugin.commands.verify):
        monkeypatch.setattr(module, "MIN_ACCEPTANCE", 1.01, raising=False)
    prompt = tmp_path / "prompt.py"
    prompt.write_text(TEXT)
    assert main(["verify", str(MLX4), "--prompt-file", str(prompt)]) == 1
    err = capsys.readouterr().err
    assert "mtp-plugin: verify: even the best wiring" in err and "under 1.01" in err


def advice(best: float, current: float, tokens: int = 1024, written: bool = False) -> str:
    wiring = {"norms": "decided", "hidden": "pre_norm", "concat_order": "embedding_first"}
    return write_advice({"tokens": tokens, "written": written, "best": {**wiring, "acceptance": best},
                         "current": {**wiring, "hidden": "post_norm", "acceptance": current}})


def test_verify_suggests_write_only_beyond_the_noise():
    """0.420 -> 0.429 over 1023 drafts (the tiny checkpoint's own sweep) is noise (2 standard errors: 0.044);
    0.076 -> 0.429 (a swapped concat order) is not; a gain of 0.2 is beyond it over 1023 drafts, within it over 40."""
    assert "within this measurement's noise (±0.044, two standard errors over 1023 drafts)" in advice(0.429, 0.420)
    assert "run with --write" not in advice(0.429, 0.420)
    assert "beyond this measurement's noise" in advice(0.429, 0.076) and "run with --write" in advice(0.429, 0.076)
    assert "run with --write" in advice(0.60, 0.40, tokens=1024) and "run with --write" not in advice(0.60, 0.40, 41)
    assert advice(0.5, 0.3, written=True).endswith("(recorded in config.json)")
