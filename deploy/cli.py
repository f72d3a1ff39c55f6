"""pagedserve: serve a model, or talk to a running server.

    pagedserve serve --model .models/smollm2-135m-instruct      # scheduler + its workers (--tp N --dp M)
    pagedserve deploy --model ... --tp 2 --dp 2                # the same under a supervisor, logs in run/
    pagedserve generate "What is the capital of France?"       # streams the answer
    pagedserve info | stats | abort REQUEST_ID
    pagedserve keys --out keys/                                 # CurveZMQ keys for a multi-host wire
"""

from __future__ import annotations

import argparse
import sys

import grpc

DEFAULT_SERVER = "127.0.0.1:50051"


def _stub(server: str, tls_ca: str | None = None):
    from protos import generation_pb2_grpc

    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(server, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(server)
    return generation_pb2_grpc.GenerationStub(channel)


def cmd_generate(args: argparse.Namespace) -> int:
    from protos import generation_pb2

    sampling = generation_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    req = generation_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling, raw_prompt=args.raw)
    stub = _stub(args.server, args.tls_ca)
    try:
        if args.no_stream:
            resp = stub.Generate(req, timeout=args.timeout)
            print(resp.choices[0].text)
            usage = resp.usage
        else:
            usage = None
            for msg in stub.GenerateStream(req, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("usage"):
                    usage = msg.usage
            print()
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.verbose and usage is not None:
        print(f"[prompt {usage.prompt_tokens} tokens, completion {usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    stub = _stub(args.server, args.tls_ca)
    call = stub.GetModelInfo if args.command == "info" else stub.GetCacheStats
    req = generation_pb2.GetModelInfoRequest() if args.command == "info" else generation_pb2.GetCacheStatsRequest()
    try:
        print(json_format.MessageToJson(call(req, timeout=args.timeout), always_print_fields_with_no_presence=True))
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    from protos import generation_pb2

    resp = _stub(args.server, args.tls_ca).Abort(generation_pb2.AbortRequest(request_id=args.request_id), timeout=args.timeout)
    print("aborted" if resp.aborted else "no live request with that id")
    return 0 if resp.aborted else 1


def cmd_keys(args: argparse.Namespace) -> int:
    from protos.curve import make_keys

    folder = make_keys(args.out)
    print(f"keys written to {folder}/: give the scheduler --curve-keys {folder} and each worker the same folder "
          "(on other hosts: scheduler.key and worker.key_secret are all a worker needs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from deploy.launcher import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["deploy"]:
        from deploy.deploy import main as deploy_main

        return deploy_main(argv[1:])
    if argv[:1] == ["prepare-model"]:
        from deploy.prepare_model import main as prepare_main

        return prepare_main(argv[1:])
    p = argparse.ArgumentParser(prog="pagedserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start a scheduler and its workers (see `pagedserve serve --help`)")
    sub.add_parser("deploy", help="scheduler + TP x DP workers under a supervisor (see `pagedserve deploy --help`)")
    sub.add_parser("prepare-model", help="turn a GGUF into a model folder")
    k = sub.add_parser("keys", help="make CurveZMQ keys for the scheduler <-> worker wire")
    k.add_argument("--out", required=True, help="folder to write the keys to")
    k.set_defaults(func=cmd_keys)
    g = sub.add_parser("generate", help="send a prompt and stream the answer")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--no-stream", action="store_true", help="use the unary Generate call")
    g.add_argument("-v", "--verbose", action="store_true")
    g.set_defaults(func=cmd_generate)
    for name, help_ in (("info", "model info"), ("stats", "KV cache accounting")):
        s = sub.add_parser(name, help=help_)
        s.set_defaults(func=cmd_info)
    a = sub.add_parser("abort", help="abort a request")
    a.add_argument("request_id")
    a.set_defaults(func=cmd_abort)
    for name, s in sub.choices.items():
        if name == "keys":
            continue
        s.add_argument("--server", default=DEFAULT_SERVER)
        s.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM)")
        s.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
