"""LoRA adapters in the scheduler: a PEFT folder checked against the base model (every refusal names
what it refuses), the prefix cache keyed by the adapter's identity, and the steps holding at most
--max-loras.
"""

import json

import numpy as np
import pytest

from protos.codec import decode_plan, encode_plan
from scheduler_service.core.adapters import (
    AdapterError,
    AdapterRegistry,
    BaseShapes,
    parse_module_flag,
)
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions
from tests.support.simulated import SimulatedWorker

BASE = BaseShapes(num_layers=2, hidden=8, q_size=8, kv_size=4, intermediate=16)


def write_adapter(
    folder, r=4, modules=("q_proj", "v_proj"), layers=2, seed=0, shapes=None, extra=None, **config
):
    """A PEFT-shaped adapter folder: its config and a safetensors file of lora_A / lora_B per
    module.
    """
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for m in modules:
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out, inp = (shapes or {}).get(m, BASE.shape(m))
            prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, inp)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, r)).astype(np.float32)
    tensors.update(extra or {})
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": list(modules),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def registry(max_rank=16):
    return AdapterRegistry(BASE, base_names=("tiny",), max_rank=max_rank)


def test_a_peft_folder_loads_with_its_rank_targets_and_an_identity_of_its_files(tmp_path):
    reg = registry()
    a = reg.load("a", str(write_adapter(tmp_path / "a", modules=("q_proj", "v_proj", "down_proj"))))
    assert (a.rank, a.target_modules) == (4, ("down_proj", "q_proj", "v_proj"))
    same = registry().load(
        "b", str(write_adapter(tmp_path / "b", modules=("q_proj", "v_proj", "down_proj")))
    )
    other = registry().load(
        "c", str(write_adapter(tmp_path / "c", seed=1, modules=("q_proj", "v_proj", "down_proj")))
    )
    assert same.identity == a.identity  # the same files
    assert other.identity != a.identity  # other weights, same names and shapes
    assert reg.get("a") is a


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: write_adapter(d, use_dora=True), "DoRA"),
        (lambda d: write_adapter(d, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda d: write_adapter(d, r=32), "rank 32 is above --max-lora-rank 16"),
        (lambda d: write_adapter(d, bias="lora_only"), "biases"),
        (lambda d: write_adapter(d, peft_type="IA3"), "peft_type 'IA3'"),
        (
            lambda d: write_adapter(
                d, extra={"base_model.model.lm_head.lora_A.weight": np.zeros((4, 8), np.float32)}
            ),
            "lm_head is not served",
        ),
        (
            lambda d: write_adapter(
                d,
                extra={
                    "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros(
                        (4, 8), np.float32
                    )
                },
            ),
            "embed_tokens is not served",
        ),
        (
            lambda d: write_adapter(d, shapes={"q_proj": (16, 8)}),
            "an adapter of another base model",
        ),
        (lambda d: write_adapter(d, layers=3), "it changes layer 2; the base model has 2"),
    ],
)
def test_what_cannot_be_served_as_meant_is_refused_by_name(tmp_path, make, needle):
    folder = make(tmp_path / "bad")
    with pytest.raises(AdapterError, match="LoRA adapter 'bad'") as e:
        registry().load("bad", str(folder))
    assert needle in str(e.value)


def test_an_adapter_on_gemma4_is_refused_naming_why(tmp_path):
    """Gemma 4's layers differ in head size and its last project no K/V: no adapter fits all."""
    cfg = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", **TEXT_SHAPES}}
    reg = AdapterRegistry(BaseShapes.from_config(cfg), base_names=("g",), max_rank=16)
    with pytest.raises(AdapterError, match="LoRA on Gemma 4 .* is not served"):
        reg.load("g4", str(write_adapter(tmp_path / "a")))


TEXT_SHAPES = dict(
    hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, head_dim=4
)


def test_missing_files_a_name_in_use_and_bad_flags_are_refused(tmp_path):
    reg = registry()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        reg.load("x", str(tmp_path / "nowhere"))
    reg.load("x", str(write_adapter(tmp_path / "x")))
    with pytest.raises(AdapterError, match="loaded already"):
        reg.load("x", str(write_adapter(tmp_path / "y", seed=2)))
    with pytest.raises(AdapterError, match="the base model"):
        reg.load("tiny", str(tmp_path / "x"))
    with pytest.raises(KeyError, match=r"unknown LoRA adapter 'z' \(loaded: x\)"):
        reg.get("z")
    with pytest.raises(AdapterError, match="NAME=PATH"):
        parse_module_flag(["nopath"])
    with pytest.raises(AdapterError, match="twice"):
        parse_module_flag(["a=/x", "a=/y"])


def test_a_reload_under_the_same_name_is_a_new_adapter(tmp_path):
    reg = registry()
    old = reg.load("x", str(write_adapter(tmp_path / "x")))
    new = reg.load("x", str(write_adapter(tmp_path / "x2", seed=5)), replace=True)
    assert new.id != old.id and new.identity != old.identity and reg.get("x") is new


def _request(rid, prompt, lora, max_tokens=6):
    return Request(rid, list(prompt), SamplingOptions(max_tokens=max_tokens), lora=lora)


