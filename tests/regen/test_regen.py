"""The `regenerate` command at scale (regen/): a real OpenAI-compatible server on 127.0.0.1 and the
in-process engine give the same output; a killed run resumes to the same bytes; shards i/n add up
to the whole; an output at the input, inside it, or an empty input is refused with exit 2.

The server is stdlib `http.server` in a thread of this process, answering with the tiny target's
greedy continuation computed independently of eval/regenerate.py (full forwards, argmax, no
cache, no `generate`), so "same output" compares two implementations, not one with itself.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_async.__main__ import main
from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_intra_op_thread")]
REPO = Path(__file__).resolve().parents[2]
REJECTED_WORD = "forbidden"  # the test server answers 400 to a prompt containing it
EVENT_DEADLINE_S = 90  # a subprocess imports torch and loads the target in ~5-15 s


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("tiny"))


def _greedy(model: Any, tokenizer: Any, body: dict[str, Any]) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of the greedy continuation, by hand."""
    kwargs = body.get("chat_template_kwargs") or {}
    text = tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True, **kwargs
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    config = model.generation_config
    suppressed = torch.tensor(config.suppress_tokens)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(body["max_tokens"]):
            logits = model(input_ids=ids).logits[0, -1].index_fill(0, suppressed, float("-inf"))
            token = int(logits.argmax())
            if token == config.eos_token_id:
                return tokenizer.decode(new, skip_special_tokens=True), len(new) + 1, "stop"
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True), len(new), "length"


def _handler(model: Any, tokenizer: Any, requests: list[dict]) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()  # one forward at a time: the answers do not depend on the threads

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if self.path != "/v1/chat/completions" or body.get("temperature") != 0:
                self._reply(400, {"error": f"unexpected request to {self.path}"})
                return
            if REJECTED_WORD in json.dumps(body["messages"]):
                self._reply(400, {"error": "this prompt is rejected"})
                return
            with lock:
                text, tokens, finish = _greedy(model, tokenizer, body)
            choice = {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": text},
            }
            self._reply(
                200,
                {
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {"completion_tokens": tokens},
                },
            )

        def log_message(self, *args: Any) -> None:  # no access lines on stderr
            pass

    return Handler


@pytest.fixture(scope="module")
def server(tiny_folder: Path) -> Iterator[tuple[str, list[dict]]]:
    """(base URL on 127.0.0.1, the request bodies it received); stopped after the module."""
    model = load_target(tiny_folder, device=torch.device("cpu"))
    requests: list[dict] = []
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", 0), _handler(model, load_target_tokenizer(tiny_folder), requests)
    )
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def sharegpt_file(path: Path, n: int, *, rejected: int | None = None) -> Path:
    """n ShareGPT conversations (two with a second turn), one record a line."""
    lines = []
    for i in range(n):
        turns = [
            {"from": "human", "value": f"What is {i} plus 3?"},
            {"from": "gpt", "value": "an answer the target did not write"},
        ]
        if i % 3 == 1:
            turns += [{"from": "human", "value": "Spell the word cat."}]
        if i == rejected:
            turns[0]["value"] = f"Say the {REJECTED_WORD} word."
        lines.append(json.dumps({"id": f"r{i}", "conversations": turns}) + "\n")
    path.write_text("".join(lines))
    return path


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse errors (the old parser: an unknown option)
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def shards(output: Path) -> list[tuple[str, str]]:
    """(name, text) of the finished shard files, in order."""
    return [(p.name, p.read_text()) for p in sorted(output.glob("shard-*.jsonl"))]


def records(output: Path) -> list[dict]:
    return [json.loads(line) for _, text in shards(output) for line in text.splitlines()]


COMMON = ["--max-new-tokens", "6", "--records-per-shard", "2"]


