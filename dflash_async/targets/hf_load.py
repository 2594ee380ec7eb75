"""targets/hf_load.py owns how a target checkpoint is handed to transformers' `from_pretrained`:
from local files only, and as transformers' own torch modules.

transformers 5.2x kernelizes every model it loads when the `kernels` package is installed (it is
one of its requirements): layers such as RMSNorm and the rotary embedding get forwards from Hub
kernel repositories. That needs the network (a machine without it fails the load with "could not
verify publisher trust status"), and it swaps the numerics the packed forwards are checked
against for other kernels'. The target's forward is ours (targets/packed/) or HF's plain torch
one, so the Hub kernels are switched off at every load.
"""

from __future__ import annotations

from typing import Any


def offline_torch_modules() -> dict[str, Any]:
    """The `from_pretrained` keywords every target load passes: local files only, Hub kernels
    off (the keyword exists since transformers 4.54 and is False by default before 5.2x)."""
    return {"local_files_only": True, "use_kernels": False}
