"""Where a target lives on disk: a local folder, or a model id found in the local Hugging Face cache.

Owns `resolve_target` and `TargetError`. Reads the cache only (`local_files_only=True`): nothing is
ever downloaded, and a model id that is not cached is a one-line TargetError telling the user how
to fetch it. Imports neither torch nor transformers, so settings validation can call it cheaply.
"""

from __future__ import annotations

import os
from pathlib import Path


class TargetError(ValueError):
    """A target folder that cannot be used; the message is one line naming the path (CLI exit 2)."""


def resolve_target(path_or_id: str | os.PathLike[str]) -> Path:
    """The folder of a target: `path_or_id` itself when it is a folder, else the snapshot of the
    model id `Org/Name` in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME, its `refs/main`).

    Raises TargetError when it is neither.
    """
    text = str(path_or_id)
    folder = Path(text).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        raise TargetError(
            f"target folder {text!r} does not exist (a local Hugging Face model folder, "
            "or a model id such as Qwen/Qwen3-8B in the local Hugging Face cache)"
        ) from None
    try:
        return Path(snapshot_download(text, local_files_only=True))
    except LocalEntryNotFoundError:
        raise TargetError(
            f"target {text!r} is neither a folder nor a model in the local Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (nothing is downloaded: fetch it first, e.g. "
            f"`hf download {text}`)"
        ) from None