def test_the_same_prompt_under_two_adapters_never_shares_a_block(tmp_path):
    reg = registry()
    a = reg.load("a", str(write_adapter(tmp_path / "a")))
    b = reg.load("b", str(write_adapter(tmp_path / "b", seed=1)))
    config = SchedulerConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, debug_invariants=True
    )
    sched = Scheduler(config, 64, max_model_len=256)
    worker = SimulatedWorker(64, 4)
    prompt = list(range(10, 30))

    def run(req):
        sched.add_request(req)
        while sched.has_work:
            worker.step(sched, sched.schedule())
        return req.cached_prompt_tokens

    assert run(_request("a1", prompt, a)) == 0
    assert run(_request("b1", prompt, b)) == 0  # another adapter: nothing of a's is reused
    assert run(_request("base", prompt, None)) == 0  # nor by the base model
    assert run(_request("a2", prompt, a)) == 16  # its own blocks are
    assert run(_request("b2", prompt, b)) == 16


def test_steps_hold_at_most_max_loras_adapters_and_every_request_finishes(tmp_path):
    reg = registry()
    adapters = [reg.load(f"a{i}", str(write_adapter(tmp_path / f"a{i}", seed=i))) for i in range(4)]
    config = SchedulerConfig(
        block_size=4, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2, debug_invariants=True
    )
    sched = Scheduler(config, 128, max_model_len=256)
    worker = SimulatedWorker(128, 4)
    rng = np.random.default_rng(0)
    reqs = [
        _request(f"r{i}", rng.integers(3, 300, 9).tolist(), adapters[i % 4] if i % 5 else None, 8)
        for i in range(20)
    ]
    for r in reqs:
        sched.add_request(r)
    most = 0
    while sched.has_work:
        out = sched.schedule()
        wire = encode_plan(sched.build_plan(out))
        plan = decode_plan(wire)
        running = {s.request.lora.id for s in sched.running if s.request.lora is not None}
        assert len(running) <= 2
        named = [] if plan.loras is None else plan.loras
        most = max(most, len(named))
        # each row points at its own adapter's identity and path
        for i, item in enumerate(out.scheduled):
            lora = item.seq.request.lora
            index = -1 if plan.lora_index is None else int(plan.lora_index[i])
            assert (index < 0) == (lora is None)
            if lora is not None:
                assert named[index] == (lora.identity, lora.path)
        sched.update(out, worker.execute(wire), worker.last_accepted, worker.last_pooled)
    assert most == 2  # two adapters did share steps
    assert all(r.is_finished for r in reqs)


def test_kv_events_say_which_adapter_a_stored_block_belongs_to(tmp_path):
    a = registry().load("a", str(write_adapter(tmp_path / "a")))
    config = SchedulerConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=64, debug_invariants=True
    )
    sched = Scheduler(config, 32, max_model_len=128)
    sched.kv.record_kv_events()
    worker = SimulatedWorker(32, 4)
    events = []
    for req in (_request("a", range(10, 19), a, 1), _request("base", range(10, 19), None, 1)):
        sched.add_request(req)
        while sched.has_work:
            update = worker.step(sched, sched.schedule())
            events += update.kv_events
    stored = [e for e in events if e[0] == "stored"]
    assert [e[4] if len(e) > 4 else None for e in stored] == [a.event_id] * 2 + [None] * 2
    assert stored[0][2] is None and stored[0][1] != stored[2][1]  # same tokens, other hashes


def test_the_launchers_pass_every_adapter_on_and_give_the_workers_their_slots():
    from deploy.launcher import build_parser, passthrough, worker_units
    from scheduler_service.main import build_parser as scheduler_parser

    args = build_parser().parse_args(
        ["--model", "m", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3"]
    )
    assert passthrough(scheduler_parser(), args, {"model"})[-5:] == [
        "--lora-modules",
        "a=/x",
        "b=/y",
        "--max-loras",
        "3",
    ]
    worker_argv = worker_units(args, "tcp://127.0.0.1:1")[0].programs[0].argv
    # one an adapter, to --max-loras
    assert worker_argv[worker_argv.index("--max-cpu-loras") + 1] == "2"
    plain = build_parser().parse_args(["--model", "m"])
    assert "--max-cpu-loras" not in worker_units(plain, "tcp://127.0.0.1:1")[0].programs[0].argv


def test_no_more_adapters_run_at_once_than_every_worker_keeps():
    from types import SimpleNamespace

    from scheduler_service.runtime.groups import adopted_config

    def group(*slots):
        hs = [SimpleNamespace(max_num_seqs=0, lora_slots=s) for s in slots]
        return SimpleNamespace(workers={i: SimpleNamespace(handshake=h) for i, h in enumerate(hs)})

    config = SchedulerConfig(max_loras=8)
    assert adopted_config(config, [group(3, 5), group(4)]).max_loras == 3
    assert adopted_config(config, [group(16)]).max_loras == 8
    assert adopted_config(config, [group(0)]).max_loras == 8  # LoRA off there: nothing to bound


def test_an_accepted_group_is_sent_the_latest_adapters_its_workers_keep(tmp_path):
    """The handshake's answer names the adapters a new or restarted worker reads before its first
    step: the latest loaded, no more than the rank with the fewest slots keeps.
    """
    from protos import wire_pb2
    from scheduler_service.runtime.groups import WorkerGroup, WorkerInfo

    reg = registry()
    group = WorkerGroup(0, 2)
    for rank, slots in ((0, 3), (1, 2)):
        group.workers[rank] = WorkerInfo(
            0, rank, b"w.x", b"hb.x", wire_pb2.Handshake(lora_slots=slots)
        )
    assert group.preload(None) == [] and group.preload(reg) == []
    loaded = [reg.load(n, str(write_adapter(tmp_path / n, seed=i))) for i, n in enumerate("abc")]
    refs = group.preload(reg)
    assert [(r.identity, r.path) for r in refs] == [(a.identity, a.path) for a in loaded[1:]]
    reg.unload("c")
    assert [r.path for r in group.preload(reg)] == [a.path for a in loaded[:2]]
