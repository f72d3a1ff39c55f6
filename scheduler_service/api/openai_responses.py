"""The engine's deltas as OpenAI bodies: chat and text completions, logprobs, usage, errors."""

from __future__ import annotations

import json
import time

from scheduler_service.api import tool_calls
from scheduler_service.api.openai_requests import ToolMode
from scheduler_service.api.reasoning import PLAIN, AnswerFormat, Reader
from scheduler_service.core.sequence import FinishReason
from scheduler_service.text.output import Delta, TokenLogprob
from scheduler_service.text.tokenizer import TokenTable

FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "abort",
    None: None,
}


# breaks JSON leaves raw, where splitlines (httpx's aiter_lines) would cut an SSE event in two
_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(body: dict) -> bytes:
    """One line of JSON for a body or an SSE event: UTF-8, every line break escaped."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).translate(_BREAKS).encode()


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class TokenText(TokenTable):
    """Logprobs in OpenAI's two shapes, with each token's text and bytes."""

    def chat_entry(self, token: int, logprob: float) -> dict:
        raw = self.bytes(token)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(raw),
        }

    def chat_logprobs(self, items: list[TokenLogprob]) -> dict:
        return {
            "content": [
                {
                    **self.chat_entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self.chat_entry(t, v) for t, v in lp.top],
                }
                for lp in items
            ]
        }

    def completion_logprobs(self, items: list[TokenLogprob], offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items:
            text = self.text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.text(t): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


def usage_body(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Sample:
    """One choice, gathered from its deltas."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs")

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        self.prompt_logprobs: list[TokenLogprob] | None = None  # its request's, where asked

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def chat_message(
    sample: Sample, mode: ToolMode, fmt: AnswerFormat = PLAIN
) -> tuple[dict, str | None]:
    """The message and finish reason: reasoning into reasoning_content, tool calls parsed by mode
    (a harmony answer's from its commentary channel).
    """
    split = fmt.split(sample.text)
    if split.calls is None:
        message, finish = _answer(sample, split.content, mode)
    else:
        calls = [tool_calls.call(name, arguments) for name, arguments in split.calls]
        message = {"role": "assistant", "content": split.content or (None if calls else "")}
        finish = FINISH[sample.finish_reason]
        if calls:
            message["tool_calls"], finish = calls, "tool_calls"
    if fmt.reasons:
        message["reasoning_content"] = split.reasoning
    return message, finish


def _answer(sample: Sample, text: str, mode: ToolMode) -> tuple[dict, str | None]:
    finish = FINISH[sample.finish_reason]
    calls = None
    if mode.kind == "required":
        calls = tool_calls.parse_required(text)
        finish = "tool_calls" if calls else finish
    elif mode.kind == "named":
        calls = tool_calls.parse_named(mode.name, text)
    elif mode.parse_auto:
        parsed = tool_calls.parse_auto(text)
        if parsed.calls:
            text, calls, finish = parsed.content, parsed.calls, "tool_calls"
    if calls:
        return {
            "role": "assistant",
            "content": text if mode.kind == "auto" else None,
            "tool_calls": calls,
        }, finish
    if mode.kind in ("required", "named"):
        return {"role": "assistant", "content": None}, finish
    return {"role": "assistant", "content": text}, finish


def chat_completion(
    request_id: str,
    model: str,
    samples: dict[int, Sample],
    mode: ToolMode,
    usage: dict,
    token_text: TokenText | None,
    fmt: AnswerFormat = PLAIN,
) -> dict:
    choices = []
    for index in sorted(samples):
        s = samples[index]
        message, finish = chat_message(s, mode, fmt)
        logprobs = token_text.chat_logprobs(s.logprobs) if token_text is not None else None
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


