"""The tests' tiny hybrid model as config.json fields, importable from conftest and spawned workers alike.

8 layers (2 full attention, 6 GDN): 2 shared tensors, 1 attention group and 3 GDN groups, like
qwen3.5-397b-a17b in miniature. At TP1 with bf16 KV: 64 B per token, 384 B conv + 512 B ssm, block 16, page 1024.
"""

TINY_CONFIG = {
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}
