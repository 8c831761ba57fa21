#!/usr/bin/env python3
"""A real MCP client session through the sluice gateway, with the official MCP
Python SDK (PyPI `mcp`, 2.x; see requirements.txt).

    session.py normal  http://127.0.0.1:PORT/mcp   # default policy
    session.py refused http://127.0.0.1:PORT/mcp   # tests/mcp/tiny-policy.yaml
    session.py jsonrpc http://127.0.0.1:PORT/mcp   # the same, refusals as JSON-RPC
    session.py agent   http://127.0.0.1:PORT/mcp   # 2 s windows, refusals as JSON-RPC:
                                                   # call until refused, sleep the
                                                   # error's retry_after_seconds, go on

Client API (mcp 2.x): `mcp.client.streamable_http.streamable_http_client(url,
http_client=...)` yields the (read, write) stream pair of the Streamable HTTP
transport; `mcp.ClientSession(read, write)` runs the JSON-RPC session on it
(`initialize()`, `list_tools()`, `call_tool()`); a JSON-RPC error, or an HTTP
error the transport turned into one, is raised as `mcp.MCPError`.

The SDK's transport is given an httpx2 client of ours whose event hooks record
every HTTP exchange (method, status, headers, and the body of error answers),
so that each check can say what went over the wire, and so that a refusal can
be pinned on the gateway's 429: mcp 2.3.0 maps any non-JSON HTTP error answer
to a request onto a JSON-RPC error (-32603 "Server returned an error
response") and keeps neither the status nor the response in the exception.

Each check prints `ok: ...` or `FAIL: ...`; the last line is
`session RESULT passed=P failed=F` (read by scripts/mcp-test). Exit status 0
only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp
from mcp import ClientSession, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import INTERNAL_ERROR, TextContent

# The gateway's edge-limiter refusal (SPEC H2).
REFUSAL_STATUS = 429
REFUSAL_CONTENT_TYPE = "text/html; charset=utf-8"
REFUSAL_BODY = "Too many requests, please try again later."


REQUIRED_TOOLS = ("optimize_message", "search_fields")

# Bounds: no request, and no whole session, can hang the run.
REQUEST_TIMEOUT_SECONDS = 20

# agent mode: most tools/call the loop makes before it must have been refused, and
# the longest wait it accepts (the short-window policy's window is 2 s).
AGENT_MAX_CALLS = 20
AGENT_MAX_WAIT_SECONDS = 3
SESSION_TIMEOUT_SECONDS = 90


@dataclass
class Exchange:
    """One HTTP request the SDK sent and the answer it got."""

    method: str
    url: str
    request_headers: dict[str, str]
    rpc: Any  # the parsed JSON-RPC body of a POST, else None
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    body: str | None = None  # read only for answers >= 400 (2xx may be an endless stream)

    def rpc_method(self) -> str | None:
        return self.rpc.get("method") if isinstance(self.rpc, dict) else None

    def rpc_id(self) -> Any:
        return self.rpc.get("id") if isinstance(self.rpc, dict) else None

    def describe(self) -> str:
        what = self.method
        if self.rpc_method():
            what += f" {self.rpc_method()}"
            if self.rpc_id() is not None:
                what += f" (id {self.rpc_id()})"
        headers = {k: v for k, v in self.response_headers.items() if k in _SHOWN_HEADERS}
        out = f"{what} -> {self.status} {json.dumps(headers)}"
        if self.body is not None:
            out += f" body={self.body[:300]!r}"
        return out


_SHOWN_HEADERS = (
    "content-type",
    "mcp-session-id",
    "retry-after",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
)


class Recorder:
    """httpx2 event hooks that log every exchange of the SDK's transport."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []
        self._by_request: dict[int, Exchange] = {}

    async def on_request(self, request: httpx2.Request) -> None:
        rpc = None
        if request.method == "POST":
            try:
                rpc = json.loads(request.content)
            except (ValueError, httpx2.RequestNotRead):
                rpc = None
        exchange = Exchange(
            method=request.method,
            url=str(request.url),
            request_headers={k.lower(): v for k, v in request.headers.items()},
            rpc=rpc,
        )
        self.exchanges.append(exchange)
        self._by_request[id(request)] = exchange

    async def on_response(self, response: httpx2.Response) -> None:
        exchange = self._by_request.get(id(response.request))
        if exchange is None:  # pragma: no cover - every request passes on_request first
            return
        exchange.status = response.status_code
        exchange.response_headers = {k.lower(): v for k, v in response.headers.items()}
        if response.status_code >= 400:
            await response.aread()  # cached: the SDK can still read it
            exchange.body = response.text

    def posts(self, rpc_method: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.rpc_method() == rpc_method]

    def dump(self, out=sys.stdout) -> None:
        print("  HTTP exchanges of this session:", file=out)
        for exchange in self.exchanges:
            print(f"    {exchange.describe()}", file=out)


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            print(f"ok: {what}" + (f" ({detail})" if detail else ""))
        else:
            self.failed += 1
            print(f"FAIL: {what}" + (f": {detail}" if detail else ""))
        sys.stdout.flush()
        return ok


