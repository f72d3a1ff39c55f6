"""The worker's torch attention backend against the plain reference, on adversarial paged inputs."""

import pytest
import torch

from kernels.reference import paged_attention, write_kv
from tests.paged_case import make_case
from worker.attention import make_backend


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 2), (10, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_backend_matches_reference_on_mixed_batches(n_heads, n_kv_heads, block_size):
    # decode rows, a fresh prefill, a chunk over a cached prefix, lengths at block boundaries
    q_lens = [1, 7, 1, 5, 1, 3]
    seq_lens = [1, 7, block_size, block_size + 5, block_size + 1, 3 * block_size - 1]
    c = make_case(q_lens, seq_lens, n_heads, n_kv_heads, 16, block_size, seed=0)
    backend = make_backend("torch", torch.device("cpu"))
    meta = backend.prepare(c.block_tables, c.seq_lens, c.query_start_loc, block_size, max(seq_lens), max(q_lens))
    out = backend.forward(c.q, c.k_cache, c.v_cache, meta, c.scale)
    ref = paged_attention(*c.args)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reference_head_mapping_and_causality():
    """One KV head filled with a constant value: exactly its query heads read that constant."""
    block_size, n_heads, n_kv_heads = 4, 6, 3
    c = make_case([3], [6], n_heads, n_kv_heads, 8, block_size, seed=1)
    q, k, v, tables, lens, qsl = c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.query_start_loc
    slots = tables[0, torch.arange(6) // block_size].long() * block_size + torch.arange(6) % block_size
    v.view(-1, n_kv_heads, 8)[slots, 1] = 7.0
    out = paged_attention(q, k, v, tables, lens, qsl, 0.3)
    assert torch.allclose(out[:, 2:4], torch.full_like(out[:, 2:4], 7.0))
    assert not torch.allclose(out[:, 0:2], torch.full_like(out[:, 0:2], 7.0))
    # the first query of a 3-token chunk over 6 keys sees keys 0..3 only: changing key 5 changes nothing for it
    v2 = v.clone()
    v2.view(-1, n_kv_heads, 8)[slots[5]] += 100.0
    out2 = paged_attention(q, k, v2, tables, lens, qsl, 0.3)
    assert torch.equal(out[:2], out2[:2]) and not torch.equal(out[2], out2[2])


def test_write_kv_padding_slots_write_nothing():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    before = k_cache.clone()
    write_kv(torch.ones(3, 1, 2), torch.ones(3, 1, 2), k_cache, v_cache, torch.tensor([-1, 5, -1]))
    changed = (k_cache != before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [5]
