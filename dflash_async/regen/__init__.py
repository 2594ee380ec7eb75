"""`python -m dflash_async regenerate`: the target rewrites the assistant turns of a corpus.

corpus.py reads the input (through data/formats.py, the reader `run` uses) and splits it across
machines; engines.py answers conversations (an OpenAI-compatible server, or the target in process
through eval/regenerate.py); shards.py streams the answers into resumable shard files; command.py
ties them together for the CLI.
"""
