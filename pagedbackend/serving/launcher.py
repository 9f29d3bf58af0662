"""Run NVIDIA's tritonserver (bundled by nvidia-pytriton) over our model repository.

    python -m pagedbackend.serve --model-repository model_repository \
        --http-port 8000 --grpc-port 8001 --metrics-port 8002

Engine settings come from the ``parameters`` of each model's ``config.pbtxt``
(names as ``EngineConfig`` fields). An environment variable
``PAGEDBACKEND_<FIELD>`` (e.g. ``PAGEDBACKEND_NUM_KV_BLOCKS=512``) overrides the
file; ``--set field=value`` and ``--model`` set those variables for the server.
Several models (``--model NAME=FOLDER``, repeated) are served from a
repository made for the run, one copy of the repository's model each, with
the settings (``--set field=value`` for all, ``--set NAME:field=value`` for
one) in their parameters.
This module is the command line alone: the model repository is read and
prepared in ``repository``, tritonserver started and stopped in ``process``,
and its readiness awaited through ``readiness``.
"""
import argparse
import atexit
import os
import pathlib
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import fields
from typing import Dict, Optional, Tuple

from pagedbackend.config import ENV_PREFIX, EngineConfig
from pagedbackend.serving.constants import ADMIN_HEADER, ADMIN_KEY_ENV, EXIT_TIMEOUT_S
from pagedbackend.serving.readiness import is_model_ready, is_ready, models_not_ready, wait_until
from pagedbackend.serving.process import (prepare_backend, server_command, server_env, signal_group,
                                          start_server_process)
from pagedbackend.serving.repository import (MODEL_REPOSITORY_ENV, build_step_packages, default_model_repository,
                                             parse_model_args, prepare_models, repository_models,
                                             served_repository)
from pagedbackend.serving.security import (API_KEY_ENV, API_KEY_HEADER, PUBLIC_BIND_FLAG, api_keys,
                                           refuse_public_bind)

# After SIGTERM, tritonserver gets its exit timeout and this much more to exit
# before the launcher kills it.
DRAIN_MARGIN_S = 5
# The exit status when a model that was ready stops being ready while no stop
# was asked for (its engine failed and it unloaded itself: serving/triton/health.py),
# so that a supervisor (systemd, Kubernetes) restarts the server.
MODEL_FAILED_STATUS = 3
MODEL_POLL_S = 0.25
# After a model failed its engine has ended every request: tritonserver gets
# this long after SIGTERM, not the drain, before the launcher kills it.
FAILED_DRAIN_S = 2.0


