"""Resolve a weights reference to a local file: a path, `file://path`, `hf://org/repo/file`, or a repo id.

Hub downloads go through `huggingface_hub` (and its cache); offline, a file missing from the cache is a clear
`CheckpointError`, never a traceback from the network stack.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = {".safetensors", ".sft", ".sfts", ".json", ".model", ".pt", ".bin"}


def hub_file(repo_id: str, filename: str) -> Path:
    """Download (or find in the cache) `filename` of the Hugging Face repo `repo_id`."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    if not _REPO_ID.match(repo_id):
        raise CheckpointError(f"{repo_id!r} is not a Hugging Face repo id (org/name)")
    try:
        return Path(hf_hub_download(repo_id, filename))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{filename} of hf://{repo_id} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline); download it first or pass a local path"
        ) from None
    except EntryNotFoundError:
        raise CheckpointError(f"hf://{repo_id} has no file {filename}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"Hugging Face repo {repo_id} not found (or not accessible)") from None
    except HFValidationError as e:
        raise CheckpointError(f"{repo_id!r} is not a Hugging Face repo id: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot fetch {filename} from hf://{repo_id}: {e}") from None


def hub_repo(ref: str | Path) -> str | None:
    """The repo id of a hub reference (`hf://org/repo/file` or `org/repo`), None for local files."""
    text = str(ref)
    if text.startswith("hf://"):
        return "/".join(text[len("hf://") :].split("/", 2)[:2])
    path = Path(text).expanduser()
    if not path.exists() and _REPO_ID.match(text) and path.suffix not in _FILE_SUFFIXES:
        return text
    return None


def hub_folder(ref: str, patterns: list[str], what: str) -> Path:
    """A local folder for `ref`: the folder itself, or a hub repo id's snapshot of the files matching `patterns`
    (through the HF cache). `CheckpointError` (option "model") naming `what` it should have been."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if hub_repo(ref) is None:
        raise CheckpointError(f"{ref}: not a folder or a Hugging Face repo id ({what})", "model")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no access: all end the same way
        why = f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{ref}: cannot fetch it from the Hugging Face hub ({why})", "model") from None


def resolve_file(ref: str | Path, default_name: str) -> Path:
    """Turn a weights reference into a local file path; `default_name` is used for directories and repo ids."""
    text = str(ref)
    if text.startswith("hf://"):
        parts = text[len("hf://") :].split("/", 2)
        if len(parts) < 3 or not all(parts):
            raise CheckpointError(f"hf:// reference must be hf://org/repo/file, got {text!r}")
        return hub_file(f"{parts[0]}/{parts[1]}", parts[2])
    if text.startswith("file://"):
        text = text[len("file://") :]
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / default_name
        if not path.is_file():
            raise CheckpointError(f"file not found: {path}")
        return path
    if path.is_file():
        return path
    if hub_repo(text) is not None:
        return hub_file(text, default_name)
    raise CheckpointError(f"file not found: {path}")
