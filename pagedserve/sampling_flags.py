"""The sampling flags of `pagedserve complete`, named as the API's fields."""

from __future__ import annotations

import argparse
import dataclasses

from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams

DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
"""The API's defaults, which an unset flag leaves to the gateway (the help shows them)."""


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (names as in the API's SamplingParams)")
    g.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the rest of the context)")
    g.add_argument("--temperature", type=float, help=f"0 is greedy (default {DEFAULTS['temperature']})")
    g.add_argument("--top-p", type=float, help=f"nucleus sampling mass in (0, 1] (default {DEFAULTS['top_p']})")
    g.add_argument("--top-k", type=int, help=f"keep the k most likely tokens; -1 = off (default {DEFAULTS['top_k']})")
    g.add_argument("--min-p", type=float,
                   help=f"drop tokens below min_p times the top probability (default {DEFAULTS['min_p']})")
    g.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    g.add_argument("--min-tokens", type=int, default=DEFAULTS["min_tokens"],
                   help="no EOS/stop tokens before this many (default %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=[], help="stop token ids")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    g.add_argument("--include-stop-str-in-output", action="store_true", help="keep the matched stop string")
    g.add_argument("--keep-special-tokens", action="store_true", help="show special tokens such as <|im_end|>")
    g.add_argument("--n", type=int, help=f"samples of the prompt, sharing its KV blocks (default {DEFAULTS['n']})")


def sampling_pb_from_args(args: argparse.Namespace) -> gen.SamplingParams:
    """The flags as the protobuf message the gateway validates, by field name (a flag is named as
    its field; unset flags stay unset, ``--keep-special-tokens`` sets ``skip_special_tokens`` false).

    Raises:
        InvalidRequestError: a value outside its field's protobuf type (int32, uint64), named as
            the gRPC API names it (``sampling_params.seed``).
    """
    msg = gen.SamplingParams()
    for name, pf in gen.SamplingParams.DESCRIPTOR.fields_by_name.items():
        value = getattr(args, name, None)
        if value is None or value is False or (pf.is_repeated and not value):
            continue
        try:
            if pf.is_repeated:
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        except ValueError as exc:  # outside the field's protobuf type (int32, uint64)
            raise InvalidRequestError(f"sampling_params.{name}", f"{value} is out of range") from exc
    if args.keep_special_tokens:
        msg.skip_special_tokens = False
    return msg