def parse_args(argv=None) -> argparse.Namespace:
    """Our options, then ``--`` and any tritonserver options, which are passed
    through (and replace ours of the same name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, passed = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serve [OPTIONS] [-- TRITONSERVER OPTIONS]",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model-repository",
                        help=f"default: ${MODEL_REPOSITORY_ENV}, else the checkout's model_repository/")
    parser.add_argument("--host", default="127.0.0.1", help="address for all three endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model", action="append", default=[], metavar="FOLDER | NAME=FOLDER",
                        help='engine model: "default", a model folder or GGUF file (PAGEDBACKEND_MODEL); '
                             "NAME=FOLDER, repeatable: several models, Triton model NAME each")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override an engine setting (PAGEDBACKEND_<FIELD>); repeatable")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--exit-timeout", type=int, default=EXIT_TIMEOUT_S,
                        help="seconds tritonserver waits after SIGTERM for HTTP connections and requests")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"value of the {ADMIN_HEADER} header that the model repository API "
                             f"(load, unload, index) requires (${ADMIN_KEY_ENV}); random if not given")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"inference, model metadata and configuration on the HTTP and gRPC ports need "
                             f"the {API_KEY_HEADER} header with this key (gRPC: triton-grpc-protocol-"
                             f"{API_KEY_HEADER}); repeatable, as the OpenAI server's, but tritonserver "
                             f"takes the first alone (default: ${API_KEY_ENV}, comma-separated)")
    parser.add_argument(PUBLIC_BIND_FLAG, action="store_true",
                        help="serve a non-loopback --host without an API key (refused otherwise)")
    parser.add_argument("--keep-serving-after-model-failure", action="store_true",
                        help="keep tritonserver up when a model that was ready stops being ready (by "
                             f"default the launcher stops it and exits with status {MODEL_FAILED_STATUS})")
    parser.add_argument("--prepare-only", action="store_true",
                        help="copy the backend stub and prepare the models, then exit")
    parser.add_argument("--build-step", action="store_true",
                        help="with --prepare-only: also build each model's compiled step package "
                             "(make setup; a server finds it at its first start)")
    args = parser.parse_args(argv)
    args.tritonserver_args = passed
    return args


def setting_overrides(args: argparse.Namespace) -> Dict[str, str]:
    """The environment for one model (``--model FOLDER``) or for the
    repository's own models; with several named models, nothing: their
    settings go into their parameters (``served_models_repository``)."""
    try:
        models = parse_model_args(args.model)
    except ValueError as exc:
        raise SystemExit(f"--model: {exc}") from None
    shared, per_model = split_settings(args.set, [name for name in models if name])
    if models and "" not in models:
        return {}
    overrides = {ENV_PREFIX + name.upper(): value for name, value in shared.items()}
    if models:   # a folder or GGUF file, made absolute: tritonserver's backend runs elsewhere
        model = models[""]
        overrides[ENV_PREFIX + "MODEL"] = os.path.abspath(model) if os.path.exists(model) else model
    return overrides


def split_settings(items, names) -> Tuple[Dict[str, str], Dict[str, Dict[str, str]]]:
    """``--set`` values: FIELD=VALUE for every model, NAME:FIELD=VALUE for the named model NAME."""
    shared, per_model = {}, {}
    known = {f.name for f in fields(EngineConfig)}
    for item in items:
        target, sep, value = item.partition("=")
        model, colon, name = target.rpartition(":")
        if not sep or name not in known or (colon and model not in names):
            raise SystemExit(f"--set expects FIELD=VALUE with an EngineConfig field, or NAME:FIELD=VALUE with "
                             f"NAME one of --model's names ({', '.join(names) or 'none given'}), got {item!r}")
        (per_model.setdefault(model, {}) if colon else shared)[name] = value
    return shared, per_model


def served_models_repository(args: argparse.Namespace, source) -> Optional[pathlib.Path]:
    """For several named models: a repository made for this run (removed at
    exit) with a copy of ``source``'s model per name; None otherwise."""
    models = parse_model_args(args.model)
    if not models or "" in models:
        return None
    shared, per_model = split_settings(args.set, list(models))
    dest = pathlib.Path(tempfile.mkdtemp(prefix="pagedbackend-models-"))
    atexit.register(shutil.rmtree, dest, True)
    return served_repository(dest, models, shared, per_model, source=source)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = setting_overrides(args)
    try:
        keys = api_keys(args.api_key)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    refusal = refuse_public_bind(args.host, keys, args.allow_public_without_api_key, "tritonserver")
    if refusal and not args.prepare_only:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    failures = []
    try:
        repository = args.model_repository or default_model_repository()
        named = served_models_repository(args, repository)
        if named is not None:   # each named model's folder is in its parameters, not in the environment
            repository = named
            os.environ.pop(ENV_PREFIX + "MODEL", None)
        prepare_backend()
        for path in prepare_models(repository, {**os.environ, **overrides}, failures):
            print(f"model weights: {path}", flush=True)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, exc in failures:
        print(f"{'error' if args.prepare_only else 'warning'}: model {name}: {exc}"
              f"{'' if args.prepare_only else '; tritonserver will load the others'}", file=sys.stderr)
    if args.prepare_only and args.build_step and not failures:
        try:
            for path in build_step_packages(repository, {**os.environ, **overrides}):
                print(f"compiled step package: {path}", flush=True)
        except Exception as exc:   # the server builds it at its first start instead
            print(f"error: building the compiled step: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    if args.prepare_only:
        return 1 if failures else 0
    # The model reads the key too (loading adapters at run time); a random one opens nothing to anyone.
    admin_key = args.admin_key or secrets.token_hex(16)
    overrides[ADMIN_KEY_ENV] = admin_key
    command = server_command(repository, args.http_port, args.grpc_port, args.metrics_port,
                             args.host, args.log_verbose, args.exit_timeout, args.tritonserver_args,
                             admin_key=admin_key, api_key=keys[0] if keys else None)
    process = start_server_process(command, server_env(overrides=overrides))
    stop_requested = []   # monotonic times of SIGTERM / SIGINT
    drain_s = args.exit_timeout + DRAIN_MARGIN_S

    def stop(signum, _frame):
        """The first signal: SIGTERM to the server's group (the model drains).
        Repeats while the drain has its time change nothing (one Ctrl-C or
        ``kill`` of ``make serve`` reaches us through the process group and
        through make's trap both); one after that kills the group."""
        now = time.monotonic()
        stop_requested.append(now)
        if len(stop_requested) == 1:
            signal_group(process.pid, signal.SIGTERM)
        elif now - stop_requested[0] >= drain_s:
            signal_group(process.pid, signal.SIGKILL)
        elif len(stop_requested) == 2:
            print(f"stopping: tritonserver is draining (up to {drain_s:.0f} s); "
                  "a signal after that kills it", file=sys.stderr, flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)

    http_url = f"http://{args.host}:{args.http_port}"
    try:
        ready = wait_until(lambda: is_ready(http_url), process, args.ready_timeout,
                           stopping=lambda: bool(stop_requested))
    except TimeoutError:
        print(f"tritonserver not ready after {args.ready_timeout:.0f} s; stopping it", file=sys.stderr)
        stop(signal.SIGTERM, None)
        ready = False
    watched = []
    if ready:
        names = repository_models(repository)
        failed = models_not_ready(http_url, names)
        for name in failed:
            print(f"warning: model {name} is not ready (did not load, or not asked to; "
                  "see the server log)", file=sys.stderr, flush=True)
        print(f"ready: HTTP {http_url}  gRPC {args.host}:{args.grpc_port}  "
              f"metrics http://{args.host}:{args.metrics_port}/metrics", flush=True)
        if not args.keep_serving_after_model_failure:
            watched = [name for name in names if name not in failed]
    return wait_for_exit(process, stop_requested, drain_s, ModelWatch(http_url, watched, stop_requested))


class ModelWatch:
    """The models that were ready at start; ``failed`` names one that is not
    any more (two probes in a row, ``MODEL_POLL_S`` apart) while tritonserver
    itself still answers ready, unless a stop was asked for. A server that was
    told to stop by someone else (SIGTERM to it alone) stops answering
    ``/v2/health/ready`` at once while its models drain: that is a stop, not a
    failed engine (whose model unloads itself under a server that stays ready)."""

    def __init__(self, http_url: str, names: list, stop_requested: list):
        self.http_url, self.names, self.stop_requested = http_url, names, stop_requested
        self.misses = {name: 0 for name in names}
        self.next_probe = time.monotonic()

    def failed(self):
        if self.stop_requested or time.monotonic() < self.next_probe:
            return None
        self.next_probe = time.monotonic() + MODEL_POLL_S
        for name in self.names:
            self.misses[name] = 0 if is_model_ready(self.http_url, name, timeout=MODEL_POLL_S) \
                else self.misses[name] + 1
            if self.misses[name] >= 2:
                if not is_ready(self.http_url, timeout=MODEL_POLL_S):   # the server is stopping
                    self.names = []
                    return None
                return name
        return None


def wait_for_exit(process, stop_requested: list, drain_s: float, watch: ModelWatch = None) -> int:
    """Wait for tritonserver to exit, killing its group once a stop has had
    ``drain_s``; report how it ended and return the exit status to give
    (``MODEL_FAILED_STATUS`` once ``watch`` saw a model fail)."""
    model_failed = None
    while process.poll() is None:
        failed = watch.failed() if watch is not None and model_failed is None else None
        if failed is not None:
            model_failed = failed
            print(f"error: model {failed} stopped being ready (its engine failed; see the server log); "
                  f"stopping tritonserver, exit status {MODEL_FAILED_STATUS}", file=sys.stderr, flush=True)
            stop_requested.append(time.monotonic())
            signal_group(process.pid, signal.SIGTERM)
            drain_s = FAILED_DRAIN_S
        if stop_requested and time.monotonic() - stop_requested[0] > drain_s:
            # tritonserver 2.51 cannot unload a model, nor exit, while a client
            # keeps a gRPC stream open (docs/robustness.md); every request has
            # had its final response by now.
            if model_failed is None:
                print("tritonserver did not exit after SIGTERM (a client holding a gRPC stream open?); "
                      "killing it", file=sys.stderr)
            signal_group(process.pid, signal.SIGKILL)
        time.sleep(0.2)
    signal_group(process.pid, signal.SIGKILL)   # a dead server's stubs and workers go with it
    status = process.returncode
    if status < 0:
        print(f"tritonserver was killed by {signal.Signals(-status).name}", file=sys.stderr)
    else:
        print(f"stopped: tritonserver exited with status {status}", file=sys.stderr, flush=True)
    if model_failed is not None:
        return MODEL_FAILED_STATUS
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
