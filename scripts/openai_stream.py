"""One streamed OpenAI chat completion over plain HTTP (standard library only), shared by the
bench scripts."""
import json
import time
import urllib.error
import urllib.request


def stream_chat(http, body, timeout=3600, who="server"):
    """POSTs `body` (a dict; `stream` is turned on, with usage) to http://HTTP/v1/chat/completions.
    Returns (t0, pieces, usage): the perf_counter time the request was sent, each content delta
    as (perf_counter time, text), and the final usage object ({} if none came)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(f"http://{http}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    pieces, usage = [], {}
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{who}: HTTP {e.code}: {e.read().decode()[:500]}")
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    pieces.append((time.perf_counter(), piece))
            if ev.get("usage"):
                usage = ev["usage"]
    return t0, pieces, usage
