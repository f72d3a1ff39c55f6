"""The protocols: generation.proto (the public API), wire.proto (scheduler <-> worker) and the codec
of the wire's arrays; the *_pb2 modules come from `make proto`. Shared flags, env and logs:
protos/base/.
"""

# Version of the scheduler <-> worker wire format (WireMessage.version); both sides refuse a
# mismatch.
# 9: a hybrid's state pool (state_slots, its snapshots and their tiers); 8: KV tiers (kv_stores,
# kv_loads, kv_load_failed); 7: embeddings; 6: drafts verified in a step
# (num_draft, num_accepted); 5: masks may follow their plan (StepMask); 4: request controls; 3:
# overlap
WIRE_VERSION = 9
