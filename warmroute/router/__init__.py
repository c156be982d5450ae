"""`warmroute serve`: the thin I/O shell around the pure routing core.

  settings.py  every setting (CLI > WARMROUTE_* env > YAML > defaults); generates docs/configuration.md
  cli.py       the `serve` subcommand
  server.py    bind, run on uvloop, graceful shutdown, worker processes; `start_router` for tests
  app.py       the HTTP routes and the error middleware
  routing.py   WHERE A REQUEST'S INSTANCE IS CHOSEN: body -> routing key -> strategy (warmroute/core)
  proxy.py     forwarding to the instance, streaming the answer back, retry on connect failure
  health.py    active checks and passive ejection
  metrics.py   Prometheus metrics
  errors.py    JSON error answers
"""
