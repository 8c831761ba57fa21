"""A rate-limit service client generated from Envoy's own protos (xds-protos), for
sluice's RLS tests: a client in another language than the server, as Envoy is.

  client.py ask ADDR        reads a JSON list of requests on stdin, answers a JSON
                            list: each request {"domain", "descriptors": [[[k, v],
                            ...], ...], "hits_addend"?, "descriptor_hits"?: [n|null]};
                            a call that fails answers {"error": CODE, "message"}
  client.py health ADDR     prints the gRPC health status of the rate-limit service
  client.py burst ADDRS N   reads one request on stdin, sends it N times at once,
                            spread over ADDRS (comma-separated); prints how many
                            were OK and how many OVER_LIMIT
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

CODES = {rls_pb2.RateLimitResponse.OK: "OK", rls_pb2.RateLimitResponse.OVER_LIMIT: "OVER_LIMIT",
         rls_pb2.RateLimitResponse.UNKNOWN: "UNKNOWN"}
UNITS = {v: k for k, v in rls_pb2.RateLimitResponse.RateLimit.Unit.items()}


def request(spec):
    descriptors = []
    hits = spec.get("descriptor_hits") or []
    for i, entries in enumerate(spec["descriptors"]):
        d = ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
        if i < len(hits) and hits[i] is not None:
            d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits[i]))
        descriptors.append(d)
    return rls_pb2.RateLimitRequest(domain=spec["domain"], descriptors=descriptors,
                                    hits_addend=spec.get("hits_addend", 0))


def answer(response):
    return {
        "overall": CODES[response.overall_code],
        "statuses": [{
            "code": CODES[s.code],
            "limit": s.current_limit.requests_per_unit if s.HasField("current_limit") else None,
            "unit": UNITS[s.current_limit.unit] if s.HasField("current_limit") else None,
            "name": s.current_limit.name if s.HasField("current_limit") else None,
            "remaining": s.limit_remaining,
            "reset": s.duration_until_reset.seconds if s.HasField("duration_until_reset") else None,
        } for s in response.statuses],
        "headers": {h.key: h.value for h in response.response_headers_to_add},
    }


def ask(stub, spec):
    """The answer to one request, or {"error": its gRPC status code's name}."""
    try:
        return answer(stub.ShouldRateLimit(request(spec), timeout=10))
    except grpc.RpcError as error:
        return {"error": error.code().name, "message": error.details()}


def main():
    command, addr = sys.argv[1], sys.argv[2]
    if command == "ask":
        with grpc.insecure_channel(addr) as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            out = [ask(stub, spec) for spec in json.load(sys.stdin)]
        print(json.dumps(out))
    elif command == "health":
        with grpc.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            name = "envoy.service.ratelimit.v3.RateLimitService"
            status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    elif command == "burst":
        n = int(sys.argv[3])
        spec = json.load(sys.stdin)
        channels = [grpc.insecure_channel(a) for a in addr.split(",")]
        stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
        req = request(spec)
        with ThreadPoolExecutor(max_workers=32) as pool:
            codes = list(pool.map(lambda i: stubs[i % len(stubs)].ShouldRateLimit(req, timeout=20).overall_code,
                                  range(n)))
        print(json.dumps({"ok": codes.count(rls_pb2.RateLimitResponse.OK),
                          "over_limit": codes.count(rls_pb2.RateLimitResponse.OVER_LIMIT)}))
        for c in channels:
            c.close()
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
