"""The default configuration end to end against transformers: the embedded SmolLM2-135M-Instruct in
the dtype `--dtype auto` picks (bfloat16 with the compiled kernels on CPUs with AVX512-BF16 or AMX,
the GGUF weights read as codes on AMX), offline and through the HTTP server, under the rule of
tests/fidelity.py. The reference is transformers in float32 on the same weights; the error bound is
measured here, as twice the largest move transformers' own bfloat16 forward makes to a float32
top-2 gap on the same sequences."""
from __future__ import annotations

import httpx
import pytest
import torch
from fidelity import Run, assert_greedy_agrees, bf16_bound, run_of
from hf_reference import hf_greedy, load_hf
from server_util import start_server

from kvserve import LLM, SamplingParams
from kvserve.model.loader import cpu_has_bf16

pytestmark = pytest.mark.slow

N = 24  # tokens generated per prompt
TEXTS = ["The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "Photosynthesis is the process by which green plants and some other organisms use sunlight to",
         "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"]
QUESTIONS = ["What is 2+2?", "Name three colours.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def default_llm():
    llm = LLM()  # every engine setting at its default
    assert llm.engine.runner.dtype == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    return llm


@pytest.fixture(scope="module")
def reference(default_llm):
    """Prompts, transformers' float32 greedy runs with their logprobs, and the bound D."""
    tok = default_llm.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    prompts += [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                for q in QUESTIONS]
    hf32 = load_hf(None)
    runs, seqs = [], []
    for p in prompts:
        seq = p + hf_greedy(hf32, p, N)
        with torch.no_grad():
            lp32 = torch.log_softmax(hf32(torch.tensor([seq])).logits[0].float(), -1)[len(p) - 1:-1]
        runs.append(Run(seq[len(p):], [{t: lp32[j, t].item() for t in lp32[j].topk(20).indices.tolist()}
                                       for j in range(N)]))
        seqs.append(seq)
    bound = bf16_bound(hf32, seqs, [range(len(p) - 1, len(s) - 1) for p, s in zip(prompts, seqs)])
    return prompts, runs, bound


def test_default_engine_matches_transformers(default_llm, reference):
    prompts, want, bound = reference
    outs = default_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=5),
                                use_tqdm=False)
    result = assert_greedy_agrees([run_of(o.outputs[0]) for o in outs], want, bound, what="offline")
    assert result.max_move > 0  # bf16 (or float32's own rounding) differs from the reference somewhere


def test_default_server_matches_transformers(default_llm, reference):
    """The same prompts through `kvserve serve` with its defaults: the text up to the first near-tie
    (the rule's agreement part; the API's logprobs name tokens by their text, not their ids)."""
    prompts, want, bound = reference
    tok = default_llm.tokenizer
    server = start_server()
    try:
        compared = 0
        for p, w in zip(prompts, want):
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": N, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            # The longest prefix of the reference's tokens the text begins with; where the text
            # goes on differently, the reference must be at a near-tie there.
            k = max(i for i in range(N + 1) if text.startswith(tok.decode(w.tokens[:i]).rstrip("\ufffd")))
            if k < N:
                gap = (lambda a, b: a - b)(*sorted(w.logprobs[k].values(), reverse=True)[:2])
                assert gap < bound, (f"the server's text parts from transformers' at token {k}, where its top-2 "
                                     f"gap {gap:.3f} >= D = {bound:.3f}: {text!r}")
            compared += k
        assert compared >= 0.5 * N * len(prompts), f"only {compared} positions compared"
    finally:
        server.stop()