def text_of(result: Any) -> str:
    return " ".join(c.text for c in getattr(result, "content", []) if isinstance(c, TextContent))


def check_tool_result(checks: Checks, result: Any, what: str) -> None:
    is_error = getattr(result, "is_error", None)
    text = text_of(result)
    checks.check(
        is_error is not True and bool(text),
        what,
        f"isError={is_error}, text={text[:120]!r}" if text or is_error else f"result={result!r}",
    )


def exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def check_refusal_answer(checks: Checks, exchange: Exchange | None) -> None:
    """The HTTP answer to the refused tools/call is the gateway's edge 429 (SPEC H2)."""
    if not checks.check(
        exchange is not None and exchange.status == REFUSAL_STATUS,
        f"the refused tools/call was answered HTTP {REFUSAL_STATUS} by the gateway",
        exchange.describe() if exchange is not None else "no POST tools/call was recorded",
    ):
        return
    assert exchange is not None
    content_type = exchange.response_headers.get("content-type", "")
    checks.check(
        content_type.replace(" ", "").lower() == REFUSAL_CONTENT_TYPE.replace(" ", ""),
        f"the 429 has Content-Type {REFUSAL_CONTENT_TYPE}",
        f"got {content_type!r}",
    )
    checks.check(
        (exchange.body or "").strip() == REFUSAL_BODY,
        f"the 429 body is {REFUSAL_BODY!r}",
        f"got {exchange.body!r}",
    )
    retry_after = exchange.response_headers.get("retry-after")
    checks.check(
        retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1,
        "the 429 carries Retry-After in whole seconds (>= 1)",
        f"Retry-After={retry_after!r}",
    )



async def agent_loop(checks: Checks, session: ClientSession) -> None:
    """An agent's loop: call tools until refused, read the wait from the SDK's
    error data, sleep it, and carry on (a policy whose windows last 2 s)."""
    made = 0
    refused: MCPError | None = None
    for _ in range(AGENT_MAX_CALLS):
        try:
            result = await session.call_tool("search_fields", {})
        except MCPError as exc:
            refused = exc
            break
        check_tool_result(checks, result, f"agent call {made + 1} succeeds")
        made += 1
    checks.check(
        refused is not None and refused.code == -32029,
        "the agent's loop is refused with mcp.MCPError -32029 once the budget is spent",
        f"after {made} calls: {type(refused).__name__}: "
        f"code={getattr(refused, 'code', None)} message={getattr(refused, 'message', None)!r}",
    )
    if refused is None:
        return
    data = refused.data if isinstance(refused.data, dict) else {}
    wait = data.get("retry_after_seconds")
    checks.check(
        isinstance(wait, int) and 1 <= wait <= AGENT_MAX_WAIT_SECONDS,
        "the agent reads retry_after_seconds from the error's data",
        f"data={refused.data!r}",
    )
    if not isinstance(wait, int):
        return
    started = time.monotonic()
    await anyio.sleep(wait)
    try:
        result = await session.call_tool("search_fields", {})
    except MCPError as exc:
        checks.check(False, "after sleeping retry_after_seconds the call succeeds", f"{exc!r} data={exc.data!r}")
        return
    check_tool_result(
        checks,
        result,
        f"after sleeping retry_after_seconds ({wait} s, {time.monotonic() - started:.2f} s in all) the call succeeds",
    )


