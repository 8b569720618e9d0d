"""The OpenAI edge's compatibility settings on a real server: --served-model-name aliases, a
--chat-template file rendered in place of the model's own, unknown fields ignored (each name logged
once) or refused with --strict-openai-fields, and a template file that does not compile failing the start.

The trained model memorised its corpus, so a template that renders a user message as bare text (after
the bos token) makes a chat answer the memorised continuation: the oracle that the file was used."""

from __future__ import annotations

import openai
import pytest
from _server import ServerProcess, ServerStartError

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

BARE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
NAMES = ("house-model", "alias-two")


@pytest.fixture(scope="module")
def compat(start_module_server, trained_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "bare.jinja"
    template.write_text(BARE)
    return start_module_server(trained_model_dir, threads=1, metrics_port=None, chat_template=str(template),
                               served_model_name=" , ".join(NAMES))


@pytest.fixture(scope="module")
def client(compat):
    with openai.OpenAI(base_url=compat.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_every_served_name_is_listed_and_answers(compat, client):
    assert [card.id for card in client.models.list().data] == list(NAMES)
    for name in NAMES:
        assert client.models.retrieve(name).id == name
        res = client.completions.create(model=name, prompt="The baker", max_tokens=2, temperature=0)
        assert res.model == name
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="smollm2", prompt="x", max_tokens=1)
    assert "house-model" in err.value.body["message"]
    with compat.channel() as ch:  # gRPC reports the first name
        assert pb_grpc.TextGenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_name == NAMES[0]


def test_the_chat_template_file_renders_chats(client, training_prompts):
    for prefix, continuation in training_prompts[:3]:
        chat = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": prefix}],
                                              max_tokens=40, temperature=0)
        plain = client.completions.create(model=NAMES[0], prompt=prefix, max_tokens=40, temperature=0)
        assert chat.choices[0].message.content == plain.choices[0].text
        assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
        text = chat.choices[0].message.content
        assert continuation.startswith(text) or text.startswith(continuation)


def test_unknown_fields_are_ignored_and_each_name_logged_once(compat, client):
    answers = [client.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "The fox"}],
                                              max_tokens=4, temperature=0, extra_body={"newer_field": {"a": i}})
               for i in range(3)]
    assert len({a.choices[0].message.content for a in answers}) == 1
    assert compat.log.count("ignoring the field 'newer_field'") == 1


def test_strict_fields_refuse_unknown_fields(start_server, trained_model_dir):
    srv = start_server(trained_model_dir, threads=1, metrics_port=None, strict_openai_fields="true")
    with openai.OpenAI(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"newer_field": 1})
        assert err.value.body["param"] == "newer_field"
        assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, user="u").usage.completion_tokens >= 1


def test_a_chat_template_that_does_not_compile_fails_the_start(trained_model_dir, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    srv = ServerProcess(trained_model_dir, log_dir=tmp_path, startup_timeout=60)
    try:
        with pytest.raises(ServerStartError):
            srv.start(chat_template=str(bad), metrics_port=None, threads=1)
        assert srv.wait(30) == 1
        assert f"--chat-template {bad}" in srv.log and "does not compile" in srv.log
    finally:
        srv.stop()
