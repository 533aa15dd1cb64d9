"""Every command answers bad input with a message and exit 2 (failures exit 1); ``--help`` gives defaults and
ranges; long commands show progress on stderr. Each case on a copy of the bundled checkpoints."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_plugin.commands.bench import bench
from mtp_plugin.commands.cli import main, parser
from mtp_plugin.commands.extract import extract
from mtp_plugin.commands.tune import tune
from mtp_plugin.usage import UsageError

ROOT = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
HF, MLX4 = ROOT / "hf", ROOT / "mlx-4bit"
COMMANDS = ["inspect", "graft", "extract", "verify", "tune", "bench"]


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return Path(shutil.copytree(MLX4, tmp_path / "model"))


def exit_code(argv) -> int:
    """``main``'s exit code, argparse's ``SystemExit`` included."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def model_args(command: str, directory: Path, tmp_path: Path) -> list:
    return {"graft": ["graft", "--recipient", directory, "--donor", HF, "--out", tmp_path / "out"],
            "extract": ["extract", "--hf", directory, "--out", tmp_path / "head.safetensors"]}.get(
        command, [command, directory])


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.parametrize("option,value", [("--max-tokens", 0), ("--max-tokens", 1), ("--max-tokens", -1),
                                          ("--max-tokens", -5), ("--repeats", 0), ("--repeats", -1),
                                          ("--depths", 0), ("--depths", 9), ("--max-tokens", "x")])
