import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.algorithms.hadamard import hadamard_matrix, hadamard_transform, random_hadamard_matrix
from quantkit.algorithms.rotation import (
    fold_norm,
    rotate_embedding,
    rotate_heads_input,
    rotate_heads_output,
    rotate_input,
    rotate_output,
)


def _tiny_llama(hidden, heads, kv_heads, intermediate, bias=False, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=256,
                         attention_bias=bias, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):  # a norm of ones would hide a missing fold
                parameter.copy_(torch.rand_like(parameter) * 1.5 + 0.25)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model


def _logits(model, seed=1):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def _rotate_r1_r2(model, r1, r2, head_dim):
    """R1 on the residual stream (norms folded first) and R2 per attention head, fused into the weights."""
    inner = model.model
    rotate_embedding(inner.embed_tokens.weight, r1)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        readers = {layer.input_layernorm: [attn.q_proj, attn.k_proj, attn.v_proj],
                   layer.post_attention_layernorm: [mlp.gate_proj, mlp.up_proj]}
        for norm, linears in readers.items():
            fold_norm(norm.weight, [linear.weight for linear in linears])
            for linear in linears:
                rotate_input(linear.weight, r1)
        for writer in (attn.o_proj, mlp.down_proj):
            rotate_output(writer.weight, r1, bias=writer.bias)
        rotate_heads_output(attn.v_proj.weight, r2, head_dim, bias=attn.v_proj.bias)
        rotate_heads_input(attn.o_proj.weight, r2, head_dim)
    fold_norm(inner.norm.weight, [model.lm_head.weight])
    rotate_input(model.lm_head.weight, r1)


def _assert_same_logits(after, before):
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5 * before.abs().max().item())


def test_r1_and_r2_hadamard_leave_the_logits_unchanged():
    model = _tiny_llama(hidden=64, heads=4, kv_heads=2, intermediate=128)  # grouped-query: 2 query heads per kv head
    before = _logits(model)
    _rotate_r1_r2(model, hadamard_matrix(64), hadamard_matrix(16), head_dim=16)
    _assert_same_logits(_logits(model), before)
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones(64)) for layer in model.model.layers)


def test_widths_that_are_not_powers_of_two_with_biases_and_random_signs():
    model = _tiny_llama(hidden=96, heads=4, kv_heads=1, intermediate=160, bias=True)  # 12·8, head_dim 24 = 12·2
    before = _logits(model)
    _rotate_r1_r2(model, random_hadamard_matrix(96, seed=0), random_hadamard_matrix(24, seed=1), head_dim=24)
    _assert_same_logits(_logits(model), before)


def test_a_rotation_given_as_a_function_is_the_matrix():
    by_matrix, by_function = (_tiny_llama(hidden=96, heads=4, kv_heads=2, intermediate=160) for _ in range(2))
    _rotate_r1_r2(by_matrix, random_hadamard_matrix(96, seed=4), hadamard_matrix(24), head_dim=24)
    _rotate_r1_r2(by_function, functools.partial(hadamard_transform, seed=4), hadamard_transform, head_dim=24)
    for (name, a), b in zip(by_matrix.named_parameters(), by_function.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("intermediate", [128, 160])
def test_r4_fused_into_down_proj_with_its_online_half_leaves_the_logits_unchanged(intermediate):
    """R4: down_proj's input rotated online (what a transform_config's `input` location asks the runtime for),
    its weight rotated to match (`weight_input`, inverse)."""
    model = _tiny_llama(hidden=64, heads=4, kv_heads=2, intermediate=intermediate)
    before = _logits(model)
    for layer in model.model.layers:
        rotate_input(layer.mlp.down_proj.weight, hadamard_transform)
        layer.mlp.down_proj.register_forward_pre_hook(lambda module, args: (hadamard_transform(args[0]),))
    _assert_same_logits(_logits(model), before)


def test_the_weights_change_so_a_missing_step_would_show():
    model = _tiny_llama(hidden=64, heads=4, kv_heads=2, intermediate=128)
    before = _logits(model)
    rotate_embedding(model.model.embed_tokens.weight, hadamard_matrix(64))
    assert not torch.allclose(_logits(model), before, atol=1e-2)


def test_fold_norm_with_an_offset_folds_one_plus_the_weight():
    """Gemma's norms compute x̂·(1 + g): folded, g is 0."""
    generator = torch.Generator().manual_seed(0)
    x_hat, g = torch.randn(8, 32, generator=generator), torch.randn(32, generator=generator) * 0.2
    weights = [torch.randn(16, 32, generator=generator), torch.randn(24, 32, generator=generator)]
    before = [(x_hat * (1 + g)) @ w.T for w in weights]
    fold_norm(g, weights, offset=1.0)
    assert torch.equal(g, torch.zeros(32))
    for b, w in zip(before, weights):
        torch.testing.assert_close((x_hat * (1 + g)) @ w.T, b)


def test_rotations_cast_back_to_the_weight_dtype_in_place():
    weight = torch.randn(16, 64, dtype=torch.bfloat16)
    storage = weight.data_ptr()
    reference = weight.double() @ hadamard_matrix(64)
    rotate_input(weight, hadamard_matrix(64))
    assert weight.dtype == torch.bfloat16 and weight.data_ptr() == storage
    assert torch.equal(weight, reference.to(torch.bfloat16))  # one rounding, from float64


def test_rotations_computed_a_block_of_rows_at_a_time_equal_the_whole_product(monkeypatch):
    """Large weights (a 128k-token embedding) rotate CHUNK_ROWS rows at a time: the same numbers as one product."""
    from quantkit.algorithms import rotation
    from quantkit.algorithms.hadamard import hadamard_matrix

    monkeypatch.setattr(rotation, "CHUNK_ROWS", 100)
    q = hadamard_matrix(64)
    weight = torch.randn(250, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    reads, writes = weight.clone(), weight.T.contiguous().clone()
    rotation.rotate_input(reads, q)
    rotation.rotate_output(writes, q)
    torch.testing.assert_close(reads, weight @ q, rtol=0, atol=1e-12)
    torch.testing.assert_close(writes, q.T @ weight.T, rtol=0, atol=1e-12)
