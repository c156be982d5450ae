"""`python -m warmroute.realengine.server [llama_cpp.server flags]`: llama-cpp-python's OpenAI server, plus
the two endpoints a router and a benchmark need and it lacks:

  GET /health    200 once the model is loaded (warmroute's router ejects instances whose /health fails)
  GET /metrics   the engine's prefix reuse in tokens, as vLLM's counters (see reuse.py)

Flags are exactly llama_cpp.server's (`--model`, `--cache`, `--cache_size`, `--n_ctx`, `--n_threads`, ...).
"""

from __future__ import annotations

import argparse
import os

from warmroute.realengine.reuse import ReuseCounters, install


def main() -> None:
    import uvicorn
    from fastapi.responses import PlainTextResponse
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args_from_model(parser, Settings)
    args = parser.parse_args()
    server = parse_model_from_args(ServerSettings, args)
    counters = ReuseCounters()
    install(counters)
    app = create_app(server_settings=server, model_settings=[parse_model_from_args(ModelSettings, args)])

    async def health() -> dict[str, str]:  # async: answered on the event loop, never queued behind a prefill
        return {"status": "ok"}

    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(counters.prometheus())

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    uvicorn.run(app, host=os.getenv("HOST", server.host), port=int(os.getenv("PORT", server.port)),
                log_level="warning")


if __name__ == "__main__":
    main()
