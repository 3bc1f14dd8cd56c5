"""A gateway configured by a deployment's environment (compose's or the Helm chart's), and the CORS
preflight a browser sends it: what tests/test_deploy_compose.py and tests/test_helm_chart.py use to
show that the deployment's allowed origins reach the gateway and are the ones it answers.

    with deployed_gateway(nats.url, compose_environment(compose["services"]["gateway"])) as gateway:
        assert allows(preflight(gateway.url, "https://app.example.com"), "https://app.example.com")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import httpx

from services.gateway.config import GatewayConfig
from shared import flags
from tests.gateway_helpers import GatewayThread

# Where the deployed gateway connects and listens, and how long it drains: the test's own, not the
# deployment's (its NATS and Redis hosts, fixed ports, a 30 s drain).
LOCAL = {"redis_url", "host", "port", "grpc_port", "metrics_port", "drain_timeout"}


@contextlib.contextmanager
def deployed_gateway(nats_url: str, env: Mapping[str, str]) -> Iterator[GatewayThread]:
    """A gateway with every setting `env` (RS_* variables) gives it, read as `radixserve gateway` reads
    them (shared/flags.py), but for LOCAL and the NATS connection (this test's server, no login)."""
    exclude = LOCAL | {f for f in GatewayConfig.__dataclass_fields__ if f.startswith("nats_")}
    gateway = GatewayThread(nats_url, **flags.values_from(GatewayConfig, env=env, exclude=exclude))
    try:
        yield gateway
    finally:
        gateway.close()


def preflight(url: str, origin: str) -> httpx.Response:
    """A browser's preflight of a chat request with an API key from a page on `origin`."""
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })


def allows(response: httpx.Response, origin: str) -> bool:
    """Whether a preflight's answer lets the page on `origin` send its request."""
    return response.status_code == 200 and response.headers.get("access-control-allow-origin") == origin


def refuses(response: httpx.Response) -> bool:
    """Whether a preflight got what a gateway without CORS for that origin answers (the route's own 405,
    or a 401 where API keys are on: a preflight brings none) with no Access-Control-* header at all,
    which a browser reads as a refusal (services/gateway/cors.py)."""
    return response.status_code in (401, 405) and not [k for k in response.headers if k.startswith("access-control-")]
