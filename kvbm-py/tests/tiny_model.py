"""Tiny random-weight models for offline engine tests (no download).

``llama``: 2 layers, 2 KV heads of 64 (vLLM's CPU attention refuses head
size 16). ``hybrid``: a Gemma-3-style text model of 4 layers alternating
sliding-window (64 tokens) and full attention, which vLLM keeps as two KV
cache groups. ``mamba``: a Qwen3-Next-style model of 4 layers alternating
linear attention (gated delta rule, a recurrent state per request: vLLM's
Mamba state group) and full attention, with a small mixture of experts
(vLLM's CPU kernels for linear attention want heads of 64). Weights are drawn with a wide initializer so greedy outputs
vary from token to token (a narrow one makes them nearly constant and a
comparison weak).
usage: python tiny_model.py OUT_DIR [llama|hybrid|mamba]
"""

import sys


def write(out_dir: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    _save(LlamaForCausalLM, config, out_dir)


def _save(model_class, config, out_dir: str) -> None:
    """Draws the weights from a fixed seed and writes the model in bf16."""
    import torch

    config.architectures = [model_class.__name__]
    torch.manual_seed(1234)
    model_class(config).to(torch.bfloat16).save_pretrained(out_dir)


def write_hybrid(out_dir: str) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=64,
        vocab_size=512,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    _save(Gemma3ForCausalLM, config, out_dir)


def write_mamba(out_dir: str) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        full_attention_interval=2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        vocab_size=512,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    _save(Qwen3NextForCausalLM, config, out_dir)


if __name__ == "__main__":
    kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
    {"llama": write, "hybrid": write_hybrid, "mamba": write_mamba}[kind](sys.argv[1])
