"""A CPU run's bits do not depend on the thread settings its process saw before it
(runtime/cpu_threads.py): torch's first `set_num_threads` turns MKL's per-call thread choice off
for the life of the process, which changes the sums of the CPU's matmuls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cli_run import PROCESS_DEADLINE_S
from tiny_run import tiny_env, tiny_inputs

# What start-up may run before training: the demo regenerates its corpus under cpu_threads(1)
# when it is not cached yet, and a resumed run skips that
PRELUDES = {
    "nothing": "",
    "a one-thread decode": (
        "from dflash_async.runtime.cpu_threads import cpu_threads\nwith cpu_threads(1): pass\n"
    ),
}


def test_a_cpu_run_trains_the_same_bits_whether_or_not_its_process_decoded_on_one_thread_first(
    tmp_path: Path,
) -> None:
    """Two processes run the same 2 steps, one after a one-thread decode: the exports are equal
    byte for byte. Without the pin at the start of a run they differ here after 2 steps."""
    inputs = tiny_inputs(tmp_path)
    exports = {}
    for name, prelude in PRELUDES.items():
        out = tmp_path / name.replace(" ", "_")
        settings = {"DFLASH_TRAIN__MAX_STEPS": "2", "DFLASH_TRAIN__SAVE_EVERY": "0"}
        env = {**os.environ, **tiny_env(inputs, out), **settings, "DFLASH_LOG__FORMAT": "json"}
        code = f"{prelude}import sys\nfrom dflash_async.__main__ import main\nsys.exit(main(['run']))\n"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=PROCESS_DEADLINE_S
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        exports[name] = (out / "drafter" / "model.safetensors").read_bytes()
    assert exports["nothing"] == exports["a one-thread decode"]
