"""pagedserve: serve a model, or talk to a running server.

    pagedserve serve --model .models/smollm2-135m-instruct      # scheduler + its workers (--tp N --dp M)
    pagedserve deploy --model ... --tp 2 --dp 2                # the same under a supervisor, logs in run/
    pagedserve generate "What is the capital of France?"       # streams the answer
    pagedserve generate "A person as JSON" --json-schema @person.json --logprobs 3
    pagedserve generate "Hi" --system "Answer in French."        # a system prompt, then the user's
    pagedserve chat --system "You are terse."                   # a conversation in the terminal
    pagedserve embed "first text" "second text" --dimensions 256 # vectors of an embedding model, JSON lines
    pagedserve stats                                            # the KV pool as a table (--json for machines)
    pagedserve top                                              # a live view of a running server
    pagedserve info | abort REQUEST_ID
    pagedserve keys --out keys/                                 # CurveZMQ keys for a multi-host wire
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from protos import EXIT_CONFIG, ConfigError
from protos.argtypes import COUNT, POSITIVE, SECONDS, Parser, float_range, int_range

DEFAULT_SERVER = "127.0.0.1:50051"
SERVER_ENV = "PAGEDSERVE_SERVER"


def _stub(server: str, tls_ca: str | None = None):
    from protos import generation_pb2_grpc

    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(server, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(server)
    return generation_pb2_grpc.GenerationStub(channel)


def text_or_file(value: str) -> str:
    """An argparse type: a flag's text, or with a leading @ the text of that file (a message naming the path
    where it cannot be read)."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {getattr(e, 'strerror', None) or e}") \
            from None


def logit_bias(item: str) -> tuple[int, float]:
    """An argparse type: TOKEN_ID=BIAS."""
    token, sep, bias = item.partition("=")
    try:
        pair = int(token), float(bias)
    except ValueError:
        pair = None
    if not sep or pair is None or pair[0] < 0:
        raise argparse.ArgumentTypeError(f"wants TOKEN_ID=BIAS (a token id and a number), got {item!r}")
    return pair


