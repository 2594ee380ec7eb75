"""Builds the real-ShareGPT first-load benchmark's inputs (BENCHMARKS.md, data path) from two
fetched snapshots; nothing is downloaded here and nothing it writes is committed.

- DATA_DIR: `sampled_enriched_data/` of Marugannwg/ShareGPT92k_user_linguistic_mining (8186064):
  its 1,000 `<id>_<n>.json` conversations (metadata files skipped), `id` and `conversations`
  (`from`/`value`) kept, in file-name order, written `--copies` times into OUT/sharegpt5000.jsonl.
- TIKTOKEN: `qwen.tiktoken` of x1ngzai/Qwen-VL-Chat-Int4 (1cd721a, 151,643 ranks), made a
  Qwen2/Qwen3 tokenizer.json (NFC, Qwen2's split regex, byte-level, the merges rank order gives,
  Qwen3's 26 added tokens) with tests/fixtures' Qwen3 chat template and a Qwen3 config.json in
  OUT/qwen3tok/.

    python benchmarks/build_sharegpt_bench.py DATA_DIR TIKTOKEN OUT
"""

from __future__ import annotations

import argparse
import base64
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens from id 151643 on: (content, special)
QWEN3_ADDED = [
    *[
        (f"<|{name}|>", True)
        for name in (
            "endoftext",
            "im_start",
            "im_end",
            "object_ref_start",
            "object_ref_end",
            "box_start",
            "box_end",
            "quad_start",
            "quad_end",
            "vision_start",
            "vision_end",
            "vision_pad",
            "image_pad",
            "video_pad",
        )
    ],
    ("<tool_call>", False),
    ("</tool_call>", False),
    *[
        (f"<|{name}|>", True)
        for name in ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad", "repo_name", "file_sep")
    ],
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "initializer_range": 0.02,
}


def write_data(data_dir: Path, out: Path, copies: int) -> int:
    records = []
    for path in sorted(data_dir.glob("*.json")):
        if not re.fullmatch(r".+_\d+\.json", path.name):
            continue  # sampling_metadata.json, encoding_progress.json
        record = json.loads(path.read_text(encoding="utf-8"))
        turns = [{"from": t["from"], "value": t["value"]} for t in record["conversations"]]
        records.append(json.dumps({"id": record["id"], "conversations": turns}))
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.writelines(line + "\n" for line in records)
    return len(records)


def byte_encoder() -> dict[int, str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def rank_bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """tiktoken's merge loop on `token` with ranks lower than `below` only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, at = below, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], below)
            if rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def write_tokenizer(tiktoken_file: Path, out: Path) -> None:
    ranks = {}
    for line in tiktoken_file.read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    chars = byte_encoder()
    text = {token: "".join(chars[b] for b in token) for token in ranks}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = rank_bpe(token, ranks, rank)
            assert len(parts) == 2, (token, parts)
            merges.append([text[parts[0]], text[parts[1]]])
    added = [
        {
            "id": len(ranks) + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED)
    ]
    level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **level},
            ],
        },
        "post_processor": {"type": "ByteLevel", **level},
        "decoder": {"type": "ByteLevel", **level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text[t]: r for t, r in ranks.items()},
            "merges": merges,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    Tokenizer.from_str(json.dumps(spec)).save(str(out / "tokenizer.json"))  # HF's layout
    template = (REPO / "tests/fixtures/qwen3_chat_template.jinja").read_text()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 131072,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "chat_template": template,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=2))
    print(f"{len(ranks)} ranks, {len(merges)} merges, {len(added)} added tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("tiktoken", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--copies", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    count = write_data(args.data_dir, args.out / "sharegpt5000.jsonl", args.copies)
    print(f"{count} conversations x {args.copies}")
    write_tokenizer(args.tiktoken, args.out / "qwen3tok")


if __name__ == "__main__":
    main()
