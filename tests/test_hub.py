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
    assert out.returncode == 1 and f"{DONOR}: no such directory (" in out.stderr
    assert "as a Hub repo id at revision v9: cannot fetch config.json" in out.stderr, out.stderr
    assert f"hf download {DONOR} --revision v9" in out.stderr and not (tmp_path / "grafted").exists()


@pytest.mark.parametrize("donor", ["./missing/dir", "missing/head.safetensors"])
def test_a_path_like_donor_stays_a_path(hub, home, tmp_path, local_recipient, donor):
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", donor, "--out", tmp_path / "grafted")
    assert out.returncode == 2 and "no such file or directory" in out.stderr, out.stderr


@pytest.mark.parametrize("argument", ["--recipient", "--donor"])
def test_a_mistyped_relative_path_says_no_such_directory_first(hub, home, tmp_path, local_recipient, argument):
    """``work/headles`` (a typo of a path whose first folder is not here either) reads as a Hub repo id; the Hub has
    no such repository, so the one line says first that there is no such directory, then what the Hub answered."""
    given = {"--recipient": local_recipient, "--donor": DONOR, argument: "work/headles"}
    out = cli(hub, home, "graft", *[x for pair in given.items() for x in pair], "--out", tmp_path / "grafted")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"mtp-plugin: work/headles: no such directory ({tempfile.gettempdir()}/work/headles), "
                               "and as a Hub repo id: cannot fetch "), lines
    assert "check the path, or the repo id" in lines[0] and not (tmp_path / "grafted").exists()


@pytest.mark.parametrize("repo,says", [(HEADLESS, f"{HEADLESS}: no MTP head tensors"),
                                       (MISSHAPEN, "the donor's head would not load"),
                                       ("tests/absent", "tests/absent: no such directory (")])
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


SHARD2 = "model-00002-of-00002.safetensors"


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the whole temporary tree a hostile repository must not reach)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def hostile_repo(hub: Hub, repos: dict, repo: str, index: dict[str, str] | None = None,
                 shard: bytes | None = None, extra: dict[str, bytes] | None = None) -> None:
    """Serve ``repo``: the donor, its index's head entries pointing at ``index[name]`` (a name the repository also
    serves, with the donor's second shard's bytes), its second shard replaced by ``shard``, and ``extra`` files."""
    hub.repos[repo] = repos[DONOR]
    files = dict(extra or {})
    if index is not None:
        data = json.loads((repos[DONOR] / INDEX).read_text())
        for key in data["weight_map"]:
            if key.startswith("mtp."):
                data["weight_map"][key] = index["mtp"]
        files[INDEX] = json.dumps(data).encode()
        files[index["mtp"]] = (repos[DONOR] / SHARD2).read_bytes()
    if shard is not None:
        files[SHARD2] = shard
    hub.extra[repo] = files


def rewrite_header(data: bytes, change) -> bytes:
    """A safetensors file's bytes with its JSON header passed through ``change`` (the data section kept)."""
    length = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8:8 + length]))
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


def utf16_header(data: bytes) -> bytes:
    """The file with its header re-encoded as UTF-16 (JSON that Python's ``json.loads`` of bytes would read)."""
    length = int.from_bytes(data[:8], "little")
    text = data[8:8 + length].decode().strip().encode("utf-16")
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


def overlapping(header: dict) -> dict:
    """Every head tensor's bytes start where the first one's do."""
    start = min(v["data_offsets"][0] for k, v in header.items() if k.startswith("mtp."))
    for key, value in header.items():
        if key.startswith("mtp."):
            value["data_offsets"] = [start, start + value["data_offsets"][1] - value["data_offsets"][0]]
    return header


def negative(header: dict) -> dict:
    key = next(k for k in header if k.startswith("mtp."))
    header[key]["data_offsets"] = [-header[key]["data_offsets"][1], header[key]["data_offsets"][0]]
    return header


@pytest.mark.parametrize("name", ["../../../../x/y.safetensors", "sub/../../../y.safetensors", "ABSOLUTE"],
                         ids=["dotdot", "sub-dotdot", "absolute"])
def test_an_index_naming_files_outside_the_cache_writes_nothing_there(hub, home, tmp_path, repos, local_recipient,
                                                                      name):
    victim = tmp_path / "victim" / "y.safetensors"
    victim.parent.mkdir()
    victim.write_bytes(b"the user's own file")
    name = str(victim) if name == "ABSOLUTE" else name
    hostile_repo(hub, repos, "tests/traversal", index={"mtp": name})
    before = files_under(tmp_path)
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", "tests/traversal", "--out",
              tmp_path / "grafted")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tests/traversal" in lines[0] and repr(name) in lines[0] and "outside" in lines[0], lines
    after = files_under(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("hf-home/")} == before  # only the cache was written
    assert not (tmp_path / "grafted").exists()


