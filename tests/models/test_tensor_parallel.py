"""Tensor parallelism: how a model splits over ranks, and the split forward through real
torch.distributed (gloo) ranks against the unsplit model on the same steps.
"""

import multiprocessing as mp

import pytest
import torch

from tests.support.tiny import make_tiny_llama
from worker.model.parallel import ParallelConfigError, make_shard

BLOCK = 4


def test_shards_cover_the_model_and_replicate_kv_heads_when_they_are_fewer_than_ranks():
    # the default model: 9 query heads, 3 KV heads, MLP 1536, vocabulary 49152
    shards = [make_shard(9, 3, 1536, 49152, r, 3) for r in range(3)]
    assert [s.q_heads for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2), (2, 3)]
    assert [s.intermediate for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [s.vocab for s in shards] == [(0, 16384), (16384, 32768), (32768, 49152)]
    # 8 query heads over 2 KV heads on 4 ranks: ranks 0, 1 read KV head 0; ranks 2, 3 KV head 1
    four = [make_shard(8, 2, 64, 10, r, 4) for r in range(4)]
    assert [s.kv_heads for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    for s in four:  # every query head of a rank belongs to the KV head it holds (group of 4)
        assert all(h // 4 == s.kv_heads[0] for h in range(*s.q_heads))
    assert [s.vocab for s in four] == [(0, 3), (3, 6), (6, 9), (9, 10)] and four[
        0
    ].vocab_shard_size == 3
    # a hybrid's Gated DeltaNet heads: each rank its key heads with their value heads
    pair = [make_shard(4, 2, 64, 10, r, 2, linear_heads=(2, 4)) for r in range(2)]
    assert [(s.linear_k_heads, s.linear_v_heads) for s in pair] == [
        ((0, 1), (0, 2)),
        ((1, 2), (2, 4)),
    ]
    with pytest.raises(ParallelConfigError, match="6 Gated DeltaNet value heads"):
        make_shard(4, 4, 64, 10, 0, 4, linear_heads=(4, 6))


@pytest.mark.parametrize(
    "heads,kv,inter,tp,needle",
    [
        (9, 3, 1536, 2, "cannot split the model's 9 query heads"),
        (12, 4, 60, 6, "is not a multiple of the model's 4 KV heads"),
        (8, 8, 62, 4, "cannot split the model's MLP intermediate size 62"),
        (12, 6, 64, 4, "cannot split the model's 6 KV heads"),
    ],
)
def test_a_size_that_cannot_split_the_model_is_refused_with_the_numbers(
    heads, kv, inter, tp, needle
):
    with pytest.raises(ParallelConfigError, match=needle):
        make_shard(heads, kv, inter, 1000, 0, tp)


def _steps(vocab):
    """Two sequences prefilled into scattered blocks, then two decode steps: (tokens, start, blocks)
    each.
    """
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, vocab, (11,), generator=g).tolist()
    b = torch.randint(0, vocab, (6,), generator=g).tolist()
    blocks_a, blocks_b = [7, 2, 9, 4], [1, 11, 5]
    return [
        [(a, 0, blocks_a), (b, 0, blocks_b)],
        [([a[0]], 11, blocks_a), ([b[1]], 6, blocks_b)],
        [([3], 12, blocks_a), ([vocab - 1], 7, blocks_b)],
    ]


def _run(folder, tp_rank, tp_size, comm=None):
    """Logits of each step's last tokens through a (possibly sharded) model; fp32 on the CPU."""
    from tests.support.forward import run_step
    from worker.model.kv_pool import KVPool
    from worker.weights.loader import load_model

    model, config = load_model(
        str(folder),
        "auto",
        torch.float32,
        torch.device("cpu"),
        tp_rank=tp_rank,
        tp_size=tp_size,
        comm=comm,
    )
    pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"), model.shard.size)
    return [run_step(model, config, pool, seqs)[0] for seqs in _steps(config.vocab_size)]


def _rank_main(folder, rank, size, meeting, out):
    torch.set_num_threads(1)
    from worker.model.parallel import init_group

    # rank 0 listens on any free port and writes it to the meeting file, where the others find it
    comm = init_group(
        "tcp://127.0.0.1:0", rank, size, torch.device("cpu"), 60, rendezvous_file=str(meeting)
    )
    logits = _run(folder, rank, size, comm)
    out.put((rank, [t.tolist() for t in logits]))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,overrides",
    [
        (2, {}),  # 4 query heads, 2 KV heads: one KV head per rank
        (4, {}),  # 2 KV heads on 4 ranks: each KV head replicated on two ranks
        # 6 heads / 3 KV heads on 3 ranks, tied embeddings, a vocabulary that 3 does not divide
        # (padded shard)
        (
            3,
            dict(
                num_attention_heads=6,
                num_key_value_heads=3,
                hidden_size=48,
                head_dim=8,
                intermediate_size=96,
                vocab_size=383,
                tie_word_embeddings=True,
            ),
        ),
    ],
)
def test_split_forward_through_gloo_ranks_equals_the_unsplit_model(tmp_path, tp, overrides):
    folder = make_tiny_llama(tmp_path / "model", seed=11, **overrides)
    expected = _run(folder, 0, 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    meeting = tmp_path / "rendezvous.json"
    procs = [ctx.Process(target=_rank_main, args=(folder, r, tp, meeting, out)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(tp))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank in range(tp):  # every rank holds the same full logits after the all-gather
        assert results[rank] == results[0]
    for got, want in zip(results[0], expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-4, rtol=1e-4)
        assert torch.equal(torch.tensor(got).argmax(-1), want.argmax(-1))
