"""LoRA adapters through the edges of a real server: chosen by the OpenAI `model` field and gRPC's `adapter`,
listed by /v1/models and GetModelInfo, loaded and unloaded at runtime inside --lora-dir behind the same
tokens, refused with errors naming what is wrong while the server keeps serving; peft is the oracle of
the adapters' tokens (tests/unit/test_lora.py writes them)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
pytest.importorskip("peft")
from test_lora import peft_model, reference_tokens  # noqa: E402

TOKEN = "lora-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
META = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]
STEPS = 16


@pytest.fixture(scope="module")
def lora_dir(trained_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora-dir")
    for i, name in enumerate(("attn", "mlp")):
        peft_model(trained_model_dir, name, seed=10 + i).save_pretrained(root / name)
    (root / "tokens.txt").write_text(TOKEN + "\n")
    return root


@pytest.fixture(scope="module")
def references(trained_model_dir) -> dict[str, list[int]]:
    return {name: reference_tokens(peft_model(trained_model_dir, name, seed=10 + i), PROMPT, STEPS)
            for i, name in enumerate(("attn", "mlp"))}


@pytest.fixture(scope="module")
def lora_server(start_module_server, trained_model_dir, lora_dir):
    srv = start_module_server(trained_model_dir, wait=False, threads=1, lora_modules=[f"attn={lora_dir / 'attn'}"],
                              lora_dir=lora_dir, max_loras=2, max_lora_rank=16, auth_tokens_file=lora_dir / "tokens.txt")
    srv.wait_ready(timeout=600)  # a first start on a busy machine builds the native kernels
    return srv


@pytest.fixture(scope="module")
def lora_stub(lora_server):
    ch = lora_server.channel()
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()


def generate(stub, adapter: str = "", steps: int = STEPS) -> list[int]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), adapter=adapter,
                             params=pb.SamplingParams(max_new_tokens=steps, ignore_eos=True))
    return list(stub.Generate(req, metadata=META, timeout=60).token_ids)


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.http_url.removesuffix('/v1')}{path}", json=body, headers=headers, timeout=60)


def test_the_model_field_and_the_adapter_field_choose_the_adapter(lora_server, lora_stub, references):
    assert generate(lora_stub, "attn") == references["attn"]
    base = generate(lora_stub)
    assert base != references["attn"]
    models = httpx.get(f"{lora_server.http_url}/models", headers=AUTH).json()["data"]
    cards = {m["id"]: m for m in models}
    base_name = models[0]["id"]
    assert cards["attn"]["parent"] == base_name and cards[base_name]["parent"] is None
    for model, adapter in ((base_name, ""), ("attn", "attn")):
        r = post(lora_server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": STEPS,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        want = lora_stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), adapter=adapter,
                                                     params=pb.SamplingParams(max_new_tokens=STEPS, ignore_eos=True)),
                                  metadata=META, timeout=60).text
        assert r.json()["choices"][0]["text"] == want, model
    info = lora_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=META, timeout=10)
    assert [(a.name, a.parent, a.rank) for a in info.adapters] == [("attn", info.model_name, 8)]


def test_an_unknown_adapter_is_not_found_naming_it(lora_server, lora_stub):
    r = post(lora_server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        generate(lora_stub, "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()


def test_runtime_load_and_unload_inside_the_directory_behind_the_tokens(lora_server, lora_stub, lora_dir, references):
    assert post(lora_server, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "mlp"}, headers={}).status_code == 401
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "mlp"})
    assert r.status_code == 200, r.text
    assert generate(lora_stub, "m") == references["mlp"]
    for body, status, words in (
            ({"lora_name": "x", "lora_path": "../"}, 400, "outside the adapter directory"),
            ({"lora_name": "x", "lora_path": str(lora_dir.parent)}, 400, "outside the adapter directory"),
            ({"lora_name": "x", "lora_path": "missing"}, 400, "adapter_config.json not found"),
            ({"lora_name": "x"}, 400, "lora_path"),
            ({"lora_name": "m", "lora_path": "mlp"}, 400, "already loaded")):
        r = post(lora_server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "m"})
    assert r.status_code == 200
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "m"}).status_code == 404
    with pytest.raises(grpc.RpcError) as err:
        generate(lora_stub, "m")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # gRPC's own calls
    loaded = lora_stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="g", path="mlp"), metadata=META, timeout=60)
    assert loaded.adapter.rank == 4 and generate(lora_stub, "g") == references["mlp"]
    with pytest.raises(grpc.RpcError) as err:
        lora_stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="h", path="/etc"), metadata=META, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in err.value.details()
    lora_stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="g"), metadata=META, timeout=10)
    assert generate(lora_stub) == generate(lora_stub)  # still serving
    m = lora_server.metrics()
    assert m.get("lmserve_lora_loads_total") >= 2 and m.get("lmserve_lora_known_adapters") == 1


def test_unloading_under_traffic_loses_no_request(lora_server, lora_stub, references):
    assert post(lora_server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": "mlp"}).status_code == 200
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            results[i] = generate(lora_stub, "busy" if i % 3 else "attn", 48)
        except grpc.RpcError as exc:  # noqa: PERF203
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while lora_server.metrics().get("lmserve_running_requests") < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 6
    for i, tokens in results.items():
        want = references["mlp" if i % 3 else "attn"]
        assert tokens[:STEPS] == want, i
