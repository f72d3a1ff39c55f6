"""The CPU scheduler service: request state, KV block allocation, continuous batching, gRPC front
door.

Never imports torch: it decides everything about memory and ships plans to the workers.
"""