@pytest.mark.parametrize("lie,says", [
    (lambda data: rewrite_header(data, overlapping), "overlap another tensor"),
    (lambda data: rewrite_header(data, negative), "are not [begin, end] with 0 <= begin <= end"),
    (lambda data: (2 ** 62).to_bytes(8, "little") + data[8:], f"header length {2 ** 62} exceeds"),
    (lambda data: rewrite_header(data, lambda header: list(header)), "its header is a JSON list, not an object"),
    (lambda data: utf16_header(data), "its header is not UTF-8 JSON"),
    (lambda data: (200_000).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000, "its header is not UTF-8 JSON"),
], ids=["overlapping", "negative", "huge-length", "array", "utf16", "deep"])
def test_a_lying_header_on_the_hub_is_refused_before_its_bytes_are_fetched(hub, home, tmp_path, repos,
                                                                           local_recipient, lie, says):
    shard = lie((repos[DONOR] / SHARD2).read_bytes())
    hostile_repo(hub, repos, "tests/liar", shard=shard)
    hub.served = 0
    out = cli(hub, home, "extract", "--hf", "tests/liar", "--out", tmp_path / "head.safetensors")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"tests/liar: {SHARD2}: unreadable safetensors header" in lines[0], lines
    assert says in lines[0], lines
    honest = int.from_bytes((repos[DONOR] / SHARD2).read_bytes()[:8], "little")
    header = min(int.from_bytes(shard[:8], "little"), len(shard) - 8)
    assert hub.served <= 8 + max(honest, header), (hub.served, header)  # the header at most, never the tensors
    assert not (tmp_path / "head.safetensors").exists()
    assert not list((home / "mtp_plugin").rglob("*.safetensors*")), list((home / "mtp_plugin").rglob("*"))


def test_a_head_that_arrives_corrupted_is_never_kept(hub, home, tmp_path, local_recipient, local_graft):
    args = ("graft", "--recipient", local_recipient, "--donor", DONOR, "--out")
    hub.corrupt = True
    try:
        out = cli(hub, home, *args, tmp_path / "a")
    finally:
        hub.corrupt = False
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{DONOR}: the fetched head does not read" in out.stderr and "non-finite" in out.stderr, out.stderr
    assert not list((home / "mtp_plugin").rglob("*.safetensors*")), list((home / "mtp_plugin").rglob("*"))
    hub.served = 0
    out = cli(hub, home, *args, tmp_path / "b")  # the Hub healthy again: fetched anew, no folder to delete first
    assert out.returncode == 0 and hub.served > 0, out.stderr
    same_tree(tmp_path / "b", local_graft)


def test_a_cached_head_that_does_not_read_is_fetched_again_once(hub, home, tmp_path, local_recipient, local_graft):
    args = ("graft", "--recipient", local_recipient, "--donor", DONOR, "--out")
    assert cli(hub, home, *args, tmp_path / "a").returncode == 0
    cached = next((home / "mtp_plugin" / "heads").rglob(SHARD2))
    data = cached.read_bytes()
    cached.write_bytes(data[:-64] + b"\xff" * 64)  # a disk fault inside the last head tensor
    hub.served = 0
    out = cli(hub, home, *args, tmp_path / "b")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "discarded and fetched again" in line]
    assert len(warnings) == 1 and DONOR in warnings[0] and "non-finite" in warnings[0], out.stderr
    assert hub.served > 0 and cached.read_bytes() == data
    same_tree(tmp_path / "b", local_graft)


def test_a_head_the_loader_would_not_see_is_not_kept(hub, home, tmp_path, repos, local_recipient):
    hostile_repo(hub, repos, "tests/dotfile", index={"mtp": ".safetensors"})  # not read as a weights file
    args = ("graft", "--recipient", local_recipient, "--donor", "tests/dotfile", "--out", tmp_path / "grafted")
    out = cli(hub, home, *args)
    assert out.returncode == 1 and "the fetched head does not read" in out.stderr, out.stderr
    assert "no head tensors" in out.stderr and "Traceback" not in out.stderr
    assert not list((home / "mtp_plugin").rglob("*.safetensors*")) and not (tmp_path / "grafted").exists()


def test_names_that_share_a_flat_form_keep_their_own_bytes(hub, home, tmp_path, repos, local_recipient, local_graft):
    shard = (repos[DONOR] / SHARD2).read_bytes()
    hostile_repo(hub, repos, "tests/twins", index={"mtp": "a/h.safetensors"}, extra={"a--h.safetensors": shard})
    out = cli(hub, home, "graft", "--recipient", local_recipient, "--donor", "tests/twins", "--out", tmp_path / "g")
    assert out.returncode == 0, out.stderr
    same_tree(tmp_path / "g", local_graft)


def test_a_discard_cut_short_does_not_block_the_next_fetch(hub, home, tmp_path, local_recipient, local_graft):
    args = ("graft", "--recipient", local_recipient, "--donor", DONOR, "--out")
    assert cli(hub, home, *args, tmp_path / "a").returncode == 0
    cached = next((home / "mtp_plugin" / "heads").rglob("config.json"))
    cached.unlink()  # what an interrupted discard leaves: the folder without its config.json
    out = cli(hub, home, *args, tmp_path / "b")
    assert out.returncode == 0, out.stderr
    same_tree(tmp_path / "b", local_graft)


@pytest.mark.parametrize("revision", ["../../../../escape", "/abs/ref"])
def test_a_revision_that_is_a_path_is_refused(hub, home, tmp_path, local_recipient, revision):
    before = files_under(tmp_path)
    out = cli(hub, home, "extract", "--hf", DONOR, "--revision", revision, "--out", tmp_path / "head.safetensors")
    assert out.returncode == 1 and f"--revision = {revision!r} names a path outside" in out.stderr, out.stderr
    assert {k: v for k, v in files_under(tmp_path).items() if not k.startswith("hf-home/")} == before