def sampling_from_args(args: argparse.Namespace):
    from protos import generation_pb2

    temperature = 0.0 if args.greedy else args.temperature
    sampling = generation_pb2.SamplingParams(
        temperature=temperature, top_k=args.top_k, stop=args.stop,
        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos, n=args.n, min_p=args.min_p,
        min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias),
        json_schema=args.json_schema or "", regex=args.regex or "", grammar=args.grammar or "",
    )
    if args.top_p is not None and temperature > 0:
        sampling.top_p = args.top_p
    for name in ("max_tokens", "seed", "repetition_penalty", "logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    return sampling


def _print_logprobs(entries, out=sys.stderr) -> None:
    """A line a token: its text, id and logprob, then the most likely ones."""
    for lp in entries:
        alternatives = "  ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top_logprobs)
        print(f"  {lp.token!r:>14} ({lp.token_id:>6})  {lp.logprob:8.4f}   {alternatives}", file=out)


def cmd_generate(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    if args.system is not None:
        if args.raw:
            raise SystemExit("--system needs the chat template: leave out --raw")
        req = generation_pb2.GenerateRequest(messages=[
            generation_pb2.ChatMessage(role="system", content=args.system),
            generation_pb2.ChatMessage(role="user", content=args.prompt)], sampling=sampling_from_args(args))
    else:
        req = generation_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling_from_args(args),
                                             raw_prompt=args.raw)
    stub = _stub(args.server, args.tls_ca)
    try:
        if args.json:
            print(json_format.MessageToJson(stub.Generate(req, timeout=args.timeout)))
            return 0
        if args.no_stream or args.n > 1:  # several samples are shown one after the other
            resp = stub.Generate(req, timeout=args.timeout)
            for c in resp.choices:
                if len(resp.choices) > 1:
                    print(f"--- sample {c.index} ({generation_pb2.FinishReason.Name(c.finish_reason)}) ---")
                print(c.text)
                if c.logprobs:
                    _print_logprobs(c.logprobs)
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
                _print_logprobs(logprobs)
        if prompt_logprobs:
            print("prompt logprobs:", file=sys.stderr)
            _print_logprobs(prompt_logprobs)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.verbose and usage is not None:
        print(f"[prompt {usage.prompt_tokens} tokens ({usage.cached_prompt_tokens} cached), "
              f"completion {usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


CHAT_HELP = "/reset forgets the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer."


def chat_turn(stub, history: list, sampling, timeout: float, out=sys.stdout) -> tuple[str, bool]:
    """Send the conversation, stream the assistant's answer to `out`; return (answer, finished). Ctrl-C
    cancels the stream and aborts the request on the server; the partial answer is returned."""
    import uuid

    from protos import generation_pb2

    request_id = f"chat-{uuid.uuid4().hex}"
    call = stub.GenerateStream(
        generation_pb2.GenerateRequest(request_id=request_id, messages=history, sampling=sampling),
        timeout=timeout)
    answer = []
    try:
        for msg in call:
            out.write(msg.text)
            out.flush()
            answer.append(msg.text)
    except KeyboardInterrupt:
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
    from protos import generation_pb2

    stub = _stub(args.server, args.tls_ca)
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
            answer, _ = chat_turn(stub, history, sampling, args.timeout)
        except grpc.RpcError as e:
            history.pop()
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            continue
        history.append(generation_pb2.ChatMessage(role="assistant", content=answer))


def cmd_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    stub = _stub(args.server, args.tls_ca)
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=args.timeout)
    if args.json:
        print(json_format.MessageToJson(info, always_print_fields_with_no_presence=True))
        return 0
    from rich.console import Console

    from deploy.console import info_table

    Console().print(info_table(info, args.server))
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """Each text's vector as one JSON line ({"index", "prompt_tokens", "embedding"}), in input order."""
    from protos import generation_pb2

    texts = args.texts
    request = generation_pb2.EmbedRequest(texts=texts, dimensions=args.dimensions,
                                          truncate_prompt_tokens=args.truncate_prompt_tokens,
                                          prompt_name=args.prompt_name or "", prompt=args.prompt or "")
    try:
        response = _stub(args.server, args.tls_ca).Embed(request, timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    for d in response.data:
        print(json.dumps({"index": d.index, "prompt_tokens": d.prompt_tokens,
                          "embedding": [round(v, 7) for v in d.values]}))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    try:
        stats = _stub(args.server, args.tls_ca).GetCacheStats(
            generation_pb2.GetCacheStatsRequest(), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(stats, always_print_fields_with_no_presence=True))
        return 0
    from rich.console import Console

    from deploy.console import stats_view

    Console().print(stats_view(stats))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    from deploy.console import Reading, top_view
    from protos import generation_pb2

    stub = _stub(args.server, args.tls_ca)
    console = Console()
    try:
        model = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=args.timeout).model_name
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    # a first reading a moment before the first frame, so that its rates are there from the start
    before = Reading(stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=args.timeout),
                     time.monotonic())
    time.sleep(min(args.interval, 0.5))
    drawn = 0
    view = None
    try:
        with Live(console=console, auto_refresh=False, screen=not args.no_screen, transient=False) as live:
            while args.iterations is None or drawn < args.iterations:
                try:
                    now = Reading(stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(),
                                                     timeout=args.timeout),
                                  time.monotonic())
                    view = top_view(now, before, args.server, model)
                    live.update(view, refresh=True)
                    before = now
                except grpc.RpcError as e:  # a restarting server: say so and keep trying
                    from rich.text import Text

                    live.update(Text(f"{args.server}: {e.code().name}: {e.details()} (retrying)",
                                     style="red"),
                                refresh=True)
                drawn += 1
                if args.iterations is None or drawn < args.iterations:
                    time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    if args.svg and view is not None:  # the last frame as a picture (docs/top.svg is one)
        import io

        recorder = Console(record=True, width=110, file=io.StringIO())
        recorder.print(view)
        recorder.save_svg(args.svg, title="pagedserve top")
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    from protos import generation_pb2

    resp = _stub(args.server, args.tls_ca).Abort(generation_pb2.AbortRequest(request_id=args.request_id),
                                                 timeout=args.timeout)
    print("aborted" if resp.aborted else "no live request with that id")
    return 0 if resp.aborted else 1


def cmd_keys(args: argparse.Namespace) -> int:
    from protos.curve import make_keys

    folder = make_keys(args.out)
    print(f"keys written to {folder}/: give the scheduler --curve-keys {folder} and each worker the same "
          "folder (on other hosts: scheduler.key and worker.key_secret are all a worker needs)")
    return 0


