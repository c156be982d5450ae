"""`warmroute serve`: the thin I/O shell around the pure routing core.

  settings.py  every setting (CLI > WARMROUTE_* env > YAML > defaults); generates docs/configuration.md
  cli.py       the `serve` subcommand
  server.py    bind, run on uvloop, graceful shutdown, worker processes; `start_router` for tests
  app.py       the HTTP routes and the error middleware; builds the components and starts them in order
  components.py  the lifecycle every service shares (start in order, stop in reverse, bounded)
  connections.py the clients to the instances (control session, upstream pool), as one component
  discovery.py and members.py  who is in the fleet, and the membership events the others follow
  routing.py   WHERE A REQUEST'S INSTANCE IS CHOSEN: body -> routing key -> strategy (warmroute/core)
  proxy.py     forwarding to the instance, streaming the answer back, retry on connect failure
  usage.py     reading the engine's cached-token report from the relayed response (engine feedback)
  health.py    active checks and passive ejection
  engine_metrics.py  scraping each engine's /metrics for its own load and KV capacity
  kv_subscriber.py   precise mode: each engine's KV-cache events (ZMQ), in sequence, into the exact index
  prompt_tokens.py   precise mode: a request's prompt as the engine's token ids (chat template, tokenizer)
  metrics.py   Prometheus metrics
  errors.py    JSON error answers
"""
