"""The libraries agents and apps are built on, each against the running server (SmolLM2, its template
rendering no tools: the fallback prompt): langchain-openai (bind_tools, with_structured_output),
openai-agents (a Chat Completions model running a function tool to the end of its run) and instructor
(a pydantic model filled through a named tool, and through a JSON schema). A small model's answers are
whatever it prefers; with the call or the schema required, their shape is the server's doing, and is
what these tests check (the libraries' own parsing and validation, and jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=30, description="their first name")
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def model_id(smollm2_http) -> str:
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0) as c:
        return c.models.list().data[0].id


@pytest.fixture(scope="module")
def chat_model(smollm2_http, model_id):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_id, base_url=smollm2_http.http_url, api_key="x", temperature=0, max_tokens=120,
                      max_retries=0, timeout=900)


def test_langchain_bind_tools_calls_validate_and_results_go_back(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"Sunny in {city}"

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    schemas = {t.name: t.tool_call_schema.model_json_schema() for t in (get_weather, add)}
    question = HumanMessage("What is the weather in Paris?")
    for choice in ("get_weather", "any", "required"):  # a named tool; "any" is langchain's word for required
        message = chat_model.bind_tools([get_weather, add], tool_choice=choice).invoke([question])
        assert message.tool_calls and not message.invalid_tool_calls, message
        for call in message.tool_calls:
            assert call["name"] in schemas and (choice in ("any", "required") or call["name"] == choice)
            jsonschema.validate(call["args"], schemas[call["name"]])
    call = message.tool_calls[0]
    result = {"get_weather": get_weather, "add": add}[call["name"]].invoke(call["args"])
    answer = chat_model.bind_tools([get_weather, add]).invoke(
        [question, message, ToolMessage(str(result), tool_call_id=call["id"])])
    assert answer.content or answer.tool_calls
    streamed = None
    for chunk in chat_model.bind_tools([add], tool_choice="add").stream("What is 2 plus 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "add"
    jsonschema.validate(streamed.tool_calls[0]["args"], schemas["add"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat_model, method):
    prompt = "Invent a person and give their name and age" + (" as JSON with the keys name and age."
                                                               if method == "json_mode" else ".")
    if method == "json_mode":  # any JSON object: the keys are the model's to choose
        result = chat_model.with_structured_output(None, method=method).invoke(prompt)
        assert isinstance(result, dict)
        return
    person = chat_model.with_structured_output(Person, method=method).invoke(prompt)
    assert isinstance(person, Person), person


async def run_weather_agent(base_url: str, model_class: str, model_id: str, **settings) -> None:
    """An openai-agents Agent on `model_class` (its Chat Completions or its Responses model) runs a weather
    tool to the end of its run: a call, its output, and a final message."""
    import agents
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no traces sent to OpenAI's servers
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}, 24 C"

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=900)
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model=getattr(agents, model_class)(model=model_id, openai_client=client),
                  # the first turn must call (the run then resets tool_choice, so the next turn may answer)
                  model_settings=ModelSettings(tool_choice="required", temperature=0, **settings))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=6)
    await client.close()
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem, kinds
    assert cities and all(isinstance(c, str) for c in cities)
    assert isinstance(result.final_output, str) and result.final_output.strip()


async def test_openai_agents_runs_a_function_tool_to_the_end(smollm2_http, model_id):
    await run_weather_agent(smollm2_http.http_url, "OpenAIChatCompletionsModel", model_id, max_tokens=80)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_fills_a_pydantic_model(smollm2_http, model_id, mode):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0,
                                                  timeout=900), mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=model_id, response_model=Person, max_retries=0, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Invent a person and give their name and age."}])
    assert isinstance(person, Person)
    jsonschema.validate(json.loads(person.model_dump_json()), Person.model_json_schema())


async def test_instructor_async(smollm2_http, model_id):
    import instructor

    client = instructor.from_openai(openai.AsyncOpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0,
                                                       timeout=900))
    person = await client.chat.completions.create(
        model=model_id, response_model=Person, max_retries=0, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Invent a person and give their name and age."}])
    assert isinstance(person, Person)


def test_openai_sdk_parse_fills_a_pydantic_model(smollm2_http, model_id):
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0, timeout=900) as client:
        res = client.chat.completions.parse(model=model_id, response_format=Person, max_tokens=120, temperature=0,
                                            messages=[{"role": "user", "content": "Invent a person."}])
    assert isinstance(res.choices[0].message.parsed, Person)
