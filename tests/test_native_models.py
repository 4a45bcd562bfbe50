"""The Llama-family variants the native engine loads, against HF transformers on tiny random models
(CPU, fp32): Qwen2's biases on q, k and v, Llama's attention and MLP biases, the llama3 and linear
rope types, through the prompt's step and a decode step (with the C++ kernels and without); what it
does not run is refused at load."""

import shutil

import pytest
import torch

from worker.config_loader import load_config
from worker.engines.native import kernels
from worker.engines.native.batch import Batch
from worker.engines.native.model import load_model

BLOCK = 16


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch-paths"])
@pytest.mark.parametrize(("family", "config"), [
    ("qwen2", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    # Llama 3.1's: with an original context of 64, some wavelengths are kept, some slowed, some blended.
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
], ids=["qwen2", "llama-biases", "llama3-rope", "linear-rope"])
def test_prompt_and_decode_logits_match_hf(tiny_model, family, config, cpu_kernels, monkeypatch):
    from transformers import AutoModelForCausalLM

    if cpu_kernels:
        if not shutil.which("c++"):
            pytest.skip("no C++ compiler: the kernels cannot be built here")
        assert kernels.load(load_config(None, {"HOME": "/tmp"}).engine.kernel_dir, kernels.resolve("auto")) == "built"
    else:
        monkeypatch.setattr(kernels, "_active", None)
    folder = tiny_model(family, **config)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder, torch.float32, torch.device("cpu"))
    assert (model.decode_weights is not None) == cpu_kernels
    c, ids = model.config, list(range(3, 40))
    k = torch.zeros(c.num_layers, 4 * BLOCK, c.num_kv_heads, c.head_dim)
    v = torch.zeros_like(k)
    n, table = len(ids), [2, 0, 3]
    slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n + 1)])
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        token = int(out.logits[0, -1].argmax())
        after = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
    prompt = Batch(torch.tensor(ids), torch.arange(n), slots[:n], [n], [n], [table], torch.tensor([n - 1]), BLOCK)
    torch.testing.assert_close(model(prompt, k, v)[0], out.logits[0, -1], atol=1e-4, rtol=1e-4)
    decode = Batch(torch.tensor([token]), torch.tensor([n]), slots[n:], [1], [n + 1], [table], torch.tensor([0]), BLOCK)
    torch.testing.assert_close(model(decode, k, v)[0], after, atol=1e-4, rtol=1e-4)


def test_weights_it_has_no_place_for_are_refused(tiny_model, tmp_path):
    """A checkpoint with a tensor this model would drop (here a per-head q norm, as Qwen3 has) is a
    variant the engine does not implement: an error at load, not silently different text."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "with-q-norm"
    shutil.copytree(tiny_model("llama"), folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no place for the weights \['layers.0.self_attn.q_norm.weight'\]"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_a_rope_type_it_does_not_run_is_refused(tiny_model, tmp_path):
    import json

    folder = tmp_path / "yarn"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        load_model(folder, torch.float32, torch.device("cpu"))
