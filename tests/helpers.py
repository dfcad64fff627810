"""Small helpers every kind of test uses: sampling parameters, ports, bounded waits, a checked
scheduler step."""
from __future__ import annotations

import contextlib
import random
import socket
import time

from kvserve import SamplingParams


def greedy(n: int = 16, **kw) -> SamplingParams:
    """Greedy decoding of exactly n tokens (EOS ignored), so runs compare token for token."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def rand_prompts(seed: int, lengths, vocab: int) -> list[list[int]]:
    """Token-id prompts of the given lengths, drawn from `vocab` with `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def free_port() -> int:
    """A port nothing listens on now, for a server the test starts (which reports a bind failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def closed_port():
    """A port that refuses connections for as long as the block runs: bound by this process and
    never listened on, so nothing else can take it meanwhile (no port is assumed to be closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` seconds pass
    (AssertionError naming `what`). Every wait in the tests is bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def terminate(proc, timeout: float = 10.0) -> None:
    """SIGTERM a child process and wait for it; SIGKILL if it outlives `timeout` seconds."""
    import subprocess
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def sched_step(sched, runner) -> None:
    """One scheduler step through a model-free runner, then the KV accounting checked from scratch."""
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.kv.check_integrity()


def sched_run(sched, runner, reqs, max_steps: int = 2000) -> None:
    """Add reqs and step until nothing is left (bounded: a request that never finishes fails)."""
    for r in reqs:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        sched_step(sched, runner)
    raise AssertionError("requests never finished")


def sched_op(sched, runner, op: tuple, live: list[str], ids, max_len: int) -> bool:
    """One operation of a hypothesis workload on a scheduler: ("add", prompt, max_tokens,
    cache_retention), ("step",), ("abort", i) or ("preempt", i). False for any other operation
    (the caller's own). `live` is the ids added so far; `ids` counts them."""
    from kvserve.core.request import Request, RequestStatus
    from kvserve.core.sampling_params import SamplingParams
    if op[0] == "add":
        _, prompt, max_tokens, ret = op
        prompt = prompt[:max_len - 1]
        rid = str(next(ids))
        sched.add_request(Request(rid, prompt, SamplingParams(
            max_tokens=min(max_tokens, max_len - len(prompt)), ignore_eos=True, cache_retention=ret)))
        live.append(rid)
    elif op[0] == "step":
        sched_step(sched, runner)
    elif op[0] == "abort":
        if live:
            sched.finish_request(live[op[1] % len(live)], RequestStatus.FINISHED_ABORTED)
    elif op[0] == "preempt":
        if live:
            sched.preempt_request(live[op[1] % len(live)])
    else:
        return False
    return True
