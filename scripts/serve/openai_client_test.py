"""The official `openai` Python client against `kvdecode serve` (scripts/test-openai.sh starts the
server with SmolLM2-135M-Instruct and runs this, with a second server on a tiny model whose chat
template takes tools as the second argument, and a third, SmolLM2 with LoRA adapters a, b and c,
as the third). Every check asserts; the first failure exits
non-zero with its reason."""
import concurrent.futures
import json
import sys

import jsonschema
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="none")
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    checks += 1
    print(f"ok: {what}")


model = client.models.list().data[0].id
check(model.endswith(".gguf"), f"models.list: {model}")

q = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=12)
answer = r.choices[0].message.content
check("Paris" in answer, f"greedy chat answer names Paris: {answer!r}")
check(r.usage.prompt_tokens > 10 and r.usage.completion_tokens >= 1, f"usage {r.usage}")
check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")

# streaming: the deltas add up to the same greedy answer, then a usage chunk
parts, usage, finish = [], None, None
for chunk in client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        finish = c.finish_reason or finish
check("".join(parts) == answer, f"streamed answer equals the non-streamed one: {''.join(parts)!r}")
check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")
check(finish == r.choices[0].finish_reason, "stream finish_reason")

# text completions
c = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
check(len(c.choices[0].text) > 0 and c.choices[0].finish_reason == "length", f"completion {c.choices[0].text!r}")

# n: one prompt, three seeded choices; the same request again gives the same three
kw = dict(model=model, messages=q, temperature=1.0, max_tokens=8, n=3, seed=42)
a = client.chat.completions.create(**kw)
b = client.chat.completions.create(**kw)
texts = [x.message.content for x in a.choices]
check(len(texts) == 3 and texts == [x.message.content for x in b.choices], f"n=3 with a seed is reproducible: {texts}")

# seed: reproducible, and another seed gives other text
s1 = client.chat.completions.create(model=model, messages=q, temperature=1.0, max_tokens=10, seed=5)
s2 = client.chat.completions.create(model=model, messages=q, temperature=1.0, max_tokens=10, seed=5)
check(s1.choices[0].message.content == s2.choices[0].message.content, "same seed, same text")

# logprobs with alternatives
lp = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
content = lp.choices[0].logprobs.content
check(len(content) >= 1 and all(len(t.top_logprobs) == 3 for t in content), "logprobs with 3 alternatives per token")
check(all(t.top_logprobs[0].token == t.token for t in content), "greedy tokens are the most likely ones")

# stop strings: trimmed, finish_reason stop
st = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=12, stop=["Paris"])
check("Paris" not in st.choices[0].message.content and st.choices[0].finish_reason == "stop",
      f"stop string trimmed: {st.choices[0].message.content!r}")

# structured output: every reply parses and validates against the schema
schema = {
    "type": "object",
    "properties": {"country": {"type": "string", "maxLength": 30}, "capital": {"type": "string", "maxLength": 30}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
for temperature, seed in [(0, 0), (1.0, 1), (1.0, 2)]:
    js = client.chat.completions.create(model=model, messages=q, temperature=temperature, seed=seed, max_tokens=40,
                                        response_format=fmt)
    reply = json.loads(js.choices[0].message.content)
    jsonschema.validate(reply, schema)
    check(js.choices[0].finish_reason == "stop", f"json_schema reply validates (T={temperature}): {reply}")
obj = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=40,
                                     response_format={"type": "json_object"})
check(isinstance(json.loads(obj.choices[0].message.content), dict), f"json_object: {obj.choices[0].message.content}")
try:
    client.chat.completions.create(model=model, messages=q, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    check(False, "an invalid schema was accepted")
except openai.BadRequestError as e:
    check("schema" in str(e), f"an invalid schema is a 400: {e}")

# errors: named, in OpenAI's shape, and the server keeps serving
for kwargs, want in [
    (dict(temperature=5), "temperature"),
    (dict(extra_body={"foo": 1}), "foo"),
    (dict(max_tokens=10 ** 7), "max_tokens"),
]:
    try:
        client.chat.completions.create(model=model, messages=q, **kwargs)
        check(False, f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        check(want in str(e), f"400 names {want}: {e}")
again = client.chat.completions.create(model=model, messages=q, temperature=0, max_tokens=12)
check(again.choices[0].message.content == answer, "still serving, same answer")

# tools: SmolLM2's template takes none, which is a 400 that says so
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
try:
    client.chat.completions.create(model=model, messages=q, tools=tools)
    check(False, "tools were accepted by a template without tools")
except openai.BadRequestError as e:
    check("does not take tools" in str(e), f"tools on a template without them: {e}")

# tools on a model whose template takes them: a required call comes back as tool_calls
if len(sys.argv) > 2:
    tc = openai.OpenAI(base_url=sys.argv[2], api_key="none")
    tmodel = tc.models.list().data[0].id
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = tc.chat.completions.create(model=tmodel, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, tool_choice=choice, temperature=0, max_tokens=200)
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, tools[0]["function"]["parameters"])
        check(r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather",
              f"tool_choice={choice}: {call.function.name}({args})")
    stream = tc.chat.completions.create(model=tmodel, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                        tool_choice="required", temperature=0, max_tokens=200, stream=True)
    calls = [d for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or [])]
    check(len(calls) == 1 and calls[0].function.name == "get_weather", "a streamed tool call")

# LoRA adapters picked by model name (a third server: SmolLM2 with adapters a, b and c): listed
# with their parent, each changes the answer, says its version, and 8 concurrent requests over
# the three each get (text and logprobs) the answer they get alone
if len(sys.argv) > 3:
    lc = openai.OpenAI(base_url=sys.argv[3], api_key="none")
    listed = [m.to_dict() for m in lc.models.list().data]
    lbase, names = listed[0]["id"], [m["id"] for m in listed[1:]]
    check(names == ["a", "b", "c"] and all(m.get("parent") == lbase for m in listed[1:]),
          f"models.list names the adapters and their parent: {names}")

    def ask(m):
        r = lc.chat.completions.create(model=m, messages=q, temperature=0, max_tokens=10, logprobs=True)
        lps = [t.logprob for t in r.choices[0].logprobs.content]
        return r.model, r.choices[0].message.content, lps, r.to_dict().get("adapter_version")

    alone = {m: ask(m) for m in [lbase] + names}
    check(alone[lbase][3] is None, "a base-model response has no adapter_version")
    for m in names:
        check(alone[m][0] == m and alone[m][3] == 0, f"adapter {m}: the response names it, version 0")
        check(alone[m][2] != alone[lbase][2], f"adapter {m} changes the answer: {alone[m][1]!r}")
    check(len({tuple(alone[m][2]) for m in names}) == 3, "the three adapters answer differently")
    order = ["a", "b", "c", "a", "b", "c", "a", "b"]
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        got = list(pool.map(ask, order))
    check(all(g == alone[m] for m, g in zip(order, got)),
          "8 concurrent requests over 3 adapters each equal their alone answers, logprobs bit for bit")
    try:
        lc.chat.completions.create(model="zzz", messages=q, max_tokens=2)
        check(False, "an unknown adapter name was accepted")
    except openai.NotFoundError as e:
        check("zzz" in str(e), f"an unknown model name is a 404: {e}")
print(json.dumps({"checks": checks, "passed": True}))
