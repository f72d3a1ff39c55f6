"""The protocols: generation.proto (the public API), wire.proto (scheduler <-> worker) and the codec
of the wire's arrays; the *_pb2 modules come from `make proto`. Shared flags, env and logs:
protos/base/.
"""

# Scheduler <-> worker wire version; both sides refuse a mismatch. 9: state pools; 8: KV tiers; 7:
# embeddings; 6: drafts; 5: masks after their plan; 4: controls; 3: overlap.
WIRE_VERSION = 9
