"""`pagedserve complete`: one request, streamed from a gateway (or run in-process with --offline)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pagedserve.sampling_flags import sampling_pb_from_args
from pagedserve.services.common.auth import bearer_metadata
from pagedserve.services.common.grpc_server import CLIENT_API_CHANNEL_OPTIONS
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from pagedserve.services.common.service_args import DEFAULT_PORT

@dataclass
class Sample:
    """One sample's text, tokens, finish reason (OpenAI's name: ``stop``, ``length``, ``abort``,
    ``tool_calls``) and tool calls (``{"id", "name", "arguments"}`` each)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    def as_json(self) -> dict:
        body = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        return body | ({"tool_calls": self.tool_calls} if self.tool_calls else {})


@dataclass
class Completion:
    """What a completion accumulated; printed as JSON by --json (sample 0 at the top, every
    sample under ``choices`` when ``--n`` asked for more than one)."""

    samples: list[Sample] = field(default_factory=lambda: [Sample()])
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def sample(self, index: int) -> Sample:
        while len(self.samples) <= index:
            self.samples.append(Sample())
        return self.samples[index]

    @property
    def text(self) -> str:
        return self.samples[0].text

    def add(self, response: gen.GenerateResponse) -> None:
        """Adds one response of the stream to its sample."""
        sample = self.sample(response.index)
        sample.text += response.text
        sample.token_ids.extend(response.token_ids)
        sample.tool_calls += [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in response.tool_calls]
        if response.finish_reason:
            sample.finish_reason = gen.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
        if response.HasField("usage"):
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens

    def to_json(self) -> str:
        body = self.samples[0].as_json()
        body["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if len(self.samples) > 1:
            body["choices"] = [{"index": i} | s.as_json() for i, s in enumerate(self.samples)]
        return json.dumps(body)


def tools_pb(text: str) -> list[gen.Tool]:
    """``--tools`` (OpenAI's JSON list of tools) as the API's tools.

    Raises:
        InvalidRequestError: ``--tools`` that is not such a list.
    """
    from pagedserve.engine.sampling_params import InvalidRequestError

    try:
        return [gen.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                         parameters=json.dumps(t["function"].get("parameters", {})))
                for t in json.loads(text)]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidRequestError("--tools", f"is not a JSON list of {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ...}}}} tools ({exc!r})") from None


def set_tools(chat: gen.ChatMessages, args: argparse.Namespace) -> None:
    """``--tools`` and ``--tool-choice`` on the chat."""
    chat.tools.extend(tools_pb(args.tools) if args.tools else ())
    if args.tool_choice in ("none", "auto", "required"):
        chat.tool_choice.mode = gen.ToolChoice.Mode.Value(f"MODE_{args.tool_choice.upper()}")
    elif args.tool_choice:
        chat.tool_choice.function = args.tool_choice


def build_request(args: argparse.Namespace) -> gen.GenerateRequest:
    """The request the flags describe.

    Raises:
        InvalidRequestError: ``--tools`` or ``--tool-choice`` without ``--chat``, or bad ``--tools``.
    """
    from pagedserve.engine.sampling_params import InvalidRequestError

    request = gen.GenerateRequest(sampling_params=sampling_pb_from_args(args))
    if args.chat:
        messages = [gen.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(gen.ChatMessage(role="user", content=args.prompt))
        request.chat.messages.extend(messages)
        set_tools(request.chat, args)
    elif args.tools or args.tool_choice:
        raise InvalidRequestError("--tools", "needs --chat (tools are offered to a chat)")
    else:
        request.prompt = args.prompt
    return request


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls`` and ``--tls-ca-file``: reach a gateway that serves TLS."""
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    parser.add_argument("--tls-ca-file", default="",
                        help="connect with TLS, trusting the CA certificate(s) in this PEM file (implies --tls)")


def tls_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS channel credentials the flags ask for, or None for plaintext.

    Raises:
        OSError: the CA file cannot be read.
    """
    if args.tls_ca_file:
        return grpc.ssl_channel_credentials(root_certificates=open(args.tls_ca_file, "rb").read())
    return grpc.ssl_channel_credentials() if args.tls else None


def gateway_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to a gateway (TLS when ``credentials`` are given) with the client API's size limits."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=CLIENT_API_CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CLIENT_API_CHANNEL_OPTIONS)


class Echo:
    """Prints sample 0's text as it arrives, and ends its line before anything else is printed."""

    def __init__(self) -> None:
        self._line_open = False

    def write(self, text: str) -> None:
        print(text, end="", flush=True)
        self._line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """Ends the text's line if it is not ended (an error then starts a line of its own)."""
        if self._line_open:
            print(flush=True)
            self._line_open = False


def stream_completion(target: str, request: gen.GenerateRequest, timeout_s: float,
                      on_text: Callable[[str], None] = lambda text: None, api_key: str = "",
                      credentials: grpc.ChannelCredentials | None = None) -> Completion:
    """Calls Generate and accumulates the stream; hands each non-empty text delta of sample 0 to
    ``on_text`` as it comes.

    ``api_key`` is sent as ``authorization: Bearer`` when not empty; ``credentials`` make it TLS.

    Raises:
        grpc.RpcError: the server refused or failed the request.
    """
    completion = Completion()
    with gateway_channel(target, credentials) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, timeout=timeout_s, metadata=bearer_metadata(api_key)):
            completion.add(response)
            if response.text and response.index == 0:
                on_text(response.text)
    return completion


