"""Trace replay: traces, workload generators, the store replayed metadata-only, OPT."""
