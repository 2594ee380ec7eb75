"""The thin benchmarks behind `python -m dflash_async bench drafter|target|data|packing`, over
the product's builders; never imported by the product. Research variants: benchmarks/research/."""