def _sampling_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--max-tokens", type=POSITIVE, default=None,
                   help="most tokens to generate (default: the server's --max-tokens-default, 1024)")
    g.add_argument("--temperature", type=float_range(0.0), default=0.7, help="0 is greedy (default 0.7)")
    g.add_argument("--greedy", action="store_true", help="temperature 0: the most likely token every time")
    g.add_argument("--top-p", type=float_range(0.0, 1.0, low_open=True), default=0.95,
                   help="nucleus sampling: draw from the smallest set of tokens this likely (default 0.95)")
    g.add_argument("--top-k", type=int_range(-1), default=0, help="draw from the K most likely (0: all)")
    g.add_argument("--min-p", type=float_range(0.0, 1.0), default=0.0,
                   help="drop tokens less likely than this share of the most likely one (0: off)")
    g.add_argument("--seed", type=int_range(0, 2**64 - 1), default=None,
                   help="the same seed and request give the same answer (default: a random one)")
    g.add_argument("-n", "--n", type=int_range(1, 16), default=1, help="number of samples (1-16)")
    g.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    g.add_argument("--stop-token-id", type=COUNT, action="append", default=[],
                   help="stop after this token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the model's end-of-answer token")
    g.add_argument("--min-tokens", type=COUNT, default=0, help="no stop before this many tokens")
    g.add_argument("--repetition-penalty", type=float_range(0.0, 2.0, low_open=True), default=None,
                   help="transformers' (1 = off)")
    g.add_argument("--presence-penalty", type=float_range(-2.0, 2.0), default=0.0,
                   help="OpenAI's, over output tokens")
    g.add_argument("--frequency-penalty", type=float_range(-2.0, 2.0), default=0.0,
                   help="OpenAI's, over output tokens")
    g.add_argument("--logit-bias", type=logit_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100 to 100) to a token's logit (repeatable)")
    g.add_argument("--logprobs", type=int_range(0, 20), default=None, metavar="K",
                   help="each token's log-probability and the K most likely (printed to stderr)")
    g.add_argument("--prompt-logprobs", type=int_range(0, 20), default=None, metavar="K",
                   help="the same for the prompt's tokens")
    g.add_argument("--json-schema", type=text_or_file, default=None,
                   help="a JSON Schema the output follows (text, or @file)")
    g.add_argument("--regex", default=None, help="a regular expression the output matches")
    g.add_argument("--grammar", type=text_or_file, default=None,
                   help="a Lark grammar the output follows (text, or @file)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pagedserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="start a scheduler and its workers (see `pagedserve serve --help`)")
    sub.add_parser("deploy",
                   help="scheduler + TP x DP workers under a supervisor (see `pagedserve deploy --help`)")
    sub.add_parser("prepare-model", help="turn a GGUF into a model folder")
    k = sub.add_parser("keys", help="make CurveZMQ keys for the scheduler <-> worker wire")
    k.add_argument("--out", required=True, help="folder to write the keys to")
    k.set_defaults(func=cmd_keys)
    g = sub.add_parser("generate", help="send a prompt and stream the answer",
                       description="Sampling defaults suit a chat model (temperature 0.7, top-p 0.95); "
                                   "--greedy decodes greedily.")
    g.add_argument("prompt", help="the user's message (the chat template is applied unless --raw)")
    _sampling_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--system", type=text_or_file, default=None,
                   help="a system prompt before the user's (text, or @file)")
    g.add_argument("--no-stream", action="store_true", help="use the unary Generate call")
    g.add_argument("--json", action="store_true", help="print the whole GenerateResponse as JSON")
    g.add_argument("-v", "--verbose", action="store_true", help="say the token counts at the end")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="a conversation in the terminal (history kept, answers streamed)",
                       description=CHAT_HELP)
    _sampling_args(c)
    c.add_argument("--system", type=text_or_file, default=None, help="the system prompt (text, or @file)")
    c.set_defaults(func=cmd_chat)
    e = sub.add_parser("embed", help="embedding vectors of texts (JSON lines), from an embedding model")
    e.add_argument("texts", nargs="+", type=text_or_file, help="texts (or @file each)")
    e.add_argument("--dimensions", type=COUNT, default=0,
                   help="keep the first N values (renormalized; 0: all)")
    e.add_argument("--truncate-prompt-tokens", type=int_range(-1), default=0,
                   help="keep each text's last N tokens (-1: the context's worth); 0 refuses a longer one")
    e.add_argument("--prompt-name", default=None, help="one of the model's named instructions (see info)")
    e.add_argument("--prompt", default=None, help="an instruction put before each text")
    e.set_defaults(func=cmd_embed)
    s = sub.add_parser("info", help="what the server serves: model, context, pool, layout")
    s.add_argument("--json", action="store_true", help="the GetModelInfo response as JSON")
    s.set_defaults(func=cmd_info)
    s = sub.add_parser("stats", help="KV cache accounting as a table")
    s.add_argument("--json", action="store_true", help="the GetCacheStats response as JSON")
    s.set_defaults(func=cmd_stats)
    t = sub.add_parser("top", help="a live view of a running server's KV pool and requests")
    t.add_argument("--interval", type=SECONDS, default=1.0, help="seconds between refreshes")
    t.add_argument("--iterations", type=POSITIVE, default=None, help="stop after this many refreshes")
    t.add_argument("--no-screen", action="store_true",
                   help="draw in place in the terminal, not a full screen")
    t.add_argument("--svg", default=None, metavar="FILE", help="save the last frame as an SVG picture")
    t.set_defaults(func=cmd_top)
    a = sub.add_parser("abort", help="abort a request")
    a.add_argument("request_id", help="the id the request was sent with")
    a.set_defaults(func=cmd_abort)
    server = os.environ.get(SERVER_ENV) or DEFAULT_SERVER
    for name, s in sub.choices.items():
        if name in ("keys", "serve", "deploy", "prepare-model"):
            continue
        s.add_argument("--server", default=server,
                       help=f"the server's gRPC HOST:PORT (${SERVER_ENV}, else {DEFAULT_SERVER}; "
                            "now %(default)s)")
        s.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM)")
        s.add_argument("--timeout", type=SECONDS, default=600.0, help="seconds to wait for an answer")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": "deploy.launcher", "deploy": "deploy.fleet", "prepare-model": "deploy.prepare_model"}
    if argv[:1] and argv[0] in commands:
        import importlib

        return importlib.import_module(commands[argv[0]]).main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except ConfigError as e:
        sys.stderr.write(f"pagedserve {args.command}: error: {e}\n")
        return EXIT_CONFIG
    except BrokenPipeError:  # `pagedserve generate ... | head`: the reader has gone, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()} (server {args.server})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
