"""Benchmarks behind `python -m dflash_async bench`; never imported by the product."""
