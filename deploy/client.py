"""The commands that talk to a running server over gRPC: generate, chat, info, embed, stats, top,
abort. Each failure is one line (a gRPC status said plainly), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

DEFAULT_SERVER = "127.0.0.1:50051"


SERVER_ENV = "PAGEDSERVE_SERVER"


def rpc_failure(e: grpc.RpcError, server: str) -> str:
    """A failed call in one line, with what to do where plain."""
    code, details = e.code(), e.details() or ""
    lowered = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and any(s in lowered for s in NOTHING_LISTENS):
        return (
            f"no pagedserve server answers at {server}: start one (`make run`, or `pagedserve "
            f"serve --model MODEL`), or point --server or ${SERVER_ENV} at a running one"
        )
    # a TLS port spoken to in plain
    if code == grpc.StatusCode.UNAVAILABLE and "socket closed" in lowered:
        return f"UNAVAILABLE: {details} (a server with TLS? --tls-ca CERT)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {server} within the timeout (--timeout SECONDS)"
    return f"{code.name}: {details}"


# what gRPC says where nothing listens at the address, or the address leads nowhere
NOTHING_LISTENS = (
    "connection refused",
    "dns resolution failed",
    "name resolution",
    "no route to host",
    "network is unreachable",
)


def stub_for(server: str, tls_ca: str | None = None, api_key: str | None = None):
    from deploy.processes import channel_to
    from protos import generation_pb2_grpc

    certificates = None
    if tls_ca:
        with open(tls_ca, "rb") as f:
            certificates = f.read()
    return generation_pb2_grpc.GenerationStub(channel_to(server, api_key, certificates))


def text_or_file(value: str) -> str:
    """argparse type: the text, or with a leading @ that file's text."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(
            f"cannot read {value[1:]}: {getattr(e, 'strerror', None) or e}"
        ) from None


def logit_bias(item: str) -> tuple[int, float]:
    """An argparse type: TOKEN_ID=BIAS."""
    token, sep, bias = item.partition("=")
    try:
        pair = int(token), float(bias)
    except ValueError:
        pair = None
    if not sep or pair is None or pair[0] < 0:
        raise argparse.ArgumentTypeError(
            f"wants TOKEN_ID=BIAS (a token id and a number), got {item!r}"
        )
    return pair


