"""``unroller.unroll(..., precision="bf16-mixed")`` on Hugging Face models: the accuracy
contract (tests/precision_contract.py: against a float64 reference, the loss and every
gradient no worse than autograd's under torch.autocast), on a Llama, BERT, GPT-2, T5 and a
LoRA Llama (peft), each trained the usual way (a keyword batch with ``labels``)."""

from __future__ import annotations

import copy

import pytest
import torch
from precision_contract import violations

import unroller

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=63,
        eos_token_id=63, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _t5():
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _lora_llama():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    net = peft.get_peft_model(_llama(), config)
    for name, p in net.named_parameters():  # peft starts B at zero: no gradient reaches A
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return net


def _lm_batch(n: int = 2, length: int = 16) -> dict:
    ids = torch.randint(0, 64, (n, length))
    labels = ids.clone()
    labels[:, :4] = -100
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def _batch(kind: str) -> dict:
    if kind == "bert":
        ids = torch.randint(0, 64, (2, 16))
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 2]))
    if kind == "t5":
        return dict(input_ids=torch.randint(0, 64, (2, 12)), labels=torch.randint(0, 64, (2, 8)))
    return _lm_batch()


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "t5": _t5, "lora_llama": _lora_llama}


def _float64_twin(net):
    from unroller.importer.hf_norms import swap_float64_twins

    twin = copy.deepcopy(net)
    swap_float64_twins(twin)
    return twin.double()


def _trained(net) -> dict:
    return {k: p.grad for k, p in net.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", list(MODELS))
def test_hugging_face_models_keep_the_contract_in_bf16_mixed(tmp_path, kind):
    torch.manual_seed(0)
    net = MODELS[kind]()
    batch = _batch(kind)
    twin = _float64_twin(net)
    ref_loss = twin(**batch).loss
    ref_loss.backward()
    want = _trained(twin)
    peer = copy.deepcopy(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peer_loss = peer(**batch).loss
    peer_loss.backward()
    step = unroller.unroll(net, batch, precision="bf16-mixed", directory=tmp_path)
    out = step(**batch)
    assert out.loss.dtype == torch.float32
    ours, theirs = _trained(net), _trained(peer)
    assert set(ours) == set(want) and all(g.dtype == torch.float32 for g in ours.values())
    if kind == "lora_llama":  # only the adapters train
        assert ours and all("lora_" in k for k in ours)
        assert all(p.grad is None for p in net.parameters() if not p.requires_grad)
    bad = violations(
        {"loss": out.loss, **ours}, {"loss": peer_loss, **theirs}, {"loss": ref_loss, **want}
    )
    assert not bad, bad


def test_a_peft_prompt_learning_model_is_refused_with_the_reason():
    class PromptTuned(torch.nn.Module):
        """What unroll reads of a peft wrapper: a base model, a config, prompt learning."""

        peft_config = {"default": None}
        active_peft_config = type("Config", (), {"is_prompt_learning": True})()

        def get_base_model(self):
            return torch.nn.Linear(4, 2)

    with pytest.raises(ValueError, match="prompt-learning"):
        unroller.unroll(PromptTuned(), torch.randn(2, 4), torch.tensor([0, 1]))


def test_a_peft_model_keeps_its_settings_across_an_import(tmp_path):
    """Importing a peft model (torch.export) leaves equal copies of its config dicts: the
    step's settings compare them by value, so the next call reuses the generated step
    instead of importing again (a second or more per call before)."""
    from unroller import stepcache

    torch.manual_seed(0)
    net = _lora_llama()
    batch = _lm_batch()
    step = unroller.unroll(net, batch, directory=tmp_path)
    before = stepcache.settings(net)
    step(**batch)
    assert stepcache.settings(net) == before
    spec = step._last
    step(**batch)
    assert step._last is spec  # the same specialisation, not a new import


def test_a_step_holds_its_logits_through_the_backward_only_when_it_returns_them(tmp_path):
    """A keyword batch's step hands out its logits (held until it returns); with
    logits=False, or called positionally (the loss alone), it holds none: the same loss and
    gradients, and less memory at its peak."""
    from unroller.bench.profiling import profile_step

    torch.manual_seed(0)
    net = _llama()
    batch = _lm_batch(n=2, length=16)
    full = unroller.unroll(net, batch, directory=tmp_path)
    lean = unroller.unroll(net, batch, directory=tmp_path, logits=False)
    out = full(**batch)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    lean_out = lean(**batch)
    assert lean_out.logits is None and torch.equal(lean_out.loss, out.loss)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    assert out.logits.shape == (2, 16, 64)
    peaks = []
    for step in (full, lean):
        net.zero_grad(set_to_none=True)
        peaks.append(profile_step(lambda s=step: s(**batch), "")["peak_bytes"])
    assert peaks[1] < peaks[0]
