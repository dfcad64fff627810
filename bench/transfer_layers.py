"""Two layers that could move a prompt's KV between servers, on this machine: Mooncake's transfer
engine over TCP (one process reads another's registered buffer) and a Redis pipeline (the tier
kvserve has), for the 64 blocks of a 1,024-token SmolLM2-135M prompt. Needs
mooncake-transfer-engine-non-cuda (and the system's libibverbs1) and a running redis-server.

    python bench/transfer_layers.py redis://127.0.0.1:6379/0

Median of 6 of each; prints a table; writes bench/results/transfer_layers.json.
"""
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

BLOCK = 16 * 23040  # one 16-token block of SmolLM2-135M's bf16 KV (30 layers x 3 KV heads x 64 x 2 x 2 B)
N = 64              # a 1,024-token prompt

def server(q, done):
    from mooncake.engine import TransferEngine
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.random.randint(0, 255, BLOCK * N, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    q.put((e.get_rpc_port(), buf.ctypes.data, int(buf[:4096].sum())))
    done.wait(120)

def main():
    q, done = mp.Queue(), mp.Event()
    p = mp.Process(target=server, args=(q, done))
    p.start()
    port, addr, check = q.get(timeout=60)
    from mooncake.engine import TransferEngine
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    dst = np.zeros(BLOCK * N, dtype=np.uint8)
    assert e.register_memory(dst.ctypes.data, dst.nbytes) == 0
    target = f"127.0.0.1:{port}"
    times = []
    for _ in range(6):
        dst[:] = 0
        t = time.perf_counter()
        rc = e.batch_transfer_sync_read(target, [dst.ctypes.data + i * BLOCK for i in range(N)],
                                        [addr + i * BLOCK for i in range(N)], [BLOCK] * N)
        times.append(time.perf_counter() - t)
        assert rc == 0 and int(dst[:4096].sum()) == check, rc
    done.set()
    p.join(10)
    import redis
    r = redis.Redis.from_url(sys.argv[1])
    payload = np.random.randint(0, 255, BLOCK, dtype=np.uint8).tobytes()
    wt, rt = [], []
    for k in range(6):
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for i in range(N):
            pipe.set(f"b{k}:{i}", payload)
        pipe.execute()
        wt.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for i in range(N):
            pipe.get(f"b{k}:{i}")
        out = pipe.execute()
        rt.append(time.perf_counter() - t)
        assert all(len(x) == BLOCK for x in out)
    mb = BLOCK * N / 1e6
    res = {"bytes": BLOCK * N, "mooncake_tcp_read_ms": sorted(times)[len(times) // 2] * 1e3,
           "redis_write_ms": sorted(wt)[3] * 1e3, "redis_read_ms": sorted(rt)[3] * 1e3}
    res["mooncake_GBps"] = mb / res["mooncake_tcp_read_ms"]
    res["redis_write_GBps"] = mb / res["redis_write_ms"]
    res["redis_read_GBps"] = mb / res["redis_read_ms"]
    print(f"{'layer':14} {'ms':>8} {'GB/s':>6}")
    print(f"{'mooncake tcp':14} {res['mooncake_tcp_read_ms']:8.1f} {res['mooncake_GBps']:6.2f}")
    print(f"{'redis write':14} {res['redis_write_ms']:8.1f} {res['redis_write_GBps']:6.2f}")
    print(f"{'redis read':14} {res['redis_read_ms']:8.1f} {res['redis_read_GBps']:6.2f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "transfer_layers.json"), "w") as f:
        json.dump(res, f, indent=2)

if __name__ == "__main__":
    main()
