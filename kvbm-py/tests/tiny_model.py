"""Tiny random-weight models for offline engine tests (no download).

``llama``: 2 layers, 2 KV heads of 64 (vLLM's CPU attention refuses head
size 16). ``hybrid``: a Gemma-3-style text model of 4 layers alternating
sliding-window (64 tokens) and full attention, which vLLM keeps as two KV
cache groups. Weights are drawn with a wide initializer so greedy outputs
vary from token to token (a narrow one makes them nearly constant and a
comparison weak).
usage: python tiny_model.py OUT_DIR [llama|hybrid]
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


if __name__ == "__main__":
    kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
    {"llama": write, "hybrid": write_hybrid}[kind](sys.argv[1])
