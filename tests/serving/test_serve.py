"""The server launcher: tritonserver found, backend stub prepared, settings parsed,
a server started on free loopback ports and stopped with nothing left behind."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pagedbackend.config import EngineConfig, engine_config
from pagedbackend.serving.constants import EXIT_TIMEOUT_S
from processes import group_members, processes_mentioning
from loadtest.harness.triton import ServerError, TritonServer
from pagedbackend.serving.process import find_tritonserver, prepare_backend, server_command, triton_home
from pagedbackend.serving.repository import make_model_repository, read_parameters
from pagedbackend.serving.triton.settings import ModelSettings
from echo_repository import write_echo_repository

REPO = pathlib.Path(__file__).resolve().parents[2]



def listening_addresses(port: int) -> set:
    """Local addresses listening on ``port`` (hex, as in /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found




def status_of(url: str):
    """The HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def echo(server: TritonServer, text: str) -> str:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    request = urllib.request.Request(f"{server.http_url}/v2/models/echo/infer",
                                     data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())["outputs"][0]["data"][0]


def test_find_tritonserver_returns_the_bundled_executable():
    binary = find_tritonserver()
    assert binary.name == "tritonserver" and os.access(binary, os.X_OK)
    assert binary.is_relative_to(triton_home())


def test_prepare_backend_places_this_pythons_stub_next_to_the_backend_once():
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = triton_home() / "python_backend_stubs" / version / "triton_python_backend_stub"

    stub = prepare_backend()
    first_mtime = stub.stat().st_mtime_ns
    again = prepare_backend()

    assert stub.parent == triton_home() / "backends" / "python"
    assert (stub.parent / "libtriton_python.so").is_file()
    assert stub.read_bytes() == source.read_bytes() and os.access(stub, os.X_OK)
    assert again == stub and stub.stat().st_mtime_ns == first_mtime  # not copied twice


def test_server_command_binds_every_endpoint_to_loopback_with_the_cpu_flags():
    command = server_command("model_repository", 18000, 18001, 18002)

    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--http-port=18000", "--grpc-port=18001", "--metrics-port=18002",
                 "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                 "--cuda-memory-pool-byte-size=0:0"):
        assert flag in command
    assert f"--model-repository={(pathlib.Path('model_repository')).resolve()}" in command


def test_server_command_lets_models_unload_themselves_but_keeps_the_repository_api_behind_a_key():
    command = server_command("model_repository", 18000, 18001, 18002, admin_key="k3y")
    other = server_command("model_repository", 18000, 18001, 18002)
    keyed = server_command("model_repository", 18000, 18001, 18002, admin_key="k3y", api_key="s3cret")
    admin = "model-repository,shared-memory,statistics,trace,logging:pagedbackend-admin-key=k3y"

    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert f"--http-restricted-api={admin}" in command
    assert f"--grpc-restricted-protocol={admin}" in command
    assert f"--exit-timeout-secs={EXIT_TIMEOUT_S}" in command
    assert not [flag for flag in other if flag.endswith("=k3y")]  # a random key otherwise
    assert not [flag for flag in command if "inference" in flag]   # open without an API key
    assert "--http-restricted-api=inference,metadata,model-config:pagedbackend-api-key=s3cret" in keyed
    assert "--grpc-restricted-protocol=inference,metadata,model-config:pagedbackend-api-key=s3cret" in keyed


def test_config_auto_completion_is_skipped_only_for_a_repository_of_our_own_models(tmp_path):
    from pagedbackend.serving.repository import make_model_repository
    ours = make_model_repository(tmp_path / "ours", {"compile": False})
    make_model_repository(ours, {"compile": True}, name="second")
    assert "--disable-auto-complete-config" in server_command(ours, 18000, 18001, 18002)

    edited = make_model_repository(tmp_path / "edited", {})   # a model.py of its own: its config may come from it
    with open(edited / "paged_llm" / "1" / "model.py", "a") as f:
        f.write("\n# edited\n")
    other = make_model_repository(tmp_path / "other", {})
    (other / "onnx_model" / "1").mkdir(parents=True)   # no config.pbtxt: tritonserver completes one
    for repository in (edited, other, tmp_path / "empty"):
        repository.mkdir(exist_ok=True)
        assert "--disable-auto-complete-config" not in server_command(repository, 18000, 18001, 18002)


def test_tritonserver_options_after_a_double_dash_pass_through_and_replace_ours():
    from pagedbackend.serving.launcher import parse_args
    args = parse_args(["--http-port", "18000", "--", "--load-model=paged_llm", "--log-info=false",
                       "--exit-timeout-secs", "9"])
    command = server_command("model_repository", args.http_port, 18001, 18002,
                             extra=args.tritonserver_args)
    polling = server_command("model_repository", 18000, 18001, 18002,
                             extra=["--model-control-mode=poll", "--repository-poll-secs=5"])

    assert args.http_port == 18000
    assert args.tritonserver_args == ["--load-model=paged_llm", "--log-info=false", "--exit-timeout-secs", "9"]
    assert "--load-model=paged_llm" in command and "--load-model=*" not in command
    assert command[-4:] == args.tritonserver_args and f"--exit-timeout-secs={EXIT_TIMEOUT_S}" not in command
    assert "--model-control-mode=poll" in polling and "--model-control-mode=explicit" not in polling
    assert not [flag for flag in polling if flag.startswith("--load-model")]  # poll mode takes none


def test_engine_config_reads_typed_parameters_and_environment_overrides():
    parameters = {"model": {"string_value": "/models/x"}, "num_kv_blocks": {"string_value": "64"},
                  "enable_prefix_caching": {"string_value": "false"}, "watermark": "0.05",
                  "max_model_len": {"string_value": ""}, "EXECUTION_ENV_PATH": {"string_value": "/env"}}
    environ = {"PAGEDBACKEND_NUM_KV_BLOCKS": "32", "PAGEDBACKEND_DTYPE": "bfloat16",
               "PAGEDBACKEND_CACHE": "/not/a/setting"}

    config = engine_config(parameters, environ)

    assert config == EngineConfig(model="/models/x", num_kv_blocks=32, enable_prefix_caching=False,
                                  watermark=0.05, max_model_len=None, dtype="bfloat16")


def test_engine_and_worker_knobs_keep_their_environment_spellings():
    """Knobs that used to be read from the environment where they were used are
    EngineConfig fields now, so the same variables set them (and config.pbtxt
    parameters, and LLM(...) keywords)."""
    environ = {"PAGEDBACKEND_NATIVE_OPS": "0", "PAGEDBACKEND_INT8_BF16": "1", "PAGEDBACKEND_CPP_WRAPPER": "0",
               "PAGEDBACKEND_TP_TIMEOUT_S": "30", "PAGEDBACKEND_TP_RENDEZVOUS_S": "60",
               "PAGEDBACKEND_TP_LOCAL_SIZE": "2"}

    config = engine_config({"int8_bf16": {"string_value": "0"}}, environ)

    assert (config.native_ops, config.int8_bf16, config.cpp_wrapper) == (False, True, False)
    assert (config.tp_timeout_s, config.tp_rendezvous_s, config.tp_local_size) == (30.0, 60.0, 2)
    assert engine_config({"int8_bf16": {"string_value": ""}}, {}).int8_bf16 is None   # by the CPU


@pytest.mark.parametrize("parameters, message", [
    ({"num_kv_blokcs": "64"}, "unknown engine setting(s): num_kv_blokcs"),
    ({"num_kv_blocks": "many"}, "num_kv_blocks: expected int"),
    ({"enable_prefix_caching": "perhaps"}, "enable_prefix_caching: expected bool"),
    ({"native_ops": "sometimes"}, "engine setting native_ops: expected bool"),
    ({"int8_bf16": "auto"}, "engine setting int8_bf16: expected bool"),
    ({"tp_timeout_s": "soon"}, "engine setting tp_timeout_s: expected float"),
    ({"tp_timeout_s": "0"}, "tp_timeout_s must be > 0 seconds"),
])
def test_engine_config_names_a_bad_setting(parameters, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine_config(parameters, {})


def test_shipped_config_parses_into_an_engine_config():
    text = (REPO / "model_repository" / "paged_llm" / "config.pbtxt").read_text()

    config = engine_config(read_parameters(text), {})

    assert config.model == "default" and config.max_num_seqs == 64 and config.num_kv_blocks > 0
    assert config.compile is True


def test_shipped_config_parses_into_model_settings():
    text = (REPO / "model_repository" / "paged_llm" / "config.pbtxt").read_text()

    settings = ModelSettings.from_parameters(read_parameters(text))

    assert settings == ModelSettings()   # the shipped values are the defaults
    assert settings.metric_namespaces == ("pagedbackend", "vllm")


def test_model_settings_read_upper_case_parameters_and_vllm_backends_names():
    parameters = {"UNLOAD_ON_ENGINE_FAILURE": {"string_value": "true"}, "METRIC_NAMES": {"string_value": " VLLM "},
                  "ENABLE_VLLM_HEALTH_CHECK": "false", "EXECUTION_ENV_PATH": "/env", "block_size": "16"}

    settings = ModelSettings.from_parameters(parameters)

    assert settings.unload_on_engine_failure is False   # vllm_backend's name wins
    assert settings.metric_namespaces == ("vllm",)
    assert ModelSettings.from_parameters({"REPORT_CUSTOM_METRICS": "false"}).metric_namespaces == ()
    assert ModelSettings.from_parameters({"UNLOAD_ON_ENGINE_FAILURE": {"string_value": ""}}) == ModelSettings()


@pytest.mark.parametrize("parameters, message", [
    ({"UNLOAD_ON_ENGINE_FAILURE": "perhaps"}, "parameter UNLOAD_ON_ENGINE_FAILURE: expected bool"),
    ({"ENABLE_VLLM_HEALTH_CHECK": "2"}, "parameter ENABLE_VLLM_HEALTH_CHECK: expected bool"),
    ({"REPORT_CUSTOM_METRICS": "yes please"}, "parameter REPORT_CUSTOM_METRICS: expected bool"),
    ({"METRIC_NAMES": "prometheus"}, "parameter METRIC_NAMES must be one of both, pagedbackend, vllm"),
])
def test_model_settings_name_a_bad_parameter(parameters, message):
    with pytest.raises(ValueError, match=message):
        ModelSettings.from_parameters(parameters)


@pytest.mark.slow
def test_the_shipped_config_serves_one_whole_context_without_capping_it(caplog):
    from pagedbackend import SamplingParams
    from pagedbackend.engine import LLMEngine
    text = (REPO / "model_repository" / "paged_llm" / "config.pbtxt").read_text()
    # Eager: the context and KV pool sizes do not depend on how the step runs,
    # and compiling the default model at load costs minutes on 2 cores
    # (test_model_runner.py checks the compiled default model).
    config = engine_config({**read_parameters(text), "device": "cpu", "compile": "false"}, {})

    with caplog.at_level("WARNING", logger="pagedbackend"):
        engine = LLMEngine(config)
    group = engine.make_group("r", "Tell me everything.", SamplingParams(max_tokens=None))

    assert engine.max_model_len == 8192 and not caplog.records   # SmolLM2's context, no cap
    assert len(group.prompt_token_ids) + group.max_tokens == 8192
    assert engine.max_prompt_chars == 16 * 8192


def test_make_model_repository_replaces_and_adds_parameters(tmp_path):
    repo = make_model_repository(tmp_path, {"num_kv_blocks": 48, "model": "/m", "seed": 5,
                                            "enable_prefix_caching": False})

    params = read_parameters((repo / "paged_llm" / "config.pbtxt").read_text())
    assert (repo / "paged_llm" / "1" / "model.py").is_file()
    assert params["num_kv_blocks"] == "48" and params["model"] == "/m"
    assert params["seed"] == "5" and params["enable_prefix_caching"] == "false"
    assert params["max_num_seqs"] == "64"  # untouched entries stay


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_server_starts_on_free_loopback_ports_and_stops_without_orphans(tmp_path):
    repo = write_echo_repository(tmp_path / "repo")

    with TritonServer(repo, ready_timeout_s=60) as server:
        answer = echo(server, "hi")
        ports = [int(url.rsplit(":", 1)[1].split("/")[0])
                 for url in (server.http_url, server.grpc_url, server.metrics_url)]
        bound = [listening_addresses(port) for port in ports]
        group = server.process.pid
        assert len(group_members(group)) >= 2  # tritonserver and its Python stub
        assert "nv_inference_request_success" in server.metrics()

    assert answer == "echo:hi"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
    assert all(addresses and addresses <= loopback for addresses in bound)
    assert group_members(group) == [] and processes_mentioning(str(repo)) == []


def stack_limit(pid: int) -> str:
    line = next(l for l in pathlib.Path(f"/proc/{pid}/limits").read_text().splitlines()
                if l.startswith("Max stack size"))
    return line.split()[3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_server_runs_with_1_gib_stacks_and_its_repository_api_needs_the_key(tmp_path):
    repo = write_echo_repository(tmp_path / "repo")

    with TritonServer(repo, ready_timeout_s=60) as server:
        limit = stack_limit(server.process.pid)
        unload = urllib.request.Request(f"{server.http_url}/v2/repository/models/echo/unload",
                                        data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(unload, timeout=10)
        answer = echo(server, "still here")

    assert limit == str(1 << 30)   # libevhtp's form-body crash needs bodies over half of it
    assert refused.value.code == 403 and "pagedbackend-admin-key" in refused.value.read().decode()
    assert answer == "echo:still here"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_model_that_fails_to_load_is_reported_with_the_server_log(tmp_path):
    repo = write_echo_repository(tmp_path / "repo", init='raise RuntimeError("weights are missing")')
    server = TritonServer(repo, ready_timeout_s=60)

    with pytest.raises(ServerError, match="weights are missing") as refused:
        server.start()

    assert server.process is None
    # The error lines close the message, wherever the log had them: a CI log
    # that keeps only the end of the output still says why.
    errors = str(refused.value).rsplit("errors in the log:", 1)
    assert len(errors) == 2 and "weights are missing" in errors[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_cli_prints_the_urls_and_exits_cleanly_on_sigterm(tmp_path):
    repo = write_echo_repository(tmp_path / "repo")
    make_model_repository(repo, {"model": str(tmp_path / "absent")}, name="broken")
    from loadtest.harness.triton import free_port
    ports = [str(free_port()) for _ in range(3)]
    command = [sys.executable, "-m", "pagedbackend.serve", "--model-repository", str(repo),
               "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
               "--", "--allow-metrics=false"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        lines, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline and not any(l.startswith("ready:") for l in lines):
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
        ready = [l for l in lines if l.startswith("ready:")]
        echo_ready = status_of(f"http://127.0.0.1:{ports[0]}/v2/models/echo/ready")
        metrics = status_of(f"http://127.0.0.1:{ports[2]}/metrics")

        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    assert ready and f"http://127.0.0.1:{ports[0]}" in ready[0] and f"127.0.0.1:{ports[1]}" in ready[0]
    # A model whose weights are missing is skipped with a warning; the rest serves.
    assert any("warning: model broken:" in l and "absent does not exist" in l for l in lines), lines
    assert any("warning: model broken is not ready" in l for l in lines), lines
    assert echo_ready == 200
    assert metrics is None   # --allow-metrics=false was passed through: no metrics endpoint
    assert status == 0
    assert processes_mentioning(str(repo)) == []


@pytest.mark.timeout(120)
def test_serve_cli_refuses_a_missing_model_folder(tmp_path):
    repo = make_model_repository(tmp_path, {"model": str(tmp_path / "absent")})

    done = subprocess.run([sys.executable, "-m", "pagedbackend.serve", "--model-repository", str(repo),
                           "--prepare-only"], cwd=REPO, capture_output=True, text=True, timeout=100)

    assert done.returncode == 1
    assert "absent does not exist" in done.stderr
