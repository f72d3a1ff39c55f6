"""Embedding models' folders (sentence-transformers' files) read into a PoolingSpec, what cannot be
served refused by name, and the vector finished from what the worker pooled.
"""

import json

import numpy as np
import pytest

from scheduler_service.core.pooling import PoolingConfigError, PoolingSpec, embedding_vector


def st_folder(
    folder, mode="pooling_mode_lasttoken", normalize=True, prompts=None, default=None, extra=()
):
    """A folder with sentence-transformers' files as Qwen3-Embedding ships them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    modules += [{"idx": 3 + i, "name": t, "path": t, "type": t} for i, t in enumerate(extra)]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": 64, "include_prompt": True}
    for key in (
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    ):
        pool[f"pooling_mode_{key}"] = False
    pool[mode] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(
            json.dumps(
                {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": "cosine"}
            )
        )
    return folder


def test_a_sentence_transformers_folder_says_how_it_pools(tmp_path):
    assert PoolingSpec.from_folder(tmp_path) is None  # a generative model's folder
    spec = PoolingSpec.from_folder(
        st_folder(tmp_path, prompts={"query": "Instruct: find it\nQuery:"})
    )
    assert (spec.pooling, spec.normalize, spec.dimension) == ("last", True, 64)
    assert spec.prompts == {"query": "Instruct: find it\nQuery:"} and spec.default_prompt is None
    assert spec.prefix_cacheable
    mean = PoolingSpec.from_folder(st_folder(tmp_path, "pooling_mode_mean_tokens", normalize=False))
    assert (mean.pooling, mean.normalize, mean.prefix_cacheable) == ("mean", False, False)
    assert PoolingSpec.from_folder(st_folder(tmp_path, "pooling_mode_cls_token")).pooling == "cls"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mode="pooling_mode_max_tokens"), "pooling_mode_max_tokens"),
        (dict(extra=("sentence_transformers.models.Dense",)), "Dense"),
        (dict(prompts={"query": "q: "}, default="passage"), "default_prompt_name 'passage'"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(PoolingConfigError, match=message):
        PoolingSpec.from_folder(st_folder(tmp_path, **kwargs))
    with pytest.raises(PoolingConfigError, match="pooling must be one of"):
        PoolingSpec(pooling="max")


def test_a_vector_is_finished_as_a_mean_truncated_and_made_unit_length():
    pooled = np.array([3.0, 4.0, 12.0, 0.0], dtype=np.float32)
    last = PoolingSpec(pooling="last")
    np.testing.assert_allclose(embedding_vector(pooled, 5, last, None), pooled / 13)
    # renormalized after cutting
    np.testing.assert_allclose(embedding_vector(pooled, 5, last, 2), [0.6, 0.8])
    mean = PoolingSpec(pooling="mean", normalize=False)
    # a sum over 4 tokens
    np.testing.assert_allclose(embedding_vector(pooled, 4, mean, None), pooled / 4)
    assert embedding_vector(np.zeros(3, np.float32), 1, last, None).tolist() == [0.0, 0.0, 0.0]


def test_the_task_follows_the_folder_and_a_headless_checkpoint_only_embeds(tmp_path):
    from scheduler_service.core.config import ModelSpec
    from tests.support.tiny import make_tiny_embedder, make_tiny_llama

    headless = make_tiny_embedder(tmp_path / "embedder", "mean_tokens")
    spec = ModelSpec.from_folder(headless)
    assert (spec.task, spec.pooling.pooling, spec.pooling.normalize) == ("embed", "mean", True)
    assert spec.hidden_size == 64
    # --pooling overrides
    assert ModelSpec.from_folder(headless, pooling="last").pooling.pooling == "last"
    for task in ("generate", "both"):
        with pytest.raises(PoolingConfigError, match="no language-model head"):
            ModelSpec.from_folder(headless, task=task)
    decoder = make_tiny_llama(tmp_path / "decoder")
    assert ModelSpec.from_folder(decoder).task == "generate"
    both = ModelSpec.from_folder(decoder, task="both", pooling="cls")
    assert (both.task, both.generates, both.pooling.pooling) == ("both", True, "cls")
    assert ModelSpec.from_folder(decoder, task="embed").pooling.pooling == "last"
    with pytest.raises(PoolingConfigError, match="--pooling applies to an embedding model"):
        ModelSpec.from_folder(decoder, pooling="mean")
