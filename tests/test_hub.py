"""graft and extract from the Hub: only the head's bytes, through the real huggingface_hub talking to a loopback
stand-in of the Hub (``hub.Hub``), in a fresh process per command (``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE``)."""

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.console_runs import environment
from helpers.hub import Hub
from mlx_lm import load

from mtp_plugin.commands.extract import extract
from mtp_plugin.commands.graft import graft

ROOT = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
HF, MLX4 = ROOT / "hf", ROOT / "mlx-4bit"
DONOR, RECIPIENT, HEADLESS, MISSHAPEN, UNLISTED = ("tests/tiny", "tests/tiny-4bit", "tests/no-head", "tests/misshapen",
                                                    "tests/unlisted")
INDEX = "model.safetensors.index.json"


def shard(weights: dict, metadata: dict, folder: Path) -> None:
    """Write ``weights`` as a real checkpoint is sharded: two files and an index, the head in the last shard beside
    the trunk's last layers."""
    folder.mkdir(parents=True)
    trunk = sorted(k for k in weights if not k.startswith("mtp."))
    files = {"model-00001-of-00002.safetensors": trunk[: len(trunk) // 2],
             "model-00002-of-00002.safetensors": trunk[len(trunk) // 2:] + [k for k in weights if k.startswith("mtp.")]}
    for name, keys in files.items():
        mx.save_safetensors(str(folder / name), {k: weights[k] for k in keys}, metadata)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in files.items()
                                                                            for k in ks}}))
    for path in HF.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Repo id → folder: the bundled checkpoint sharded (``DONOR``), its 4-bit conversion without the head and with
    a model card naming ``DONOR`` (``RECIPIENT``), the donor without a head (``HEADLESS``), with a head whose ``fc``
    is misshapen (``MISSHAPEN``), and with its head in a file the index does not list (``UNLISTED``)."""
    root = tmp_path_factory.mktemp("hub")
    weights, metadata = mx.load(str(HF / "model.safetensors"), return_metadata=True)
    shard(weights, metadata, root / "donor")
    shard({k: v for k, v in weights.items() if not k.startswith("mtp.")}, metadata, root / "headless")
    shard({**weights, "mtp.fc.weight": weights["mtp.fc.weight"][:, :-8]}, metadata, root / "misshapen")
    shard({k: v for k, v in weights.items() if not k.startswith("mtp.")}, metadata, root / "unlisted")
    mx.save_safetensors(str(root / "unlisted" / "head.safetensors"),
                        {k: v for k, v in weights.items() if k.startswith("mtp.")}, metadata)
    shutil.copytree(MLX4, root / "recipient", ignore=shutil.ignore_patterns("mtp.safetensors", "README.md"))
    (root / "recipient" / "README.md").write_text(f"---\nbase_model: {DONOR}\nlibrary_name: mlx\n---\n# tiny 4-bit\n")
    return {DONOR: root / "donor", RECIPIENT: root / "recipient", HEADLESS: root / "headless",
            MISSHAPEN: root / "misshapen", UNLISTED: root / "unlisted"}


@pytest.fixture(scope="module")
def hub(repos):
    with Hub(repos) as served:
        yield served


@pytest.fixture
def home(tmp_path):
    """A fresh huggingface_hub home (its cache and the fetched heads')."""
    return tmp_path / "hf-home"


@pytest.fixture(scope="module")
def local_recipient(tmp_path_factory, repos):
    path = tmp_path_factory.mktemp("local") / "tiny-4bit"
    shutil.copytree(repos[RECIPIENT], path)
    return path


@pytest.fixture(scope="module")
def local_graft(tmp_path_factory, local_recipient, repos):
    """The graft of the donor's local copy: what a graft from the Hub must equal."""
    out = tmp_path_factory.mktemp("local-graft") / "grafted"
    graft(local_recipient, repos[DONOR], out)
    return out


def start(hub: Hub, home: Path, *args, offline: bool = False, python: tuple = ("-m", "mtp_plugin")
          ) -> subprocess.Popen:
    """``mtp-plugin ARGS`` (or ``python ARGS``) started in a fresh process pointed at ``hub``, with ``home`` as
    huggingface_hub's home."""
    env = environment(HF_ENDPOINT=hub.endpoint, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
                      HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
                      HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    return subprocess.Popen([sys.executable, *python, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())


def cli(hub: Hub, home: Path, *args, offline: bool = False, python: tuple = ("-m", "mtp_plugin")
        ) -> subprocess.CompletedProcess:
    """``mtp-plugin ARGS`` (or ``python ARGS``) run to its end (``start``)."""
    process = start(hub, home, *args, offline=offline, python=python)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def same_tree(a: Path, b: Path, without: tuple[str, ...] = ()) -> None:
    """``a`` and ``b`` hold the same files, byte for byte (``without`` left out of ``b``)."""
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name not in without)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def head_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the head tensors, bytes of the headers of the files that hold them) in ``folder``."""
    tensors = headers = 0
    for path in folder.glob("*.safetensors"):
        weights = mx.load(str(path))
        heads = [v.nbytes for k, v in weights.items() if k.startswith("mtp.")]
        if heads:
            tensors += sum(heads)
            headers += 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return tensors, headers


def test_graft_from_the_hub_fetches_only_the_head_and_equals_a_local_graft(hub, home, tmp_path, repos,
                                                                           local_recipient, local_graft):
    hub.served = 0
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "a")
    assert out.returncode == 0, out.stderr
    tensors, headers = head_bytes(repos[DONOR])
    assert 0 < hub.served <= 1.25 * tensors + headers, (hub.served, tensors, headers)
    same_tree(tmp_path / "a", local_graft)
    hub.served = 0  # a second graft reads the cached head
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "b")
    assert out.returncode == 0, out.stderr
    assert hub.served == 0
    same_tree(tmp_path / "b", local_graft)
    offline = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "c",
                  offline=True)
    assert offline.returncode == 0, offline.stderr  # cached: no network needed
    same_tree(tmp_path / "c", local_graft)


def test_concurrent_grafts_fetch_the_head_once(hub, home, tmp_path, repos, local_recipient, local_graft):
    tensors, headers = head_bytes(repos[DONOR])
    hub.served, hub.delay = 0, 0.3
    try:
        runs = [start(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / n)
                for n in ("a", "b")]
        results = [run.communicate(timeout=300) for run in runs]
    finally:
        hub.delay = 0.0
    assert [run.returncode for run in runs] == [0, 0], results
    assert hub.served <= 1.25 * tensors + headers, (hub.served, tensors, headers)
    same_tree(tmp_path / "a", local_graft)
    same_tree(tmp_path / "b", local_graft)


def test_a_head_in_a_file_the_index_does_not_list(hub, home, tmp_path, repos, local_recipient):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", UNLISTED, "--out", tmp_path / "hub")
    assert out.returncode == 0, out.stderr
    graft(local_recipient, repos[UNLISTED], tmp_path / "local")
    same_tree(tmp_path / "hub", tmp_path / "local")


def test_one_command_gives_a_hub_conversion_its_head(hub, home, tmp_path, local_graft):
    out = cli(hub, home, "graft", "--recipient", RECIPIENT, "--donor", DONOR, "--out", tmp_path / "grafted")
    assert out.returncode == 0, out.stderr
    same_tree(tmp_path / "grafted", local_graft, without=("README.md",))  # mlx-lm downloads no model card


def test_extract_from_the_hub_equals_a_local_extract(hub, home, tmp_path, repos):
    out = cli(hub, home, "extract", "--hf", DONOR, "--out", tmp_path / "head.safetensors", "--bits", "4")
    assert out.returncode == 0, out.stderr
    extract(repos[DONOR], tmp_path / "local.safetensors", bits=4)
    assert (tmp_path / "head.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


@pytest.mark.parametrize("across_processes", [False, True], ids=["retried", "rerun"])
def test_a_fetch_cut_off_midway_resumes(hub, home, tmp_path, repos, local_recipient, local_graft, across_processes):
    tensors, headers = head_bytes(repos[DONOR])
    hub.served, hub.ranges, hub.cut, hub.cut_after, hub.refuse = 0, [], False, tensors // 2, across_processes
    try:
        args = ("graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "grafted")
        out = cli(hub, home, *args)
        assert hub.cut
        if across_processes:
            assert out.returncode == 1 and "tests/tiny" in out.stderr and "Traceback" not in out.stderr, out.stderr
            assert not (tmp_path / "grafted").exists()
            hub.cut_after = hub.refuse = None
            out = cli(hub, home, *args)
        assert out.returncode == 0, out.stderr
    finally:
        hub.cut_after, hub.refuse, hub.cut = None, False, False
    assert hub.served <= 1.25 * tensors + headers, (hub.served, tensors, headers)
    shard2 = "model-00002-of-00002.safetensors"
    starts = [start for name, start in hub.ranges if name == shard2 and start > 8]
    assert len(starts) >= 2 and starts[-1] > starts[0], hub.ranges  # the second request starts where the first stopped
    same_tree(tmp_path / "grafted", local_graft)


def test_offline_without_the_head_cached_names_what_to_download(hub, home, tmp_path, local_recipient):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "grafted",
              offline=True)
    assert out.returncode == 1, out.stderr
    assert f"hf download {DONOR}" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "grafted").exists()


def test_offline_a_whole_checkpoint_in_the_cache_serves(hub, home, tmp_path, local_recipient, local_graft):
    out = cli(hub, home, "-c", f"import huggingface_hub; huggingface_hub.snapshot_download({DONOR!r})", python=())
    assert out.returncode == 0, out.stderr
    hub.served = 0
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--out", tmp_path / "grafted",
              offline=True)
    assert out.returncode == 0 and hub.served == 0, out.stderr
    same_tree(tmp_path / "grafted", local_graft)


def test_a_revision_the_repo_lacks_names_it(hub, home, tmp_path, local_recipient):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", DONOR, "--revision", "v9", "--out",
              tmp_path / "grafted")
    assert out.returncode == 1 and f"{DONOR} at revision v9: cannot fetch config.json" in out.stderr, out.stderr
    assert f"hf download {DONOR} --revision v9" in out.stderr and not (tmp_path / "grafted").exists()


@pytest.mark.parametrize("donor", ["./missing/dir", "missing/head.safetensors"])
def test_a_path_like_donor_stays_a_path(hub, home, tmp_path, local_recipient, donor):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", donor, "--out", tmp_path / "grafted")
    assert out.returncode == 2 and "no such file or directory" in out.stderr, out.stderr


@pytest.mark.parametrize("repo,says", [(HEADLESS, f"{HEADLESS}: no MTP head tensors"),
                                       (MISSHAPEN, "the donor's head would not load"),
                                       ("tests/absent", "tests/absent: cannot fetch config.json (and it is no local")])
def test_a_repo_that_cannot_give_a_head_writes_nothing(hub, home, tmp_path, local_recipient, repo, says):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", repo, "--out", tmp_path / "grafted")
    assert out.returncode == 1, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "grafted").exists()


def test_loading_a_conversion_that_dropped_its_head_names_the_graft(tmp_path, caplog, repos):
    model_dir = tmp_path / "tiny-4bit"
    shutil.copytree(repos[RECIPIENT], model_dir)
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        model, _ = load(str(model_dir))
    assert model.mtp_head is None
    assert f"mtp-plugin graft --recipient {model_dir} --donor {DONOR} --out tiny-4bit-mtp" in caplog.text
    (model_dir / "README.md").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        load(str(model_dir))
    assert "--donor ORIGINAL/REPO" in caplog.text


def test_inspect_names_the_graft_with_the_model_cards_donor(hub, home, tmp_path):
    snapshot = home / "hub" / f"models--{RECIPIENT.replace('/', '--')}" / "snapshots" / Hub.COMMIT
    out = cli(hub, home, "graft", "--recipient", RECIPIENT, "--donor", DONOR, "--out", tmp_path / "grafted")
    assert out.returncode == 0 and snapshot.is_dir(), out.stderr
    out = cli(hub, home, "inspect", snapshot)
    assert out.returncode == 1
    assert f"mtp-plugin graft --recipient {RECIPIENT} --donor {DONOR} --out tiny-4bit-mtp" in out.stdout, out.stdout
