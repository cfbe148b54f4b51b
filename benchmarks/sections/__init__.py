"""One module per section of ``docs/benchmarks.md``: ``run(quick)`` launches its ranks and writes the section."""
