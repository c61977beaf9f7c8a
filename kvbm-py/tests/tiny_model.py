"""A tiny random-weight Llama for offline engine tests (no download).

2 layers, 2 KV heads of 64 (vLLM's CPU attention refuses head size 16),
weights drawn with a wide initializer so greedy outputs vary from token to
token (a narrow one makes them nearly constant and a comparison weak).
usage: python tiny_model.py OUT_DIR
"""

import sys


def write(out_dir: str) -> None:
    import torch
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
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1234)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)


if __name__ == "__main__":
    write(sys.argv[1])
