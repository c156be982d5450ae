"""`warmroute epp`: warmroute as the Endpoint Picker of an Envoy-based gateway (Gateway API Inference Extension).

The gateway carries the requests; the picker answers Envoy's ext_proc stream for each one with the instance to
send it to, decided by the same Router, strategies, index and books as `warmroute serve` (router/routing.py).
See docs/gateway.md.
"""
