#!/usr/bin/env python3
"""Runs the README's OpenAI Python SDK examples against a running server (`vlm up`, default
http://127.0.0.1:8080) and checks each one's answer has the shape the README promises.

    python3 scripts/check-openai-sdk.py [--base-url http://127.0.0.1:8080/v1] [--model tiny-s0]

Needs `openai` and `pydantic` (e.g. the vLLM venv from scripts/install-vllm-cpu.sh). On the
embedded random checkpoint the text is random; what is checked is the API: logprobs present
and sorted, structured answers that validate, tool calls that parse, completions, n choices.
"""
import argparse
import json
import sys

from openai import OpenAI
from pydantic import BaseModel


class City(BaseModel):
    name: str
    population: int


def frame_rgb(k, w=96, h=64):
    from PIL import Image
    img = Image.new("RGB", (w, h), (40, 80, 120))
    for x in range(k * 8, min(w, k * 8 + 24)):
        for y in range(16, 40):
            img.putpixel((x, y), (250, 250, 40))
    return img


def frame_png(k):
    import base64
    import io
    buf = io.BytesIO()
    frame_rgb(k).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def frame_mp4(n, fps=8):
    """An H.264 MP4 of n frames (constrained baseline, as OpenH264 decodes it), or None."""
    try:
        import av
    except ImportError:
        return None
    import base64
    import io
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        s.options = {"profile": "baseline"}
        for k in range(n):
            for p in s.encode(av.VideoFrame.from_image(frame_rgb(k % 8))):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return base64.b64encode(buf.getvalue()).decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default="tiny-s0")
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="unused")
    m = a.model
    failures = []

    def check(name, ok, detail=""):
        print(("ok   " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""))
        if not ok:
            failures.append(name)

    # Sampling and logprobs.
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16, temperature=0,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"11": -100},
        logprobs=True, top_logprobs=3,
        extra_body={"repetition_penalty": 1.1, "min_p": 0.05, "top_k": -1, "min_tokens": 4},
    )
    content = r.choices[0].logprobs.content
    check("logprobs", len(content) == r.usage.completion_tokens and all(
        len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        for t in content))

    # Structured output (bounded so a random model finishes).
    schema = City.model_json_schema()
    schema["properties"]["name"]["maxLength"] = 20
    schema["additionalProperties"] = False
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "The largest city in France, as JSON."}],
        max_tokens=100,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    try:
        City.model_validate_json(r.choices[0].message.content)
        check("json_schema", True)
    except Exception as e:  # noqa: BLE001
        check("json_schema", False, str(e))
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "y/n"}], max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    check("choice", r.choices[0].message.content in ("yes", "no"), r.choices[0].message.content)

    # Tool calls.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=m, messages=messages, tools=tools,
                                       tool_choice="required", max_tokens=100,
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls or []
    ok = (r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
          and calls[0].function.name == "get_weather"
          and "city" in json.loads(calls[0].function.arguments))
    check("tool_calls", ok, str(r.choices[0]))
    if calls:
        messages += [r.choices[0].message,
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]
        r = client.chat.completions.create(model=m, messages=messages, tools=tools, max_tokens=8)
        check("tool result turn", r.choices[0].finish_reason in ("stop", "length", "tool_calls"))

    # Completions, n choices.
    r = client.completions.create(model=m, prompt="Once upon a time", max_tokens=16,
                                  logprobs=2, temperature=0)
    check("completions", len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens)
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                       n=3, max_tokens=4, seed=1)
    check("n=3", [c.index for c in r.choices] == [0, 1, 2])

    # Video: frames as a "video" part (PNG data: URLs), and an MP4 as a "video_url" part when
    # PyAV can write one (pip install av).
    frames = [frame_png(k) for k in range(6)]
    r = client.chat.completions.create(
        model=m, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "video", "video": [f"data:image/png;base64,{f}" for f in frames], "fps": 4},
            {"type": "text", "text": "What happens in the video?"}]}])
    check("video frames", r.usage.prompt_tokens > 40 and r.choices[0].finish_reason in ("stop", "length"))
    mp4 = frame_mp4(16)
    if mp4 is None:
        print("skip video_url (no PyAV to write an MP4: pip install av)")
    else:
        r = client.chat.completions.create(
            model=m, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}},
                {"type": "text", "text": "What happens in the video?"}]}],
            extra_body={"mm_processor_kwargs": {"fps": 4}})
        check("video_url mp4", r.usage.prompt_tokens > 40)

    if failures:
        sys.exit(f"{len(failures)} failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
