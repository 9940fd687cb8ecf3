"""`pagedserve complete`: one request, streamed from a gateway (or run in-process with --offline)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import grpc

from pagedserve.sampling_flags import sampling_pb_from_args
from services.common.pb import generate_pb2 as gen
from services.common.pb import generate_pb2_grpc

FINISH_REASON_NAMES = {
    gen.FINISH_REASON_STOP: "stop",
    gen.FINISH_REASON_LENGTH: "length",
    gen.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Completion:
    """What a completion accumulated; printed as JSON by --json."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_json(self) -> str:
        return json.dumps({
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
        })


def build_request(args: argparse.Namespace) -> gen.GenerateRequest:
    request = gen.GenerateRequest(sampling_params=sampling_pb_from_args(args))
    if args.chat:
        messages = [gen.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(gen.ChatMessage(role="user", content=args.prompt))
        request.chat.messages.extend(messages)
    else:
        request.prompt = args.prompt
    return request


def stream_completion(target: str, request: gen.GenerateRequest, timeout_s: float, echo: bool) -> Completion:
    """Calls Generate and accumulates the stream; prints text deltas as they come when ``echo``.

    Raises:
        grpc.RpcError: the server refused or failed the request.
    """
    completion = Completion()
    with grpc.insecure_channel(target) as channel:
        for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s):
            completion.text += response.text
            completion.token_ids.extend(response.token_ids)
            if echo and response.text:
                print(response.text, end="", flush=True)
            if response.finish_reason:
                completion.finish_reason = FINISH_REASON_NAMES[response.finish_reason]
                completion.prompt_tokens = response.usage.prompt_tokens
                completion.completion_tokens = response.usage.completion_tokens
    return completion


def offline_completion(args: argparse.Namespace, request: gen.GenerateRequest) -> Completion:
    """The same request on the in-process engine (no services)."""
    from pagedserve.llm import LLM

    llm = LLM(model=args.model or None)
    result = llm.generate_from_pb(request)
    return Completion(
        text=result.text,
        token_ids=list(result.token_ids),
        finish_reason=result.finish_reason.value if result.finish_reason else None,
        prompt_tokens=len(result.prompt_token_ids),
        completion_tokens=len(result.token_ids),
    )


def run_complete(args: argparse.Namespace) -> int:
    """Runs `pagedserve complete`; returns the exit status (1 on a server error)."""
    from services.common.sampling_params import InvalidRequestError

    request = build_request(args)
    try:
        if args.offline:
            completion = offline_completion(args, request)
            if not args.json:
                print(completion.text, end="")
        else:
            completion = stream_completion(args.target, request, args.timeout, echo=not args.json)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except InvalidRequestError as exc:
        print(f"error: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 1
    print(completion.to_json() if args.json else "")
    return 0