class ChatStream:
    """Streamed chat chunks: reasoning, then content; a forced tool call is held to the end."""

    def __init__(
        self,
        request_id: str,
        model: str,
        mode: ToolMode,
        token_text: TokenText | None,
        usage_each_chunk: bool,
        fmt: AnswerFormat = PLAIN,
    ) -> None:
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.mode = mode
        self.token_text = token_text
        self.usage_each_chunk = usage_each_chunk
        self.format = fmt
        self.samples: dict[int, Sample] = {}
        self.readers: dict[int, Reader] = {}
        # characters of each sample's content, and of its reasoning, already sent
        self.sent: dict[int, int] = {}
        self.sent_reasoning: dict[int, int] = {}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = {**self.head, "choices": choices}
        if usage is not None or self.usage_each_chunk:
            body["usage"] = usage
        return b"data: " + dumps(body) + b"\n\n"

    def opening(self, n: int) -> bytes:
        first = {"role": "assistant", "content": ""}
        return b"".join(
            self.chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}])
            for i in range(n)
        )

    def delta(self, d: Delta, usage: dict | None) -> bytes | None:
        s = self.samples.setdefault(d.index, Sample())
        s.add(d)
        logprobs = (
            self.token_text.chat_logprobs(d.logprobs) if self.token_text and d.logprobs else None
        )
        if d.finish_reason is not None:
            return self._last(d.index, s, logprobs, usage)
        reasoning, rest = self.readers.setdefault(d.index, self.format.reader()).add(d.text)
        delta = {}
        if reasoning := self._unsent(self.sent_reasoning, d.index, reasoning):
            delta["reasoning_content"] = reasoning
        if content := self._streamable(d.index, rest):
            delta["content"] = content
        if not delta and logprobs is None:
            return None
        return self.chunk(
            [{"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
            usage,
        )

    @staticmethod
    def _unsent(sent: dict[int, int], index: int, text: str) -> str:
        start = sent.get(index, 0)
        sent[index] = max(start, len(text))
        return text[start:]

    def _streamable(self, index: int, text: str | None) -> str:
        """Content past any reasoning that can go out now (text None: not yet known)."""
        if text is None or self.mode.kind in ("required", "named"):
            return ""
        end = len(text)
        if self.mode.parse_auto:
            opened = text.find(tool_calls.TOOL_CALL_OPEN)
            end = opened if opened >= 0 else end - tool_calls.held_back(text)
        return self._unsent(self.sent, index, text[:end])

    def _last(self, index: int, s: Sample, logprobs: dict | None, usage: dict | None) -> bytes:
        message, finish = chat_message(s, self.mode, self.format)
        delta: dict = {}
        reasoning = self._unsent(self.sent_reasoning, index, message.get("reasoning_content") or "")
        if reasoning:
            delta["reasoning_content"] = reasoning
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
            rest = message["content"] or ""  # beside calls: auto's or harmony's content
            if len(rest) > (sent := self.sent.get(index, 0)):
                delta["content"] = rest[sent:]
        elif message["content"] is not None:
            delta["content"] = message["content"][self.sent.get(index, 0) :]
        return self.chunk(
            [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], usage
        )

    def closing(self, usage: dict | None) -> bytes:
        """The usage chunk (include_usage), then [DONE]."""
        tail = (
            b"data: " + dumps({**self.head, "choices": [], "usage": usage}) + b"\n\n"
            if usage
            else b""
        )
        return tail + b"data: [DONE]\n\n"


def prompt_logprobs_body(table: TokenTable, items: list[TokenLogprob] | None) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then {logprob, rank, decoded_token}."""
    if items is None:
        return None
    body: list = [None]
    for lp in items:
        ranks = {t: i + 1 for i, (t, _) in enumerate(lp.top)}
        entry = {
            str(lp.token_id): {
                "logprob": lp.logprob,
                "rank": ranks.get(lp.token_id),
                "decoded_token": table.text(lp.token_id),
            }
        }
        for t, v in lp.top:
            entry.setdefault(
                str(t), {"logprob": v, "rank": ranks[t], "decoded_token": table.text(t)}
            )
        body.append(entry)
    return body


class CompletionShape:
    """A completion's choices, whole or streamed, with logprobs as vLLM gives them."""

    def __init__(
        self,
        request_id: str,
        model: str,
        n: int,
        echoes: list[str | None],
        token_text: TokenText | None,
        table: TokenText,
        prompts: list[list[int]],
        prompt_logprobs: int | None,
    ) -> None:
        self.id, self.model, self.n = request_id, model, n
        self.echoes, self.token_text, self.table = echoes, token_text, table
        self.prompts, self.wants_prompt = prompts, prompt_logprobs is not None
        self.head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self.offsets: dict[int, int] = {}  # characters of each choice's text sent so far
        self.prompt_lps: dict[int, list[TokenLogprob]] = {}  # each request's, from its first delta

    def _echo_logprobs(self, i: int, items: list[TokenLogprob] | None) -> dict:
        """The echoed prompt's tokens in completion logprobs' shape (the first has no logprob)."""
        ids = self.prompts[i]
        first = self.table.text(ids[0]) if ids else ""
        body = {
            "tokens": [first],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [0],
        }
        rest = self.table.completion_logprobs(items or [], len(first))
        for key in body:
            body[key] += rest[key]
        return body

    def _logprobs(self, i: int, items: list[TokenLogprob], first: bool, offset: int) -> dict | None:
        if self.token_text is None:
            return None
        own = self.token_text.completion_logprobs(items, offset)
        if not (first and self.echoes[i] is not None):
            return own
        echoed = self._echo_logprobs(i, self.prompt_lps.get(i))
        return {key: echoed[key] + own[key] for key in own}

    def choice(self, index: int, sample: Sample) -> dict:
        i = index // self.n
        if sample.prompt_logprobs is not None:
            self.prompt_lps[i] = sample.prompt_logprobs
        echo = self.echoes[i] or ""
        body = {
            "index": index,
            "text": echo + sample.text,
            "logprobs": self._logprobs(i, sample.logprobs, True, len(echo)),
            "finish_reason": FINISH[sample.finish_reason],
        }
        if self.wants_prompt:
            body["prompt_logprobs"] = prompt_logprobs_body(self.table, self.prompt_lps.get(i))
        return body

    def whole(self, samples: dict[int, Sample], usage: dict) -> dict:
        choices = [self.choice(k, samples[k]) for k in sorted(samples)]
        return {**self.head, "choices": choices, "usage": usage}

    def event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {**self.head, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + dumps(payload) + b"\n\n"

    def delta(self, i: int, delta: Delta, usage: dict | None) -> bytes | None:
        """The chunk for request i's delta, or None where it carries nothing to say."""
        if delta.prompt_logprobs is not None:
            self.prompt_lps[i] = delta.prompt_logprobs
        index = i * self.n + delta.index
        first = index not in self.offsets
        text = (self.echoes[i] or "") + delta.text if first else delta.text
        offset = self.offsets.get(index, 0)
        logprobs = (
            self._logprobs(i, delta.logprobs or [], first, offset + len(text) - len(delta.text))
            if self.token_text is not None
            and (delta.logprobs or (first and self.echoes[i] is not None))
            else None
        )
        self.offsets[index] = offset + len(text)
        if not (text or logprobs or delta.finish_reason is not None):
            return None
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": FINISH[delta.finish_reason],
        }
        if first and self.wants_prompt:
            choice["prompt_logprobs"] = prompt_logprobs_body(self.table, self.prompt_lps.get(i))
        return self.event([choice], usage)
