"""Schemathesis hooks for tests/test_openapi_conformance.py (loaded through SCHEMATHESIS_HOOKS).

The OpenAPI document states every rule JSON Schema can say. A few rules it cannot: a grammar must
compile (regex, ebnf, json_schema, a forced tool call's parameters), min_tokens <= max_tokens, best_of
is 1 or n, a native batch's rid list has one id per prompt, a named tool_choice is among the tools.
And a request's own `timeout` that runs out is a 504 by design (the request took longer than its client
allows), which schemathesis would count as a server error: generated valid timeouts are left out. So
is /ready's 503 for a model no worker serves (not ready for it): its generated `model`, valid or not
(a query string carries any value as text), becomes the model the scripted pipeline serves.
Schema-valid bodies that break one of them are changed here, before they are sent, into the nearest
body that keeps it: the check that they are accepted stays meaningful for everything else. Bodies
generated to violate the schema are sent as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis

from tests.gateway_helpers import FAKE_MODEL

GRAMMARS = ("regex", "ebnf", "json_schema")


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if case.path == "/ready" and isinstance(case.query, dict) and "model" in case.query:
        case.query["model"] = FAKE_MODEL
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return
    body = case.body
    sampling = body.get("sampling_params")
    for fields in (body, sampling if isinstance(sampling, dict) else {}):
        for name in (*GRAMMARS, "min_tokens", "min_new_tokens", "timeout"):
            fields.pop(name, None)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_object"}
    if body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict):
        body["tool_choice"] = "auto"
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        body.pop("best_of")
    if isinstance(body.get("rid"), list) or (
        "rid" in body and any(isinstance(body.get(k), list) and body[k] and isinstance(body[k][0], (str, list))
                              for k in ("text", "input_ids"))):
        body.pop("rid")