def sampling_from_args(args: argparse.Namespace):
    from protos import generation_pb2

    temperature = 0.0 if args.greedy else args.temperature
    sampling = generation_pb2.SamplingParams(
        temperature=temperature,
        top_k=args.top_k,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        n=args.n,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        json_schema=args.json_schema or "",
        regex=args.regex or "",
        grammar=args.grammar or "",
    )
    if args.top_p is not None and temperature > 0:
        sampling.top_p = args.top_p
    for name in ("max_tokens", "seed", "repetition_penalty", "logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    return sampling


def print_logprobs(entries, out=sys.stderr) -> None:
    """A line a token: its text, id and logprob, then the most likely ones."""
    for lp in entries:
        alternatives = "  ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top_logprobs)
        print(
            f"  {lp.token!r:>14} ({lp.token_id:>6})  {lp.logprob:8.4f}   {alternatives}", file=out
        )


def cmd_generate(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    if args.system is not None:
        if args.raw:
            raise SystemExit("--system needs the chat template: leave out --raw")
        req = generation_pb2.GenerateRequest(
            messages=[
                generation_pb2.ChatMessage(role="system", content=args.system),
                generation_pb2.ChatMessage(role="user", content=args.prompt),
            ],
            sampling=sampling_from_args(args),
            lora=args.lora,
        )
    else:
        req = generation_pb2.GenerateRequest(
            prompt=args.prompt,
            sampling=sampling_from_args(args),
            raw_prompt=args.raw,
            lora=args.lora,
        )
    stub = stub_for(args.server, args.tls_ca, args.api_key)
    try:
        if args.json:
            print(json_format.MessageToJson(stub.Generate(req, timeout=args.timeout)))
            return 0
        if args.no_stream or args.n > 1:  # several samples are shown one after the other
            resp = stub.Generate(req, timeout=args.timeout)
            for c in resp.choices:
                if len(resp.choices) > 1:
                    print(
                        f"--- sample {c.index} "
                        f"({generation_pb2.FinishReason.Name(c.finish_reason)}) ---"
                    )
                print(c.text)
                if c.logprobs:
                    print_logprobs(c.logprobs)
            usage, logprobs, prompt_logprobs = resp.usage, [], list(resp.prompt_logprobs)
        else:
            usage, logprobs, prompt_logprobs = None, [], []
            for msg in stub.GenerateStream(req, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                logprobs.extend(msg.logprobs)
                prompt_logprobs.extend(msg.prompt_logprobs)
                if msg.HasField("usage"):
                    usage = msg.usage
            print()
            if logprobs:
                print("logprobs:", file=sys.stderr)
                print_logprobs(logprobs)
        if prompt_logprobs:
            print("prompt logprobs:", file=sys.stderr)
            print_logprobs(prompt_logprobs)
    except grpc.RpcError as e:
        print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
        return 1
    if args.verbose and usage is not None:
        print(
            f"[prompt {usage.prompt_tokens} tokens ({usage.cached_prompt_tokens} cached), "
            f"completion {usage.completion_tokens} tokens]",
            file=sys.stderr,
        )
    return 0


CHAT_HELP = "/reset forgets the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer."


def chat_turn(
    stub, history: list, sampling, timeout: float, out=sys.stdout, lora: str = ""
) -> tuple[str, bool]:
    """Stream the answer to `out` -> (answer, finished); Ctrl-C aborts it on the server too."""
    import uuid

    from protos import generation_pb2

    request_id = f"chat-{uuid.uuid4().hex}"
    answer, call = [], None
    # (a Ctrl-C from the moment the request may be on its way stops it)
    try:
        call = stub.GenerateStream(
            generation_pb2.GenerateRequest(
                request_id=request_id, messages=history, sampling=sampling, lora=lora
            ),
            timeout=timeout,
        )
        for msg in call:
            out.write(msg.text)
            out.flush()
            answer.append(msg.text)
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()
        try:
            stub.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=5)
        except grpc.RpcError:
            pass
        out.write(" [stopped]\n")
        return "".join(answer), False
    out.write("\n")
    return "".join(answer), True


def cmd_chat(args: argparse.Namespace) -> int:
    import signal

    from protos import generation_pb2

    # Ctrl-C stops an answer however the chat was started: a SIGINT its parent ignored or blocked
    # (a script's background job, a process that masks it) is taken back
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stub = stub_for(args.server, args.tls_ca, args.api_key)
    sampling = sampling_from_args(args)
    system = [generation_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    history = list(system)
    print(CHAT_HELP, file=sys.stderr)
    prompt = ">>> " if sys.stdin.isatty() else ""  # piped input: stdout carries the answers alone
    while True:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(system)
            print("(conversation forgotten)", file=sys.stderr)
            continue
        history.append(generation_pb2.ChatMessage(role="user", content=line))
        try:
            answer, _ = chat_turn(stub, history, sampling, args.timeout, lora=args.lora)
        except grpc.RpcError as e:
            history.pop()
            print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
            continue
        history.append(generation_pb2.ChatMessage(role="assistant", content=answer))


def cmd_embed(args: argparse.Namespace) -> int:
    """Each text's vector as one JSON line ({"index", "prompt_tokens", "embedding"}), in input
    order.
    """
    from protos import generation_pb2

    texts = args.texts
    request = generation_pb2.EmbedRequest(
        texts=texts,
        dimensions=args.dimensions,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        prompt_name=args.prompt_name or "",
        prompt=args.prompt or "",
    )
    try:
        response = stub_for(args.server, args.tls_ca, args.api_key).Embed(
            request, timeout=args.timeout
        )
    except grpc.RpcError as e:
        print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
        return 1
    for d in response.data:
        print(
            json.dumps(
                {
                    "index": d.index,
                    "prompt_tokens": d.prompt_tokens,
                    "embedding": [round(v, 7) for v in d.values],
                }
            )
        )
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    from protos import generation_pb2

    stub = stub_for(args.server, args.tls_ca, args.api_key)
    resp = stub.Abort(generation_pb2.AbortRequest(request_id=args.request_id), timeout=args.timeout)
    print("aborted" if resp.aborted else "no live request with that id")
    return 0 if resp.aborted else 1