def test_a_sharegpt_file_through_an_openai_server_equals_the_in_process_engine_token_for_token(
    server: tuple[str, list[dict]], tiny_folder: Path, tmp_path: Path, capsys
) -> None:
    url, requests = server
    source = sharegpt_file(tmp_path / "sharegpt.jsonl", 5)
    via_server = [
        "regenerate",
        "--input",
        str(source),
        "--output",
        str(tmp_path / "server"),
        "--server",
        url,
        "--concurrency",
        "3",
        *COMMON,
    ]
    code, out, err = cli(via_server, capsys)
    assert code == 0, out + err
    in_process = [
        "regenerate",
        "--input",
        str(source),
        "--output",
        str(tmp_path / "local"),
        "--target",
        str(tiny_folder),
        "--batch-size",
        "2",
        *COMMON,
    ]
    code, out, err = cli(in_process, capsys)
    assert code == 0, out + err
    assert shards(tmp_path / "server") == shards(tmp_path / "local")
    assert [p[0] for p in shards(tmp_path / "server")] == [f"shard-0000{i}.jsonl" for i in range(3)]
    got = records(tmp_path / "server")
    assert [r["id"] for r in got] == [f"r{i}" for i in range(5)]  # input order, keys kept
    assert [m["role"] for m in got[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert all("an answer the target did not write" not in json.dumps(r) for r in got)
    sent = requests[-1]  # the sampling settings go explicitly, thinking off by default
    assert (sent["model"], sent["temperature"], sent["max_tokens"]) == ("tiny", 0.0, 6)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}


def test_a_record_the_server_rejects_is_skipped_and_counted_or_fails_the_run_naming_it(
    server: tuple[str, list[dict]], tmp_path: Path, capsys
) -> None:
    url, _ = server
    source = sharegpt_file(tmp_path / "in.jsonl", 3, rejected=1)
    argv = ["regenerate", "--input", str(source), "--server", url, *COMMON]
    code, out, err = cli([*argv, "--output", str(tmp_path / "skip"), "--on-error", "skip"], capsys)
    assert code == 0, out + err
    assert [r["id"] for r in records(tmp_path / "skip")] == ["r0", "r2"]
    (done,) = [json.loads(line) for line in out.splitlines() if "regenerate_completed" in line]
    assert done["skipped"] == 1
    code, out, err = cli([*argv, "--output", str(tmp_path / "fail")], capsys)
    assert (code, len(err.splitlines())) == (2, 1), out + err
    assert err.startswith("error: ") and "in.jsonl:2" in err and "HTTP 400" in err


def test_shard_0_of_2_and_shard_1_of_2_together_equal_the_whole(
    server: tuple[str, list[dict]], tmp_path: Path, capsys
) -> None:
    url, _ = server
    source = sharegpt_file(tmp_path / "in.jsonl", 5)
    argv = ["regenerate", "--input", str(source), "--server", url, *COMMON]
    for name, extra in (("whole", []), ("a", ["--shard", "0/2"]), ("b", ["--shard", "1/2"])):
        code, out, err = cli([*argv, "--output", str(tmp_path / name), *extra], capsys)
        assert code == 0, out + err
    whole, a, b = (records(tmp_path / name) for name in ("whole", "a", "b"))
    assert [r["id"] for r in a] == ["r0", "r2", "r4"] and [r["id"] for r in b] == ["r1", "r3"]
    assert whole == [r for pair in zip(a, [*b, None], strict=True) for r in pair if r is not None]


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_async", *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for_event(process: subprocess.Popen[bytes], event: str) -> dict:
    """The first stdout event named `event` (the process keeps running); fails past a deadline."""
    assert process.stdout is not None
    fd, buffer, deadline = process.stdout.fileno(), b"", time.monotonic() + EVENT_DEADLINE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        chunk = os.read(fd, 1 << 16) if ready else b""
        if ready and not chunk:
            break  # it exited
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            if json.loads(line)["event"] == event:
                return json.loads(line)
    process.kill()
    pytest.fail(f"no {event} event; exit {process.wait()}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_run_killed_midway_and_run_again_gives_the_uninterrupted_output(
    tiny_folder: Path, tmp_path: Path, capsys, signum: int
) -> None:
    source = sharegpt_file(tmp_path / "in.jsonl", 12)
    argv = [
        "--input",
        str(source),
        "--target",
        str(tiny_folder),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "24",
        "--records-per-shard",
        "2",
    ]
    process = _start(["regenerate", *argv, "--output", str(tmp_path / "killed")], tmp_path)
    _wait_for_event(process, "regenerate_shard_written")
    process.send_signal(signum)
    process.communicate(timeout=EVENT_DEADLINE_S)
    assert process.returncode == (-9 if signum == signal.SIGKILL else 143)
    manifest = json.loads((tmp_path / "killed" / "regenerate.manifest").read_text())
    assert not manifest["progress"]["complete"]  # stopped midway, not after the end
    code, out, err = cli(["regenerate", *argv, "--output", str(tmp_path / "killed")], capsys)
    assert code == 0, out + err
    (started,) = [json.loads(line) for line in out.splitlines() if "regenerate_started" in line]
    assert started["resumed_at"] >= 2  # it went on from the records done, not from the start
    code, out, err = cli(["regenerate", *argv, "--output", str(tmp_path / "whole")], capsys)
    assert code == 0, out + err
    assert shards(tmp_path / "killed") == shards(tmp_path / "whole")
    assert len(records(tmp_path / "whole")) == 12
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir()
    )  # no partial or temporary file left


