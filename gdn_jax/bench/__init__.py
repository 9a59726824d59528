"""Benchmarks: one module per benchmark (`python -m gdn_jax bench <name>`); helpers in `common`."""
