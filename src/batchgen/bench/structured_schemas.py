"""JSON schemas for the structured-output measurements, and valid instances of them built by hand.

`WIDE_SCHEMA` has 30 top-level fields of every kind a synthesis record uses (integers and numbers
with bounds, enums, string patterns, a nullable field, a nested object, arrays with minItems, an
array of objects), all required, no extra properties. `wide_instance(rng)` builds a record that
satisfies it from a seeded generator, so a grammar can be walked through a realistic output without
a model; the tests check the instances against the `jsonschema` package.
"""

from __future__ import annotations

import random

_WORDS = ("alpha", "bravo", "delta", "north", "river", "stone", "cloud", "maple", "orbit", "quartz",
          "ember", "cedar", "harbor", "lumen", "prairie", "summit", "tundra", "violet")

WIDE_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "status": {"enum": ["new", "active", "suspended", "closed"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "created": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "priority": {"enum": ["low", "medium", "high"]},
        "notes": {"type": "string"},
        "weight_kg": {"type": "number", "minimum": 0, "maximum": 500},
        "height_cm": {"type": "number", "minimum": 30, "maximum": 250},
        "is_verified": {"type": "boolean"},
        "phone": {"type": "string", "pattern": "^\\+[0-9]{7,12}$"},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es", "it"]}, "minItems": 1},
        "manager": {"type": ["string", "null"]},
        "department": {"enum": ["research", "sales", "support", "legal"]},
        "salary": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "start_year": {"type": "integer", "minimum": 1950, "maximum": 2030},
        "skills": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "level": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["name", "level"],
                "additionalProperties": False,
            },
            "minItems": 2,
        },
        "remote": {"type": "boolean"},
        "timezone": {"type": "string", "pattern": "^UTC[+-][0-9]{1,2}$"},
        "bio": {"type": "string", "maxLength": 200},
        "website": {"type": "string"},
        "rank": {"type": "integer", "minimum": -100, "maximum": 100},
        "metadata": {
            "type": "object",
            "properties": {
                "source": {"enum": ["web", "form", "import"]},
                "version": {"type": "integer", "minimum": 1},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["source", "version", "confidence"],
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
WIDE_SCHEMA["required"] = list(WIDE_SCHEMA["properties"])


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def wide_instance(rng: random.Random) -> dict:
    """A record that satisfies WIDE_SCHEMA, its keys in the schema's order (as a grammar emits them)."""
    first = rng.choice(_WORDS)
    return {
        "id": rng.randint(1, 1000000),
        "name": f"{first.title()} {rng.choice(_WORDS).title()}",
        "email": f"{first}@{rng.choice(_WORDS)}.com",
        "age": rng.randint(18, 90),
        "score": round(rng.uniform(0, 100), 2),
        "active": rng.random() < 0.5,
        "status": rng.choice(["new", "active", "suspended", "closed"]),
        "tags": [rng.choice(_WORDS) for _ in range(rng.randint(1, 4))],
        "address": {"street": f"{rng.randint(1, 999)} {_words(rng, 1, 2).title()} St",
                    "city": rng.choice(_WORDS).title(), "zip": f"{rng.randint(0, 99999):05d}",
                    "country": rng.choice(["US", "FR", "DE", "JP"])},
        "created": f"{rng.randint(2000, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "rating": rng.randint(1, 5),
        "priority": rng.choice(["low", "medium", "high"]),
        "notes": _words(rng, 2, 8),
        "weight_kg": round(rng.uniform(40, 120), 1),
        "height_cm": round(rng.uniform(140, 210), 1),
        "is_verified": rng.random() < 0.5,
        "phone": "+" + "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(7, 12))),
        "languages": rng.sample(["en", "fr", "de", "es", "it"], rng.randint(1, 3)),
        "manager": None if rng.random() < 0.3 else rng.choice(_WORDS).title(),
        "department": rng.choice(["research", "sales", "support", "legal"]),
        "salary": rng.randint(20000, 200000),
        "currency": rng.choice(["USD", "EUR", "GBP"]),
        "start_year": rng.randint(1990, 2025),
        "skills": [{"name": rng.choice(_WORDS), "level": rng.randint(1, 10)} for _ in range(rng.randint(2, 4))],
        "remote": rng.random() < 0.5,
        "timezone": f"UTC{rng.choice('+-')}{rng.randint(0, 12)}",
        "bio": _words(rng, 4, 16),
        "website": f"https://{rng.choice(_WORDS)}.example.org",
        "rank": rng.randint(-100, 100),
        "metadata": {"source": rng.choice(["web", "form", "import"]), "version": rng.randint(1, 9),
                     "confidence": round(rng.random(), 3)},
    }
