"""The HTTP surface as a table of operations: each becomes a Starlette route and a path of the
OpenAPI 3.1 document served at /openapi.json, whose request bodies are the JSON Schemas of the very
pydantic models the routes validate with (so the document cannot drift from what is enforced).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

REF = "#/components/schemas/{model}"
JSON_OBJECT = {"type": "object"}

# what each kind of operation answers with 200
_ANSWERS = {
    "json": {"application/json": {"schema": JSON_OBJECT}},
    # JSON, or server-sent events where the body asks `stream: true`
    "stream": {
        "application/json": {"schema": JSON_OBJECT},
        "text/event-stream": {"schema": {"type": "string"}},
    },
    "text": {"text/plain": {"schema": {"type": "string"}}},
    "metrics": {"text/plain": {"schema": {"type": "string"}}},
}

_ERROR = {
    "type": "object",
    "description": "OpenAI's error shape (Anthropic's, `{type: error, error}`, on /v1/messages)",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        },
        "type": {"type": "string"},
    },
    "required": ["error"],
}

# the statuses a client's request can be answered with besides 200
_REFUSALS = {
    "400": "the body or a parameter is wrong: the message names the field",
    "401": "the API key is missing or wrong",
    "404": "no such model, adapter or stored response",
    "413": "the body is over the size limit",
    "429": "the queue is full",
    "503": "starting, draining, or no worker",
}


@dataclass(frozen=True)
class Operation:
    """One HTTP operation: its route, the model its JSON body is validated with, what it answers."""

    path: str  # Starlette's form: /v1/models/{model:path}
    method: str
    endpoint: Callable
    summary: str
    body: type[BaseModel] | None = None
    answers: str = "json"  # a key of _ANSWERS

    def route(self) -> Route:
        return Route(self.path, self.endpoint, methods=[self.method])


_PARAM = re.compile(r"\{([a-z_]+)(?::[a-z]+)?\}")


def document(operations: list[Operation], title: str, version: str, keyed: bool) -> dict:
    """The OpenAPI 3.1 document of `operations` (a bearer key required everywhere when `keyed`)."""
    models = sorted({op.body for op in operations if op.body}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = _ERROR
    paths: dict[str, dict] = {}
    for op in operations:
        path = _PARAM.sub(r"{\1}", op.path)
        entry: dict = {
            "operationId": f"{op.method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}",
            "summary": op.summary,
            "responses": {
                "200": {"description": "the answer", "content": _ANSWERS[op.answers]},
                **{
                    code: {
                        "description": why,
                        "content": {
                            "application/json": {"schema": {"$ref": REF.format(model="Error")}}
                        },
                    }
                    for code, why in _REFUSALS.items()
                },
            },
        }
        names = _PARAM.findall(op.path)
        if names:
            entry["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                for n in names
            ]
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
            }
        paths.setdefault(path, {})[op.method.lower()] = entry
    spec = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if keyed:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec
