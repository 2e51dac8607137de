"""The adapter loader: PEFT's own weights, read safely, and every bad adapter refused by name."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import boto3
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from serving.engine.lora.reader import (
    AdapterError,
    BaseShapes,
    download_s3_prefix,
    load_adapter,
    validate_adapter_dir,
)
from serving.contracts.artifact import adapter_digest, base_config_sha256, manifest_write

WEIGHTS = "adapter_model.safetensors"
KEY = "base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"
LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_config(tiny_llama_dir):
    return AutoConfig.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def all_modules_adapter(tiny_llama_dir, make_adapter) -> Path:
    return make_adapter(
        tiny_llama_dir, r=8, lora_alpha=16, target_modules=LLAMA_MODULES, seed=3
    )


@pytest.fixture
def adapter(all_modules_adapter, tmp_path) -> Path:
    """A private copy of a valid adapter for the test to change."""
    return Path(shutil.copytree(all_modules_adapter, tmp_path / "adapter"))


def _load(source, base_config, *, max_lora_rank=64, **kwargs):
    return load_adapter(source, base_config=base_config, max_lora_rank=max_lora_rank, **kwargs)


def _edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(adapter_dir: Path, edit) -> None:
    tensors = load_file(adapter_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, adapter_dir / WEIGHTS, metadata={"format": "pt"})


def _write_manifest(adapter_dir: Path, base_dir: Path) -> None:
    manifest_write(
        adapter_dir, tenant="alice-co", name="bot", version="1.0.0", base_model_name="tiny-llama",
        base_config_sha256=base_config_sha256(base_dir), source_kind="upload", source_id="u1",
    )


# --- what a good adapter loads to ---------------------------------------------------------------


def test_weights_equal_peft_and_reproduce_its_layer_output(tiny_model_dir, make_adapter):
    adapter_dir = make_adapter(
        tiny_model_dir, r=6, lora_alpha=24, target_modules=["q_proj", "v_proj", "down_proj"], seed=1
    )
    config = AutoConfig.from_pretrained(tiny_model_dir)

    loaded = load_adapter(adapter_dir, base_config=config, max_lora_rank=8)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                           adapter_dir)
    layers = peft_model.base_model.model.model.layers
    assert (loaded.rank, loaded.lora_alpha, loaded.scaling) == (6, 24.0, 4.0)
    assert loaded.target_modules == {"q_proj", "v_proj", "down_proj"}
    assert set(loaded.weights) == {
        (layer, module) for layer in range(2) for module in ("q_proj", "v_proj", "down_proj")
    }
    for (layer, module), (a, b) in loaded.weights.items():
        parent = layers[layer].mlp if module == "down_proj" else layers[layer].self_attn
        lora_layer = getattr(parent, module)
        assert a.dtype == b.dtype == torch.float32 and a.device.type == "cpu"
        assert torch.equal(a, lora_layer.lora_A["default"].weight)
        assert torch.equal(b, lora_layer.lora_B["default"].weight)
        assert loaded.scaling == lora_layer.scaling["default"]
    assert loaded.nbytes == sum(a.nbytes + b.nbytes for a, b in loaded.weights.values())
    assert loaded.digest == adapter_digest(adapter_dir)

    q_proj = layers[1].self_attn.q_proj
    a, b = loaded.weights[1, "q_proj"]
    x = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        expected = q_proj(x)
        ours = q_proj.base_layer(x) + loaded.scaling * (x @ a.T) @ b.T
    torch.testing.assert_close(ours, expected)


def test_rslora_scales_by_the_square_root_of_the_rank(adapter, base_config, tiny_llama_dir):
    _edit_config(adapter, use_rslora=True)

    loaded = _load(adapter, base_config)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                                           adapter)
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert loaded.scaling == pytest.approx(16 / 8**0.5) == q_proj.scaling["default"]


def test_half_precision_weights_load_as_float32(adapter, base_config):
    original = load_file(adapter / WEIGHTS)
    _edit_tensors(adapter, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))

    loaded = _load(adapter, base_config)

    a, _ = loaded.weights[0, "o_proj"]
    name = KEY.format(layer=0, parent="self_attn", module="o_proj", which="A")
    assert a.dtype == torch.float32
    assert torch.equal(a, original[name].to(torch.bfloat16).to(torch.float32))


def test_base_shapes_work_in_place_of_a_transformers_config(adapter, base_config):
    shapes = BaseShapes.from_config(base_config)
    assert shapes.modules["k_proj"] == (64, 32) and shapes.modules["down_proj"] == (128, 64)

    from_shapes = _load(adapter, shapes)
    from_config = _load(adapter, base_config)

    assert from_shapes.digest == from_config.digest
    assert all(torch.equal(from_shapes.weights[k][1], from_config.weights[k][1])
               for k in from_config.weights)


def test_a_phi3_adapter_loads_on_the_fused_projections_and_a_split_one_is_refused(tiny_model_factory, make_adapter,
                                                                                 adapter):
    """Phi-3's checkpoints fuse q/k/v and gate/up, so PEFT adapts qkv_proj and gate_up_proj whole."""
    phi3_dir = tiny_model_factory("phi3")
    config = AutoConfig.from_pretrained(phi3_dir)
    fused = make_adapter(phi3_dir, r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], seed=2)

    loaded = _load(fused, config)

    heads_out = (config.num_attention_heads + 2 * config.num_key_value_heads) * 16
    assert loaded.target_modules == {"qkv_proj", "gate_up_proj"}
    assert loaded.weights[1, "qkv_proj"][1].shape == (heads_out, 4)
    assert loaded.weights[0, "gate_up_proj"][1].shape == (2 * config.intermediate_size, 4)
    with pytest.raises(AdapterError, match=r"adapts gate_proj, which the base model does not have; its projections "
                                           r"are qkv_proj, o_proj, gate_up_proj, down_proj"):
        _load(adapter, config)


