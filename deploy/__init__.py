"""Launcher, client, model preparation and benchmarks for pagedserve."""
