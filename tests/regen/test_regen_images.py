"""`regenerate` on image+text records: through an OpenAI-compatible server (a stdlib stub here
that records what it receives and answers a fixed text), each local image goes as a base64 data
URL of the file's bytes, the output keeps the images as image_url parts with absolute paths and
the server's answers, and `run`'s reader reads the output back. In process (`--target`) the
wrapper loads whole with its processor and every answer, image records and text ones in one input,
equals HF's own `generate` of that prompt alone (the mutant: vision inputs dropped on the way to
the model must change an answer); a target without an image processor, or an image file that is
missing, is exit 2 before any weights load."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from image_text_kit import MULTIMODAL, data_url, image, tiny_multimodal, write_image_data

from dflash_async.__main__ import main
from dflash_async.data.images import (
    ImageTextSample,
    encode_rendered_prompt,
    image_conversation,
    load_image,
    processor_template,
    read_image_samples,
)
from dflash_async.eval.regenerate import answers, generation_config, render_prompt
from dflash_async.targets import multimodal
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_intra_op_thread")]
MAX_NEW = 12
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


def _in_process(folder: Path, source: Path, out: Path, capsys) -> list[dict]:
    argv = ["regenerate", "--input", str(source), "--output", str(out), "--target", str(folder)]
    argv += ["--max-new-tokens", str(MAX_NEW), "--device", "cpu"]
    assert main(argv) == 0, capsys.readouterr()
    return [json.loads(x) for p in sorted(out.glob("shard-*.jsonl")) for x in p.open()]


def _reference_answer(model, processor, record: dict) -> str:
    """HF's own greedy `generate` of the wrapper on one record's prompt alone (no batching,
    no static cache, no pool), decoded as `regenerate` decodes. An image prompt renders with
    the processor's chat template, a text one with the tokenizer's (as the text path does)."""
    messages, sources = image_conversation({"messages": record["messages"][:-1]}, root=None)
    template = {"chat_template": processor_template(processor)} if sources else {}
    # regenerate's default: --no-enable-thinking
    text = render_prompt(processor.tokenizer, messages, {**template, "enable_thinking": False})
    prompt = encode_rendered_prompt(processor, text, [load_image(s, None) for s in sources])
    config = generation_config(
        model, processor.tokenizer, max_new_tokens=MAX_NEW, greedy=True, temperature=1.0
    )
    ids = torch.as_tensor(prompt.input_ids, dtype=torch.long)[None]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            **prompt.model_inputs(torch.device("cpu"), torch.float32),
        )
    return answers(out[:, ids.shape[1] :].tolist(), processor.tokenizer, config)[0][0]


@pytest.mark.parametrize("model_type", sorted(MULTIMODAL))
def test_in_process_answers_equal_hf_generate_of_each_prompt_alone(
    model_type, tmp_path, capsys, monkeypatch
):
    processor, model = tiny_multimodal(model_type)
    model.save_pretrained(tmp_path / "target")
    processor.tokenizer.save_pretrained(tmp_path / "target")
    # the in-memory processor (Qwen3-VL's AutoProcessor needs torchvision, absent here)
    monkeypatch.setattr(multimodal, "load_target_processor", lambda path: processor)
    source = _input(tmp_path / "in")
    with source.open("a") as f:  # a text record among the image ones
        f.write(json.dumps({"messages": [{"role": "user", "content": "Hello there!"}]}) + "\n")
    lines = _in_process(tmp_path / "target", source, tmp_path / "out", capsys)
    assert len(lines) == 4
    truth = [_reference_answer(model, processor, line) for line in lines]
    assert [line["messages"][-1]["content"] for line in lines] == truth
    assert lines[0]["messages"][0]["content"][0]["image_url"]["url"].endswith("0.png")
    samples, counts = read_image_samples(
        str(tmp_path / "out"), processor, max_len=512, block_size=2
    )
    assert len(samples) == 4 and counts["images"] == 3

    # the mutant: the pixels never reach the model; some image record's answer must change
    original = ImageTextSample.model_inputs

    def without_pixels(self, device, dtype):
        return {k: v for k, v in original(self, device, dtype).items() if "pixel" not in k}

    monkeypatch.setattr(ImageTextSample, "model_inputs", without_pixels)
    mutant = _in_process(tmp_path / "target", source, tmp_path / "mutant", capsys)
    assert [line["messages"][-1]["content"] for line in mutant[:3]] != truth[:3]


def test_in_process_a_target_without_an_image_processor_is_exit_2_before_loading(tmp_path, capsys):
    source = _input(tmp_path / "in")
    folder = ensure_tiny_target(tmp_path / "tiny")  # a text model: its tokenizer, no processor
    argv = ["regenerate", "--input", str(source), "--output", str(tmp_path / "out")]
    code = main([*argv, "--target", str(folder), "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "no image processor" in err, err


def test_a_missing_image_file_is_exit_2_naming_file_and_line_before_loading(tmp_path, capsys):
    source = _input(tmp_path / "in")
    (tmp_path / "in" / "images" / "1.png").unlink()
    argv = ["regenerate", "--input", str(source), "--output", str(tmp_path / "out")]
    code = main([*argv, "--target", str(tmp_path / "no-model"), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl:2" in err and "1.png" in err, err


def test_in_process_an_unreadable_image_is_exit_2_naming_its_record(tmp_path, capsys, monkeypatch):
    processor, model = tiny_multimodal("qwen3_vl")
    model.save_pretrained(tmp_path / "target")
    processor.tokenizer.save_pretrained(tmp_path / "target")
    monkeypatch.setattr(multimodal, "load_target_processor", lambda path: processor)
    source = _input(tmp_path / "in")
    (tmp_path / "in" / "images" / "1.png").write_bytes(b"not a png")
    argv = ["regenerate", "--input", str(source), "--output", str(tmp_path / "out")]
    argv += ["--target", str(tmp_path / "target"), "--max-new-tokens", "4", "--device", "cpu"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl:2" in err and "not a readable image" in err, err
