"""`regenerate` on image+text records: through an OpenAI-compatible server (a stdlib stub here
that records what it receives and answers a fixed text), each local image goes as a base64 data
URL of the file's bytes, the output keeps the images as image_url parts with absolute paths and
the server's answers, and `run`'s reader reads the output back; the in-process engine refuses
image records (exit 2, naming file and line) before any model loads."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from image_text_kit import MULTIMODAL, data_url, image, write_image_data

from dflash_async.__main__ import main
from dflash_async.data.images import read_image_samples

pytestmark = pytest.mark.timeout(120)
ANSWER = "The answer is four. Let me think step by step about the question."


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict]]]:
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"object": "list", "data": [{"id": "vl", "object": "model"}]})

        def do_POST(self) -> None:
            requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            message = {"role": "assistant", "content": ANSWER}
            choice = {"index": 0, "finish_reason": "stop", "message": message}
            self._reply({"choices": [choice], "usage": {"completion_tokens": 12}})

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _input(folder: Path, inline: str = "") -> Path:
    """Three records: two OpenAI ones with relative paths, one ShareGPT one with an <image>
    placeholder and a data URL (`inline`)."""
    path = write_image_data(folder, records=2)
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "<image>What is two plus two?"},
            {"from": "gpt", "value": "not the target's answer"},
        ],
        "image": inline or data_url(image(9, (32, 32))),
    }
    with path.open("a") as f:
        f.write(json.dumps(sharegpt) + "\n")
    return path


def test_image_records_go_to_the_server_inline_and_come_back_readable(server, tmp_path, capsys):
    url, requests = server
    inline = data_url(image(9, (32, 32)))
    source = _input(tmp_path / "in", inline)
    out = tmp_path / "out"
    argv = ["regenerate", "--input", str(source), "--output", str(out), "--server", url]
    assert main([*argv, "--max-new-tokens", "16"]) == 0, capsys.readouterr()
    assert len(requests) == 3
    received = sorted(  # every image went as a data URL of its bytes (requests in any order)
        base64.b64decode(p["image_url"]["url"].partition("base64,")[2])
        for body in requests
        for p in body["messages"][0]["content"]
        if isinstance(p, dict) and p["type"] == "image_url"
    )
    files = [(tmp_path / "in" / "images" / f"{n}.png").read_bytes() for n in range(2)]
    assert received == sorted([*files, base64.b64decode(inline.partition("base64,")[2])])
    lines = [json.loads(x) for p in sorted(out.glob("shard-*.jsonl")) for x in p.open()]
    assert len(lines) == 3
    first = lines[0]["messages"]
    assert first[0]["content"][0]["image_url"]["url"] == str(tmp_path / "in" / "images" / "0.png")
    assert first[1] == {"role": "assistant", "content": ANSWER}
    assert lines[2]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/")
    processor = MULTIMODAL["qwen3_vl"].processor()
    samples, counts = read_image_samples(str(out), processor, max_len=512, block_size=2)
    assert len(samples) == 3 and counts["images"] == 3


def test_the_in_process_engine_refuses_image_records_before_loading(tmp_path, capsys):
    source = _input(tmp_path / "in")
    argv = ["regenerate", "--input", str(source), "--output", str(tmp_path / "out")]
    code = main([*argv, "--target", str(tmp_path / "no-model"), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl:1" in err and "through --server only" in err, err