def offline_completion(args: argparse.Namespace, request: gen.GenerateRequest) -> Completion:
    """The same request on the in-process engine (no services); tool calls are parsed as the
    gateway parses them (with the hermes parser)."""
    from pagedserve.config_flags import config_from_args
    from pagedserve.engine.runner_config import EngineConfig
    from pagedserve.llm import LLM
    from pagedserve.text.tool_parsers import ToolCallParserKind
    from pagedserve.services.gateway.grpc_tools import SampleCalls

    llm = LLM(args.model or None, config_from_args(EngineConfig, args, EngineConfig.of()))
    from pagedserve.services.gateway.request_parser import parse_generate_request

    try:
        given = parse_generate_request(request, llm.tokenizer)  # validated exactly as the gateway does
        result = llm.run_to_completion([llm.add_parsed(given.parsed, request.request_id or None)])[0]
    finally:
        llm.close()  # stops the helper ranks of --tensor-parallel-size / --pipeline-parallel-size
    if result.error:
        raise EngineRefusal(result.error)
    completion = Completion()
    calls = SampleCalls(given.tool_use, ToolCallParserKind.HERMES)
    for i, sample in enumerate(result.samples):
        response = gen.GenerateResponse(text=sample.text, token_ids=sample.token_ids, index=i)
        calls.fill(response, sample.finish_reason)
        completion.add(response)
    completion.prompt_tokens = len(result.prompt_token_ids)
    completion.completion_tokens = sum(len(s.token_ids) for s in completion.samples)
    return completion


NOT_GRPC = ("http1.x server", "Failed parsing HTTP/2")
"""What gRPC's core says when the server at a target answered, but not in HTTP/2 (an HTTP/1 server, Redis, ...)."""


def unreachable_hint(exc: grpc.RpcError) -> str:
    """What to do when a client's call found no gateway: an HTTP server answered (--target named the OpenAI
    API's port), or nothing did."""
    if any(sign in (exc.details() or "") for sign in NOT_GRPC):
        return ("Something answers at that port, but not gRPC (the OpenAI HTTP API's port?): --target takes the "
                f"gateway's gRPC port ({DEFAULT_PORT} by default).")
    return "Is the stack up? `pagedserve up` starts it; --target names the service's gRPC HOST:PORT."


def hint(exc: grpc.RpcError) -> str:
    """What to do about a failed call's status, to append to its message ("" when there is nothing to add)."""
    if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
        return " (pass the gateway's key with --api-key or PAGEDSERVE_API_KEY)"
    return f" ({unreachable_hint(exc)})" if exc.code() is grpc.StatusCode.UNAVAILABLE else ""


class EngineRefusal(RuntimeError):
    """The in-process engine refused the request (it cannot fit in the KV cache)."""


def run_complete(args: argparse.Namespace) -> int:
    """Runs `pagedserve complete`; returns the exit status (1 on a server error)."""
    from pagedserve.engine.sampling_params import InvalidRequestError

    echo = Echo()
    try:
        request = build_request(args)
        if request.sampling_params.n > 1 and not args.json:
            print("--- sample 0 ---")  # streamed as it comes; the others are printed after it
        if args.offline:
            completion = offline_completion(args, request)
            if not args.json:
                print(completion.text, end="")
        else:
            on_text = (lambda text: None) if args.json else echo.write
            completion = stream_completion(args.target, request, args.timeout, on_text, api_key=args.api_key,
                                           credentials=tls_credentials(args))
    except EngineRefusal as exc:
        print(f"error: RESOURCE_EXHAUSTED: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        echo.end_line()
        print(f"error: {exc.code().name}: {exc.details()}{hint(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # an unreadable --tls-ca-file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except InvalidRequestError as exc:
        print(f"error: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(completion.to_json())
        return 0
    for i, sample in enumerate(completion.samples):
        if i:
            print(f"\n--- sample {i} ---\n{sample.text}", end="")
        for call in sample.tool_calls:
            print(f"\ntool call {call['id']}: {call['name']}({call['arguments']})", end="")
    print()
    return 0
