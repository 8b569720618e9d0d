"""The OpenAI-compatible HTTP edge: an ASGI app (app.py) served by uvicorn in the gRPC server's event loop
(server.py), translating OpenAI requests into the same engine Requests as gRPC (openai_requests.py) and
engine output into OpenAI responses and SSE events (openai_responses.py, sse.py)."""