def test_bench_and_tune_refuse_out_of_range_options(model, capsys, command, option, value):
    assert exit_code([command, model, option, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and ("must be" in err or "not an integer" in err)


@pytest.mark.parametrize("function", [tune, bench])
@pytest.mark.parametrize("options", [{"max_tokens": 1}, {"max_tokens": -1}, {"repeats": 0}, {"depths": 9}])
def test_python_api_refuses_the_same_values(model, capsys, function, options):
    with pytest.raises(UsageError, match="--(max-tokens|repeats|depths) must be"):
        function(model, **options)
    assert "warm-up" not in capsys.readouterr().err  # refused before loading or measuring


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("directory", ["empty", "missing"])
def test_commands_on_a_directory_without_a_model(tmp_path, capsys, command, directory):
    path = tmp_path / directory
    if directory == "empty":
        path.mkdir()
    assert exit_code(model_args(command, path, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "pass a model directory" in err
    assert ("no config.json" if directory == "empty" else "no such directory") in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "head.safetensors").exists()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("text", ["{oops", "[1, 2]"], ids=["not-json", "not-an-object"])
def test_commands_name_an_invalid_config_json(model, tmp_path, capsys, command, text):
    """An unreadable checkpoint (exit 1): the message names config.json and the fix, before any runtime reads it."""
    (model / "config.json").write_text(text)
    assert exit_code(model_args(command, model, tmp_path)) == 1
    err = capsys.readouterr().err
    assert f"mtp-plugin: {model / 'config.json'}: " in err and "restore the file" in err, err
    assert "warm-up" not in err and "trunk passes" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "head.safetensors").exists()


@pytest.mark.parametrize("command", [*COMMANDS, "graft-donor"])
@pytest.mark.parametrize("value,kind", [("abc", "a string"), (None, "null")])
def test_commands_name_a_text_config_that_is_not_an_object(model, tmp_path, capsys, command, value, kind):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "text_config": value}))
    if command == "graft-donor":  # the donor's config is refused too, not read as one without dimensions
        recipient = Path(shutil.copytree(MLX4, tmp_path / "recipient", ignore=shutil.ignore_patterns("mtp.*")))
        args = ["graft", "--recipient", recipient, "--donor", model, "--out", tmp_path / "out"]
    else:
        args = model_args(command, model, tmp_path)
    assert exit_code(args) == 1
    err = capsys.readouterr().err
    assert f"mtp-plugin: {model / 'config.json'}: \"text_config\" is {kind}, not a JSON object" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_commands_name_a_truncated_weights_file(model, tmp_path, capsys, command, cut):
    """A download cut off in the header or among the tensors (exit 1): the message names the file and the fix, before
    any runtime reads it."""
    path = model / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(100 if cut == "header" else path.stat().st_size // 2)
    assert exit_code(model_args(command, model, tmp_path)) == 1
    err = capsys.readouterr().err
    assert f"mtp-plugin: {path}: unreadable safetensors header" in err and "re-download" in err, err
    assert "warm-up" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("donor", ["missing", "missing.safetensors", "empty-directory"])
def test_graft_refuses_a_donor_that_is_not_a_model(tmp_path, capsys, donor):
    """A usage error (exit 2), as for the recipient: a donor path that does not exist, or a directory without
    config.json; refused before anything else is looked at, nothing is written."""
    path = tmp_path / donor
    if donor == "empty-directory":
        path.mkdir()
    assert exit_code(["graft", "--recipient", MLX4, "--donor", path, "--out", tmp_path / "out"]) == 2
    err = capsys.readouterr().err
    assert f"--donor {path}: " in err
    assert ("without config.json" if donor == "empty-directory" else "no such file or directory") in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("group_size", ["0", "-64", "16", "256"])
def test_extract_refuses_unsupported_group_sizes(tmp_path, capsys, group_size):
    out = tmp_path / "head.safetensors"
    assert exit_code(["extract", "--hf", HF, "--out", out, "--group-size", group_size]) == 2
    assert "--group-size" in capsys.readouterr().err and not out.exists()
    with pytest.raises(UsageError, match="--group-size"):
        extract(HF, out, 8, int(group_size))


@pytest.mark.parametrize("text", ["", "\n", "x"])
def test_verify_refuses_a_prompt_too_short(model, tmp_path, capsys, text):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    assert exit_code(["verify", model, "--prompt-file", prompt]) == 2
    assert "verify needs at least 2" in capsys.readouterr().err


def test_verify_refuses_unreadable_prompt_files(model, tmp_path, capsys):
    assert exit_code(["verify", model, "--prompt-file", tmp_path / "missing.txt"]) == 2
    assert "missing.txt: cannot be read" in capsys.readouterr().err
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    assert exit_code(["verify", model, "--prompt-file", binary]) == 2


def test_graft_failure_exits_1_usage_error_2(tmp_path, capsys):
    """A donor that does not fit is a failure (1); the output directory is never created."""
    assert exit_code(["graft", "--recipient", MLX4, "--donor", HF, "--out", tmp_path / "out"]) == 1
    assert "already carries a head" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert exit_code(["graft", "--recipient", MLX4, "--donor", HF, "--out", tmp_path / "out", "--layout", "x"]) == 2


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_defaults_and_ranges(capsys, command):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    sub = parser()._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        if action.default not in (None, False, "==SUPPRESS==") and action.dest != "help":
            assert f"(default: {action.default})" in text, (action.dest, text)
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in text
    if command in ("tune", "bench"):
        assert "N in 1-8" in text and "per prompt, >= 2" in text and "(medians), >= 1" in text


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text(capsys, command):
    """argparse prints descriptions as written: no reStructuredText markup (double backticks) may reach them."""
    with pytest.raises(SystemExit):
        main(["--help"] if command is None else [command, "--help"])
    text = capsys.readouterr().out
    assert "usage: mtp-plugin" in text and "``" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert re.fullmatch(r"mtp-plugin \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_tune_shows_progress_phases(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = shutil.copytree(HF, tmp_path / "model")  # the unquantized copy: 4-bit decoding is 5x slower on a CPU
    assert main(["tune", str(model), "--depths", "1", "--max-tokens", "4", "--repeats", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "tune: warm-up" in captured.err and "tune: decode" in captured.err and "depth 1, run 1/1" in captured.err
    assert captured.out.startswith("{")  # progress never mixes into the JSON on stdout


def test_a_reader_that_leaves_early_gets_no_error_line():
    """``mtp-plugin inspect --json | head -c 1``: the closed pipe ends the command quietly (exit 1), without
    ``[Errno 32] Broken pipe`` on stderr."""
    command = [str(Path(sys.executable).parent / "mtp-plugin"), "inspect", str(MLX4), "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # before the command writes anything
    err = process.stderr.read()
    assert process.wait(timeout=120) == 1 and "Broken pipe" not in err and "Traceback" not in err, err