async def run(mode: str, url: str, checks: Checks, recorder: Recorder) -> None:
    http_client = httpx2.AsyncClient(
        timeout=httpx2.Timeout(REQUEST_TIMEOUT_SECONDS, read=60.0),
        event_hooks={"request": [recorder.on_request], "response": [recorder.on_response]},
    )
    async with http_client:
        async with streamable_http_client(url, http_client=http_client) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=REQUEST_TIMEOUT_SECONDS) as session:
                init = await session.initialize()
                server = init.server_info
                checks.check(
                    bool(init.protocol_version),
                    "initialize through the gateway",
                    f"protocol {init.protocol_version}, server {server.name if server else None} "
                    f"{server.version if server else ''}".strip(),
                )
                init_post = next(iter(recorder.posts("initialize")), None)
                session_id = init_post.response_headers.get("mcp-session-id") if init_post else None
                checks.check(
                    bool(session_id),
                    "the initialize answer carries an Mcp-Session-Id",
                    f"{init_post.describe()}" if init_post else "no initialize POST recorded",
                )

                tools = await session.list_tools()
                names = sorted(t.name for t in tools.tools)
                checks.check(
                    all(name in names for name in REQUIRED_TOOLS),
                    f"tools/list names {' and '.join(REQUIRED_TOOLS)}",
                    f"tools: {', '.join(names)}",
                )
                # The session id went out again on the requests after initialize.
                later = [e for e in recorder.posts("tools/list")]
                checks.check(
                    bool(later) and all(e.request_headers.get("mcp-session-id") == session_id for e in later),
                    "the SDK sent the Mcp-Session-Id back (through the gateway)",
                    f"sent {[e.request_headers.get('mcp-session-id') for e in later]}",
                )

                if mode == "normal":
                    result = await session.call_tool("search_fields", {})
                    check_tool_result(checks, result, "tools/call search_fields {} succeeds with text content")
                elif mode == "jsonrpc":
                    first = await session.call_tool("search_fields", {})
                    check_tool_result(checks, first, "first tools/call search_fields {} succeeds (read budget 1)")
                    refused = None
                    try:
                        await session.call_tool("search_fields", {})
                    except Exception as exc:  # what the SDK raises is the point of the check
                        refused = exc
                    answer = (recorder.posts("tools/call") or [None])[-1]
                    checks.check(
                        answer is not None and answer.status == REFUSAL_STATUS,
                        "the refused tools/call is answered with HTTP 429",
                        answer.describe() if answer else "no tools/call recorded",
                    )
                    checks.check(
                        isinstance(refused, MCPError) and refused.code == -32029,
                        "the SDK raises mcp.MCPError with the gateway's code -32029",
                        f"{type(refused).__name__}: code={getattr(refused, 'code', None)} "
                        f"message={getattr(refused, 'message', refused)!r}",
                    )
                    data = getattr(refused, "data", None) or {}
                    wait = data.get("retry_after_seconds") if isinstance(data, dict) else None
                    checks.check(
                        isinstance(data, dict)
                        and data.get("reason") == "rate_limited"
                        and isinstance(wait, int)
                        and wait >= 1
                        and data.get("class") == "read",
                        "the agent reads why and when from the error's data (reason, retry_after_seconds, class)",
                        f"data={data!r}",
                    )
                    header = answer.response_headers.get("retry-after") if answer else None
                    checks.check(
                        header is not None and wait is not None and header == str(wait),
                        "Retry-After says the same wait as the data",
                        f"Retry-After={header!r}, data.retry_after_seconds={wait!r}",
                    )
                elif mode == "agent":
                    await agent_loop(checks, session)
                else:
                    first = await session.call_tool("search_fields", {})
                    check_tool_result(checks, first, "first tools/call search_fields {} succeeds (read budget 1)")

                    calls_before = len(recorder.posts("tools/call"))
                    refused: BaseException | None = None
                    second = None
                    started = time.monotonic()
                    try:
                        second = await session.call_tool("search_fields", {})
                    except Exception as exc:  # what the SDK raises is the point of the check
                        refused = exc
                    elapsed = time.monotonic() - started
                    posts = recorder.posts("tools/call")[calls_before:]
                    answer = posts[-1] if posts else None

                    checks.check(
                        isinstance(refused, MCPError),
                        "second tools/call search_fields raises mcp.MCPError in the client",
                        f"{type(refused).__name__}: code={getattr(refused, 'code', None)} "
                        f"message={str(refused)!r}, after {elapsed:.2f} s"
                        if refused is not None
                        else f"no exception; result {second!r}",
                    )
                    if isinstance(refused, MCPError):
                        # mcp 2.3.0 turns a non-JSON HTTP error answer to a request into
                        # JSON-RPC INTERNAL_ERROR "Server returned an error response"
                        # (streamable_http.py, _handle_post_request); the status is not kept.
                        chain = exception_chain(refused)
                        mentions_429 = any("429" in repr(e) or "429" in str(e) for e in chain)
                        checks.check(
                            refused.code == INTERNAL_ERROR
                            and refused.message == "Server returned an error response",
                            "the SDK surfaces the HTTP error as JSON-RPC INTERNAL_ERROR "
                            "'Server returned an error response' (mcp 2.3.0's mapping of a non-JSON 4xx)",
                            f"code={refused.code} message={refused.message!r}; exception chain "
                            f"{'mentions' if mentions_429 else 'does not mention'} 429",
                        )
                    checks.check(
                        len(posts) == 1,
                        "the SDK sent the refused call once (no retry behind the caller's back)",
                        f"{len(posts)} POST tools/call",
                    )
                    check_refusal_answer(checks, answer)

                    # The session survives a refusal: protocol-class calls still pass.
                    again = await session.list_tools()
                    checks.check(
                        any(t.name == "search_fields" for t in again.tools),
                        "the session goes on after the 429 (tools/list, class protocol, still answers)",
                    )

        # Leaving streamable_http_client sends DELETE /mcp (end of session).
        deletes = [e for e in recorder.exchanges if e.method == "DELETE"]
        checks.check(
            bool(deletes) and deletes[-1].status in (200, 204),
            "closing the session: DELETE /mcp answered 200/204",
            deletes[-1].describe() if deletes else "no DELETE sent",
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("normal", "refused", "jsonrpc", "agent"))
    parser.add_argument("url", help="the gateway's MCP endpoint, e.g. http://127.0.0.1:PORT/mcp")
    args = parser.parse_args()

    print(f"session {args.mode}: MCP Python SDK (mcp {_sdk_version()}) -> {args.url}")
    checks = Checks()
    recorder = Recorder()

    async def bounded() -> None:
        with anyio.fail_after(SESSION_TIMEOUT_SECONDS):
            await run(args.mode, args.url, checks, recorder)

    try:
        anyio.run(bounded)
    except BaseException as exc:  # noqa: BLE001 - any escape is a failed run, reported in full
        if isinstance(exc, KeyboardInterrupt):
            raise
        checks.check(False, f"session {args.mode} ran to the end", f"{type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stdout)
    if checks.failed:
        recorder.dump()
    print(f"session RESULT passed={checks.passed} failed={checks.failed}")
    return 0 if checks.failed == 0 else 1


def _sdk_version() -> str:
    try:
        from importlib.metadata import version

        return version("mcp")
    except Exception:  # pragma: no cover
        return getattr(mcp, "__version__", "?")


if __name__ == "__main__":
    sys.exit(main())
