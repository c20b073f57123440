"""Models spread over devices (`device_map`) and tensor parallelism: where each cache layer is pinned.

CPU tests check the per-layer device logic (a faked `hf_device_map`, a decoder layer moved to the meta
device) and the per-rank head arithmetic (a faked tensor-parallel size). The `gpu` tests need two CUDA
devices: they save a zoo model, reload it with a `device_map` that splits its decoder layers over
`cuda:0` and `cuda:1`, and compare compiled cachelife generation with eager dynamic-cache generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache, StaticCache

import cachelife
from cachelife.core import placement
from cachelife.core.layer_lifecycle import Filled, Pinned
from cachelife.core.pinning import pin_for_model
from cachelife.core.shapes import CacheShapes, LayerShape, per_rank_shapes
from cachelife.errors import CacheShapeError, UnsupportedCacheError
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.call_fit import check_call_fits
from cachelife.tools import zoo

NEW_TOKENS = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
ROOT = Path(__file__).resolve().parents[2]
# Where each zoo family keeps its decoder layers (the module path `decoder_layer_list` must find).
LAYER_LISTS = {"t5": "decoder.block", "bart": "model.decoder.layers", "whisper": "model.decoder.layers",
               "llama": "model.layers"}  # fmt: skip


def decoder_layers(model: PreTrainedModel) -> int:
    return len(cachelife.model_cache_shapes(model).self_attention)


def set_attribute(model: PreTrainedModel, name: str, value: object) -> None:
    """Set what transformers sets on a loaded model (`hf_device_map`, `_tp_size`, `_tp_plan`)."""
    model.__dict__[name] = value


def spread(model: PreTrainedModel) -> PreTrainedModel:
    """Make the model look loaded over two devices, as `from_pretrained(..., device_map=...)` marks it."""
    set_attribute(model, "hf_device_map", {"model.layers.0": "cpu", "model.layers.1": 0})
    return model


def cache_devices(cache: object) -> list[str]:
    devices = []
    for layer in cachelife.lifecycle(cache).layers:
        state = layer.state
        devices.append(str(state.buffers.device) if isinstance(state, Pinned | Filled) else "unpinned")
    return devices


# -- CPU: the per-layer device logic ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYER_LISTS))
def test_the_decoder_layer_list_is_found_for_each_family(name: str) -> None:
    model = zoo.build(name).model
    found = placement.decoder_layer_list(model, decoder_layers(model))
    assert found is model.get_submodule(LAYER_LISTS[name])


def test_a_model_on_one_device_pins_every_layer_on_the_model_device() -> None:
    model = zoo.build("t5").model
    assert not placement.is_spread_over_devices(model)
    assert placement.cache_layer_devices(model, 2, 2) == [torch.device("cpu")] * 4
    set_attribute(model, "hf_device_map", {"": "cpu"})  # a device_map of one device is no spread either
    assert not placement.is_spread_over_devices(model)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_spread_model_reads_each_decoder_layer_device_and_equals_eager(name: str) -> None:
    built = zoo.build(name)
    inputs = built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(built.model, inputs, **SETTINGS, disable_compile=True)
    model = spread(built.model)
    assert placement.decoder_layer_devices(model, 2) == (torch.device("cpu"), torch.device("cpu"))
    if model.config.is_encoder_decoder:  # transformers' generate needs accelerate's hooks for those
        cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=16, encoder_length=7)
        assert cache_devices(cache) == ["cpu"] * 4
        return
    cachelife.enable(model)
    tokens = zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    assert torch.equal(tokens, expected)


def test_a_decoder_layer_on_the_meta_device_is_refused_and_nothing_is_pinned() -> None:
    built = zoo.build("llama")
    model = spread(built.model)
    model.get_submodule("model.layers.1").to("meta")
    with pytest.raises(UnsupportedCacheError, match=r"decoder layer 1 \(LlamaDecoderLayer\) .* meta device"):
        placement.decoder_layer_devices(model, 2)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(UnsupportedCacheError, match="offloaded"):
        pin_for_model(cache, model, batch_size=2)
    assert cache_devices(cache) == ["unpinned", "unpinned"]


def test_a_decoder_layer_split_over_devices_is_refused() -> None:
    model = spread(zoo.build("t5").model)
    model.get_submodule("decoder.block.0.layer.2").to("meta")  # the feed-forward part only
    with pytest.raises(UnsupportedCacheError, match=r"decoder layer 0 \(T5Block\) .* meta device"):
        cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=8, encoder_length=4)


def test_no_decoder_layer_list_of_the_right_length_is_refused_with_the_count() -> None:
    model = spread(zoo.build("llama").model)
    with pytest.raises(UnsupportedCacheError, match="cannot find the 3 decoder layers of LlamaForCausalLM"):
        placement.decoder_layer_devices(model, 3)


def fake_layer_devices(monkeypatch: pytest.MonkeyPatch, devices: list[str]) -> None:
    """Pretend decoder layer i lives on devices[i] (a CPU machine has one real device, and meta)."""

    def layer_device(model: PreTrainedModel, index: int, layer: torch.nn.Module) -> torch.device:
        return torch.device(devices[index])

    monkeypatch.setattr(placement, "_layer_device", layer_device)


def test_each_cache_layer_is_pinned_on_its_decoder_layer_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model = spread(zoo.build("t5").model)
    fake_layer_devices(monkeypatch, ["cpu", "meta"])
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=16, encoder_length=5)
    assert isinstance(cache, EncoderDecoderCache)
    # self-attention layers 0 and 1, then cross-attention layers 0 and 1
    assert cache_devices(cache) == ["cpu", "meta", "cpu", "meta"]


def test_the_boundary_checks_each_layer_against_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    built = zoo.build("llama")
    model = spread(built.model)
    step = {"input_ids": built.inputs(2, 5, 1)["input_ids"]}
    fake_layer_devices(monkeypatch, ["cpu", "meta"])
    per_layer = StaticCache(config=model.config, max_cache_len=16)
    pin_for_model(per_layer, model, batch_size=2)
    check_call_fits(cachelife.lifecycle(per_layer), model, {**step, cache_argument_name(model): per_layer})
    one_device = StaticCache(config=model.config, max_cache_len=16)
    cachelife.lifecycle(one_device).pin(
        batch_size=2, shapes=cachelife.model_cache_shapes(model), dtype=torch.float32, device="cpu"
    )
    with pytest.raises(
        CacheShapeError, match=r"layer 1 \(self-attention\) does not fit .* holds device 'cpu' where 'meta' is needed"
    ):
        check_call_fits(cachelife.lifecycle(one_device), model, step)


# -- CPU: tensor-parallel head arithmetic ----------------------------------------------------------------


def test_per_rank_shapes_split_the_key_value_heads() -> None:
    shapes = CacheShapes((LayerShape(8, 64, 64), LayerShape(4, 32, 16)), (LayerShape(8, 64, 64),) * 2)
    halves = per_rank_shapes(shapes, 2)
    assert halves == CacheShapes((LayerShape(4, 64, 64), LayerShape(2, 32, 16)), (LayerShape(4, 64, 64),) * 2)
    assert per_rank_shapes(shapes, 1) == shapes
    with pytest.raises(UnsupportedCacheError, match=r"layer 1 \(self-attention\) of M has 4 key/value heads.*8"):
        per_rank_shapes(shapes, 8, who="M")


def test_a_tensor_parallel_llama_infers_per_rank_heads() -> None:
    model = zoo.build("llama").model  # 4 heads, 2 key/value heads; Llama's plan splits k_proj column-wise
    assert cachelife.model_cache_shapes(model).self_attention[0].num_kv_heads == 2
    set_attribute(model, "_tp_size", 2)
    assert cachelife.model_cache_shapes(model).self_attention == (LayerShape(1, 16, 16),) * 2
    cache = cachelife.prepare_static_cache(model, batch_size=3, max_cache_len=8)
    states = [layer.state for layer in cachelife.lifecycle(cache).layers]
    keys = [state.buffers.key_shape for state in states if isinstance(state, Pinned)]
    assert keys == [(3, 1, 8, 16)] * 2
    set_attribute(model, "_tp_size", 4)
    with pytest.raises(UnsupportedCacheError, match="has 2 key/value heads, which 4 tensor-parallel ranks"):
        cachelife.model_cache_shapes(model)


def test_a_model_whose_plan_keeps_keys_whole_keeps_its_heads() -> None:
    model = zoo.build("t5").model  # T5 has no tensor-parallel plan in transformers
    set_attribute(model, "_tp_size", 2)
    assert cachelife.model_cache_shapes(model).self_attention[0].num_kv_heads == 4
    llama = zoo.build("llama").model
    set_attribute(llama, "_tp_size", 2)
    # a gathered key projection: every rank holds all heads
    set_attribute(llama, "_tp_plan", {"model.layers.*.self_attn.k_proj": "colwise_rep"})
    assert cachelife.model_cache_shapes(llama).self_attention[0].num_kv_heads == 2


def run_tp_check(out: Path, device: str, model: str) -> dict[str, Any]:
    pytest.importorskip("accelerate", reason="transformers' tensor parallelism (tp_plan) needs accelerate")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    script = str(ROOT / "tests" / "core" / "tp_check.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               script, "--out", str(out), "--device", device, "--model", model]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    result_file = out / "tp-check.json"
    assert result_file.exists(), f"no result (exit {done.returncode}): {done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


@pytest.mark.slow
def test_tensor_parallel_on_two_cpu_ranks_equals_one_process_eager(tmp_path: Path) -> None:
    """transformers' tensor parallelism over gloo, two CPU processes: cachelife pins per-rank caches."""
    result = run_tp_check(tmp_path, "cpu", "llama")
    assert result["per_rank_key_shapes_ok"], result
    assert result["tp_eager_equals_single"], result
    assert result["cachelife_equals_single"], result


