"""The command that gives a head-less checkpoint its head, with the donor its model card names (``base_model``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

PLACEHOLDER = "ORIGINAL/REPO"  # shown when no model card names the checkpoint's base model
SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[^/]+)$")


def hub_origin(model_dir: Path) -> tuple[str, str] | None:
    """``(repo_id, commit)`` when ``model_dir`` is a snapshot in huggingface_hub's cache
    (``…/models--OWNER--NAME/snapshots/COMMIT``), else None."""
    match = SNAPSHOT.search(Path(model_dir).absolute().as_posix())
    return None if match is None else (f"{match['owner']}/{match['name']}", match["commit"])


def base_model(model_dir: Path, online: bool = False) -> str | None:
    """The first ``base_model`` of the model card of ``model_dir``: its README.md, else (for a Hub snapshot) the
    card cached by huggingface_hub, else, when ``online`` and huggingface_hub is not offline, the card fetched from
    the Hub. None when no card is found or none names a base model; never raises."""
    from huggingface_hub import ModelCard, constants, hf_hub_download, try_to_load_from_cache

    card = Path(model_dir) / "README.md"
    origin = hub_origin(model_dir)
    try:
        if not card.is_file() and origin is not None:
            cached = try_to_load_from_cache(origin[0], "README.md", revision=origin[1])
            if isinstance(cached, str):
                card = Path(cached)
            elif online and not constants.HF_HUB_OFFLINE:
                card = Path(hf_hub_download(origin[0], "README.md", revision=origin[1]))
        if not card.is_file():
            return None
        base = ModelCard.load(card, ignore_metadata_errors=True).data.base_model
    except Exception:  # noqa: BLE001 - a hint must never fail the load or the report
        return None
    base = base[0] if isinstance(base, list) and base else base
    return base if isinstance(base, str) and base else None


def graft_command(model_dir: Path, online: bool = False) -> str:
    """``mtp-plugin graft --recipient R --donor D --out OUT`` for ``model_dir``, POSIX-quoted: R its Hub repo id (a Hub
    snapshot) or the directory; D its card's ``base_model``, else ``PLACEHOLDER``."""
    origin = hub_origin(model_dir)
    recipient = origin[0] if origin else str(model_dir)
    donor = base_model(model_dir, online) or PLACEHOLDER
    return (f"mtp-plugin graft --recipient {shlex.quote(recipient)} --donor {shlex.quote(donor)} "
            f"--out {shlex.quote(Path(recipient).name + '-mtp')}")
