"""Diagnostic: can the copy kernel write pinned staging memory from the main thread and from another thread?"""
import threading

import numpy as np
import torch

from tiered_kv import KVLayout, LayerMajorPool
from tiered_kv.config import EngineConfig
from tiered_kv.copyops import Copier
from tiered_kv.device import resolve_device
from tiered_kv.pools import BlockPool, Tier

L = KVLayout(2, 2, 16, 8, torch.float16)
dev = resolve_device("cuda")
host = dev.empty_host((4, L.bytes_per_block), torch.uint8)
print("pinned", host.is_pinned())
pool = BlockPool(Tier.HOST, L, host.view(L.dtype).view(4, *L.block_shape))
lm = LayerMajorPool.allocate(L, 6, "cuda", split_kv=False)
cop = Copier(dev, EngineConfig())
op = cop.build(lm, np.array([0, 2]), pool, np.array([1, 3]), None)
try:
    op(); torch.cuda.synchronize(); print("main thread: ok")
except Exception as e:
    print("main thread:", e)
err = []
def t():
    try:
        op(); torch.cuda.synchronize(); print("other thread: ok")
    except Exception as e:
        print("other thread:", e)
th = threading.Thread(target=t); th.start(); th.join()