# -- GPU: two devices ------------------------------------------------------------------------------------


needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 CUDA devices, found {torch.cuda.device_count()}"
)


def split_device_map(model: PreTrainedModel) -> dict[str, int]:
    """Everything on GPU 0 except the second half of the decoder layers, on GPU 1."""
    layers = decoder_layers(model)
    layer_list = placement.decoder_layer_list(model, layers)
    device_map: dict[str, int] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if child is layer_list:
                device_map.update({f"{prefix}{name}.{i}": int(i >= layers // 2) for i in range(layers)})
            elif any(inner is layer_list for inner in child.modules()):
                visit(child, f"{prefix}{name}.")
            else:
                device_map[f"{prefix}{name}"] = 0

    visit(model, "")
    return device_map


@pytest.mark.gpu
@needs_two_gpus
# CUDA-graph trees capture the layers of the other GPU into an empty graph (torch warns); tokens are checked.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
# inductor's note that it split a softmax reduction (T5 on transformers 5.17): a performance remark.
@pytest.mark.filterwarnings("ignore:\\nOnline softmax is disabled on the fly:UserWarning")
@pytest.mark.parametrize(("name", "mode"), [("llama", "default"), ("t5", "default"), ("llama", "reduce-overhead")])
def test_device_map_over_two_gpus_pins_each_layer_on_its_device_and_equals_eager(
    tmp_path: Path, name: str, mode: str
) -> None:
    pytest.importorskip("accelerate", reason="transformers dispatches a multi-device device_map with accelerate")
    built = zoo.build(name)
    built.model.save_pretrained(tmp_path)
    device_map = split_device_map(built.model)
    model = type(built.model).from_pretrained(tmp_path, device_map=device_map).eval()
    layers = decoder_layers(model)
    expected_devices = [f"cuda:{int(i >= layers // 2)}" for i in range(layers)]
    assert [str(d) for d in placement.decoder_layer_devices(model, layers)] == expected_devices
    inputs = {key: value.to("cuda:0") for key, value in built.inputs(2, 7, 1).items()}
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)

    cachelife.enable(model)
    seen: list[list[str]] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get(cache_argument_name(model))
        if not seen and cache is not None:
            seen.append(cache_devices(cache))

    model.register_forward_pre_hook(record, with_kwargs=True)
    torch._dynamo.reset()
    skips_before = int(counters["inductor"]["cudagraph_skips"])
    # accelerate's device hooks wrap every layer's forward in Python; no fullgraph across them.
    cachelife.compile_forward(model, mode=mode)
    for _ in range(2):
        tokens = zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
        assert torch.equal(tokens.cpu(), expected.cpu())
    cross = expected_devices if model.config.is_encoder_decoder else []
    assert seen == [[*expected_devices, *cross]]
    skips = int(counters["inductor"]["cudagraph_skips"]) - skips_before
    print(f"{name} {mode}: CUDA-graph skips {skips}")


@pytest.mark.gpu
@needs_two_gpus
def test_tensor_parallel_on_two_gpus_equals_one_gpu_eager(tmp_path: Path) -> None:
    result = run_tp_check(tmp_path, "cuda", "llama-small")
    assert result["per_rank_key_shapes_ok"], result
    assert result["cachelife_equals_tp_eager"], result
    assert result["cachelife_equals_single"], result
