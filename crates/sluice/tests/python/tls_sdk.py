"""SPEC O5 with the official openai SDK over https: `sluice serve --tls-cert`
verified against the test's CA (the SDK's own HTTP client with that CA), a request
answers with sluice's rate-limit headers, and the sixth `POST /oauth/register` in a
minute raises the SDK's own RateLimitError.

Usage: python tls_sdk.py https://127.0.0.1:PORT CA.pem
"""

import ssl
import sys

import openai

try:  # the HTTP client the SDK is built on (newer releases name it httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx


def main() -> None:
    base = sys.argv[1]
    assert base.startswith("https://"), base
    trust = ssl.create_default_context(cafile=sys.argv[2])
    client = openai.OpenAI(
        base_url=base,
        api_key="sk-o5",
        max_retries=0,
        timeout=10,
        http_client=openai.DefaultHttpxClient(verify=trust),
    )
    response = client.get("/search/fields", cast_to=httpx.Response)
    assert response.status_code == 200, response.status_code
    assert response.headers.get("x-ratelimit-limit") == "300", dict(response.headers)
    print("openai https ok", response.http_version)
    for _ in range(5):
        client.post("/oauth/register", cast_to=httpx.Response, body={})
    try:
        client.post("/oauth/register", cast_to=httpx.Response, body={})
    except openai.RateLimitError as error:
        assert error.status_code == 429
        assert error.response.headers.get("retry-after"), dict(error.response.headers)
        print("openai RateLimitError over https ok")
    else:
        raise AssertionError("the sixth registration was not refused")


if __name__ == "__main__":
    main()
