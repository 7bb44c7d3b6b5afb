"""Benchmarks of tiered_kv: programs that print a table and write JSON, each next to its same-run baseline."""