def test_gemma_shapes_take_its_default_head_dim(base_config):
    """Gemma's config classes default head_dim to 256, not hidden / heads (the upload check reads
    config.json's fields, which may leave it out)."""
    fields = {**base_config.to_dict(), "model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8,
              "num_key_value_heads": 4}
    del fields["head_dim"]
    shapes = BaseShapes.from_config(type("Config", (), fields))
    assert shapes.modules["q_proj"] == (2304, 8 * 256) and shapes.modules["o_proj"] == (8 * 256, 2304)


def test_manifest_is_verified_and_its_sha256_is_the_digest(adapter, base_config, tiny_llama_dir):
    without_manifest = _load(adapter, base_config).digest
    _write_manifest(adapter, tiny_llama_dir)

    loaded = _load(adapter, base_config)

    assert loaded.digest == adapter_digest(adapter) != without_manifest


def test_file_uri_loads_the_same_adapter(adapter, base_config):
    assert _load(adapter.as_uri(), base_config).digest == _load(adapter, base_config).digest


@pytest.mark.parametrize("accepted", ["tiny-llama", "TINY-LLAMA", "/srv/models/tiny-llama/",
                                      ["other", "org/tiny-llama"]])
def test_base_model_matches_by_last_path_component(adapter, base_config, accepted):
    _edit_config(adapter, base_model_name_or_path="/var/models/tiny-llama")
    assert _load(adapter, base_config, base_model_name=accepted).rank == 8


def test_validation_reads_the_header_only_and_reports_the_layout(adapter, base_config):
    _edit_tensors(adapter, lambda t: t[KEY.format(layer=1, parent="mlp", module="up_proj",
                                                    which="B")].fill_(float("nan")))

    spec = validate_adapter_dir(adapter, base_config=base_config, max_lora_rank=8)

    assert (spec.rank, spec.lora_alpha, spec.scaling) == (8, 16.0, 2.0)
    assert spec.target_modules == set(LLAMA_MODULES) and spec.layers == {0, 1}
    assert spec.weights_bytes == (adapter / WEIGHTS).stat().st_size
    with pytest.raises(AdapterError, match=r"layers\.1\.mlp\.up_proj\.lora_B\.weight contains NaN"):
        _load(adapter, base_config)


