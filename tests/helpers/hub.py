"""Hugging Face Hub repositories served from local folders, for tests that have no network.

``snapshot_download`` stands in for ``huggingface_hub.snapshot_download`` where mlx-lm imported it
(``mlx_lm.utils.snapshot_download``): it copies the files of ``remote`` that ``allow_patterns`` selects, chosen by
huggingface_hub's own ``filter_repo_objects`` (the filter the real function applies), into one snapshot folder, and
returns that folder, as the real function returns the cached snapshot.

``Hub`` serves the Hub's own HTTP endpoints on loopback, for processes pointed at it with ``HF_ENDPOINT``: the real
huggingface_hub then talks to it as to the Hub.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO_ID = "mtp-plugin-tests/tiny"  # no local path has this name


def snapshot_download(remote: Path, snapshot: Path):
    """A ``snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs) -> str`` serving ``remote``
    (for ``REPO_ID`` only) into ``snapshot``; ``calls`` lists each call's patterns."""
    from huggingface_hub.utils import filter_repo_objects

    def download(repo_id, revision=None, allow_patterns=None, **kwargs):
        assert repo_id == REPO_ID, repo_id
        download.calls.append(allow_patterns)
        files = sorted(p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file())
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, snapshot / name)
        return str(snapshot)

    download.calls = []
    snapshot.mkdir(parents=True, exist_ok=True)
    return download


class Hub:
    """The Hub's HTTP endpoints that huggingface_hub calls, served on loopback from local folders.

    ``repos`` maps a repo id to a folder: ``GET /api/models/ID[/revision/REV]`` (revision info: ``sha``, ``siblings``),
    ``GET /api/models/ID/tree/REV`` (the file listing ``snapshot_download`` reads) and ``HEAD``/``GET
    /ID/resolve/REV/PATH`` (``X-Repo-Commit``, ``ETag``, sizes; a ``.safetensors`` file is redirected to
    ``/cdn/ID/PATH`` as the Hub sends LFS files to its CDN, which honours ``Range``). ``served`` counts the bytes of
    ``.safetensors`` files sent; ``ranges`` lists ``(path, first byte)`` of each safetensors GET. ``cut_after``: the
    next safetensors response of more bytes than that stops after that many bytes (the connection closes); ``refuse``:
    safetensors GETs answer 403 after a cut; ``delay``: seconds before each safetensors body; ``corrupt``: while True,
    safetensors bodies past their header (a range starting after byte 8) arrive as 0xFF bytes (NaN in any float).
    ``extra``: repo id → ``{name: bytes}`` served beside the folder's files, any name (a hostile repository's).
    Revisions: ``main`` and ``COMMIT``; any other is not found. Use as a context manager.
    """

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, repos: dict[str, Path]):
        self.repos, self.served, self.ranges = repos, 0, []
        self.extra: dict[str, dict[str, bytes]] = {}
        self.cut_after: int | None = None
        self.refuse = self.cut = self.corrupt = False
        self.delay = 0.0  # seconds before each safetensors body

    def files(self, repo: str) -> dict[str, bytes] | None:
        """``{name: bytes}`` of every file ``repo`` serves; None for an unknown repo."""
        folder = self.repos.get(repo)
        if folder is None:
            return None
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return {**files, **self.extra.get(repo, {})}

    def __enter__(self) -> Hub:
        import threading
        from http.server import ThreadingHTTPServer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: Hub):
    import hashlib
    import json
    import re
    import time
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import unquote, urlparse

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _file(self, repo: str, name: str) -> bytes | None:
            return (hub.files(repo) or {}).get(name)

        def _send(self, status: int, headers: dict, body: bytes = b"") -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _api(self, repo: str) -> None:
            files = hub.files(repo)
            if files is None:
                self._send(404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}')
                return
            siblings = [{"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest(),
                         **({"lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                     "pointerSize": 134}} if name.endswith(".safetensors") else {})}
                        for name, data in files.items()]
            body = json.dumps({"id": repo, "modelId": repo, "sha": Hub.COMMIT, "private": False,
                               "siblings": siblings}).encode()
            self._send(200, {"Content-Type": "application/json"}, body)

        def _tree(self, repo: str) -> None:
            files = hub.files(repo)
            if files is None:
                self._send(404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}')
                return
            entries = []
            for name, data in files.items():
                entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                entries.append(entry)
            self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode())

        def _resolve(self, repo: str, name: str) -> None:
            data = self._file(repo, name)
            if data is None:
                self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": Hub.COMMIT}, b"")
                return
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            common = {"X-Repo-Commit": Hub.COMMIT, "ETag": etag, "Accept-Ranges": "bytes"}
            if name.endswith(".safetensors"):  # an LFS file: the Hub redirects to its CDN
                self._send(302, {**common, "X-Linked-Etag": etag, "X-Linked-Size": str(len(data)),
                                 "Location": f"/cdn/{repo}/{name}"})
                return
            self._send(200, common, data)

        def _cdn(self, repo: str, name: str) -> None:
            data = self._file(repo, name)
            if data is None or hub.refuse and hub.cut:
                self._send(404 if data is None else 403, {})
                return
            start, end, status = 0, len(data) - 1, 200
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if match:
                start, end, status = int(match[1]), min(int(match[2] or end), end), 206
            body = data[start:end + 1]
            if hub.corrupt and start > 8:
                body = b"\xff" * len(body)
            headers = {"Accept-Ranges": "bytes", "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                       "X-Repo-Commit": Hub.COMMIT}  # huggingface_hub follows a same-host redirect as the Hub's own
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            if self.command == "GET":
                hub.ranges.append((name, start))
                time.sleep(hub.delay)
            if self.command == "GET" and hub.cut_after is not None and len(body) > hub.cut_after and not hub.cut:
                hub.cut, hub.served = True, hub.served + hub.cut_after
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body[:hub.cut_after])
                self.wfile.flush()
                self.close_connection = True
                return
            if self.command == "GET":
                hub.served += len(body)
            self._send(status, headers, body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = unquote(urlparse(self.path).path)
            revision = re.search(r"/(?:tree|revision|resolve)/([^/]+)", path)
            if revision and revision[1] not in ("main", Hub.COMMIT):
                self._send(404, {"X-Error-Code": "RevisionNotFound"}, b'{"error": "Invalid rev id"}')
            elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path):
                self._tree(match[1])
            elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
                self._api(match[1])
            elif match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
                self._resolve(match[1], match[2])
            elif match := re.fullmatch(r"/cdn/([^/]+/[^/]+)/(.+)", path):
                self._cdn(match[1], match[2])
            else:
                self._send(404, {}, b"")

    return Handler
