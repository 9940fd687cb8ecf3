"""The four JSON schemas (and one valid instance of each) that ``bench grammar-engines`` compiles and walks.

Real shapes: a flat object, a nested one (arrays, enums, numeric bounds, ``additionalProperties:
false``), a ``$ref``/``anyOf`` one, and a wide one with 100 properties.
"""

from __future__ import annotations

FLAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                   "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "active"],
}
FLAT_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True}

NESTED = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0}},
            "required": ["sku", "quantity", "price"]}},
        "customer": {"type": "object", "additionalProperties": False,
                     "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                     "required": ["id", "tags"]},
    },
    "required": ["order_id", "status", "items", "customer"],
}
NESTED_INSTANCE = {"order_id": "ABC-1234", "status": "shipped",
                   "items": [{"sku": "x-1", "quantity": 2, "price": 9.5}, {"sku": "y-2", "quantity": 1, "price": 20}],
                   "customer": {"id": 7, "tags": ["vip", "eu"]}}

REF_ANY_OF = {
    "$defs": {
        "circle": {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
                   "required": ["kind", "radius"], "additionalProperties": False},
        "rect": {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                                  "h": {"type": "number"}},
                 "required": ["kind", "w", "h"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {"shapes": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/circle"},
                                                                  {"$ref": "#/$defs/rect"}]}}},
    "required": ["shapes"],
    "additionalProperties": False,
}
REF_ANY_OF_INSTANCE = {"shapes": [{"kind": "circle", "radius": 1.5}, {"kind": "rect", "w": 2, "h": 3}]}

_TYPES = ({"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"})
WIDE = {
    "type": "object",
    "properties": {f"field_{i:03d}": _TYPES[i % 4] for i in range(100)},
    "required": [f"field_{i:03d}" for i in range(100)],
    "additionalProperties": False,
}
WIDE_INSTANCE = {f"field_{i:03d}": ("v", i, True, 0.5)[i % 4] for i in range(100)}

SCHEMAS = {"flat": (FLAT, FLAT_INSTANCE), "nested": (NESTED, NESTED_INSTANCE),
           "ref_anyof": (REF_ANY_OF, REF_ANY_OF_INSTANCE), "wide_100": (WIDE, WIDE_INSTANCE)}
"""name -> (schema, a valid instance)."""

SLOW_SHAPES = ("wide_500", "anyof_300", "deep_60")
"""The shapes of :func:`slow_schemas`, the slowest for llguidance to build a matcher from (measured
with the worker's ``GrammarCompiler.matcher`` on the default model: 30-70 ms each on a 2-core
EPYC, against 1-4 ms for ``SCHEMAS``), each under ``MAX_SPEC_BYTES``. Optional properties and
alternatives are what costs; a large enum alone is cheap (4000 values: about 9 ms). More than 500
optional properties pass the spec check but fail at the object's first key: llguidance's parser
allows 2000 items per row, 4 per optional property."""


def slow_schemas(count: int, seed: int = 0) -> list[dict]:
    """``count`` distinct JSON schemas that are slow to compile, cycling through ``SLOW_SHAPES``:
    500 optional properties, ``anyOf`` over 300 objects with numeric bounds, and 60 nested objects
    of 15 optional properties each around an enum of 1000 values. Names are drawn from ``seed``, so
    no two schemas (and no two runs with different seeds) share a compiled grammar."""
    import random

    rng = random.Random(seed)

    def word(i: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) + str(i)

    def wide() -> dict:
        return {"type": "object", "additionalProperties": False,
                "properties": {word(i): _TYPES[i % 4] for i in range(500)}}

    def any_of() -> dict:
        variants = [{"type": "object", "additionalProperties": False, "required": ["kind", "value"],
                     "properties": {"kind": {"const": word(i)},
                                    "value": {"type": "integer", "minimum": i, "maximum": 100 * i + 7}}}
                    for i in range(300)]
        return {"type": "object", "properties": {"item": {"anyOf": variants}}, "required": ["item"]}

    def deep() -> dict:
        node: dict = {"enum": [word(i) for i in range(1000)]}
        for depth in range(60):
            properties = {word(i): {"type": "integer"} for i in range(15)}
            node = {"type": "object", "additionalProperties": False, "required": [f"k{depth}"],
                    "properties": {**properties, f"k{depth}": node}}
        return node

    makers = {"wide_500": wide, "anyof_300": any_of, "deep_60": deep}
    return [makers[SLOW_SHAPES[i % len(SLOW_SHAPES)]]() for i in range(count)]
