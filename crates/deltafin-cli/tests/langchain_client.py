"""langchain-openai's ChatOpenAI against `deltafin serve` replaying a recorded K3 reply that calls a
tool (run by tests/server_conformance.rs): invoke, stream, bound tools, an error."""
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return "18C"


llm = ChatOpenAI(base_url=sys.argv[1], api_key="unused", model="k3", max_retries=0)
with_tools = llm.bind_tools([get_weather])
msg = with_tools.invoke([HumanMessage("What is the weather in Paris?")])
assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
assert msg.tool_calls[0]["args"] == {"city": "Paris"}, msg.tool_calls

chunks = list(with_tools.stream([HumanMessage("What is the weather in Paris?")]))
merged = chunks[0]
for c in chunks[1:]:
    merged = merged + c
assert merged.tool_calls and merged.tool_calls[0]["args"] == {"city": "Paris"}, merged

call = msg.tool_calls[0]
follow = with_tools.invoke([HumanMessage("What is the weather in Paris?"), msg, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])
assert follow.usage_metadata["input_tokens"] > msg.usage_metadata["input_tokens"], (follow.usage_metadata, msg.usage_metadata)

try:
    ChatOpenAI(base_url=sys.argv[1], api_key="unused", model="k3", max_retries=0, n=2).invoke("hi")
    raise AssertionError("n=2 must be refused")
except Exception as e:  # the client's BadRequestError
    assert "400" in str(e) or "n" in str(e), e
print("ok")
