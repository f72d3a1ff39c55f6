"""The servers a load test drives: pagedserve over gRPC, any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import grpc

from protos import generation_pb2, generation_pb2_grpc


class TargetError(Exception):
    """A refused or failed request; str() is the gRPC code name or HTTP_<code>."""


class GrpcTarget:
    """pagedserve.v1 over gRPC: streams, cache accounting, leak check."""

    def __init__(self, channel) -> None:
        self.stub = generation_pb2_grpc.GenerationStub(channel)

    async def info(self) -> tuple[str, int]:
        info = await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=60)
        return info.model_name, info.vocab_size

    async def stream(self, item, index: int, s):
        """Yields (new output tokens, prompt tokens or None, timed)
        per message that carries tokens.
        """
        if s.endpoint == "embeddings":
            yield 0, await self._embed(item, s), True
            return
        sampling = generation_pb2.SamplingParams(
            max_tokens=item.output_len,
            temperature=s.temperature,
            seed=s.seed + index,
            ignore_eos=s.ignore_eos,
        )
        req = generation_pb2.GenerateRequest(sampling=sampling)
        if item.prompt_token_ids is not None:
            req.prompt_token_ids.extend(item.prompt_token_ids)
        else:
            req.prompt = item.prompt
        call = self.stub.GenerateStream(req, timeout=s.timeout)
        try:
            async for msg in call:
                prompt_tokens = msg.usage.prompt_tokens if msg.HasField("usage") else None
                if msg.token_ids or prompt_tokens is not None:
                    yield len(msg.token_ids), prompt_tokens, bool(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            raise TargetError(e.code().name) from e
        finally:
            call.cancel()

    async def _embed(self, item, s) -> int:
        req = generation_pb2.EmbedRequest()
        if item.prompt_token_ids is not None:
            req.inputs.add().ids.extend(item.prompt_token_ids)
        else:
            req.texts.append(item.prompt)
        try:
            resp = await self.stub.Embed(req, timeout=s.timeout)
        except grpc.aio.AioRpcError as e:
            raise TargetError(e.code().name) from e
        return resp.usage.prompt_tokens

    async def cache_stats(self) -> dict | None:
        try:
            st = await self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return None
        return dict(
            utilization=st.utilization,
            preemptions=st.num_preemptions,
            prefix_hits=st.prefix_cache_hits,
            prefix_queries=st.prefix_cache_queries,
            running=st.num_running,
            waiting=st.num_waiting,
        )

    async def leaked_blocks(self, timeout: float = 30.0) -> int | None:
        """Once the server is idle: blocks neither free nor cached (0 unless blocks leaked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = await self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return None
            if st.num_running == 0 and st.num_waiting == 0:
                return st.num_blocks - st.num_free_blocks - st.num_cached_blocks
            await asyncio.sleep(0.2)
        return None


class OpenAITarget:
    """An OpenAI-compatible HTTP server (streamed /v1/completions); output tokens from the final
    usage where sent.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None,
        vocab_size: int,
        api_key: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        import httpx

        if tokenizer:
            from scheduler_service.text.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(tokenizer)
            vocab_size = min(vocab_size, self.tokenizer.vocab_size)
        else:
            self.tokenizer = None
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.vocab_size = vocab_size
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=30.0),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )

    async def info(self) -> tuple[str, int]:
        if self.model is None:
            resp = await self.http.get(f"{self.base_url}/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.model, self.vocab_size

    async def stream(self, item, index: int, s):
        prompt = item.prompt
        if item.prompt_token_ids is not None:
            prompt = (
                self.tokenizer.decode(item.prompt_token_ids)
                if self.tokenizer
                else item.prompt_token_ids
            )
        if s.endpoint == "embeddings":  # one call, one vector: the whole call is its latency
            resp = await self.http.post(
                f"{self.base_url}/v1/embeddings", json={"model": self.model, "input": [prompt]}
            )
            if resp.status_code != 200:
                raise TargetError(f"HTTP_{resp.status_code}")
            yield 0, (resp.json().get("usage") or {}).get("prompt_tokens"), True
            return
        body = {
            "model": self.model,
            "max_tokens": item.output_len,
            "temperature": s.temperature,
            "seed": s.seed + index,
            "stream": True,
            "stream_options": {"include_usage": True},
            "prompt": prompt,
        }
        if s.ignore_eos:
            body["ignore_eos"] = True
        counted = 0
        async with self.http.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise TargetError(f"HTTP_{resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise TargetError("STREAM_ERROR")
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    counted += 1
                    yield 1, None, True
                usage = chunk.get("usage")
                if usage:
                    yield (
                        max(0, usage.get("completion_tokens", counted) - counted),
                        usage.get("prompt_tokens"),
                        False,
                    )

    async def cache_stats(self) -> dict | None:
        return None

    async def leaked_blocks(self) -> int | None:
        return None

    async def close(self) -> None:
        await self.http.aclose()
