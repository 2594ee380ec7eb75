"""`bench data`'s cached-reload measurement runs against the cache as load_samples writes it."""

from __future__ import annotations

from dflash_async.bench.data_bench import bench_cached_reload


def test_the_cached_reload_bench_reads_back_the_entry_it_wrote():
    figures = bench_cached_reload(1000)
    assert figures["samples"] == 1000 and figures["tokens"] > 0