def _refused_cases(root: Path) -> dict[str, tuple[str, str, list[str]]]:
    """case -> (--input, --output, texts the error line names)."""
    folder = root / "corpus"
    folder.mkdir()  # OpenAI messages, which the old reader read too: it overwrote the input
    (folder / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    (root / "empty.jsonl").write_text("")
    return {
        "output_is_the_input": (
            str(folder / "a.jsonl"),
            str(folder / "a.jsonl"),
            ["--output", "the input"],
        ),
        "output_inside_the_input": (
            str(folder),
            str(folder / "out"),
            ["--output", "inside the input"],
        ),
        "empty_input": (
            str(root / "empty.jsonl"),
            str(root / "out"),
            ["empty.jsonl", "no records"],
        ),
    }


@pytest.mark.parametrize("case", ["output_is_the_input", "output_inside_the_input", "empty_input"])
def test_an_output_at_or_inside_the_input_or_an_empty_input_exits_2_with_one_line(
    case: str, tiny_folder: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, output, expected = _refused_cases(tmp_path)[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dflash_async.targets.loading.load_target", no_model)
    argv = [
        "regenerate",
        "--input",
        source,
        "--output",
        output,
        "--target",
        str(tiny_folder),
        "--max-new-tokens",
        "2",
    ]
    code, out, err = cli(argv, capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert all(text in lines[0] for text in expected), lines[0]
    assert {p: p.read_bytes() for p in before} == before  # the input is as it was


def test_an_interrupt_inside_an_add_leaves_the_last_flush_standing(tmp_path: Path) -> None:
    """A signal's KeyboardInterrupt between a record's count and its bytes: the flush after it
    (the command's `finally`) must not record the half-added record; the re-run redoes it."""
    from dflash_async.regen.shards import ShardWriter, read_progress

    identity = {"input_fingerprint": "x"}
    writer = ShardWriter(
        tmp_path,
        identity=identity,
        records_per_shard=10,
        progress=read_progress(tmp_path, identity),
    )
    writer.add({"n": 0})
    writer.flush()
    real_write = writer._partial.write

    def interrupted(data: bytes) -> int:
        raise KeyboardInterrupt

    writer._partial.write = interrupted
    with pytest.raises(KeyboardInterrupt):
        writer.add({"n": 1})  # counted, not written
    writer._partial.write = real_write
    writer.flush()  # the `finally`: a no-op now
    writer.close()
    resumed = ShardWriter(
        tmp_path,
        identity=identity,
        records_per_shard=10,
        progress=read_progress(tmp_path, identity),
    )
    assert resumed.done == 1  # record 1 is redone, not skipped
    resumed.add({"n": 1})
    resumed.finish()
    assert records(tmp_path) == [{"n": 0}, {"n": 1}]
