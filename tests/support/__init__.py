"""What the tests and the benchmarks share, and no product module imports: a server in a child
process, the simulated worker, tiny random models, paged attention cases.
"""
