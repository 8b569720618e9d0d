"""Benchmarks of the server and its engine (not imported by the serving path)."""
