"""An OpenAI-compatible HTTP API in front of a running tritonserver.

    python -m pagedbackend.serving.openai_server --triton-url 127.0.0.1:8001 --port 9000

This module is its command line; the app and its routes are in ``app``.
"""
import argparse
import os
import sys

from pagedbackend.serving.constants import ADMIN_KEY_ENV, SERVED_MODEL
from pagedbackend.serving.openai.app import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, Settings, create_app,
                                             serve)
from pagedbackend.serving.openai.reasoning import REASONING_PARSERS
from pagedbackend.serving.repository import parse_model_args
from pagedbackend.serving.requests import RequestLimits
from pagedbackend.serving.security import API_KEY_ENV, PUBLIC_BIND_FLAG, api_keys, refuse_public_bind


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serving.openai_server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model-name", default=SERVED_MODEL,
                        help="Triton model for requests that name none")
    parser.add_argument("--tokenizer", "--model-path", dest="tokenizer", default="default",
                        help='the served model\'s folder, for its tokenizer and chat template '
                             '("default": the engine\'s default model)')
    parser.add_argument("--model", action="append", default=[], metavar="NAME=FOLDER",
                        help="a served model (repeatable): Triton model NAME, its tokenizer, chat template and "
                             "context length from FOLDER; the first is the default (replaces --model-name and "
                             "--tokenizer). A plain FOLDER is --tokenizer FOLDER")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--triton-admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help="the key of tritonserver's model repository API (python -m pagedbackend.serve "
                             f"--admin-key, ${ADMIN_KEY_ENV}): /v1/models then lists every ready text model, "
                             "not only --model-name")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="vLLM's: chat answers put the text up to </think> in reasoning_content, and "
                             "structured outputs and tool calls apply after it")
    parser.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                        help="request line and headers larger than this get 431")
    parser.add_argument("--request-limit", action="append", default=[], metavar="NAME=VALUE",
                        help="a request limit (repeatable), e.g. max_n=16 or max_stop_strings=8; the limits "
                             "and their defaults: " + ", ".join(f"{k}={v}" for k, v in
                                                               vars(RequestLimits()).items() if v is not None))
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="every route but /health needs 'Authorization: Bearer KEY' with one of these "
                             f"keys; repeatable (default: ${API_KEY_ENV}, comma-separated). The first is "
                             "also sent to tritonserver (python -m pagedbackend.serve --api-key)")
    parser.add_argument("--max-concurrent-per-key", type=int, default=0, metavar="N",
                        help="at most N requests in flight per API key (per client address without keys); "
                             "one more gets 429. 0 (default): no cap")
    parser.add_argument(PUBLIC_BIND_FLAG, action="store_true",
                        help="serve a non-loopback --host without an API key (refused otherwise)")
    parser.add_argument("--exit-after-triton-lost", type=float, default=5.0, metavar="SECONDS",
                        help="exit with status 3 when the model was ready and has not been for this long "
                             "(its engine failed, or tritonserver stopped); 0: keep answering 503")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        limits = RequestLimits.from_settings(dict(item.partition("=")[::2] for item in args.request_limit))
    except ValueError as exc:
        print(f"error: --request-limit: {exc}", file=sys.stderr)
        return 2
    try:
        keys = api_keys(args.api_key)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    refusal = refuse_public_bind(args.host, keys, args.allow_public_without_api_key, "the OpenAI API")
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        models = parse_model_args(args.model)
    except ValueError as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    if models and list(models) == [""]:   # a plain folder: the default Triton model's tokenizer
        args.tokenizer, models = models[""], {}
    settings = Settings(args.triton_url, args.model_name, args.tokenizer, args.max_body_bytes,
                        args.triton_admin_key, args.reasoning_parser, limits, keys, keys[0] if keys else None,
                        max(0, args.max_concurrent_per_key), models=models)
    if models:
        args.model_name = next(iter(models))
    try:
        app = create_app(settings)
    except (OSError, ValueError) as exc:
        print(f"error: cannot load the tokenizer from {dict(models) or args.tokenizer!r}: {exc}", file=sys.stderr)
        return 1
    print(f"OpenAI API: http://{args.host}:{args.port}/v1 (Triton gRPC {args.triton_url})", flush=True)
    return serve(app, args.host, args.port, args.log_level, args.max_header_bytes, args.model_name,
                 args.exit_after_triton_lost)

