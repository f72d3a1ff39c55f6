"""--kv-cache-dtype: a bf16 KV pool holds twice the tokens of an fp32 one in the same memory, is
read by every CPU path (native decode and prefill, the fused step, torch) as its values widened, and
is said in GetModelInfo; what cannot work is refused before loading.
"""

import pytest
import torch

from protos import generation_pb2 as pb
from worker.serve.choices import kv_cache_dtype

CPU = torch.device("cpu")


def test_auto_follows_the_model_and_a_pool_wider_than_the_compute_is_refused():
    f32, bf16 = torch.float32, torch.bfloat16
    assert kv_cache_dtype("auto", f32, f32, CPU) == f32
    # --dtype bfloat16 on a CPU: bf16 weights, fp32 compute
    assert kv_cache_dtype("auto", f32, bf16, CPU) == bf16
    assert kv_cache_dtype("bf16", f32, f32, CPU) == bf16
    assert kv_cache_dtype("fp32", f32, bf16, CPU) == f32
    assert kv_cache_dtype("auto", bf16, bf16, torch.device("cuda")) == bf16
    with pytest.raises(ValueError, match="wider KV pool would hold nothing more"):
        kv_cache_dtype("fp32", bf16, bf16, torch.device("cuda"))
    with pytest.raises(ValueError, match="float32 or bfloat16 pool"):
        kv_cache_dtype("fp16", f32, f32, CPU)


def _answers(server, prompts):
    futures = [
        server.stub.Generate.future(
            pb.GenerateRequest(
                prompt_token_ids=p,
                sampling=pb.SamplingParams(
                    max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=0
                ),
            )
        )
        for p in prompts
    ]
    out = []
    for f in futures:
        r = f.result(timeout=120)
        out.append((list(r.choices[0].token_ids), [lp.logprob for lp in r.prompt_logprobs]))
    return out


@pytest.mark.slow
def test_a_bf16_pool_doubles_the_blocks_and_answers_as_the_torch_path_over_the_same_values(
    server_factory, tiny_model_dir
):
    """Same --kv-cache-memory: twice the blocks. The native kernels and the fused step over the bf16
    pool decode the greedy tokens the torch path decodes over it; prompt logprobs stay within bf16's
    rounding of the fp32 pool's; GetModelInfo says which pool it is; nothing leaks.
    """
    # up to 70 tokens: blocks crossed
    prompts = [[1, 5 + i, 9, 30 + 2 * i, 7] * (2 + 3 * i) for i in range(5)]
    runs = {}
    for name, flags in (
        ("fp32", []),
        ("bf16", ["--kv-cache-dtype", "bf16"]),
        (
            "bf16-torch",
            ["--kv-cache-dtype", "bf16", "--attention-backend", "torch", "--cpu-decode", "layers"],
        ),
    ):
        server = server_factory(
            tiny_model_dir, "--block-size", "16", "--kv-cache-memory", "8MiB", *flags
        )
        info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
        runs[name] = (info, _answers(server, prompts))
        stats = server.stub.GetCacheStats(pb.GetCacheStatsRequest())
        # every block back
        assert stats.num_free_blocks + stats.num_cached_blocks == info.num_blocks
        server.stop()
    (f32_info, f32), (bf_info, bf), (torch_info, via_torch) = (
        runs["fp32"],
        runs["bf16"],
        runs["bf16-torch"],
    )
    assert (f32_info.kv_cache_dtype, bf_info.kv_cache_dtype) == ("float32", "bfloat16")
    assert (
        bf_info.num_blocks == torch_info.num_blocks
        and bf_info.num_blocks // 2 == f32_info.num_blocks
    )
    assert [tokens for tokens, _ in bf] == [tokens for tokens, _ in via_torch]
    diffs = [
        abs(a - b)
        for (_, lp_bf), (_, lp_32) in zip(bf, f32, strict=True)
        for a, b in zip(lp_bf, lp_32, strict=True)
    ]
    assert max(diffs) < 0.05 and 0 < sum(diffs)  # bf16's rounding moves them, a little
