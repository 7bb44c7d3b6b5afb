import sys, torch
sys.path.insert(0, 'tests')
from tiered_kv import _ext, pool_kinds as pk
assert _ext.load()
from test_pool_kinds import _case, _chunked
gp, _p, _r, lay = _case('flash_attn', 'cuda')
pool = _chunked(gp, lay)
table = torch.from_numpy(pk.block_table(pool, pool))
src = pk.chunk_tensors(pool)
dst = [t.clone() for t in src]
op = torch.ops.tiered_kv.copy_chunk_blocks.default
print(table, flush=True)
try:
    op(dst, src, table, None, [6], [1], 0)
except Exception as e:
    print("raised", e)
