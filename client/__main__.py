"""Command line: send one prompt to the paged_llm model and print tokens as they arrive.

    python -m client "Tell me a story" --max-tokens 64 --temperature 0.7 --stream
    python -m client "Hi" --protocol http --url http://127.0.0.1:8000 --n 2 --seed 1
    python -m client "What is paging?" --chat --beam-width 2
    python -m client "What is in the picture?" --chat --image cat.png --tokenizer /models/llava
"""
import argparse
import base64
import sys

from client.streaming import (DEFAULT_GRPC_URL, DEFAULT_HTTP_URL, DEFAULT_MODEL, Result,
                              ServerError, grpc_stream, http_stream)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", help=f"server address (default {DEFAULT_GRPC_URL} for gRPC, "
                                      f"{DEFAULT_HTTP_URL} for HTTP)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Triton model name")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--n", type=int, help="outputs to return (default 1, or the beam width)")
    parser.add_argument("--beam-width", type=int, help="beam search with this many beams")
    parser.add_argument("--stop", nargs="+", help="stop strings")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--tokenizer", help="tokenizer folder for --chat (default: the default model's)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole request")
    parser.add_argument("--api-key", help="the server's API key (default: the first of $PAGEDBACKEND_API_KEY)")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image for a vision-language model (repeatable; gRPC), sent base64 in the "
                             "image input; with --chat it follows the prompt's text in the message")
    return parser.parse_args(argv)


def sampling_params(args: argparse.Namespace) -> dict:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.beam_width:
        params.update(use_beam_search=True, best_of=args.beam_width, temperature=0.0,
                      n=args.n or args.beam_width)
    elif args.n:
        params["n"] = args.n
    optional = {"top_p": args.top_p, "top_k": args.top_k, "stop": args.stop, "seed": args.seed}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def chat_prompt(prompt: str, tokenizer_path=None, images: int = 0) -> str:
    from transformers import AutoTokenizer
    if tokenizer_path is None:
        from pagedbackend.models.default_model import resolve_model_path
        tokenizer_path = resolve_model_path("default")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    content = [{"type": "text", "text": prompt}] + [{"type": "image"}] * images if images else prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.image and args.protocol != "grpc":
        print("error: --image is sent over gRPC only (the image input is a list)", file=sys.stderr)
        return 2
    try:
        images = [base64.b64encode(open(path, "rb").read()).decode("ascii") for path in args.image]
    except OSError as exc:
        print(f"error: cannot read the image: {exc}", file=sys.stderr)
        return 2
    prompt = chat_prompt(args.prompt, args.tokenizer, len(images)) if args.chat else args.prompt
    params = sampling_params(args)
    stream_fn = grpc_stream if args.protocol == "grpc" else http_stream
    extra = {"images": images} if images else {}
    url = args.url or (DEFAULT_GRPC_URL if args.protocol == "grpc" else DEFAULT_HTTP_URL)
    result = Result()
    live = params.get("n", 1) == 1 and not args.beam_width  # one output: print it as it grows
    try:
        for delta in stream_fn(prompt, params, url=url, model=args.model, stream=args.stream,
                               exclude_input=True, timeout=args.timeout, api_key=args.api_key, **extra):
            result.add(delta)
            if live:
                print(delta.text, end="", flush=True)
    except ServerError as exc:
        print(("\n" if result.deltas and live else "") + f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:  # connection refused, unreachable, timed out
        print(("\n" if result.deltas and live else "") + f"error: no answer from {url}: {exc}",
              file=sys.stderr)
        return 1
    if live:
        print()
    else:
        for i, text in enumerate(result.texts):
            print(f"--- output {i} ({result.finish_reasons[i]}) ---\n{text}")
    ttft = f"{result.ttft * 1000:.0f} ms" if result.ttft is not None else "n/a"
    tpot = result.time_per_output_token
    tpot = f"{tpot * 1000:.1f} ms" if tpot is not None else "n/a"
    print(f"[{sum(result.num_output_tokens)} tokens, prompt {result.num_input_tokens}, "
          f"finish {','.join(map(str, result.finish_reasons))}, first token {ttft}, "
          f"per token {tpot}, total {result.latency:.2f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
