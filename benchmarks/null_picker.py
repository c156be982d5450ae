#!/usr/bin/env python3
"""A null endpoint picker for benchmarks/gateway.py: grpcio's asyncio API with no routing code.

    python benchmarks/null_picker.py PORT HOST:PORT [HOST:PORT ...]

Answers each ext_proc message at once; the request's last message (its body, or headers without a body) sets
x-gateway-destination-endpoint to the next engine, round robin. What Envoy + a Python grpcio picker costs before
any of warmroute's own code runs.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

DESTINATION = "x-gateway-destination-endpoint"


class NullPicker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, engines: list[str]) -> None:
        self.next = itertools.cycle(engines)

    def _routed(self) -> ep.CommonResponse:
        header = core.HeaderValueOption(header=core.HeaderValue(key=DESTINATION, raw_value=next(self.next).encode()),
                                        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        return ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[header]), clear_route_cache=True)

    def answer(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            routed = self._routed() if message.request_headers.end_of_stream else None
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=routed))
        if kind == "request_body":
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=self._routed()))
        if kind == "response_headers":
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if kind == "response_body":
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        return ep.ProcessingResponse()

    async def Process(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            if not message.observability_mode:  # observed messages get no answer
                await context.write(self.answer(message))


async def serve(port: int, engines: list[str]) -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(NullPicker(engines), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"null picker on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        raise SystemExit(2)
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2:]))
