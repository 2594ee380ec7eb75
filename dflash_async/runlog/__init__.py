"""A run's record and its report: the run folder (log.jsonl, settings.json, run_summary) read back
into curves, a summary table and a self-contained HTML page (`python -m dflash_async report`)."""
