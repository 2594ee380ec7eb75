"""Terminal lines of a sane length: the key fields first, long values shortened, the JSON log
whole; `eval --prompts` reads ShareGPT `conversations` as `run` does."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dflash_async.data.formats import DataError
from dflash_async.eval.harness import read_prompts
from dflash_async.log import configure_logging, console_fields, get_logger
from dflash_async.settings.env import load_settings

pytestmark = pytest.mark.timeout(60)
# what `eval` logs when done: the summary of eval/evaluation.py, tau among 20 fields
EVAL = {
    "target": "/models/Qwen3-8B",
    "drafter": "runs/qwen3-8b/drafter",
    "num_samples": 16,
    "block_size": 16,
    "accepted_length_histogram": {str(k): 100 * k for k in range(1, 17)},
    "acceptance_by_position": [0.912345678 - 0.05 * k for k in range(15)],
    "new_tokens": 4096,
    "plain_s": 12.3456789,
    "speculative_s": 4.56789123,
    "plain_tokens_per_s": 331.789123,
    "speculative_tokens_per_s": 896.12345,
    "speedup": 2.7012345,
    "numerical_ties": 0,
    "max_new_tokens": 256,
    "batch_size": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "tau": 3.123456789,
}


def console_text(event: str, **fields) -> str:
    stream = io.StringIO()
    configure_logging("console", "info", stream)
    try:
        get_logger("test").info(event, **fields)
    finally:
        configure_logging("json", "info", io.StringIO())
    return stream.getvalue()


def test_the_eval_line_shows_tau_first_and_fits_a_wide_terminal() -> None:
    line = console_text("eval_completed", **EVAL).strip()
    # the prefix (time, level, padded event name) is ~75 characters; tau right after it
    assert line.index("tau=3.123") < 110
    assert len(line) < 600, len(line)  # 20 fields; each list or mapping at most 80
    assert "<16 keys: 1, 2, 3" in line


def test_the_settings_line_names_the_sections_instead_of_every_value() -> None:
    settings = load_settings({"DFLASH_ENV_FILE": "none"}).public_dict()
    assert len(json.dumps(settings)) > 1900  # what the JSON log keeps
    line = console_text("settings_loaded", **settings).strip()
    assert len(line) < 400, len(line)
    assert "target, drafter, data, train, pipeline, eval, log" in line


def test_console_fields_leave_short_values_and_the_json_whole() -> None:
    fields = console_fields({"event": "x", "short": [1, 2], "path": "p", "n": 1.23456789})
    assert list(fields) == ["event", "path", "short", "n"]
    assert fields["short"] == [1, 2] and fields["n"] == 1.235
    warnings = ["w" * 200, "v" * 200]  # a user must read every warning in full
    assert console_fields({"event": "x", "warnings": warnings})["warnings"] == warnings


def test_eval_prompts_accept_sharegpt_conversations_as_run_does(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    records = [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"prompt": "Plain"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sharegpt, openai, plain = read_prompts(path)
    assert sharegpt["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
    ]
    assert openai["messages"] == [{"role": "user", "content": "Hello"}]
    assert plain["prompt"] == "Plain"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"conversations": [{"from": "narrator", "value": "x"}]}, "narrator"),
        ({"text": "x"}, "{'conversations': [...]}"),
    ],
)
def test_a_bad_prompt_record_names_its_line(tmp_path: Path, record: dict, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"prompts.jsonl:1: .*{message}".replace("[", r"\[")):
        read_prompts(path)


@pytest.mark.parametrize("command", ["run", "settings"])
def test_help_lists_every_setting_and_says_where_they_are_described(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_async.__main__ import main
    from dflash_async.settings.env import setting_names

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert all(f"\n{name}  " in out for name in setting_names())
    assert "docs/training.md" in out and "python -m dflash_async settings" in out
    assert max(len(line) for line in out.splitlines()) <= 100
