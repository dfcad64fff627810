"""LoRA through the server, as vLLM serves it: --lora-modules in both forms, a request's `model`
picks the adapter (the same tokens as the offline API), /v1/models lists adapters with their
parent, runtime load / unload with VLLM_ALLOW_RUNTIME_LORA_UPDATING, vllm:lora_requests_info,
and each bad input a clear 4xx (or a start-up error) while everything else keeps serving."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
from helpers import greedy
from hf_reference import load_hf
from lora_adapters import make_adapter
from server_util import start_server

from kvserve import LLM, LoRARequest

pytestmark = pytest.mark.slow
BASE = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--disable-log-stats", "--enable-lora",
        "--max-lora-rank", "8", "--max-loras", "2"]
PROMPT = [5, 17, 300, 42, 8, 99, 1000, 7]


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    hf = load_hf(tiny)
    d = tmp_path_factory.mktemp("server_adapters")
    return {"a": make_adapter(hf, d / "a", r=8, seed=21), "b": make_adapter(hf, d / "b", r=4, seed=22),
            "big": make_adapter(hf, d / "big", r=16, seed=23)}


@pytest.fixture(scope="module")
def server(tiny, adapters):
    handle = start_server(tiny, *BASE, "--lora-modules", f"a={adapters['a']}",
                          json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny"}),
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield handle
    handle.stop()


def complete(server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def test_model_field_selects_the_adapter(server, tiny, adapters):
    llm = LLM(tiny, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=16 * 2**20)
    for name in ("a", "b", None):
        expect = llm.generate(PROMPT, greedy(8), use_tqdm=False,
                              lora_request=None if name is None else LoRARequest(name, 1, adapters[name]))[0]
        r = complete(server, name or tiny)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expect.outputs[0].text, name
        assert r.json()["model"] == (name or tiny)  # the adapter's name answers, as vLLM's
    assert complete(server, "a").json()["choices"][0]["text"] != complete(server, tiny).json()["choices"][0]["text"]


def test_models_lists_adapters_with_their_parent(server, tiny):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["a"]["parent"] == tiny and cards["b"]["parent"] == tiny and cards[tiny]["parent"] is None


def test_unknown_adapter_is_a_404_as_vllm(server):
    r = complete(server, "nope")
    assert r.status_code == 404 and "The model `nope` does not exist" in r.json()["error"]["message"]


def test_load_and_unload_at_runtime(server, adapters, tmp_path):
    url = server.url
    load = lambda name, path: httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})  # noqa: E731
    unload = lambda name: httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})  # noqa: E731
    assert complete(server, "c").status_code == 404
    r = load("c", adapters["a"])
    assert r.status_code == 200 and "added successfully" in r.text
    assert complete(server, "c").json()["choices"][0]["text"] == complete(server, "a").json()["choices"][0]["text"]
    r = load("c", adapters["b"])
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = load("d", adapters["big"])
    assert r.status_code == 400 and "rank 16" in r.json()["error"]["message"] and "--max-lora-rank 8" in r.text
    broken = tmp_path / "broken"
    shutil.copytree(adapters["b"], broken)
    (broken / "adapter_model.safetensors").unlink()
    r = load("e", str(broken))
    assert r.status_code == 400 and "adapter_model.safetensors is missing" in r.json()["error"]["message"]
    assert unload("c").status_code == 200
    assert complete(server, "c").status_code == 404
    r = unload("c")
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    # replaced under the same name: the new weights, no blocks of the old ones
    assert load("c", adapters["b"]).status_code == 200
    r = complete(server, "c").json()
    assert r["choices"][0]["text"] == complete(server, "b").json()["choices"][0]["text"]
    assert complete(server, "a").status_code == 200  # everything else still serves


def test_unloading_an_adapter_lets_its_running_request_finish(server, tiny, adapters):
    """The unload takes the name from new requests at once; a request already streaming under it
    keeps the engine's copy and finishes with the adapter's tokens, others are untouched, and
    nothing stays held once it is done (no running request, no block in use, no adapter in use)."""
    url = server.url
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "u", "lora_path": adapters["a"]}).status_code == 200
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    expect = httpx.post(f"{url}/v1/completions", json={**body, "model": "a"}, timeout=120).json()["choices"][0]["text"]
    base = complete(server, tiny).json()["choices"][0]["text"]
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "model": "u", "stream": True}, timeout=120) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]")
        chunks.append(json.loads(next(lines)[6:]))  # the request is running
        assert 'running_lora_adapters="u"' in httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "u"}).status_code == 200
        assert complete(server, "u").status_code == 404
        assert complete(server, tiny).json()["choices"][0]["text"] == base
        chunks += [json.loads(ln[6:]) for ln in lines]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expect
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = httpx.get(f"{url}/metrics").text
    assert server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info


def test_lora_requests_info_metric(server):
    complete(server, "a")
    text = httpx.get(f"{server.url}/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line
    loads = next(ln for ln in text.splitlines() if ln.startswith("kvserve:lora_slot_loads_total{"))
    assert float(loads.split()[-1]) >= 1  # adapter a was copied into a slot


def test_bad_lora_modules_stop_the_start_with_the_reason(tiny, adapters):
    with pytest.raises(RuntimeError, match=r"--lora-modules big=.*rank 16 .* above --max-lora-rank 8"):
        start_server(tiny, *BASE, "--lora-modules", f"big={adapters['big']}", timeout=120)
    with pytest.raises(RuntimeError, match="neither name=path nor a JSON object"):
        start_server(tiny, *BASE, "--lora-modules", "junk", timeout=120)
