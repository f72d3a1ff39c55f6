"""LoRA adapters loaded, unloaded and listed while serving, for gRPC and HTTP alike; the workers
read an adapter's weights when a step first names it.
"""

from __future__ import annotations

import asyncio

from protos import generation_pb2
from scheduler_service.core.adapters import Adapter, AdapterError
from scheduler_service.runtime.engine import Engine


class AdapterExists(AdapterError):
    """A load under a name in use, without replace."""


class AdapterNotFound(AdapterError):
    """An unload of a name that is not loaded."""


def lora_slots(engine: Engine) -> int:
    """Adapters every connected worker holds at once; 0 where none or LoRA is off."""
    slots = [w.handshake.lora_slots for g in engine.client.groups for w in g.workers.values()]
    return min(slots, default=0)


async def load_adapter(engine: Engine, name: str, path: str, replace: bool = False) -> Adapter:
    """Read and checked off the event loop; AdapterError if it cannot be served."""
    registry = engine.adapters
    if registry is None:
        raise AdapterError(
            "this model cannot take LoRA adapters (its config.json does not give the "
            "projections' shapes)"
        )
    if lora_slots(engine) < 1:
        raise AdapterError(
            "the workers keep no LoRA adapters: start them with --max-cpu-loras N (pagedserve "
            "serve gives them one slot per adapter --lora-modules names)"
        )
    if not name or not path:
        raise AdapterError("a LoRA adapter needs a name and a path")
    if name in registry.adapters and not replace:
        raise AdapterExists(
            f"a LoRA adapter named {name!r} is loaded already (replace it with replace=true)"
        )
    return await asyncio.to_thread(registry.load, name, path, replace)


def unload_adapter(engine: Engine, name: str) -> int:
    """New requests can no longer name it -> how many running ones finish on it."""
    registry = engine.adapters
    if registry is None or name not in registry.adapters:
        have = ", ".join(sorted(registry.adapters)) if registry else ""
        raise AdapterNotFound(
            f"no LoRA adapter named {name!r} is loaded (loaded: {have or 'none'})"
        )
    adapter = registry.unload(name)
    return sum(1 for s in engine.streams.values() if s.request.lora is adapter)


def loaded(engine: Engine) -> list[Adapter]:
    return (
        sorted(engine.adapters.adapters.values(), key=lambda a: a.name) if engine.adapters else []
    )


def adapter_message(a: Adapter) -> generation_pb2.LoraAdapter:
    return generation_pb2.LoraAdapter(
        name=a.name, path=a.path, rank=a.rank, target_modules=a.target_modules, identity=a.identity
    )
