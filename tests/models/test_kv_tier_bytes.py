"""The KV tiers' bytes on a worker: a pool block written to the host or disk tier and read back into
another block is the same block, bit for bit (every layer's K and V, and its token record); a block
that fails its check — another hash, a flipped byte, a truncated file, another model's layout — does
not load.
"""

import os

import numpy as np
import pytest
import torch

from protos.codec import TIER_DISK, TIER_HOST, TierOps
from worker.model.config import ModelConfig
from worker.model.kv_pool import KVPool
from worker.model.kv_tiers import HEADER, DiskTier, KvTierStore, block_bytes, layout_key

SHAPE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def pool_of(dtype, blocks=8, seed=0):
    cfg = ModelConfig(**SHAPE)
    pool = KVPool(cfg, blocks, 4, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.k, *pool.v]:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    pool.tokens.copy_(torch.randint(0, 100, pool.tokens.shape, generator=g, dtype=torch.int32))
    return pool


def block_of(pool, b):
    return [t[b].clone() for t in [*pool.k, *pool.v]] + [pool.tokens[b].clone()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def ops(stores=(), loads=(), hashes=(), drops=()):
    rows = lambda r: np.asarray(r, dtype=np.int32).reshape(-1, 3)  # noqa: E731
    return TierOps(rows(stores), rows(loads), list(hashes), list(drops))


H = [bytes([i]) * 16 for i in range(8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_round_trips_through_each_tier_bit_for_bit(tmp_path, dtype):
    pool = pool_of(dtype)
    key = layout_key("fp", "w", pool, 0, 1, 0)
    store = KvTierStore(pool, 4, DiskTier(str(tmp_path), key, block_bytes(pool).size, 10))
    want = [block_of(pool, 1), block_of(pool, 2)]
    failed, _ = store.run(ops(stores=[(1, TIER_HOST, 3), (2, TIER_DISK, -1)], hashes=[H[1], H[2]]))
    store.disk.flush()
    assert (tmp_path / key.hex() / f"{H[2].hex()}.kv").stat().st_size == HEADER.size + block_bytes(
        pool
    ).size
    for t in [*pool.k, *pool.v]:  # the pool's blocks are reused for something else
        t[5:7].zero_()
    failed, _ = store.run(ops(loads=[(5, TIER_HOST, 3), (6, TIER_DISK, -1)], hashes=[H[1], H[2]]))
    assert failed.tolist() == []
    assert same(block_of(pool, 5), want[0]) and same(block_of(pool, 6), want[1])


def test_a_block_that_fails_its_check_does_not_load(tmp_path):
    pool = pool_of(torch.float32)
    key = layout_key("fp", "w", pool, 0, 1, 0)
    disk = DiskTier(str(tmp_path), key, block_bytes(pool).size, 10)
    store = KvTierStore(pool, 2, disk)
    store.run(
        ops(
            stores=[(0, TIER_HOST, 0), (1, TIER_DISK, -1), (2, TIER_DISK, -1), (3, TIER_DISK, -1)],
            hashes=[H[0], H[1], H[2], H[3]],
        )
    )
    disk.flush()
    path = lambda h: disk.dir / f"{h.hex()}.kv"  # noqa: E731
    with open(path(H[1]), "r+b") as f:  # one byte of the payload flipped
        f.seek(HEADER.size + 100)
        byte = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([byte[0] ^ 1]))
    with open(path(H[2]), "r+b") as f:  # cut short
        f.truncate(HEADER.size + 10)
    os.replace(path(H[3]), path(H[4]))  # a file under another block's name
    before = block_of(pool, 7)
    failed, _ = store.run(
        ops(
            loads=[
                (7, TIER_HOST, 0),
                (7, TIER_HOST, 1),
                (7, TIER_DISK, -1),
                (7, TIER_DISK, -1),
                (7, TIER_DISK, -1),
                (7, TIER_DISK, -1),
            ],
            hashes=[H[5], H[0], H[1], H[2], H[4], H[6]],
        )
    )
    # the host slot holds H[0], not H[5]; slot 1 holds nothing; then the flipped, cut, renamed and
    # missing
    assert failed.tolist() == [0, 1, 2, 3, 4, 5]
    assert same(block_of(pool, 7), before)  # nothing was written
    store.host.data[0, 17] ^= 1  # the host copy changed under it
    assert store.run(ops(loads=[(7, TIER_HOST, 0)], hashes=[H[0]]))[0].tolist() == [0]


def test_another_layout_never_reads_these_files_and_drops_delete_them(tmp_path):
    pool = pool_of(torch.float32)
    key = layout_key("fp", "w", pool, 0, 1, 0)
    disk = DiskTier(str(tmp_path), key, block_bytes(pool).size, 10)
    store = KvTierStore(pool, 0, disk)
    store.run(ops(stores=[(0, TIER_DISK, -1), (1, TIER_DISK, -1)], hashes=[H[0], H[1]]))
    disk.flush()
    assert DiskTier(str(tmp_path), key, block_bytes(pool).size, 10).held() == [H[0], H[1]]
    for other in (
        layout_key("fp2", "w", pool, 0, 1, 0),
        layout_key("fp", "w2", pool, 0, 1, 0),
        layout_key("fp", "w", pool, 1, 2, 0),
        layout_key("fp", "w", pool_of(torch.bfloat16), 0, 1, 0),
    ):
        assert (
            other != key and DiskTier(str(tmp_path), other, block_bytes(pool).size, 10).held() == []
        )
    store.run(ops(drops=[H[0]]))
    disk.flush()
    assert disk.held() == [H[1]]


def test_a_folder_that_cannot_be_written_is_refused(tmp_path):
    pool = pool_of(torch.float32)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError):
        DiskTier(str(blocker / "kv"), layout_key("fp", "w", pool, 0, 1, 0), 10, 10)


def test_writes_that_fail_are_later_misses_never_an_error(tmp_path):
    # the folder turns into a file under the worker: every write fails as on a full or vanished disk
    pool = pool_of(torch.float32)
    disk = DiskTier(str(tmp_path), layout_key("fp", "w", pool, 0, 1, 0), block_bytes(pool).size, 10)
    store = KvTierStore(pool, 0, disk)
    for p in disk.dir.iterdir():
        p.unlink()
    disk.dir.rmdir()
    disk.dir.write_text("not a folder")
    store.run(ops(stores=[(0, TIER_DISK, -1), (1, TIER_DISK, -1)], hashes=[H[0], H[1]]))
    disk.flush()
    failed, _ = store.run(ops(loads=[(4, TIER_DISK, -1), (5, TIER_DISK, -1)], hashes=[H[0], H[1]]))
    assert failed.tolist() == [0, 1]
    disk.dir.unlink()  # the folder is back: the writer goes on
    disk.dir.mkdir()
    store.run(ops(stores=[(2, TIER_DISK, -1)], hashes=[H[2]]))
    disk.flush()
    assert store.run(ops(loads=[(5, TIER_DISK, -1)], hashes=[H[2]]))[0].tolist() == []


def test_a_hybrids_state_snapshot_round_trips_beside_the_blocks_and_fails_numbered_after_them(
    tmp_path,
):
    """Every linear layer's conv and delta-rule state of a slot, written to each tier and read back
    into another slot, bit for bit; the block files and snapshot files share a folder apart; a
    snapshot that fails its check is reported after the step's block loads.
    """
    from worker.model.kv_tiers import snapshot_bytes
    from worker.model.state_pool import StatePool

    cfg = ModelConfig(
        **SHAPE,
        linear_layers=(True, True, False),
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=8,
        linear_v_dim=8,
        linear_conv_kernel=4,
    )
    # the linear layers hold no K/V in the pool: their state is in the state pool
    pool = KVPool(cfg, 8, 4, torch.bfloat16, torch.device("cpu"))
    pool.states = StatePool(cfg, 4, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    parts = [*pool.k, *pool.v, *pool.states.tensors()]
    for t in parts:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    key = layout_key("fp", "w", pool, 0, 1, 0)
    size, snap = block_bytes(pool).size, snapshot_bytes(pool.states).size
    assert snap == pool.states.bytes_per_slot and size == pool.bytes_per_block + 4 * 4
    store = KvTierStore(
        pool,
        2,
        DiskTier(str(tmp_path), key, size, 10),
        2,
        DiskTier(str(tmp_path), key, snap, 10, suffix=".st"),
    )
    slot = lambda s: [t[s].clone() for t in snapshot_bytes(pool.states).parts]  # noqa: E731
    want = [slot(0), slot(1)]
    full = lambda b: [t[b].clone() for t in [pool.k[2], pool.v[2], pool.tokens]]  # noqa: E731
    block = full(0)
    work = ops(stores=[(0, TIER_DISK, -1)], hashes=[H[0]])
    work.states = ops(stores=[(0, TIER_HOST, 1), (1, TIER_DISK, -1)], hashes=[H[0], H[1]])
    store.run(work)
    store.flush()
    assert store.disk.held() == [H[0]] and store.states.disk.held() == [H[1]]
    assert (tmp_path / key.hex() / f"{H[1].hex()}.st").stat().st_size == HEADER.size + snap
    for t in snapshot_bytes(pool.states).parts:
        t[2:4].zero_()
    work = ops(loads=[(5, TIER_DISK, -1), (6, TIER_DISK, -1)], hashes=[H[0], H[7]])
    work.states = ops(
        loads=[(2, TIER_HOST, 1), (3, TIER_DISK, -1), (3, TIER_DISK, -1)], hashes=[H[0], H[1], H[0]]
    )
    failed, _ = store.run(work)
    # the second block is missing; the third snapshot names a file only the block tier has
    assert failed.tolist() == [1, 4]
    assert same(slot(2), want[0]) and same(slot(3), want[1]) and same(full(5), block)
    # another state layout (other heads) is another folder
    assert layout_key("fp", "w", pool_of(torch.bfloat16), 0, 1, 0) != key
