"""The gateway: radixserve's front door (HTTP: OpenAI-compatible and native; gRPC; NATS).

service.py runs it all in one process from config.py's GatewayConfig. dispatch.py is what every door
does with a request (validate, route, publish, abort), over router.py (live workers, least loaded) and
streams.py (this gateway's stream subject fanned out per request); liveness.py finds gone workers and
migration.py moves their requests. HTTP: app.py (error mapping, body limit, request counts),
openai_protocol.py + openai_api.py, native_api.py, http_streaming.py (SSE).
gRPC: grpc_server.py with the stubs protos.py generates from proto/. NATS: nats_frontdoor.py.
auth.py checks API keys for every door; aborts.py decides who may abort which request.
errors.py holds the statuses; metrics.py the Prometheus metrics.
"""
