"""The names vLLM and newer SGLang give some of our routes, so their users' scripts and probes work
unchanged: each is the same function as our route, with the same answer and errors.

| alias | our route | whose name |
| --- | --- | --- |
| POST /v1/tokenize, /v1/detokenize | /tokenize, /detokenize | vLLM and SGLang |
| GET or POST /ping | GET /health | vLLM (SageMaker's liveness probe) |
| GET /model_info, /server_info | /get_model_info, /get_server_info | SGLang (which keeps both) |

and GET /version, `{"version": ...}` (vLLM's; SGLang puts the version in /get_server_info, as we do too).
"""

from __future__ import annotations

from fastapi import APIRouter

from services.gateway.native_api import HEALTH_RESPONSES, VERSION, get_model_info, get_server_info, health
from services.gateway.openapi import GUARDED, WITH_BODY, responses
from services.gateway.tokenize_api import detokenize, tokenize

router = APIRouter(tags=["aliases"])

router.add_api_route("/v1/tokenize", tokenize, methods=["POST"], responses=responses(*WITH_BODY, 404))
router.add_api_route("/v1/detokenize", detokenize, methods=["POST"], responses=responses(*WITH_BODY, 404))
for method in ("GET", "POST"):  # a route each, so each has its own OpenAPI operation id
    router.add_api_route("/ping", health, methods=[method], responses=HEALTH_RESPONSES)
router.add_api_route("/model_info", get_model_info, methods=["GET"], responses=responses(*GUARDED))
router.add_api_route("/server_info", get_server_info, methods=["GET"], responses=responses(*GUARDED))


@router.get("/version", responses=responses(500))
async def server_version() -> dict[str, str]:
    """The radixserve version this gateway runs."""
    return {"version": VERSION}
