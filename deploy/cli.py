"""pagedserve: serve a model, or talk to a running server.

pagedserve serve --model .models/smollm2-135m-instruct   # scheduler + workers (--tp N --dp M)
pagedserve deploy --model ... --tp 2 --dp 2             # the same supervised, logs in run/
pagedserve generate "What is the capital of France?"    # streams the answer
pagedserve generate "A person as JSON" --json-schema @person.json --logprobs 3
pagedserve generate "Hi" --system "Answer in French."   # a system prompt, then the user's
pagedserve chat --system "You are terse."               # a conversation in the terminal
pagedserve embed "first" "second" --dimensions 256      # an embedding model's vectors
pagedserve stats                                        # the KV pool (--json for machines)
pagedserve top                                          # a live view of a running server
pagedserve info | abort REQUEST_ID
pagedserve keys --out keys/                             # CurveZMQ keys for a multi-host wire
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from deploy.client import (
    CHAT_HELP,
    DEFAULT_SERVER,
    SERVER_ENV,
    cmd_abort,
    cmd_chat,
    cmd_embed,
    cmd_generate,
    logit_bias,
    rpc_failure,
    text_or_file,
)
from deploy.console import cmd_info, cmd_stats, cmd_top
from protos.base import EXIT_CONFIG, ConfigError, env
from protos.base.argtypes import COUNT, POSITIVE, SECONDS, Parser, float_range, int_range


def cmd_keys(args: argparse.Namespace) -> int:
    from protos.curve import make_keys

    folder = make_keys(args.out)
    print(
        f"keys written to {folder}/: give the scheduler --curve-keys {folder} and each worker the "
        "same folder (on other hosts: scheduler.key and worker.key_secret are all a worker needs)"
    )
    return 0


def _sampling_args(g: argparse.ArgumentParser) -> None:
    g.add_argument(
        "--max-tokens",
        type=POSITIVE,
        default=None,
        help="most tokens to generate (default: the server's --max-tokens-default, 1024)",
    )
    g.add_argument(
        "--temperature", type=float_range(0.0), default=0.7, help="0 is greedy (default 0.7)"
    )
    g.add_argument(
        "--greedy", action="store_true", help="temperature 0: the most likely token every time"
    )
    g.add_argument(
        "--top-p",
        type=float_range(0.0, 1.0, low_open=True),
        default=0.95,
        help="nucleus sampling: draw from the smallest set of tokens this likely (default 0.95)",
    )
    g.add_argument(
        "--top-k", type=int_range(-1), default=0, help="draw from the K most likely (0: all)"
    )
    g.add_argument(
        "--min-p",
        type=float_range(0.0, 1.0),
        default=0.0,
        help="drop tokens less likely than this share of the most likely one (0: off)",
    )
    g.add_argument(
        "--seed",
        type=int_range(0, 2**64 - 1),
        default=None,
        help="the same seed and request give the same answer (default: a random one)",
    )
    g.add_argument("-n", "--n", type=int_range(1, 16), default=1, help="number of samples (1-16)")
    g.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    g.add_argument(
        "--stop-token-id",
        type=COUNT,
        action="append",
        default=[],
        help="stop after this token id (repeatable)",
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="go on past the model's end-of-answer token"
    )
    g.add_argument("--min-tokens", type=COUNT, default=0, help="no stop before this many tokens")
    g.add_argument(
        "--repetition-penalty",
        type=float_range(0.0, 2.0, low_open=True),
        default=None,
        help="transformers' (1 = off)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float_range(-2.0, 2.0),
        default=0.0,
        help="OpenAI's, over output tokens",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float_range(-2.0, 2.0),
        default=0.0,
        help="OpenAI's, over output tokens",
    )
    g.add_argument(
        "--logit-bias",
        type=logit_bias,
        action="append",
        default=[],
        metavar="TOKEN_ID=BIAS",
        help="add BIAS (-100 to 100) to a token's logit (repeatable)",
    )
    g.add_argument(
        "--logprobs",
        type=int_range(0, 20),
        default=None,
        metavar="K",
        help="each token's log-probability and the K most likely (printed to stderr)",
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int_range(0, 20),
        default=None,
        metavar="K",
        help="the same for the prompt's tokens",
    )
    g.add_argument(
        "--json-schema",
        type=text_or_file,
        default=None,
        help="a JSON Schema the output follows (text, or @file)",
    )
    g.add_argument("--regex", default=None, help="a regular expression the output matches")
    g.add_argument(
        "--grammar",
        type=text_or_file,
        default=None,
        help="a Lark grammar the output follows (text, or @file)",
    )
    g.add_argument(
        "--lora",
        default="",
        metavar="NAME",
        help="generate with this LoRA adapter (a name the server loaded; see `pagedserve info`)",
    )


def build_parser() -> argparse.ArgumentParser:
    # one function: every command's flag table
    p = Parser(
        prog="pagedserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "serve", help="start a scheduler and its workers (see `pagedserve serve --help`)"
    )
    sub.add_parser(
        "deploy",
        help="scheduler + TP x DP workers under a supervisor (see `pagedserve deploy --help`)",
    )
    sub.add_parser("prepare-model", help="turn a GGUF into a model folder")
    k = sub.add_parser("keys", help="make CurveZMQ keys for the scheduler <-> worker wire")
    k.add_argument("--out", required=True, help="folder to write the keys to")
    k.set_defaults(func=cmd_keys)
    g = sub.add_parser(
        "generate",
        help="send a prompt and stream the answer",
        description="Sampling defaults suit a chat model (temperature 0.7, top-p 0.95); "
        "--greedy decodes greedily.",
    )
    g.add_argument("prompt", help="the user's message (the chat template is applied unless --raw)")
    _sampling_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument(
        "--system",
        type=text_or_file,
        default=None,
        help="a system prompt before the user's (text, or @file)",
    )
    g.add_argument("--no-stream", action="store_true", help="use the unary Generate call")
    g.add_argument("--json", action="store_true", help="print the whole GenerateResponse as JSON")
    g.add_argument("-v", "--verbose", action="store_true", help="say the token counts at the end")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser(
        "chat",
        help="a conversation in the terminal (history kept, answers streamed)",
        description=CHAT_HELP,
    )
    _sampling_args(c)
    c.add_argument(
        "--system", type=text_or_file, default=None, help="the system prompt (text, or @file)"
    )
    c.set_defaults(func=cmd_chat)
    e = sub.add_parser(
        "embed", help="embedding vectors of texts (JSON lines), from an embedding model"
    )
    e.add_argument("texts", nargs="+", type=text_or_file, help="texts (or @file each)")
    e.add_argument(
        "--dimensions", type=COUNT, default=0, help="keep the first N values (renormalized; 0: all)"
    )
    e.add_argument(
        "--truncate-prompt-tokens",
        type=int_range(-1),
        default=0,
        help="keep each text's last N tokens (-1: the context's worth); 0 refuses a longer one",
    )
    e.add_argument(
        "--prompt-name", default=None, help="one of the model's named instructions (see info)"
    )
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
    t.add_argument(
        "--iterations", type=POSITIVE, default=None, help="stop after this many refreshes"
    )
    t.add_argument(
        "--no-screen", action="store_true", help="draw in place in the terminal, not a full screen"
    )
    t.add_argument(
        "--svg", default=None, metavar="FILE", help="save the last frame as an SVG picture"
    )
    t.set_defaults(func=cmd_top)
    a = sub.add_parser("abort", help="abort a request")
    a.add_argument("request_id", help="the id the request was sent with")
    a.set_defaults(func=cmd_abort)
    server = env.server()
    for name, s in sub.choices.items():
        if name in ("keys", "serve", "deploy", "prepare-model"):
            continue
        s.add_argument(
            "--server",
            default=server,
            help=f"the server's gRPC HOST:PORT (${SERVER_ENV}, else {DEFAULT_SERVER}; "
            "now %(default)s)",
        )
        s.add_argument(
            "--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM)"
        )
        s.add_argument(
            "--api-key",
            default=env.api_key(),
            help="the key of a server started with --api-key (default: $PAGEDSERVE_API_KEY)",
        )
        s.add_argument(
            "--timeout", type=SECONDS, default=600.0, help="seconds to wait for an answer"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "serve": "deploy.launcher",
        "deploy": "deploy.fleet",
        "prepare-model": "deploy.prepare_model",
    }
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
        print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
