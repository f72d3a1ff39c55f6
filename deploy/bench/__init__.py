"""The benchmarks (`make bench-*`), run by hand; what they share is harness.py."""
