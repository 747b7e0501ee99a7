"""What the connector reads of vLLM's attention layers, for a suite that builds no model.

The connector takes the page interior of a rank's attention kernels from the layers vLLM built
(``static_forward_context[name].attn_backend``, and ``isa`` on vLLM's CPU backend;
docs/attention-layouts.md#page-interiors). This suite has no model forward, so every config it
builds declares the backend explicitly (``declare_attention_backend``): a token-major one by default,
which is what the suite's own forward writes (the global-coordinate pattern through our K/V views),
or vLLM's CPU backend with an ISA, whose interior the connector treats as opaque. Nothing is left to
what the host would pick.
"""

from __future__ import annotations

TOKEN_MAJOR_BACKEND = "FLASH_ATTN"


class StandInBackend:
    """An attention backend class as the connector sees it: its name."""

    def __init__(self, name: str):
        self.name = name

    def get_name(self) -> str:
        return self.name


class StandInAttention:
    """An attention layer as the connector sees it: its backend, and the CPU backend's ISA."""

    def __init__(self, backend: str, isa: str | None):
        self.attn_backend = StandInBackend(backend)
        if isa is not None:
            self.isa = isa


def declare_attention_backend(cfg, backend: str = TOKEN_MAJOR_BACKEND, isa: str | None = None) -> None:
    """Give every attention layer of ``cfg``'s model a stand-in layer running ``backend`` (and ``isa``)."""
    hf = cfg.model_config.hf_text_config
    context = cfg.compilation_config.static_forward_context
    for i, kind in enumerate(hf.layer_types):
        if kind == "full_attention":
            context[f"model.layers.{i}.self_attn.attn"] = StandInAttention(backend, isa)
