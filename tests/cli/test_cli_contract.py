"""Every command keeps `run`'s contract: a bad input (missing file, malformed file, no CUDA,
unwritable output) is exit 2 with one line on stderr naming it and no traceback, before any model
is loaded; stdout in JSON mode holds JSON lines only; an internal error is exit 1 with the traceback
inside the JSON log. Also: `--version`, `settings` on a preset whose paths are absent, the case
rule of names, and a model id resolved from a Hugging Face cache folder built here.

Bad inputs run the CLI's main() in this process (each case ~0 s after the first imports); the
cases that need a real stdout and environment run as two subprocesses started together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_run import finish
from logging_kit import logging_restored

from dflash_async.__main__ import main
from dflash_async.settings.env import repo_root
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = pytest.mark.timeout(120)
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No DFLASH_* variable of the caller, a scratch working folder, and the process-wide logging
    a command sets up put back afterwards (its handler writes to this test's captured stdout)."""
    for name in [k for k in os.environ if k.upper().startswith("DFLASH_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    with logging_restored(monkeypatch):
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Inputs good and bad, and `a_file` (an output under it cannot be created, even by root)."""
    root = tmp_path_factory.mktemp("contract")
    good = root / "in.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    bad = root / "bad.jsonl"
    bad.write_text(good.read_text() + "{not json\n")
    bad_env = root / "bad.env"
    bad_env.write_text("DFLASH_TRAIN__SEED=1\nDFLASH_TRAIN__LR=fast\n")
    a_file = root / "a_file"
    a_file.write_text("")
    empty = root / "empty.jsonl"
    empty.write_text("")
    return {
        "root": root,
        "good": good,
        "bad": bad,
        "bad_env": bad_env,
        "a_file": a_file,
        "empty": empty,
        **corrupt_drafter_exports(root),
    }


def corrupt_drafter_exports(root: Path) -> dict[str, Path]:
    """Drafter exports with a valid config.json but a model.safetensors cut short (a copy that
    stopped half-way: header intact, data missing) or holding no safetensors at all."""
    from conftest import TinySpec, tiny_config, tiny_drafter

    from dflash_async.checkpoint.export import export_drafter

    config = tiny_config(TinySpec())
    folders = {}
    for name in ("truncated_drafter", "garbage_drafter"):
        folder = export_drafter(tiny_drafter(config, seed=0), config, root / name)
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2] if name.startswith("truncated") else b"junk")
        folders[name] = folder
    return folders


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse: --version, --help, argument errors
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *expected: str) -> None:
    assert code == 2, (out, err)
    # stdout: nothing, or (run) the JSON log lines before the check that failed (settings_resolved
    # may warn about the very setting refused); never the error
    assert all(json.loads(line)["level"] in ("info", "warning") for line in out.splitlines()), out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in lines[0], (text, lines[0])


# case -> (argv with {placeholders} of `files`, environment, texts the error line must name)
BAD_INPUTS = {
    "run/missing_data_file": (
        ["run"],
        {"DFLASH_ENV_FILE": "none", "DFLASH_DATA__PATH": "{root}/none.jsonl"},
        ["DFLASH_DATA__PATH"],
    ),
    "run/malformed_env_file": (
        ["run"],
        {"DFLASH_ENV_FILE": "{bad_env}"},
        ["DFLASH_TRAIN__LR='fast'", "bad.env"],
    ),
    "run/unwritable_output": (
        ["run"],
        {"DFLASH_ENV_FILE": "none", "DFLASH_OUTPUT_DIR": "{a_file}/out"},
        ["DFLASH_OUTPUT_DIR", "a_file"],
    ),
    "run/cuda_target_cpu_drafter": (
        ["run"],
        {
            "DFLASH_ENV_FILE": "none",
            "DFLASH_PIPELINE__TARGET_DEVICES": "0",
            "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu",
        },
        ["DFLASH_PIPELINE__TARGET_DEVICES=cuda:0", "DFLASH_PIPELINE__DRAFTER_DEVICES=cpu"],
    ),
    "settings/missing_env_file": (
        ["settings"],
        {"DFLASH_ENV_FILE": "{root}/none.env"},
        ["DFLASH_ENV_FILE", "none.env"],
    ),
    "settings/malformed_env_file": (
        ["settings"],
        {"DFLASH_ENV_FILE": "{bad_env}"},
        ["DFLASH_TRAIN__LR='fast'", "bad.env"],
    ),
    "settings/lowercase_name": (
        ["settings"],
        {"DFLASH_ENV_FILE": "none", "dflash_train__max_steps": "2"},
        ["dflash_train__max_steps", "DFLASH_TRAIN__MAX_STEPS"],
    ),
    "bench/packing_bad_argument": (["bench", "packing", "--max-len", "0"], {}, ["--max-len"]),
    "regenerate/missing_input": (
        [
            "regenerate",
            "--input",
            "{root}/none.jsonl",
            "--output",
            "{root}/out.jsonl",
            "--target",
            "{root}",
        ],
        {},
        ["none.jsonl"],
    ),
    "regenerate/malformed_input": (
        ["regenerate", "--input", "{bad}", "--output", "{root}/out.jsonl", "--target", "{root}"],
        {},
        ["bad.jsonl:2", "malformed JSON"],
    ),
    "regenerate/unwritable_output": (
        ["regenerate", "--input", "{good}", "--output", "{a_file}/out.jsonl", "--target", "{root}"],
        {},
        ["--output", "a_file"],
    ),
    "regenerate/missing_target": (
        [
            "regenerate",
            "--input",
            "{good}",
            "--output",
            "{root}/out.jsonl",
            "--target",
            "{root}/no_model",
        ],
        {},
        ["no_model"],
    ),
    "regenerate/bad_argument": (
        [
            "regenerate",
            "--input",
            "{good}",
            "--output",
            "{root}/o.jsonl",
            "--target",
            "{root}",
            "--batch-size",
            "0",
        ],
        {},
        ["--batch-size"],
    ),
    "regenerate/repeated_device": (
        [
            "regenerate",
            "--input",
            "{good}",
            "--output",
            "{root}/o.jsonl",
            "--target",
            "{root}",
            "--devices",
            "cpu,cpu",
        ],
        {},
        ["--devices", "once"],
    ),
    "eval/missing_drafter": (
        ["eval", "--drafter", "{root}/no_drafter", "--device", "cpu"],
        {},
        ["no_drafter"],
    ),
    "eval/malformed_prompts": (
        ["eval", "--drafter", "{root}", "--prompts", "{bad}"],
        {},
        ["bad.jsonl:2"],
    ),
    "eval/unwritable_results": (
        ["eval", "--drafter", "{root}", "--device", "cpu", "--results", "{a_file}/r.jsonl"],
        {},
        ["--results", "a_file"],
    ),
    "eval/bad_argument": (
        ["eval", "--drafter", "{root}", "--num-prompts", "0"],
        {},
        ["--num-prompts"],
    ),
    "bench/moved_research_name": (
        ["bench", "optimizer"],
        {},
        ["bench optimizer", "benchmarks/research/optimizer_bench.py"],
    ),
    "bench/unknown_name": (["bench", "bogus"], {}, ["'bogus'", "drafter", "packing"]),
    "eval/truncated_drafter_weights": (
        ["eval", "--drafter", "{truncated_drafter}", "--device", "cpu"],
        {},
        ["truncated_drafter/model.safetensors", "not a readable safetensors file"],
    ),
    "eval/garbage_drafter_weights": (
        ["eval", "--drafter", "{garbage_drafter}", "--device", "cpu"],
        {},
        ["garbage_drafter/model.safetensors", "not a readable safetensors file"],
    ),
    "eval/empty_prompts": (
        ["eval", "--drafter", "{root}", "--prompts", "{empty}"],
        {},
        ["empty.jsonl", "no prompt records"],
    ),
    "calibrate/missing_drafter": (
        ["calibrate", "--drafter", "{root}/no_drafter", "--device", "cpu"],
        {},
        ["no_drafter"],
    ),
    "calibrate/bad_argument": (
        ["calibrate", "--drafter", "{root}", "--num-prompts", "0"],
        {},
        ["--num-prompts"],
    ),
    "calibrate/truncated_drafter_weights": (
        ["calibrate", "--drafter", "{truncated_drafter}", "--device", "cpu"],
        {},
        ["truncated_drafter/model.safetensors", "not a readable safetensors file"],
    ),
    "regenerate/sample_at_temperature_0": (
        [
            "regenerate",
            "--input",
            "{good}",
            "--output",
            "{root}/o.jsonl",
            "--target",
            "{root}",
            "--sample",
            "--temperature",
            "0",
        ],
        {},
        ["--temperature", "--sample"],
    ),
}

NO_CUDA_INPUTS = {
    "run/gpu_drafter": (
        ["run"],
        {"DFLASH_ENV_FILE": "none", "DFLASH_PIPELINE__DRAFTER_DEVICES": "0"},
        ["DFLASH_PIPELINE__DRAFTER_DEVICES", "CUDA"],
    ),
    "bench/drafter": (["bench", "drafter"], {}, ["bench drafter", "CUDA"]),
    "bench/drafter_on_cpu": (["bench", "drafter", "--device", "cpu"], {}, ["bench drafter"]),
    "regenerate/cuda_device": (
        [
            "regenerate",
            "--input",
            "{good}",
            "--output",
            "{root}/o.jsonl",
            "--target",
            "{root}",
            "--device",
            "cuda:0",
        ],
        {},
        ["--device", "CUDA"],
    ),
    "eval/cuda_device": (
        ["eval", "--drafter", "{root}", "--device", "cuda"],
        {},
        ["--device", "CUDA"],
    ),
}


def _run_case(case, files, capsys, monkeypatch) -> None:
    argv, environment, expected = case
    for name, value in environment.items():
        monkeypatch.setenv(name, value.format(**files))
    code, out, err = cli([arg.format(**files) for arg in argv], capsys)
    assert_one_line_error(code, out, err, *expected)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_naming_it(case, files, capsys, monkeypatch) -> None:
    _run_case(BAD_INPUTS[case], files, capsys, monkeypatch)


@NO_CUDA
@pytest.mark.parametrize("case", list(NO_CUDA_INPUTS))
def test_without_cuda_a_gpu_command_or_device_exits_2_at_once(
    case, files, capsys, monkeypatch
) -> None:
    _run_case(NO_CUDA_INPUTS[case], files, capsys, monkeypatch)


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_async import __version__

    code, out, err = cli(["--version"], capsys)
    assert (code, out, err) == (0, f"dflash_async {__version__}\n", "")


def test_settings_prints_a_preset_whose_paths_are_absent_here_and_warns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DFLASH_ENV_FILE", "settings/qwen3_8b_8xh200.env")
    code, out, err = cli(["settings"], capsys)
    assert code == 0, err
    printed = json.loads(out)  # stdout: the JSON document alone
    assert printed["env_file"] == str(repo_root() / "settings" / "qwen3_8b_8xh200.env")
    assert printed["target"]["path"] == "/models/Qwen3-8B"
    assert printed["pipeline"]["devices"] == [f"cuda:{i}" for i in range(8)]  # layout auto
    warnings = [line for line in err.strip().splitlines() if line.startswith("warning: ")]
    assert [w.split(":")[0:2] for w in warnings[:2]] == [
        ["warning", " DFLASH_TARGET__PATH"],
        ["warning", " DFLASH_DATA__PATH"],
    ]
    assert "/models/Qwen3-8B" in warnings[0] and "/data/qwen3_8b_regenerated" in warnings[1]
    # where the values came from, the devices, and GPUs named on a machine without them
    assert f"from {repo_root() / 'settings' / 'qwen3_8b_8xh200.env'}: DFLASH_OUTPUT_DIR" in err
    assert "\ndevices: cuda:0,cuda:1," in err


# ---- subprocesses: the real stdout, environment and Hugging Face cache ----------------------

# regenerate with the tiny target's generation failing: an internal error after the target loaded
FAILING_REGENERATE = """
import sys
import dflash_async.regen.batched_generation as batched
def generate_ids(*args, **kwargs):
    raise RuntimeError("generation failed")
batched.generate_ids = generate_ids
from dflash_async.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def hub_cache_with(folder: Path, cache: Path, repo_id: str, revision: str = "0123abc") -> Path:
    """A Hugging Face hub cache holding `folder` as `repo_id`: models--Org--Name/snapshots/<rev>/
    (files linked, as the hub links them to blobs) and refs/main naming the revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    return env | {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]):
    """The subprocess cases, started at once; each test finishes its own."""
    root = tmp_path_factory.mktemp("hub")
    tiny = ensure_tiny_target(root / "dflash_cache")
    hub = root / "hub"
    snapshot = hub_cache_with(tiny, hub, "Org/Tiny-Qwen3")
    env = subprocess_env(HF_HUB_CACHE=str(hub), DFLASH_ENV_FILE="none")

    def start(argv: list[str], **extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, *argv],
            env=env | extra,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    regen = ["--input", str(files["good"]), "--target", "Org/Tiny-Qwen3", "--max-new-tokens", "2"]
    processes = {
        "settings_id": start(
            ["-m", "dflash_async", "settings"], DFLASH_TARGET__PATH="Org/Tiny-Qwen3"
        ),
        "settings_uncached_id": start(
            ["-m", "dflash_async", "settings"], DFLASH_TARGET__PATH="Org/Not-Cached"
        ),
        "regenerate_id": start(
            ["-m", "dflash_async", "regenerate", *regen, "--output", str(root / "out.jsonl")]
        ),
        "regenerate_fails": start(
            ["-c", FAILING_REGENERATE, "regenerate", *regen, "--output", str(root / "failed.jsonl")]
        ),
    }
    yield processes, snapshot, root
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def json_lines(stdout: str) -> list[dict]:
    """Every stdout line parses as JSON (fails on any console text)."""
    return [json.loads(line) for line in stdout.splitlines()]


def test_a_model_id_resolves_to_its_snapshot_in_the_local_hub_cache(launched) -> None:
    processes, snapshot, _ = launched
    code, out, err = finish(processes["settings_id"])
    assert code == 0
    # stderr: where the values came from and the devices; no warning about the path
    assert not [line for line in err.splitlines() if "DFLASH_TARGET__PATH:" in line], err
    assert "from environment: DFLASH_TARGET__PATH" in err
    assert json.loads(out)["target"]["path"] == str(snapshot)


def test_a_model_id_missing_from_the_cache_is_named_and_never_downloaded(launched) -> None:
    processes, _, root = launched
    code, out, err = finish(processes["settings_uncached_id"])
    assert code == 0  # `settings` reports, `run` refuses (load_settings checks paths)
    assert json.loads(out)["target"]["path"] == "Org/Not-Cached"
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: DFLASH_TARGET")]
    assert "DFLASH_TARGET__PATH" in warning and "'Org/Not-Cached'" in warning
    assert str(root / "hub") in warning  # the cache it looked in
    assert not (root / "hub" / "models--Org--Not-Cached").exists()


def test_regenerate_loads_a_cached_model_id_and_prints_json_lines_only(launched) -> None:
    processes, _, root = launched
    code, out, err = finish(processes["regenerate_id"])
    assert code == 0, out + err
    events = json_lines(out)
    assert events[-1] == {"event": "regenerated", "path": str(root / "out.jsonl")}
    assert any(e["event"] == "regenerate_completed" for e in events)
    assert "Traceback" not in err


def test_an_internal_error_exits_1_with_the_traceback_inside_the_json_log(launched) -> None:
    processes, _, _ = launched
    code, out, err = finish(processes["regenerate_fails"])
    assert code == 1, out + err
    (failed,) = [e for e in json_lines(out) if "exception" in e]
    assert (failed["event"], failed["level"]) == ("regenerate_failed", "error")
    assert "generation failed" in json.dumps(failed["exception"])
    assert "Traceback" not in err


def test_files_a_command_writes_are_readable_as_the_umask_allows(tmp_path: Path) -> None:
    from conftest import TinySpec, tiny_config, tiny_drafter

    from dflash_async.checkpoint.export import export_drafter
    from dflash_async.eval.regenerate import write_jsonl

    config = tiny_config(TinySpec())
    previous = os.umask(0o027)  # owner rw, group r, others nothing
    try:
        written = [write_jsonl([{"messages": []}], tmp_path / "regenerated.jsonl")]
        export = export_drafter(tiny_drafter(config, seed=0), config, tmp_path / "drafter")
        written += sorted(export.iterdir())
    finally:
        os.umask(previous)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {
        p.name: oct(0o640) for p in written
    }
