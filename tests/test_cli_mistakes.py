"""What the clients and `pagedserve up` say to the first mistakes a newcomer makes (review 69): a target with
no gateway, or the HTTP port, or a URL, or no port; ports of one stack that clash; an offset past 65535."""

from __future__ import annotations

import argparse
import http.server
import threading

import pytest

from pagedserve.cli import main
from pagedserve.stack_config import StackConfig
from pagedserve.stack_ports import apply_port_offset
from tests.e2e.ports import free_port


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_health_says_unreachable_when_nothing_listens(capsys):
    code, out, _ = run_cli(capsys, "health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "5")
    assert code == 1
    assert out.startswith("UNREACHABLE: no gRPC service answers at 127.0.0.1:") and "Is the stack up?" in out


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_a_target_that_answers_http_is_named_so(capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = f"127.0.0.1:{server.server_port}"
        code, out, _ = run_cli(capsys, "health", "--target", target, "--timeout", "5")
        assert code == 1 and "but not gRPC (the OpenAI HTTP API's port?)" in out
        code, _, err = run_cli(capsys, "complete", "--target", target, "--prompt", "Hi", "--timeout", "5")
        assert code == 1 and err.startswith("error: UNAVAILABLE") and "but not gRPC" in err
    finally:
        server.shutdown()


@pytest.mark.parametrize(("target", "said"), [("http://127.0.0.1:8000", "is a URL: --target takes the gateway's gRPC"),
                                              ("localhost", "'localhost' has no port")])
def test_a_target_that_is_no_grpc_host_and_port_is_refused_before_any_call(capsys, target, said):
    code, _, err = run_cli(capsys, "complete", "--target", target, "--prompt", "Hi")
    assert code == 2 and said in err


def test_two_ports_of_one_stack_that_clash_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="gateway gRPC and gateway HTTP would both listen on port 8700"):
        StackConfig(model=tmp_path, port=8700, http_port=8700)
    with pytest.raises(ValueError, match="scheduler-0 and gateway metrics would both listen on port 50752"):
        StackConfig(model=tmp_path, port=50751, http_port=8700, scheduler_port=50752, metrics_port=50752)
    with pytest.raises(ValueError, match="gateway gRPC and Redis would both listen on port 6379"):
        StackConfig(model=tmp_path, port=6379, redis_url="redis://127.0.0.1:6379/0")
    assert len(StackConfig(model=tmp_path, port=50751, http_port=8700, scheduler_port=50752,
                           metrics_port=10150).listen_ports()) == 6
    assert StackConfig(model=tmp_path, port=6379, redis_url="redis://10.0.0.5:6379/0")  # a remote Redis: no clash


def test_an_offset_that_moves_redis_past_65535_says_so():
    args = argparse.Namespace(port_offset=1000, port=50051, http_port=8000, scheduler_port=50052, metrics_port=0,
                              redis_url="redis://127.0.0.1:65000/0")
    with pytest.raises(ValueError, match="moves the local Redis's port 65000 past port 65535"):
        apply_port_offset(args)


@pytest.mark.parametrize(("target", "said"), [("::1", "write an IPv6 address in brackets"),
                                              ("::1:50051", "in brackets"),
                                              ("127.0.0.1:99999", "the port must be in 1..65535")])
def test_a_target_an_ipv6_address_or_port_gRPC_would_misread_is_refused(capsys, target, said):
    code, _, err = run_cli(capsys, "health", "--target", target)
    assert code == 2 and said in err


def test_a_server_that_answers_without_a_health_service_is_not_called_unreachable(capsys):
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code, out, _ = run_cli(capsys, "health", "--target", f"127.0.0.1:{port}", "--timeout", "5")
        assert code == 1 and out.startswith("UNIMPLEMENTED")
    finally:
        server.stop(0)


def test_an_offset_that_moves_a_port_past_65535_names_the_flag():
    args = argparse.Namespace(port_offset=20000, port=50051, http_port=8000, scheduler_port=50052, metrics_port=9450,
                              redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match=r"--port-offset 20000 moves --port 50051, --scheduler-port 50052 past "):
        apply_port_offset(args)


def test_a_model_folder_that_does_not_exist_is_named_so_and_one_without_config_json_too(tmp_path):
    from pagedserve.engine.models.config import ModelConfigError
    from pagedserve.engine.models.registry import load_model_config

    with pytest.raises(ModelConfigError, match="nope is not a folder; --model takes a Hugging Face model folder"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="has no config.json; --model takes a Hugging Face model folder"):
        load_model_config(tmp_path)


def test_pagedserve_alone_lists_its_commands(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2
    assert all(f"\n    {command} " in err for command in ("up", "complete", "health", "bench"))
