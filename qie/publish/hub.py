"""Uploading an export folder to the Hugging Face Hub with huggingface_hub's own API (`create_repo`,
`upload_folder`). Offline (`HF_HUB_OFFLINE=1`, or the endpoint not answering) it stops in one line before anything
is sent, and the folder stays as written."""

from __future__ import annotations

import os
from pathlib import Path

from qie.errors import QieError


class HubError(QieError):
    """The Hub cannot be reached or refused the upload."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def push_folder(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create the model repo `repo_id` (kept if it exists) and upload `folder` into it; returns the commit's URL.

    Raises:
        HubError: offline, the Hub not answering, or it refusing (a missing token, no write access), naming the
            repo and the folder, which stays.
    """
    keep = f"the folder {folder} is written; upload it later with: hf upload {repo_id} {folder}"
    if _offline():
        raise HubError(f"export.push_to_hub={repo_id}: HF_HUB_OFFLINE is set, nothing was sent; {keep}")
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message="Upload a LoRA exported by qie"
        )
    except Exception as e:  # connection errors, HTTP errors, a missing token: one line, the folder kept
        raise HubError(f"export.push_to_hub={repo_id}: {_reason(e, api.endpoint)}; {keep}") from None
    return str(getattr(commit, "commit_url", commit))


def _reason(error: Exception, endpoint: str) -> str:
    """Why the upload failed, in a few words."""
    names = {type(c).__name__ for c in _causes(error)}
    if names & {"ConnectError", "ConnectionError", "ConnectTimeout", "OfflineModeIsEnabled", "TimeoutException"}:
        return f"the Hub at {endpoint} cannot be reached ({type(error).__name__})"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''} (log in with `hf auth login` or set HF_TOKEN)"


def _causes(error: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__
    return out
