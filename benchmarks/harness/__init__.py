"""The benchmark harness: starting one process per rank, timing across them, the measured model and data, the
measurement the speed and memory sections share, and turning numbers into medians and markdown."""
