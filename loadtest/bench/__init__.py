"""Benchmarks: ``python -m loadtest.bench NAME [options]``; ``--help`` lists them."""