# --- every bad adapter is refused with its reason --------------------------------------------


def test_rank_above_the_maximum_names_both_numbers(adapter, base_config):
    with pytest.raises(AdapterError, match=r"adapter rank 8 exceeds max_lora_rank 4"):
        _load(adapter, base_config, max_lora_rank=4)


def test_unsupported_module_in_the_config_is_named(adapter, base_config):
    _edit_config(adapter, target_modules=["q_proj", "classifier"])
    message = r"unsupported target module\(s\) classifier; supported: q_proj.*embed_tokens, lm_head"
    with pytest.raises(AdapterError, match=message):
        _load(adapter, base_config)


def test_unsupported_module_in_the_weights_is_named(adapter, base_config):
    _edit_config(adapter, target_modules=".*(q_proj|classifier)")
    name = "base_model.model.model.layers.0.mlp.classifier.lora_A.weight"
    _edit_tensors(adapter, lambda t: t.update({name: torch.zeros(8, 64)}))
    with pytest.raises(AdapterError, match=r"unsupported target module classifier \(tensor .*classifier"):
        _load(adapter, base_config)


def test_shape_mismatch_names_the_tensor_and_both_shapes(adapter, base_config):
    bigger = copy.deepcopy(base_config)
    bigger.intermediate_size = 256
    message = (r"layers\.0\.mlp\.down_proj\.lora_A\.weight has shape \(8, 128\), "
               r"but the base model with r=8 expects \(8, 256\)")
    with pytest.raises(AdapterError, match=message):
        _load(adapter, bigger)


def test_tensor_rank_must_match_the_config_rank(adapter, base_config):
    _edit_config(adapter, r=4)
    message = r"lora_A\.weight has shape \(8, (\d+)\), .* r=4 expects \(4, \1\)"
    with pytest.raises(AdapterError, match=message):
        _load(adapter, base_config)


def test_layer_beyond_the_base_model_is_refused(adapter, base_config):
    shallower = copy.deepcopy(base_config)
    shallower.num_hidden_layers = 1
    with pytest.raises(AdapterError, match=r"is for layer 1, but the base model has 1 layers"):
        _load(adapter, shallower)


@pytest.mark.parametrize(
    ("missing", "message"),
    [("adapter_config.json", r"adapter_config\.json is missing"),
     (WEIGHTS, r"adapter_model\.safetensors is missing")],
)
def test_missing_file_is_named(adapter, base_config, missing, message):
    (adapter / missing).unlink()
    with pytest.raises(AdapterError, match=message):
        _load(adapter, base_config)


class _Trap:
    """Unpickling this creates a directory: proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickled_weights_are_refused_without_being_unpickled(adapter, base_config, tmp_path):
    marker = tmp_path / "unpickled"
    (adapter / WEIGHTS).unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(marker)))

    with pytest.raises(AdapterError, match=r"adapter_model\.bin is a pickled checkpoint, which is "
                                           r"never loaded"):
        _load(adapter, base_config)
    assert not marker.exists()


@pytest.mark.parametrize(
    "corrupt",
    [lambda data: data[: len(data) - 100], lambda data: data[:6], lambda data: b"\x80\x04junk" * 9],
    ids=["truncated-data", "truncated-header", "not-safetensors"],
)
def test_corrupt_safetensors_is_refused(adapter, base_config, corrupt):
    path = adapter / WEIGHTS
    path.write_bytes(corrupt(path.read_bytes()))
    message = r"adapter_model\.safetensors is not a valid safetensors"
    with pytest.raises(AdapterError, match=message):
        _load(adapter, base_config)


def test_manifest_digest_mismatch_is_refused(adapter, base_config, tiny_llama_dir):
    _write_manifest(adapter, tiny_llama_dir)
    _edit_tensors(adapter, lambda t: t[KEY.format(layer=0, parent="self_attn", module="q_proj",
                                                    which="B")].mul_(2))
    with pytest.raises(AdapterError, match=r"sha256 mismatch for adapter_model\.safetensors"):
        _load(adapter, base_config)


def test_wrong_base_model_is_refused(adapter, base_config):
    _edit_config(adapter, base_model_name_or_path="meta-llama/Llama-3-8B")
    with pytest.raises(AdapterError, match=r"trained for base model 'meta-llama/Llama-3-8B', but "
                                           r"this engine serves 'tiny-llama'"):
        _load(adapter, base_config, base_model_name="tiny-llama")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"peft_type": "IA3"}, r"peft_type 'IA3'; only LoRA adapters"),
        ({"bias": "all"}, r"bias 'all'; only bias \"none\""),
        ({"modules_to_save": ["norm"]}, r"modules_to_save \(norm\) is not supported: .* copies"),
        ({"use_dora": True}, r"layer 0 \w+ has LoRA weights but no lora_magnitude_vector"),
        ({"rank_pattern": {"q_proj": 4}}, r"rank_pattern is not supported"),
        ({"alpha_pattern": {"q_proj": 4}}, r"alpha_pattern is not supported"),
        ({"r": 0}, r"r=0; it must be a positive integer"),
        ({"lora_alpha": "16"}, r"lora_alpha='16'; it must be a number"),
        ({"target_modules": 7}, r"target_modules=7; it must be a list"),
    ],
)
def test_unsupported_configs_are_refused(adapter, base_config, changes, message):
    _edit_config(adapter, **changes)
    with pytest.raises(AdapterError, match=message):
        _load(adapter, base_config)


def test_a_lora_a_without_its_b_is_refused(adapter, base_config):
    name = KEY.format(layer=1, parent="self_attn", module="k_proj", which="B")
    _edit_tensors(adapter, lambda t: t.pop(name))
    with pytest.raises(AdapterError, match=r"layer 1 k_proj has lora_A but no lora_B"):
        _load(adapter, base_config)


def test_unexpected_tensor_is_refused(adapter, base_config):
    extra = {"base_model.model.model.norm.weight": torch.zeros(2, 2)}
    _edit_tensors(adapter, lambda t: t.update(extra))
    with pytest.raises(AdapterError, match=r"unexpected tensor base_model\.model\.model\.norm\.weight"):
        _load(adapter, base_config)


def test_not_a_directory_and_unknown_schemes_are_refused(tmp_path, base_config):
    with pytest.raises(AdapterError, match=r"does not exist"):
        _load(tmp_path / "nowhere", base_config)
    with pytest.raises(AdapterError, match=r"unsupported adapter location https://x/y"):
        _load("https://x/y", base_config)


# --- S3 (a moto server over HTTP) --------------------------------------------------------------


def _upload(directory: Path, bucket: str, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    for path in directory.iterdir():
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def test_s3_adapter_loads_like_the_local_one(adapter, base_config, tiny_llama_dir, s3_bucket):
    _write_manifest(adapter, tiny_llama_dir)
    _upload(adapter, s3_bucket, "adapters/alice-co/bot/1.0.0")
    # A sibling whose name extends the prefix must not be mixed in.
    _upload(adapter, s3_bucket, "adapters/alice-co/bot/1.0.0-rc1")

    local = _load(adapter, base_config)
    remote = _load(f"s3://{s3_bucket}/adapters/alice-co/bot/1.0.0/", base_config)

    assert remote.digest == local.digest
    assert all(torch.equal(remote.weights[k][0], local.weights[k][0]) for k in local.weights)


def test_s3_adapter_is_validated_like_a_local_one(adapter, base_config, s3_bucket):
    (adapter / WEIGHTS).rename(adapter / "adapter_model.bin")
    _upload(adapter, s3_bucket, "bad")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin is a pickled checkpoint"):
        _load(f"s3://{s3_bucket}/bad", base_config)


def test_s3_missing_prefix_or_bucket_is_a_clear_error(base_config, s3_bucket):
    with pytest.raises(AdapterError, match=rf"no adapter at s3://{s3_bucket}/absent"):
        _load(f"s3://{s3_bucket}/absent", base_config)
    with pytest.raises(AdapterError, match=r"cannot download the adapter at s3://no-such-bucket/x"):
        _load("s3://no-such-bucket/x", base_config)


def test_s3_download_is_all_or_nothing(adapter, s3_bucket, tmp_path):
    _upload(adapter, s3_bucket, "nested")
    boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).put_object(
        Bucket=s3_bucket, Key="nested/zz/extra.txt", Body=b"x"
    )
    target = tmp_path / "downloads" / "adapter"

    with pytest.raises(AdapterError, match=r"nested/zz/extra\.txt is nested under"):
        download_s3_prefix(f"s3://{s3_bucket}/nested", target)
    assert list(target.parent.iterdir()) == []

    _upload(adapter, s3_bucket, "flat")
    assert download_s3_prefix(f"s3://{s3_bucket}/flat", target) == target
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in adapter.iterdir())
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]


# --- adapter kinds (docs/adapter-kinds.md) ----------------------------------------------------


@pytest.fixture(scope="module")
def dora_adapter(tiny_llama_dir, make_adapter) -> Path:
    return make_adapter(tiny_llama_dir, r=4, lora_alpha=8, target_modules=("q_proj", "down_proj"), seed=2,
                        use_dora=True)


def test_a_dora_adapter_reads_with_its_magnitudes(dora_adapter, base_config):
    spec = validate_adapter_dir(dora_adapter, base_config=base_config, max_lora_rank=8)
    assert (spec.kind, spec.use_dora) == ("dora", True)
    loaded = _load(dora_adapter, base_config)
    assert loaded.use_dora and loaded.magnitudes is not None
    assert set(loaded.magnitudes) == set(loaded.weights)
    saved = load_file(dora_adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"
    torch.testing.assert_close(loaded.magnitudes[1, "down_proj"], saved[name].float(), rtol=0, atol=0)


def test_a_dora_adapter_without_a_magnitude_is_refused_naming_the_module(dora_adapter, tmp_path, base_config):
    broken = Path(shutil.copytree(dora_adapter, tmp_path / "broken"))
    _edit_tensors(broken, lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"))
    with pytest.raises(AdapterError, match=r"layer 0 q_proj has LoRA weights but no lora_magnitude_vector"):
        _load(broken, base_config)


def test_a_magnitude_in_a_plain_lora_adapter_is_refused(dora_adapter, tmp_path, base_config):
    lying = Path(shutil.copytree(dora_adapter, tmp_path / "lying"))
    _edit_config(lying, use_dora=False)
    with pytest.raises(AdapterError, match=r"is a DoRA magnitude, but adapter_config.json does not set use_dora"):
        _load(lying, base_config)


def test_a_magnitude_of_the_wrong_width_names_both_shapes(dora_adapter, tmp_path, base_config):
    wrong = Path(shutil.copytree(dora_adapter, tmp_path / "wrong"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    _edit_tensors(wrong, lambda t: t.update({name: torch.ones(3)}))
    with pytest.raises(AdapterError, match=r"lora_magnitude_vector has shape \(3,\), but the base model expects \(64,\)"):
        _load(wrong, base_config)


def test_a_server_that_cannot_serve_dora_refuses_it_saying_why(dora_adapter, base_config):
    with pytest.raises(AdapterError, match=r"DoRA adapters \(use_dora\) are not served here: not under tensor"):
        _load(dora_adapter, base_config, dora_refusal="not under tensor parallelism (tensor_parallel_size=2)")
